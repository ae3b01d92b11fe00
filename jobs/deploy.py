"""Rolling drafter deployment with a canary and an acceptance gate (either backend).

python -m jobs.deploy --config configs/smollm2-135m/deploy.yaml drafter=models:/NAME@candidate

Exit status 0: deployed (initial or promoted); 1: rolled back, inconclusive (the canary's test undecided when
the longest window ended) or the candidate failed to start. Interrupted
(Ctrl-C, or SIGTERM from `ray job stop`) while a canary runs, it first gives all traffic back to the stable
backend, then removes the canary.
"""

from __future__ import annotations

import json
import sys

from orchestrator.jobrunner import interrupt_on_sigterm, run_job
from orchestrator.serving.rollout import DeployConfig, run_rollout


def main(cfg: DeployConfig) -> int:
    interrupt_on_sigterm()  # `ray job stop`: unwind as Ctrl-C does (routes back to stable)
    record = run_rollout(cfg)
    summary = {k: record.get(k) for k in ("decision", "app", "drafter", "reason", "acceptance", "record_dir")}
    print(json.dumps(summary, indent=2))
    return 0 if record["decision"] in ("initial", "promoted") else 1


if __name__ == "__main__":
    sys.exit(run_job(__doc__, DeployConfig, main))
