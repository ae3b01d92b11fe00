"""The EAGLE-3.1 extrapolation experiment: EAGLE-3 and EAGLE-3.1 trained on the same short, single-template data
with the same budget (several seeds each), evaluated on the training distribution, long contexts, unseen chat
templates and out-of-distribution system prompts; tau per condition and the ratio 3.1 / 3 with 95% bootstrap
intervals over seeds and prompts.

    python -m jobs.extrapolation --config configs/smollm2-135m/extrapolation.yaml [key=value ...]

Rerun to resume: finished stages (collection, each training, the evaluation) are skipped (output_dir/state.json).
"""

from __future__ import annotations

import sys

from orchestrator.evaluation.extrapolation import ExtrapolationConfig, run_extrapolation
from orchestrator.jobrunner import run_job


def main(cfg: ExtrapolationConfig) -> int:
    run_extrapolation(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(run_job(__doc__, ExtrapolationConfig, main))
