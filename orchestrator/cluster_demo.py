"""`make cluster-demo`: the disaggregated server across three nodes of this machine (orchestrator/netcluster.py:
network namespaces on a bridge, needs root), and what a thin link between the target and the draft node costs.

    python -m orchestrator.cluster_demo [--rates none,1000,100,20,5] [--seconds 40] [--users 4] [--repeats 1] [--pin]

It serves SmolLM2-135M-Instruct with the committed drafter (configs/smollm2-135m/serve.yaml) with the target worker
and the scheduler on the target node, the drafter on the draft node and the router on the head, prints which actor
runs where, then sends steady streaming load (MT-Bench first turns) first target-only, then with speculation at
each rate of the draft node's link (tc's token bucket, both directions). `--repeats` runs the whole sequence again,
in reverse order every other time (target-only and speculation, the rates too), so the machine's drift falls on
both sides. Per rate: per-user tokens/s and its ratio to target-only (each repeat paired with the target-only run
of the same repeat; a bootstrap interval over those pairs), the share of rounds that drafted (the mode chooser
stops drafting where it does not pay) and why they drafted, the draft call's time, the bytes per round on the
link against the scheduler's counters, and each node's CPU time per round (`--pin` gives each node cores of its
own, as separate machines have). Writes runs/cluster-demo/result.json and table.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
from pathlib import Path

from orchestrator.errors import AerieError, exit_status
from orchestrator.stats import format_ratio, paired_ratio

REPO = Path(__file__).resolve().parents[1]
PLACEMENT = [  # the GB200 manifests' node groups (clusters/gb200-raycluster.yaml)
    "target.resources={target: 1}",
    "draft.resources={draft: 1}",
    "server.label_selector={aerie/group: target}",
    "target.torch_threads=1",
    "draft.torch_threads=1",
]


PINNED = {"target": (0,), "draft": (1,), "head": (1,)}  # --pin: the target's node alone on a core


def measure(cluster, url: str, headers: dict, prompts: list[dict], seconds: float, users: int, max_tokens: int):
    """Steady load for `seconds`: the load's summary, what the scheduler did, and the draft link's bytes."""
    import httpx

    from orchestrator.benchmarks.load import steady_load
    from orchestrator.benchmarks.serving import scheduler_delta
    from orchestrator.netcluster import cpu_between

    before, link0 = httpx.get(f"{url}/stats", headers=headers, timeout=60).json(), cluster.link_bytes("draft")
    cpu0 = {node: cluster.cpu_seconds(node) for node in cluster.nodes}
    load = asyncio.run(steady_load(url, prompts, users, seconds, max_tokens, headers))
    cpu1 = {node: cluster.cpu_seconds(node) for node in cluster.nodes}
    after, link1 = httpx.get(f"{url}/stats", headers=headers, timeout=60).json(), cluster.link_bytes("draft")
    sched = scheduler_delta(before, after)
    rounds = max(1, sched["rounds"])
    link = sum(link1[k] - link0[k] for k in link1) / rounds
    counted = sched["target_to_draft_bytes_per_round"] + sched["draft_to_target_bytes_per_round"]
    return {
        "load": load,
        "ms_per_round": 1e3 * load["seconds"] / rounds,
        "spec_round_share": sched["spec_round_share"],
        "draft_call_ms": sched.get("draft_call_ms"),
        "acceptance_length": sched["acceptance_length"],
        "drafted_by": sched["drafted_by"],  # why rounds drafted: probe, best (by choice), measuring; catch-ups
        "drafting_excess": sched["drafting_excess"],  # drafted rounds' time beyond target-only's, a share of all
        "link_bytes_per_round": link,
        "counted_bytes_per_round": counted,
        # where the CPU went: each node's processes' CPU time per round (the nodes share this machine's cores
        # unless --pin gives each its own)
        "cpu_ms_per_round": {node: 1e3 * cpu_between(cpu0[node], cpu1[node]) / rounds for node in cpu1},
    }


def run(args: argparse.Namespace) -> dict:
    from orchestrator.data.prompts import mtbench_first_turns
    from orchestrator.models.prepare import prepare_model
    from orchestrator.netcluster import ClusterServer, NetCluster, ray_token_env

    why = NetCluster.unavailable()
    if why is not None:
        raise AerieError(f"the cluster demo needs network namespaces: {why}")
    model = prepare_model("smollm2-135m-instruct", REPO / "models" / "smollm2-135m-instruct")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(24)  # this demo's own API key (never printed)
    env = ray_token_env() | {"AERIE_API_KEY": key}
    env.pop("AERIE_API_KEY_FILE", None)
    headers = {"Authorization": f"Bearer {key}"}
    prompts = mtbench_first_turns()
    rates = [None if r in ("none", "") else float(r) for r in args.rates.split(",")]
    result: dict = {"rates_mbit": rates, "users": args.users, "seconds": args.seconds, "rows": []}
    arms = [("target only", ["speculation=false"], [None]), ("speculation", [], rates)]
    cores = PINNED if args.pin else {}
    if cores and not {c for node in cores.values() for c in node} <= os.sched_getaffinity(0):
        raise AerieError(f"--pin needs cores 0 and 1; this process may use {sorted(os.sched_getaffinity(0))}")
    result["cores"] = cores
    with NetCluster(env, head_cores=cores.get("head")) as cluster:
        cluster.add_node("target", {"target": 1}, cores=cores.get("target"))
        cluster.add_node("draft", {"draft": 1}, cores=cores.get("draft"))
        for repeat in range(args.repeats):
            for arm, extra, arm_rates in arms if repeat % 2 == 0 else arms[::-1]:
                overrides = [f"model={model}", *PLACEMENT, *extra]
                log = out / f"serve-{arm.replace(' ', '-')}-{repeat}.log"
                server = ClusterServer(cluster, args.config, overrides, log)
                try:
                    server.wait_healthy(headers)
                    if arm == "speculation" and "topology" not in result:
                        result["topology"], result["actors"] = cluster.topology(), cluster.actors()
                        nodes = (f"{n['node']} {n['ip']} {n['resources']}" for n in result["topology"])
                        print("nodes:", ", ".join(nodes))
                        print("actors:", ", ".join(f"{cls} on {node}" for cls, node in result["actors"]))
                    for rate in arm_rates if repeat % 2 == 0 else arm_rates[::-1]:
                        cluster.rate_limit("draft", rate)
                        measure(cluster, server.url, headers, prompts, 5, args.users, args.max_tokens)  # warm, adapt
                        row = measure(cluster, server.url, headers, prompts, args.seconds, args.users, args.max_tokens)
                        row |= {"arm": arm, "rate_mbit": rate, "repeat": repeat}
                        result["rows"].append(row)
                        print(f"[{repeat + 1}/{args.repeats}] {format_row(row)}", flush=True)
                finally:
                    cluster.rate_limit("draft", None)
                    server.stop()
    result["summary"] = summarize(result["rows"])
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "table.md").write_text(table(result["summary"]))
    print(table(result["summary"]), end="")
    print(f"wrote {out / 'table.md'} and result.json")
    return result


def format_row(row: dict) -> str:
    rate = "unlimited" if row["rate_mbit"] is None else f"{row['rate_mbit']:g} Mbit/s"
    return (
        f"{row['arm']:<12} {rate:>14}: {row['load']['per_user_tok_s']:6.2f} tok/s per user, "
        f"{row['load']['failed']} failed, drafted {100 * row['spec_round_share']:3.0f}% of rounds, "
        f"{row['ms_per_round']:5.1f} ms/round, link {row['link_bytes_per_round'] / 1e3:6.1f} kB/round "
        f"(counted {row['counted_bytes_per_round'] / 1e3:.1f}), CPU ms/round {_cpu(row['cpu_ms_per_round'])}, "
        f"drafted by {_why(row['drafted_by'])}"
    )


def _why(drafted_by: dict) -> str:
    return ", ".join(f"{why} {n}" for why, n in drafted_by.items() if n) or "none"


def _cpu(per_node: dict) -> str:
    return " / ".join(f"{node} {ms:.0f}" for node, ms in per_node.items())


def summarize(rows: list[dict]) -> list[dict]:
    """One line per (arm, rate) over the repeats: means, and per-user tokens/s over target-only's as a ratio of
    means with a bootstrap interval over the repeats, each paired with the target-only run of the same repeat."""
    base = {r["repeat"]: r["load"]["per_user_tok_s"] for r in rows if r["arm"] == "target only"}
    keys = list(dict.fromkeys((r["arm"], r["rate_mbit"]) for r in rows))
    out = []
    for arm, rate in keys:
        runs = sorted((r for r in rows if (r["arm"], r["rate_mbit"]) == (arm, rate)), key=lambda r: r["repeat"])
        paired = [r for r in runs if r["repeat"] in base]
        call = [r["draft_call_ms"] for r in runs if r["draft_call_ms"] is not None]
        out.append(
            {
                "arm": arm,
                "rate_mbit": rate,
                "repeats": len(runs),
                "per_user_tok_s": statistics.mean(r["load"]["per_user_tok_s"] for r in runs),
                "vs_target_only": paired_ratio(
                    [r["load"]["per_user_tok_s"] for r in paired], [base[r["repeat"]] for r in paired]
                )
                if paired
                else None,
                "failed": sum(r["load"]["failed"] for r in runs),
                "requests": sum(r["load"]["requests"] for r in runs),
                "spec_round_share": statistics.mean(r["spec_round_share"] for r in runs),
                "ms_per_round": statistics.mean(r["ms_per_round"] for r in runs),
                "draft_call_ms": statistics.mean(call) if call else None,
                "link_bytes_per_round": statistics.mean(r["link_bytes_per_round"] for r in runs),
                "counted_bytes_per_round": statistics.mean(r["counted_bytes_per_round"] for r in runs),
                "cpu_ms_per_round": {
                    node: statistics.mean(r["cpu_ms_per_round"][node] for r in runs)
                    for node in runs[0]["cpu_ms_per_round"]
                },
            }
        )
    return out


def table(summary: list[dict]) -> str:
    lines = [
        "| arm | draft link | per-user tok/s | vs target-only [95%] | failed / requests | rounds drafted | ms/round "
        "| draft call ms | link kB/round | counted kB/round | CPU ms/round by node |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        rate = "unlimited" if r["rate_mbit"] is None else f"{r['rate_mbit']:g} Mbit/s"
        call = "" if r["draft_call_ms"] is None else f"{r['draft_call_ms']:.1f}"
        if r["arm"] == "target only":
            ratio = "baseline"
        else:
            ratio = "" if r["vs_target_only"] is None else format_ratio(r["vs_target_only"])
        lines.append(
            f"| {r['arm']} | {rate} | {r['per_user_tok_s']:.2f} | {ratio} | {r['failed']} / {r['requests']} "
            f"| {100 * r['spec_round_share']:.0f}% | {r['ms_per_round']:.1f} | {call} "
            f"| {r['link_bytes_per_round'] / 1e3:.1f} | {r['counted_bytes_per_round'] / 1e3:.1f} "
            f"| {_cpu(r['cpu_ms_per_round'])} |"
        )
    return "\n".join(lines) + "\n"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.cluster_demo", description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "smollm2-135m" / "serve.yaml"))
    p.add_argument("--rates", default="none,1000,100,20,5", help="draft link rates in Mbit/s (none: unlimited)")
    p.add_argument("--seconds", type=float, default=40, help="load per rate")
    p.add_argument("--users", type=int, default=4, help="streaming clients at once")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=_positive, default=1, help="the whole sequence again, every other time reversed")
    p.add_argument(
        "--pin",
        action="store_true",
        help="give the target node core 0 and the draft node and the head core 1 (taskset), as machines of their own",
    )
    p.add_argument("--out", default="runs/cluster-demo")
    args = p.parse_args(argv)
    return exit_status(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
