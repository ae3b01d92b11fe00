"""Capacity planning with the simulator: the real scheduler over simulated workers on a virtual clock.

    python -m jobs.plan --config configs/smollm2-135m/plan.yaml    # calibrate on this machine's serving benchmark
    python -m jobs.plan --config configs/llama-3.1-8b/plan.yaml     # GB200: per-user tok/s and GPUs needed

With `calibration.benchmark` (a `jobs.benchmark_serving` output made with spans=true) it fits the cost model to
that run's worker calls and predicts each of its levels beside what was measured. With `setups` it simulates
each serving setup at each concurrency and writes the table, a plot and an MLflow run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from orchestrator.jobrunner import run_job, write_result
from orchestrator.sim.plan import PlanConfig, run_plan


def main(cfg: PlanConfig) -> int:
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = run_plan(cfg, out)
    path = write_result(out, {"config": cfg.model_dump(), **result})
    print(result["table"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_job(__doc__, PlanConfig, main))
