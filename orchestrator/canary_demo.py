"""Real canary rollouts of drafters against the served one, under streaming load, as an operator runs them.

    python -m orchestrator.canary_demo DRAFTER [DRAFTER ...] [--users 2] [--window-s 60] [--out runs/canary-demo]

`aerie serve` starts with the committed broad drafter (configs/smollm2-135m/serve.yaml); `--users` clients stream
HumanEval problems the adapt demo never captures (not captured: `X-Aerie-Capture: off`) the whole time; each
DRAFTER (a directory or models:/ URI) is rolled out in turn with `python -m jobs.deploy` (its canary window
`--window-s`, `--min-drafts`), so each one is compared with whichever drafter then serves. Per rollout: the
decision, the test's interval and sample sizes, and both sides' draft tokens per draft (measurement rounds verify
whole trees, so the two should match); over the run, every response checked and the failed requests counted.
Records with their counter streams (for `aerie canary-replay`) stay under --out; the summary is --out/result.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.adapt_demo import REPO, Background, own_key, serving
from orchestrator.errors import AerieError, exit_status


def rollout_summary(record: dict) -> dict:
    """A rollout's decision, its test, and per side the drafts and draft tokens per draft of its window."""
    from orchestrator.spec.acceptance import Acceptance

    sides = {}
    last = (record.get("counters") or [{}])[-1]
    for side in ("stable", "canary"):
        app = (record.get(side) or {}).get("app")
        a = Acceptance.from_dict(last[app]) if app in last else Acceptance()
        sides[side] = {
            "app": app,
            "drafts": a.drafts,
            "acceptance_length": a.acceptance_length,
            "draft_tokens_per_draft": a.draft_tokens / a.drafts if a.drafts else None,
        }
    return {"decision": record.get("decision"), "reason": record.get("reason"), "test": record.get("test"), **sides}


def deploy(drafter: str, dest: Path, env: dict, args: argparse.Namespace) -> dict:
    """`python -m jobs.deploy` of `drafter` to the served model, its record under `dest`: its exit status and
    `rollout_summary`."""
    cmd = [sys.executable, "-m", "jobs.deploy", "--config", "configs/smollm2-135m/deploy.yaml", f"drafter={drafter}"]
    cmd += [f"window_s={args.window_s}", f"min_drafts={args.min_drafts}", f"output_dir={dest}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, check=False)
    records = sorted(dest.glob("*/record.json"))
    return {"exit": proc.returncode, **(rollout_summary(json.loads(records[-1].read_text())) if records else {})}


def run(args: argparse.Namespace) -> dict:
    from orchestrator.data.prompts import humaneval_prompts
    from orchestrator.serving.app import CAPTURE_HEADER

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for d in args.drafters:
        if not d.startswith("models:/") and not Path(d).is_dir():
            raise AerieError(f"drafter {d!r} is neither a directory nor a models:/ URI")
    unseen = humaneval_prompts()[130:]  # the adapt demo's "before" and "after" problems, never captured there
    env, headers = own_key()
    result: dict = {"users": args.users, "window_s": args.window_s, "min_drafts": args.min_drafts, "rollouts": []}
    print("[canary-demo] starting the server", flush=True)
    with serving(out / "serve.log", env, headers, []):
        load = Background(unseen, args.users, headers | {CAPTURE_HEADER: "off"}, args.max_tokens)
        try:
            time.sleep(20)  # the load running before the first canary
            for i, drafter in enumerate(args.drafters, 1):
                print(f"[canary-demo] rollout {i}: {drafter}", flush=True)
                result["rollouts"].append({"drafter": drafter, **deploy(drafter, out / f"rollout-{i}", env, args)})
                print(f"[canary-demo]   {result['rollouts'][-1].get('reason')}", flush=True)
        finally:
            result["load"] = load.stop()
    result["failed_requests"] = result["load"]["failed"]
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafters", nargs="+", help="drafters rolled out in turn (directories or models:/ URIs)")
    p.add_argument("--users", type=int, default=2, help="clients streaming the whole time")
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--min-drafts", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--out", default="runs/canary-demo")
    return exit_status(lambda: run(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
