"""Acceptance evaluation: drafters side by side on MT-Bench, the validation split, long contexts and unseen
templates, with the project's engine (chain and tree) and a vLLM cross-check.

    python -m jobs.evaluate_drafter --config configs/smollm2-135m/evaluate.yaml [key=value ...]

Drafters are directories, s3:// prefixes or MLflow models:/ URIs. Writes result.json, table.md and plots to
output_dir and logs them to an MLflow run.
"""

from __future__ import annotations

import sys

from orchestrator.evaluation import EvalConfig, run_evaluation
from orchestrator.jobrunner import run_job


def main(cfg: EvalConfig) -> int:
    run_evaluation(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(run_job(__doc__, EvalConfig, main))
