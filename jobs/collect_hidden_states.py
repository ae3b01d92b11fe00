"""Hidden-state collection: conversations -> chat templates -> target aux/final hidden states -> shards.

    python -m jobs.collect_hidden_states --config configs/smollm2-135m/collect.yaml [key=value ...]
    ray job submit --working-dir . -- python -m jobs.collect_hidden_states --config ...
    (on the KubeRay clusters the code is in the image: clusters/rayjob-*.yaml, no --working-dir)

Without a cluster address (ray_address or RAY_ADDRESS) it starts a local Ray. Rerunning resumes: shards whose
bytes still match their checksum are kept. Writes result.json next to the shards (local) or to result_dir.
"""

from __future__ import annotations

import json
import sys

from orchestrator.data.collect import CollectConfig, run_collection
from orchestrator.data.storage import open_storage
from orchestrator.jobrunner import run_job
from orchestrator.models.prepare import resolve_model


def main(cfg: CollectConfig) -> int:
    model_dir = resolve_model(cfg.model, cfg.models_dir)
    result = run_collection(cfg, model_dir)
    open_storage(cfg.output).write_bytes("result.json", json.dumps(result, indent=2).encode())
    print(json.dumps({k: v for k, v in result.items() if k != "datasets"}, indent=2))
    return 0 if result["complete"] or cfg.max_new_shards is not None else 1


if __name__ == "__main__":
    sys.exit(run_job(__doc__, CollectConfig, main))
