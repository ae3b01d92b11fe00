"""EAGLE-3 / EAGLE-3.1 drafter training on Ray Train, tracked in MLflow.

    python -m jobs.train_drafter --config configs/smollm2-135m/train.yaml [key=value ...]
    ray job submit --working-dir . -- python -m jobs.train_drafter --config ...
    (on the KubeRay clusters the code is in the image: clusters/rayjob-*.yaml, no --working-dir)

Rerunning with the same `name` resumes from the latest checkpoint (and the same MLflow run). Writes
result.json and train_config.json (the config it ran with, overrides applied, secrets redacted) next to the
exported drafter (local) or under runs/<name>/ (s3 output); `aerie convert-drafter` records both.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from orchestrator.jobrunner import run_job, write_result
from orchestrator.redaction import redact_tree
from orchestrator.train.config import TrainConfig
from orchestrator.train.run import run_training


def main(cfg: TrainConfig) -> int:
    result = run_training(cfg)
    out = Path("runs") / cfg.name if cfg.output.startswith("s3://") else Path(cfg.output)
    write_result(out, result)
    (out / "train_config.json").write_text(json.dumps(redact_tree(cfg.model_dump(mode="json")), indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_job(__doc__, TrainConfig, main))
