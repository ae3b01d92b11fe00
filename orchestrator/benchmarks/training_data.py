"""Online vs offline training data, side by side: the same training config trained from the stored collection
(offline) and from hidden states captured while training (online), alternating which goes first, repeated.
Reports per run tokens/s (trained tokens over training time), the trainer's and the capture actors' peak RSS
and the bytes stored per token; per repeat the online / offline tokens/s ratio, and their range.

    python -m jobs.benchmark_training_data --config configs/smollm2-135m/benchmark_training_data.yaml
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from pydantic import Field

from orchestrator.config import StrictModel, load_config


class BenchmarkTrainingDataConfig(StrictModel):
    """`python -m jobs.benchmark_training_data` settings."""

    train: str = Field(description="the training config file (its data is replaced)")
    train_overrides: list[str] = Field([], description="key=value overrides of it")
    collection: str = Field(description="a finished collection of `collect`'s config (the offline data)")
    collect: str = Field(description="the collection's config file (what online training captures)")
    collect_overrides: list[str] = Field([], description="key=value overrides of it (as the collection was made)")
    minutes: float = Field(3.0, gt=0, description="training time per run")
    repeats: int = Field(2, ge=1, description="pairs of runs, the order alternating")
    output_dir: str = Field(description="result.json and table.md")


def run_benchmark(cfg: BenchmarkTrainingDataConfig) -> dict:
    from orchestrator.data.storage import open_storage
    from orchestrator.train.config import OnlineData, TrainConfig
    from orchestrator.train.run import run_training

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads(open_storage(cfg.collection).read_bytes("manifest.json"))
    stored = sum(s["bytes"] for s in manifest["shards"]) / sum(s["num_tokens"] for s in manifest["shards"])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = []
    for rep in range(cfg.repeats):
        for mode in ("offline", "online") if rep % 2 == 0 else ("online", "offline"):
            overrides = [
                *cfg.train_overrides,
                f"name=bench-data-{stamp}-{rep}-{mode}",
                f"output={out / 'drafters' / f'{rep}-{mode}'}",
                f"max_time_minutes={cfg.minutes}",
                "max_steps=null",
                "mlflow.registered_model=null",
                "mlflow.experiment=aerie-benchmarks",
                f"checkpoint.storage_path={out / 'checkpoints'}",
                f"data={cfg.collection}",
            ]
            train = load_config(TrainConfig, cfg.train, overrides)
            if mode == "online":
                online = OnlineData(collect=cfg.collect, overrides=cfg.collect_overrides)
                train = TrainConfig.model_validate(
                    {**train.model_dump(), "data": "online", "online": online.model_dump()}
                )
            print(f"[benchmark] repeat {rep + 1}/{cfg.repeats}: {mode}", flush=True)
            result = run_training(train)
            m = result["final_metrics"]
            runs.append(
                {
                    "repeat": rep,
                    "mode": mode,
                    "steps": result["steps"],
                    "tokens": result["tokens"],
                    "minutes": result["train_minutes"],
                    "tokens_per_s": result["tokens"] / max(60 * result["train_minutes"], 1e-9),
                    "trainer_peak_rss_mib": m.get("peak_rss_mib"),
                    "capture_peak_rss_mib": m.get("capture_peak_rss_mib"),
                    "stored_bytes_per_token": stored if mode == "offline" else 0.0,
                    "val_loss_step_0": m.get("val_loss_step_0"),
                }
            )
    ratios = [
        next(r["tokens_per_s"] for r in runs if r["repeat"] == rep and r["mode"] == "online")
        / next(r["tokens_per_s"] for r in runs if r["repeat"] == rep and r["mode"] == "offline")
        for rep in range(cfg.repeats)
    ]
    result = {"config": cfg.model_dump(), "runs": runs, "online_over_offline_tokens_per_s": ratios}
    result["ratio_median"] = statistics.median(ratios)
    result["ratio_range"] = [min(ratios), max(ratios)]
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "table.md").write_text(format_table(result) + "\n")
    return result


def format_table(result: dict) -> str:
    rows = [
        "| repeat | mode | steps | tokens | tokens/s | trainer peak RSS MiB | capture peak RSS MiB "
        "| stored bytes/token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        capture = f"{r['capture_peak_rss_mib']:.0f}" if r["capture_peak_rss_mib"] else "- (collected before)"
        rows.append(
            f"| {r['repeat'] + 1} | {r['mode']} | {r['steps']} | {r['tokens']} | {r['tokens_per_s']:.0f} | "
            f"{r['trainer_peak_rss_mib']:.0f} | {capture} | {r['stored_bytes_per_token']:.0f} |"
        )
    lo, hi = result["ratio_range"]
    rows.append(
        f"\nonline / offline tokens/s: median {result['ratio_median']:.2f} (range {lo:.2f}-{hi:.2f} over "
        f"{len(result['online_over_offline_tokens_per_s'])} interleaved pairs)"
    )
    return "\n".join(rows)
