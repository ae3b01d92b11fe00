"""`jobs.plan`: the simulator calibrated on this machine, and applied to GPU serving setups.

Calibration (`calibration.benchmark`): fit the cost model to a serving benchmark's worker calls and predict every
level of that benchmark (sim/calibrate.py). The table it writes is the check that the simulator can be trusted
here: per-user tokens/s within 15%, speed-ups within 10%.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field

from orchestrator.config import StrictModel
from orchestrator.errors import AerieError


class CalibrationConfig(StrictModel):
    benchmark: str = Field(description="output_dir of a `jobs.benchmark_serving` run made with spans=true")
    models_dir: str = Field("models", description="where the benchmark's packaged target was prepared")


class PlanConfig(StrictModel):
    """`python -m jobs.plan` settings."""

    calibration: CalibrationConfig | None = Field(None, description="fit and check the simulator on this machine")
    output_dir: str = Field("runs/plan", description="result.json, table and plot")


def run_plan(cfg: PlanConfig, out: Path) -> dict:
    if cfg.calibration is None:
        raise AerieError("jobs.plan has nothing to do: set calibration.benchmark (or setups)")
    return calibrate_on_benchmark(cfg.calibration, out)


def calibrate_on_benchmark(cfg: CalibrationConfig, out: Path) -> dict:
    from orchestrator.serving.launch import read_serve_config
    from orchestrator.sim.calibrate import fit_costs, load_benchmark, measured_profile, predict, speedups

    result, levels = load_benchmark(cfg.benchmark)
    bench = result["config"]
    _, app = read_serve_config(bench["app"], bench["app_overrides"])
    args = app["args"]
    from orchestrator.spec.proposer import SpecConfig

    depth, topk, _ = SpecConfig.model_validate(args.get("spec", {})).shape()
    costs = fit_costs(levels, depth, topk, _aux_bytes_per_token(args, cfg.models_dir))
    profile = measured_profile(levels)
    rows = predict(levels, bench["max_tokens"], args, costs, profile)
    ratios = speedups(rows)
    table = _calibration_table(rows, ratios)
    (out / "calibration.md").write_text(table + "\n")
    plot = _calibration_plot(rows, out / "calibration.png")
    return {
        "costs": costs.model_dump(),
        "acceptance": profile.model_dump(),
        "levels": rows,
        "speedups": ratios,
        "table": table,
        "files": [str(out / "calibration.md"), str(plot)],
    }


def _aux_bytes_per_token(args: dict, models_dir: str) -> int:
    """What the target sends the drafter per committed token: k aux hidden states at the serving dtype, and the
    token id."""
    from orchestrator.models.prepare import resolve_model

    model_dir = resolve_model(args["model"], args.get("models_dir", models_dir))
    config = json.loads((model_dir / "config.json").read_text())
    width = 2 if args.get("dtype", "auto") in ("bfloat16", "float16") else 4  # auto on a CPU: float32
    return 3 * config["hidden_size"] * width + 8


def _calibration_table(rows: list[dict], ratios: list[dict]) -> str:
    lines = [
        "| users | mode | measured tok/s per user | predicted | error | drafted share measured / predicted |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        shares = f"{r['measured_drafted_share'] or 0:.2f} / {r['predicted_drafted_share']:.2f}"
        lines.append(
            f"| {r['users']} | {r['mode']} | {r['measured_tok_s']:.2f} | {r['predicted_tok_s']:.2f} | "
            f"{100 * r['error']:+.1f}% | {shares} |"
        )
    lines += ["", "| users | speed-up measured | predicted | error |", "|---|---|---|---|"]
    for s in ratios:
        lines.append(f"| {s['users']} | {s['measured']:.3f} | {s['predicted']:.3f} | {100 * s['error']:+.1f}% |")
    return "\n".join(lines)


def _calibration_plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode, marker in (("spec", "o"), ("no-spec", "s")):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["users"])
        users = [r["users"] for r in mine]
        ax.plot(users, [r["measured_tok_s"] for r in mine], marker=marker, label=f"{mode} measured")
        ax.plot(users, [r["predicted_tok_s"] for r in mine], marker=marker, linestyle="--", label=f"{mode} simulated")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("users")
    ax.set_ylabel("tokens/s per user")
    ax.set_title("simulator vs serving benchmark (this machine)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
