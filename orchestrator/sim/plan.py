"""`jobs.plan`: the simulator calibrated on this machine, and applied to GPU serving setups.

Calibration (`calibration.benchmark`): fit the cost model to a serving benchmark's worker calls and predict every
level of that benchmark (sim/calibrate.py). The table it writes is the check that the simulator can be trusted
here: per-user tokens/s within 15%, speed-ups within 10%.

GPU setups (`gpu`, `target`, `drafter`, `setups`): each setup simulated at each concurrency with roofline costs
(sim/roofline.py), the project's scheduler deciding as it would there:

    target-only      speculation off
    colocated        drafter and target on the same GPUs, a fixed chain every round (vLLM's EAGLE)
    disaggregated    the drafter on a GPU of its own, reached over NVLink (or InfiniBand), pipelined micro-batches

With an `slo` (a request rate and a time per output token), the GPUs each setup needs to meet it.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from orchestrator.config import StrictModel
from orchestrator.errors import AerieError
from orchestrator.runtime.scheduler import SchedulerConfig
from orchestrator.sim.costs import AcceptanceProfile, CostModel
from orchestrator.sim.roofline import Accelerator, ModelShape, Network, Placement, measured_costs, roofline_cost
from orchestrator.spec.proposer import SpecConfig


class CalibrationConfig(StrictModel):
    benchmark: str = Field(description="output_dir of a `jobs.benchmark_serving` run made with spans=true")
    models_dir: str = Field("models", description="where the benchmark's packaged target was prepared")


class Setup(StrictModel):
    """One way to serve the target."""

    name: str = Field(description="the setup's row in the table, its line in the plot and its MLflow metrics")
    kind: Literal["target-only", "colocated", "disaggregated"] = Field(
        description="target-only: speculation off; colocated: the drafter on the target's GPUs, drafting every "
        "round (vLLM's EAGLE); disaggregated: the drafter on a GPU of its own, pipelined"
    )
    serve_config: str | None = Field(
        None, description="take spec and scheduler from this Serve config's args (what `aerie serve` would run)"
    )
    spec: SpecConfig | None = Field(None, description="the drafts (chain or tree); default: serve_config's")
    scheduler: dict = Field({}, description="SchedulerConfig fields over serve_config's (budget_tokens, ...)")
    link: Literal["nvlink", "infiniband"] = Field("nvlink", description="disaggregated: how the drafter is reached")
    call_s: float = Field(0.0, ge=0, description="per worker call beside the compute (the serving stack's, e.g. Ray)")


class Slo(StrictModel):
    rate_per_s: float = Field(gt=0, description="requests per second to serve")
    tpot_ms: float = Field(gt=0, description="mean time per output token a request may see")
    ttft_p90_s: float = Field(2.0, gt=0, description="time to first token of 9 in 10 requests (no queue building up)")
    requests: int = Field(400, ge=20, description="requests per simulated rate")
    steps: int = Field(6, ge=1, le=20, description="bisection steps after the rate is bracketed")


class PlanConfig(StrictModel):
    """`python -m jobs.plan` settings: `calibration`, or a GPU plan (gpu, network, target, drafter, setups)."""

    calibration: CalibrationConfig | None = Field(None, description="fit and check the simulator on this machine")
    gpu: Accelerator | None = Field(None, description="the GPU of a GPU plan (or from `hardware: FILE`)")
    network: Network | None = Field(None, description="the links between GPUs (or from `hardware: FILE`)")
    target: ModelShape | None = Field(None, description="the target's shape")
    target_placement: Placement = Field(
        default_factory=Placement, description="the target's GPUs (a colocated drafter's too)"
    )
    drafter: ModelShape | None = Field(None, description="the drafter's shape (setups that speculate)")
    acceptance: AcceptanceProfile | None = Field(None, description="how often the target accepts draft tokens")
    acceptance_source: str = Field("", description="where the acceptance profile comes from")
    setups: list[Setup] = Field([], description="ways to serve, each simulated at every concurrency")
    users: list[int] = Field([1, 4, 16, 64], min_length=1, description="concurrencies: users in a closed loop")
    max_batch: int = Field(
        64, ge=1, description="the scheduler's max_batch (requests) unless serve_config or a setup's scheduler sets it"
    )
    requests_per_user: int = Field(4, ge=1, description="requests per level = users x this (at least 32)")
    prompt_tokens: list[int] = Field([1024], min_length=1, description="prompt lengths (tokens), drawn uniformly")
    max_tokens: int = Field(256, ge=1, description="tokens generated per request (no EOS, as the benchmark's)")
    published: dict[str, dict[int, float]] = Field(
        {}, description="published speed-ups to show beside the simulated ones: {label: {users: x}}"
    )
    published_tok_s: dict[str, dict[int, float]] = Field(
        {}, description="published per-user tok/s of a setup, by its name: shown beside the simulated ones"
    )
    slo: Slo | None = Field(None, description="a service level objective: the GPUs each setup needs to meet it")
    sweep: bool = Field(
        False,
        description="against each adaptive disaggregated setup, fixed settings (speculation off, chains of 1-5, the "
        "setup's tree whole every round) at every concurrency: where adaptive loses by > 5% to the best it could "
        "choose itself (the policy loses), or only to a chain deeper than it drafts (deeper drafts pay)",
    )
    measured: str | None = Field(
        None,
        description="gpu-check.json of `make gpu-check` on this plan's GPU: step costs fitted from its measured "
        "target forwards and drafter rounds replace the roofline's (this project's engine, as it ran there)",
    )
    mlflow_experiment: str = Field("aerie-plan", description="MLflow experiment of the plan's run")
    output_dir: str = Field("runs/plan", description="result.json, table and plot")

    @model_validator(mode="before")
    @classmethod
    def _hardware_file(cls, data):
        """`hardware: FILE` (a YAML with `gpu` and `network`) fills both, so plans share one set of constants."""
        if isinstance(data, dict) and isinstance(data.get("hardware"), str):
            import yaml

            path = Path(data["hardware"])
            if not path.is_file():
                raise ValueError(f"hardware file {str(path)!r} does not exist")
            hardware = yaml.safe_load(path.read_text()) or {}
            data = {k: v for k, v in data.items() if k != "hardware"}
            data = {"gpu": hardware.get("gpu"), "network": hardware.get("network")} | data
        return data

    @model_validator(mode="after")
    def _complete(self) -> PlanConfig:
        gpu_plan = [self.gpu, self.network, self.target, self.acceptance]
        if self.setups and any(x is None for x in gpu_plan):
            raise ValueError("a GPU plan (setups) needs gpu, network, target and acceptance")
        if any(s.kind != "target-only" for s in self.setups) and self.drafter is None:
            raise ValueError("setups that speculate need the drafter's shape (drafter)")
        return self


def run_plan(cfg: PlanConfig, out: Path) -> dict:
    if cfg.calibration is None and not cfg.setups:
        raise AerieError("jobs.plan has nothing to do: set calibration.benchmark, or a GPU plan's setups")
    result: dict = {"table": ""}
    if cfg.calibration is not None:
        result["calibration"] = calibrate_on_benchmark(cfg.calibration, out)
        result["table"] = result["calibration"]["table"]
    if cfg.setups:
        result["plan"] = gpu_plan(cfg, out)
        result["table"] = (result["table"] + "\n\n" + result["plan"]["table"]).strip()
    return result


def costs_of(cfg: PlanConfig, setup: Setup) -> CostModel:
    """The roofline costs of a setup: the target on its placement; the drafter on the target's GPUs
    (colocated) or on a GPU of its own behind the setup's link. With `measured`, gpu-check's fitted costs."""
    colocated = setup.kind == "colocated"
    if cfg.measured is not None:
        target, draft = _measured(cfg.measured)
    else:
        target = roofline_cost(cfg.target, cfg.gpu, cfg.target_placement)
        drafter = cfg.drafter or cfg.target
        draft = roofline_cost(drafter, cfg.gpu, cfg.target_placement if colocated else Placement())
    return CostModel(
        target=target,
        draft=draft,
        link=getattr(cfg.network, setup.link),
        call_s=setup.call_s,
        colocated=colocated,
        aux_bytes_per_token=3 * cfg.target.hidden_size * 2 + 8,  # 3 aux hidden states in bf16, the token id
    )


@functools.cache
def _measured(path: str):
    """(target, drafter) StepCosts fitted from a gpu-check.json's steps (read once per plan)."""
    data = json.loads(Path(path).read_text())
    if "target" not in data.get("steps", {}):
        raise AerieError(f"{path} has no measured steps: run `make gpu-check` (its steps section) on the GPU")
    return measured_costs(data["steps"])


def _served(setup: Setup) -> tuple[dict, dict]:
    """(spec, scheduler) of the setup's Serve config, or ({}, {})."""
    return _serve_args(setup.serve_config) if setup.serve_config is not None else ({}, {})


@functools.cache
def _serve_args(path: str) -> tuple[dict, dict]:
    """Read once per plan: a sweep or an SLO search simulates the same setup dozens of times."""
    from orchestrator.serving.launch import read_serve_config

    args = read_serve_config(path)[1]["args"]
    return args.get("spec", {}), args.get("scheduler", {})


def _spec_of(setup: Setup) -> SpecConfig:
    """What the setup drafts: its own spec, or its Serve config's."""
    return setup.spec or SpecConfig.model_validate(_served(setup)[0])


def _sim_config(cfg: PlanConfig, setup: Setup, workload: dict):
    from orchestrator.sim.run import SimConfig

    served_scheduler = _served(setup)[1]
    defaults = {"max_batch": cfg.max_batch, "request_timeout_s": 1e6} | served_scheduler
    if setup.kind == "colocated":  # vLLM's EAGLE: every round drafts its chain, one batch
        defaults |= {"adaptive": False, "micro_batches": 1}
    if setup.kind == "target-only":  # nothing to overlap: one batch (two would read the weights twice a step)
        defaults |= {"micro_batches": 1}
    scheduler = SchedulerConfig.model_validate(defaults | setup.scheduler)
    return SimConfig(
        scheduler=scheduler,
        spec=_spec_of(setup),
        speculation=setup.kind != "target-only",
        costs=costs_of(cfg, setup),
        acceptance=cfg.acceptance,
        workload=workload,
        mode="colocated" if setup.kind == "colocated" else "disaggregated",
    )


def gpus_of(cfg: PlanConfig, setup: Setup) -> int:
    return cfg.target_placement.gpus + (1 if setup.kind == "disaggregated" else 0)


def _closed_loop(cfg: PlanConfig, users: int) -> dict:
    """A level's workload: `users` users, each sending its next request when one ends."""
    return {
        "users": users,
        "requests": max(32, users * cfg.requests_per_user),
        "prompt_tokens": cfg.prompt_tokens,
        "max_tokens": cfg.max_tokens,
    }


def gpu_plan(cfg: PlanConfig, out: Path) -> dict:
    """Every setup at every concurrency; speed-ups over target-only; GPUs for the SLO; table, plot, MLflow."""
    from orchestrator.sim.run import simulate

    rows = []
    for setup in cfg.setups:
        for users in cfg.users:
            workload = _closed_loop(cfg, users)
            r = simulate(_sim_config(cfg, setup, workload))
            rows.append({"setup": setup.name, "kind": setup.kind, "users": users, **r})
    base = {r["users"]: r["per_user_tok_s"] for r in rows if r["kind"] == "target-only"}
    for r in rows:
        r["speedup"] = r["per_user_tok_s"] / base[r["users"]] if r["users"] in base else None
    slo = [_gpus_for_slo(cfg, s) for s in cfg.setups] if cfg.slo else []
    table = _plan_table(cfg, rows, slo)
    sweep = _sweep(cfg) if cfg.sweep else []
    if sweep:
        table += "\n\n" + _sweep_table(sweep)
    (out / "plan.md").write_text(table + "\n")
    plot = _plan_plot(cfg, rows, out / "plan.png")
    run_id = _log_plan(cfg, rows, slo, [out / "plan.md", plot])
    return {
        "levels": rows,
        "slo": slo,
        "sweep": sweep,
        "table": table,
        "files": [str(out / "plan.md"), str(plot)],
        "mlflow_run_id": run_id,
    }


def fixed_variants(setup: Setup) -> list[Setup]:
    """Fixed settings to hold an adaptive setup against: speculation off (same stack), chains of 1 to 5 drafted
    every round, and the setup's own drafts (its tree or chain) verified whole every round."""
    fixed = setup.scheduler | {"adaptive": False}
    variants = [setup.model_copy(update={"name": "off", "kind": "target-only"})]
    for k in range(1, 6):
        chain = SpecConfig(method="chain", num_spec_tokens=k)
        variants.append(setup.model_copy(update={"name": f"chain {k}", "spec": chain, "scheduler": fixed}))
    variants.append(setup.model_copy(update={"name": "its drafts, whole", "scheduler": fixed}))
    return variants


def _sweep(cfg: PlanConfig) -> list[dict]:
    """Each adaptive disaggregated setup against its fixed variants at every concurrency. `ratio` holds it against
    the best of them; `policy_ratio` against the best it could have chosen itself: a chain no deeper than what
    its drafter drafts (a policy trims drafts, it cannot draft deeper), off, its own drafts whole."""
    from orchestrator.sim.run import simulate

    out = []
    for setup in cfg.setups:
        adaptive = SchedulerConfig.model_validate(_served(setup)[1] | setup.scheduler).adaptive
        if setup.kind != "disaggregated" or not adaptive:
            continue
        depth = _spec_of(setup).shape()[0]
        variants = fixed_variants(setup)
        reach = {v.name for v in variants if _spec_of(v).shape()[0] <= depth}
        for users in cfg.users:
            workload = _closed_loop(cfg, users)
            mine = simulate(_sim_config(cfg, setup, workload))["per_user_tok_s"]
            fixed = {v.name: simulate(_sim_config(cfg, v, workload))["per_user_tok_s"] for v in variants}
            best = max(fixed, key=fixed.get)
            own = max(reach, key=fixed.get)
            out.append(
                {"setup": setup.name, "users": users, "adaptive": mine, "best_fixed": best, "best": fixed[best]}
                | {"fixed": fixed, "ratio": mine / fixed[best], "policy_best": own, "policy_ratio": mine / fixed[own]}
            )
    return out


def _sweep_table(sweep: list[dict]) -> str:
    lines = [
        "Adaptive against the best fixed setting (per-user tok/s). Within its reach: the best of the settings it could "
        "choose itself (off, chains no deeper than its drafts, its drafts whole); ratio < 0.95 there: **the policy "
        "loses** by more than 5%. Against all: ratio < 0.95 where only a deeper drafter wins: *deeper drafts pay*.",
        "",
        "| setup | users | adaptive | best within reach | ratio | best of all | its tok/s | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sweep:
        policy = " **the policy loses**" if r["policy_ratio"] < 0.95 else ""
        deeper = " *deeper drafts pay*" if r["ratio"] < 0.95 and not policy else ""
        lines.append(
            f"| {r['setup']} | {r['users']} | {r['adaptive']:.1f} | {r['policy_best']} | "
            f"{r['policy_ratio']:.3f}{policy} | {r['best_fixed']} | {r['best']:.1f} | {r['ratio']:.3f}{deeper} |"
        )
    return "\n".join(lines)


def _gpus_for_slo(cfg: PlanConfig, setup: Setup) -> dict:
    """The highest Poisson rate one replica serves within the TPOT objective (bisection), and the GPUs the SLO's
    rate then needs."""
    from orchestrator.sim.run import simulate

    def meets(rate: float) -> bool:
        workload = {
            "rate_per_s": rate,
            "requests": cfg.slo.requests,
            "prompt_tokens": cfg.prompt_tokens,
            "max_tokens": cfg.max_tokens,
        }
        r = simulate(_sim_config(cfg, setup, workload))
        if r["failed"] or r["tpot_mean_s"] is None:
            return False
        return 1e3 * r["tpot_mean_s"] <= cfg.slo.tpot_ms and r["ttft_p90_s"] <= cfg.slo.ttft_p90_s

    low, high = 1.0, 2.0  # bracket: low meets the SLO, high does not
    if meets(low):
        while meets(high):
            if high >= 1e5:
                break
            low, high = high, 2 * high
    else:
        for _ in range(12):
            low, high = low / 2, low
            if meets(low):
                break
        else:
            return {"setup": setup.name, "rate_per_replica": 0.0, "replicas": None, "gpus": None}
    for _ in range(cfg.slo.steps):
        mid = (low + high) / 2
        low, high = (mid, high) if meets(mid) else (low, mid)
    replicas = math.ceil(cfg.slo.rate_per_s / low) if low > 0 else None
    gpus = replicas * gpus_of(cfg, setup) if replicas else None
    return {"setup": setup.name, "rate_per_replica": low, "replicas": replicas, "gpus": gpus}


def _plan_table(cfg: PlanConfig, rows: list[dict], slo: list[dict]) -> str:
    users = cfg.users
    head = "| setup | GPUs | " + " | ".join(f"{u} users: tok/s per user (x)" for u in users) + " |"
    lines = [f"{cfg.target.name} on {cfg.gpu.name}", "", head, "|---|---|" + "---|" * len(users)]
    for setup in cfg.setups:
        cells = []
        for u in users:
            r = next(r for r in rows if r["setup"] == setup.name and r["users"] == u)
            x = f" ({r['speedup']:.2f}x)" if r["speedup"] is not None and setup.kind != "target-only" else ""
            seen = cfg.published_tok_s.get(setup.name, {}).get(u)
            cells.append(f"{r['per_user_tok_s']:.1f}{x}" + (f" [published {seen:g}]" if seen else ""))
        lines.append(f"| {setup.name} | {gpus_of(cfg, setup)} | " + " | ".join(cells) + " |")
    for label, by_users in cfg.published.items():
        cells = [f"({by_users[u]:.2f}x)" if u in by_users else "" for u in users]
        lines.append(f"| published: {label} | | " + " | ".join(cells) + " |")
    if slo:
        lines += [
            "",
            f"SLO: {cfg.slo.rate_per_s:g} requests/s, mean time per output token <= {cfg.slo.tpot_ms:g} ms, "
            f"p90 time to first token <= {cfg.slo.ttft_p90_s:g} s",
            "",
            "| setup | requests/s per replica | replicas | GPUs |",
            "|---|---|---|---|",
        ]
        for s in slo:
            lines.append(f"| {s['setup']} | {s['rate_per_replica']:.2f} | {s.get('replicas')} | {s.get('gpus')} |")
    return "\n".join(lines)


def _plan_plot(cfg: PlanConfig, rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for setup in cfg.setups:
        mine = sorted((r for r in rows if r["setup"] == setup.name), key=lambda r: r["users"])
        ax.plot([r["users"] for r in mine], [r["per_user_tok_s"] for r in mine], marker="o", label=setup.name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("users")
    ax.set_ylabel("tokens/s per user (simulated)")
    ax.set_title(f"{cfg.target.name} on {cfg.gpu.name}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _slug(name: str) -> str:
    """A setup's name as MLflow accepts it in a metric key."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


def _log_plan(cfg: PlanConfig, rows: list[dict], slo: list[dict], files: list[Path]) -> str:
    """An MLflow run: the setup's identity as params, every level's per-user tok/s and speed-up as metrics."""
    from orchestrator.tracking.store import client

    mlflow = client()
    exp = mlflow.get_experiment_by_name(cfg.mlflow_experiment)
    exp_id = exp.experiment_id if exp else mlflow.create_experiment(cfg.mlflow_experiment)
    run_id = mlflow.create_run(exp_id, run_name=f"plan-{cfg.target.name}-{cfg.gpu.name}").info.run_id
    for key, value in {
        "target": cfg.target.name,
        "gpu": cfg.gpu.name,
        "target_gpus": cfg.target_placement.gpus,
    }.items():
        mlflow.log_param(run_id, key, value)
    for r in rows:
        slug = f"{_slug(r['setup'])}.u{r['users']}"
        mlflow.log_metric(run_id, f"{slug}.per_user_tok_s", r["per_user_tok_s"])
        if r["speedup"] is not None:
            mlflow.log_metric(run_id, f"{slug}.speedup", r["speedup"])
    for s in slo:
        if s.get("gpus"):
            mlflow.log_metric(run_id, f"{_slug(s['setup'])}.slo_gpus", s["gpus"])
    for f in files:
        mlflow.log_artifact(run_id, str(f))
    mlflow.set_terminated(run_id, status="FINISHED")
    return run_id


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
    rows = predict(levels, bench, args, costs, profile)
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
