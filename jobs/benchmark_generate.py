"""Generation throughput: this project's engine vs transformers vs vLLM, same prompts, same run.

python -m jobs.benchmark_generate --config configs/smollm2-135m/benchmark_generate.yaml [key=value ...]
"""

from __future__ import annotations

import sys

from orchestrator.benchmarks.generate import BenchmarkGenerateConfig, format_table, run_generate_benchmark
from orchestrator.jobrunner import run_job, write_result
from orchestrator.models.prepare import resolve_model


def main(cfg: BenchmarkGenerateConfig) -> int:
    model_dir = resolve_model(cfg.model, cfg.models_dir)
    result = run_generate_benchmark(cfg, model_dir)
    path = write_result(cfg.output_dir, {"config": cfg.model_dump(), **result})
    print(format_table(result))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_job(__doc__, BenchmarkGenerateConfig, main))
