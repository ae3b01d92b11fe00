"""Online vs offline training data: tokens/s, peak memory and stored bytes, interleaved and repeated.

python -m jobs.benchmark_training_data --config configs/smollm2-135m/benchmark_training_data.yaml [key=value ...]
"""

from __future__ import annotations

import sys

from orchestrator.benchmarks.training_data import BenchmarkTrainingDataConfig, format_table, run_benchmark
from orchestrator.jobrunner import run_job


def main(cfg: BenchmarkTrainingDataConfig) -> int:
    result = run_benchmark(cfg)
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_job(__doc__, BenchmarkTrainingDataConfig, main))
