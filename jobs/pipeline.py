"""The main job: prepare -> collect -> train -> evaluate -> gate -> deploy -> benchmark -> report.

    python -m jobs.pipeline --config configs/smollm2-135m/pipeline.yaml [key=value ...]
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python -m jobs.pipeline --config ...
    (on the KubeRay clusters the code is in the image: clusters/rayjob-pipeline.yaml, no --working-dir)

Rerunning skips every stage whose inputs did not change and resumes the one that stopped (collection keeps its
good shards, training continues from its latest checkpoint). It deploys only to a running cluster: RAY_ADDRESS,
or the local Ray that `aerie serve` started; without one the deploy stage is skipped and says so. Writes
state.json, report.json, report.md and plots to output_dir; the MLflow pipeline run has a child run per stage.
The console shows the stage lines, bars and warnings; the engines' own output goes to output_dir/logs/.
"""

from __future__ import annotations

import sys

from orchestrator.jobrunner import interrupt_on_sigterm, run_job
from orchestrator.pipeline import PipelineConfig, run_pipeline


def main(cfg: PipelineConfig) -> int:
    interrupt_on_sigterm()  # `ray job stop`: a canary in flight gives its traffic back first
    report = run_pipeline(cfg)
    deploy = report["deploy"]
    return 1 if deploy.get("decision") in ("rolled back", "failed") else 0


if __name__ == "__main__":
    sys.exit(run_job(__doc__, PipelineConfig, main))
