"""Serving benchmark: the HTTP endpoint at concurrency 1/4/16, speculation on vs off, same code, same run.

python -m jobs.benchmark_serving --config configs/smollm2-135m/benchmark_serving.yaml [key=value ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

from orchestrator.benchmarks.serving import BenchmarkServingConfig, format_table, run_serving_benchmark
from orchestrator.jobrunner import run_job, write_result


def main(cfg: BenchmarkServingConfig) -> int:
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = run_serving_benchmark(cfg, out)
    path = write_result(out, {"config": cfg.model_dump(), **result})
    print(format_table(result))
    print(f"wrote {path}")
    failed = sum(r["failed"] for levels in result["modes"].values() for r in levels.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_job(__doc__, BenchmarkServingConfig, main))
