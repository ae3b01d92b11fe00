"""Attention drift: per drafting depth, the drafter's attention mass on the sink tokens, on the rest of the
target's context and on its own drafted tokens, for drafters side by side at several context lengths.

    python -m jobs.diagnose_drafter --config configs/smollm2-135m/diagnose.yaml [key=value ...]

Drafters are directories, s3:// prefixes or MLflow models:/ URIs. Writes result.json, table.md and plots to
output_dir and logs them to an MLflow run (experiment aerie-diagnostics).
"""

from __future__ import annotations

import sys

from orchestrator.evaluation.diagnose import DiagnoseConfig, run_diagnosis
from orchestrator.jobrunner import run_job


def main(cfg: DiagnoseConfig) -> int:
    run_diagnosis(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(run_job(__doc__, DiagnoseConfig, main))
