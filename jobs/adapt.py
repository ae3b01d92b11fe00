"""Drafters that learn from the traffic they serve: the pipeline on what the serving tap captured.

    python -m jobs.adapt --config configs/smollm2-135m/adapt.yaml [every_minutes=60] [key=value ...]
    RAY_AUTH_MODE=token ray job submit -- python -m jobs.adapt --config ...   (clusters/rayjob-adapt.yaml)

Each round: the traffic shards written since the production drafter's own (its `aerie.traffic.until` tag), the
newest held out; fine-tune the production drafter (models:/NAME@production, else the config's base drafter) on
the rest plus a replay share of its corpus; evaluate it against production on the held-out traffic and MT-Bench;
the gate; a canary rollout on the running server that live acceptance decides. The registry version records
the traffic manifest, the version it came from and the replay share. With every_minutes it runs again after that
many minutes, for as long as it is left running; a round without enough new traffic waits for the next.
"""

from __future__ import annotations

import sys
import time

from pydantic import Field

from orchestrator.errors import AerieError
from orchestrator.jobrunner import interrupt_on_sigterm, run_job
from orchestrator.pipeline import PipelineConfig, run_pipeline


class AdaptConfig(PipelineConfig):
    """`python -m jobs.adapt` settings: a pipeline whose data is served traffic."""

    every_minutes: float | None = Field(None, gt=0, description="run again after this many minutes (None: once)")


def main(cfg: AdaptConfig) -> int:
    interrupt_on_sigterm()  # `ray job stop`: a canary in flight gives its traffic back first
    if cfg.traffic is None:
        raise AerieError("jobs.adapt adapts on served traffic: set traffic.output to the serving tap's output")
    pipeline_cfg = PipelineConfig.model_validate(cfg.model_dump(exclude={"every_minutes"}))
    while True:
        try:
            report = run_pipeline(pipeline_cfg)
            print(f"[adapt] round done: deploy {report['deploy'].get('decision') or report['deploy']}", flush=True)
        except AerieError as err:
            if cfg.every_minutes is None:
                raise
            print(f"[adapt] round skipped: {err}", flush=True)
        if cfg.every_minutes is None:
            return 0
        time.sleep(60 * cfg.every_minutes)


if __name__ == "__main__":
    sys.exit(run_job(__doc__, AdaptConfig, main))
