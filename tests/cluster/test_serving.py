"""Serving across nodes: `aerie serve` on the head of a cluster of network namespaces, the scheduler and the
target worker on the target node, the draft worker on the draft node, the router on the head. Greedy output
exact, the bytes the workers exchange measured on the draft node's link against the scheduler's own counters;
then faults under steady streaming load, each test printing what the clients saw: requests sent, failed (with
their errors), and how long until speculation resumed or a replacement node served."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from tests.cluster.conftest import RESOURCES, Load, Watch, serve
from tests.helpers import AUTH, QUESTIONS, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
DRAFTER = REPO / "drafters" / "smollm2-135m-chitchat-eagle3.1"
MAX_TOKENS = 48


def app_args(model: Path, **extra) -> dict:
    """SmolLM2 and the committed drafter, the workers on the GB200 manifests' custom resources, every round drafted."""
    return {
        "model": str(model),
        "served_model_name": "smollm2",
        "drafter": str(DRAFTER),
        "spec": {"method": "chain", "num_spec_tokens": 4},
        "scheduler": {"max_batch": 8, "budget_tokens": 40, "adaptive": False, "request_timeout_s": 300},
        "target": {"num_cpus": 0.5, "torch_threads": 1, "resources": {"target": 1}},
        "draft": {"num_cpus": 0.5, "torch_threads": 1, "resources": {"draft": 1}},
        "server": {"label_selector": {"aerie/group": "target"}},  # the scheduler next to its target
        **extra,
    }


@pytest.fixture(scope="module")
def references(smollm2_dir) -> dict:
    """The target's own greedy answers (no speculation, in this process) to the chat questions."""
    from orchestrator.engine import load_engine
    from orchestrator.models.tokenizer import load_tokenizer
    from orchestrator.spec import SamplingParams

    tok = load_tokenizer(smollm2_dir)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS[:4]]
    prompts = [
        list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for m in messages
    ]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = load_engine(smollm2_dir, max_batch=4).generate(prompts, greedy)
    return {"messages": messages, "texts": [tok.decode(g.token_ids, skip_special_tokens=True) for g in outs]}


def chat(url: str, messages: list[dict]) -> httpx.Response:
    body = {"model": "smollm2", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300, headers=AUTH)


@pytest.fixture(scope="module")
def served(netcluster, smollm2_dir, tmp_path_factory):
    """One server for this module's tests (the training tests need the nodes' CPUs it holds back)."""
    server = serve(netcluster, app_args(smollm2_dir), tmp_path_factory.mktemp("served"))
    yield server
    server.stop()


def test_serving_across_nodes(netcluster, served, references):
    server = served
    health = httpx.get(f"{server.url}/health", headers=AUTH).json()
    actors = netcluster.actors()
    print("topology:", netcluster.topology())
    print("actors:", actors)
    assert ("TargetWorker", "target") in actors and ("DraftWorker", "draft") in actors
    assert {node for cls, node in actors if cls.endswith(":Router") or cls == "RouteTable"} == {"head"}
    assert {node for cls, node in actors if cls.endswith(":SpecServer")} == {"target"}
    ips = {n.ip: n.name for n in netcluster.nodes.values()}
    assert health["workers"]["draft"]["node_id"] != health["workers"]["target"]["node_id"]

    # the draft link's background (Ray's heartbeats, resource reports, metrics) while nothing is served
    before, t0 = netcluster.link_bytes("draft"), time.monotonic()
    time.sleep(10)
    idle = netcluster.link_bytes("draft")
    idle_rate = {k: (idle[k] - before[k]) / (time.monotonic() - t0) for k in idle}

    stats0 = httpx.get(f"{server.url}/stats", headers=AUTH).json()
    link0, t1 = netcluster.link_bytes("draft"), time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda m: chat(server.url, m), references["messages"]))
    link1, elapsed = netcluster.link_bytes("draft"), time.monotonic() - t1
    stats1 = httpx.get(f"{server.url}/stats", headers=AUTH).json()

    for r, want in zip(answers, references["texts"], strict=True):
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
    calls = stats1["draft_calls"] - stats0["draft_calls"]
    assert calls > 0
    counted = {
        "rx": (stats1["target_to_draft_bytes"] - stats0["target_to_draft_bytes"]) / calls,
        "tx": (stats1["draft_to_target_bytes"] - stats0["draft_to_target_bytes"]) / calls,
    }
    link = {k: (link1[k] - link0[k] - idle_rate[k] * elapsed) / calls for k in link1}
    print(f"{calls:g} draft calls in {elapsed:.1f} s; link background {idle_rate} B/s; nodes {ips}")
    print("bytes per draft call: link", link, "counted", counted)
    # the pairs the target's hidden states make (rx) are the link's traffic to the drafter, within 10%; what
    # the drafter sends back is its trees (counted) plus its reply and TCP's acknowledgements (not counted)
    assert abs(link["rx"] / counted["rx"] - 1) <= 0.10, (link, counted)
    assert link["tx"] >= counted["tx"]


def summary(records: list[dict], t0: float) -> dict:
    failed = [r for r in records if "error" in r]
    return {
        "requests": len(records),
        "failed": len(failed),
        "errors": sorted({r["error"][:120] for r in failed})[:4],
        "failed_at_s": [round(r["ended"] - t0, 1) for r in failed][:10],
        "longest_s": round(max((r["ended"] - r["sent"] for r in records), default=0), 1),
    }


def longest_stall(rows: list[tuple]) -> float:
    """The longest time the server's round counter stood still (seconds, from the /stats rows)."""
    rows = [r for r in rows if r[3] is not None]
    longest, since = 0.0, rows[0] if rows else None
    for row in rows[1:]:
        if row[3] != since[3]:
            since = row
        longest = max(longest, row[0] - since[0])
    return round(longest, 1)


def rounds_between(rows: list[tuple], start: float, end: float) -> tuple[float, float]:
    """Rounds and drafted rounds the server counted between two times (from the /stats rows)."""
    during = [r for r in rows if start <= r[0] <= end and r[3] is not None]
    if not during:
        return 0, 0
    return during[-1][3] - during[0][3], during[-1][2] - during[0][2]


def test_draft_link_down_for_30s(netcluster, served):
    """The draft node cut off for 30 s: requests go on target-only (none fails); once the link is back (the node
    rejoining, or replaced if Ray declared it dead meanwhile) the drafter drafts again."""
    load, watch = Load(served.url), Watch(served.url)
    try:
        t0 = time.monotonic()
        wait_for(lambda: watch.speculating_since(t0), 120, "speculation under load")
        cut, replaced = time.monotonic(), None
        netcluster.link("draft", up=False)
        time.sleep(30)
        netcluster.link("draft", up=True)
        up = time.monotonic()
        # either the node rejoins, or Ray declared it dead while it was cut off and ends its raylet on return
        wait_for(lambda: watch.speculating_since(up) or not netcluster.ray_alive("draft"), 120, "rejoined or ended")
        if not netcluster.ray_alive("draft"):
            netcluster.add_node("draft", RESOURCES["draft"])
            replaced = time.monotonic() - up
        resumed = wait_for(lambda: watch.speculating_since(up), 300, "speculation after the link came back")
        time.sleep(3)
    finally:
        records, rows = load.stop(), watch.stop()
    rounds, spec_rounds = rounds_between(rows, cut, up)
    out = summary(records, cut) | {
        "resumed_after_link_up_s": round(resumed - up, 1),
        "replaced_after_s": replaced and round(replaced, 1),
        "rounds_while_cut": rounds,
        "spec_rounds_while_cut": spec_rounds,
        "longest_stall_s": longest_stall(rows),
    }
    print("draft link down 30 s:", out)
    assert out["failed"] == 0, out
    assert out["rounds_while_cut"] > 0, out  # target-only rounds went on (after draft_timeout_s)


def test_draft_node_killed(netcluster, served):
    """Every process of the draft node killed at once: requests go on target-only (none fails); a replacement
    draft node joins 10 s later and the drafter, restarted there, drafts again."""
    load, watch = Load(served.url), Watch(served.url)
    try:
        t0 = time.monotonic()
        wait_for(lambda: watch.speculating_since(t0), 120, "speculation under load")
        killed = time.monotonic()
        processes = netcluster.kill("draft")
        time.sleep(10)
        netcluster.add_node("draft", RESOURCES["draft"])
        joined = time.monotonic()
        resumed = wait_for(lambda: watch.speculating_since(joined), 300, "speculation on the replacement node")
        time.sleep(3)
    finally:
        records, rows = load.stop(), watch.stop()
    out = summary(records, killed) | {
        "processes_killed": processes,
        "rounds_until_replaced": rounds_between(rows, killed, joined)[0],
        "resumed_after_replacement_s": round(resumed - joined, 1),
        "longest_stall_s": longest_stall(rows),
    }
    print("draft node killed:", out)
    assert out["failed"] == 0, out
    assert out["rounds_until_replaced"] > 0, out


def test_target_node_killed(netcluster, served):
    """Every process of the target node killed (the target worker and the scheduler with it): requests in flight
    end with an error the client sees (an HTTP status or the stream's error event, or the stream cut) or with
    their whole answer, never one cut short; none is served while no target node is up, none hangs past the
    request timeout; once a replacement target node joins, new requests are served."""
    load = Load(served.url)
    try:
        wait_for(lambda: len(load.records) >= 2, 120, "requests served before the fault")
        killed = time.monotonic()
        processes = netcluster.kill("target")
        time.sleep(10)
        netcluster.add_node("target", RESOURCES["target"])
        joined = time.monotonic()
        served_again = wait_for(
            lambda: next((r["ended"] for r in load.records if r["sent"] > joined and "error" not in r), None),
            600,
            "a request served by the replacement",
        )
    finally:
        records = load.stop()
    # In flight: sent before the kill, not ended by then. One may still succeed after it: its tokens were all made
    # before its process died and relayed after (seen in CI). No margin of time tells the two apart on a loaded
    # machine (relays came >0.5 s after the kill, errors 1.4-1.9 s), so what is checked is what the client got:
    # either an error it sees, or the whole answer (ignore_eos: exactly max_tokens), never a stream cut short.
    in_flight = [r for r in records if r["sent"] < killed < r["ended"]]
    # Sent with no target node and ended before one joined: nothing could have served it.
    no_target = [r for r in records if killed < r["sent"] and r["ended"] < joined]
    out = summary(records, killed) | {
        "processes_killed": processes,
        "in_flight_at_kill": len(in_flight),
        "in_flight_failed": sum("error" in r for r in in_flight),
        "in_flight_cut_short": sum("error" not in r and r["tokens"] != load.max_tokens for r in in_flight),
        "sent_with_no_target": len(no_target),
        "served_with_no_target": sum("error" not in r for r in no_target),
        "served_after_replacement_s": round(served_again - joined, 1),
    }
    print("target node killed:", out)
    assert out["in_flight_failed"] > 0 and out["in_flight_cut_short"] == 0, out
    assert out["served_with_no_target"] == 0, out  # (those sent then mostly wait for the replacement)
    assert out["longest_s"] <= 300 + 30, out  # request_timeout_s (app_args), and the client's own read


def deploy_command(cluster, served, out: Path, **kw) -> list[str]:
    """`python -m jobs.deploy` to the served router, as a driver on the head, of a new version: the committed
    drafter copied (the same weights under another path)."""
    import shutil

    drafter = shutil.copytree(DRAFTER, out / "drafter")
    cfg = {
        "app": str(served.config),
        "drafter": str(drafter),
        "name": "aerie",
        "address": cluster.address,
        "host": cluster.nodes["head"].ip,
        "port": 8000,
        "window_s": 20,
        "max_window_s": 120,
        "min_drafts": 20,
        "poll_s": 1.0,
        "startup_timeout_s": 600,
        "drain_timeout_s": 120,
        "output_dir": str(out),
    } | kw
    (out / "deploy.yaml").write_text(yaml.safe_dump(cfg))
    return [sys.executable, "-m", "jobs.deploy", "--config", str(out / "deploy.yaml")]


def rollout_record(stdout: str) -> dict:
    """The summary jobs.deploy prints last."""
    return json.loads(stdout[stdout.rindex("\n{") :])


def routes(url: str) -> list[str]:
    status = httpx.get(f"{url}/router/status", headers=AUTH, timeout=10).json()
    return [r["app"] for r in status["routes"] if r["weight"] > 0]


def test_rollout_with_the_draft_node_cut_off_mid_canary(netcluster, served, tmp_path):
    """A rollout under streaming load whose candidate's drafter runs on the draft node, that node's link cut once
    the canary takes traffic: the candidate drafts nothing more and is not promoted (rolled back or undecided,
    by `max_window_s`); the stable backend serves on, target-only, and no request fails. (The promotion itself
    is tests/serving/test_rollout.py's, on one node.)"""
    stable = routes(served.url)
    load = Load(served.url)
    try:
        log = tmp_path / "deploy.log"
        proc = netcluster.popen(
            "head",
            deploy_command(netcluster, served, tmp_path / "cut", max_window_s=60),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
        )
        wait_for(lambda: len(routes(served.url)) == 2, 600, "the canary taking traffic")
        drafters = {node for cls, node in netcluster.actors() if cls == "DraftWorker"}
        netcluster.link("draft", up=False)
        stdout, _ = proc.communicate(timeout=900)
        netcluster.link("draft", up=True)
    finally:
        records = load.stop()
    record = rollout_record(stdout)
    out = summary(records, 0.0) | {"decision": record["decision"], "reason": record.get("reason")}
    print("rollout, draft node cut off mid-canary:", out, record["acceptance"])
    assert record["decision"] in ("rolled back", "inconclusive", "interrupted"), log.read_text()[-3000:]
    assert routes(served.url) == stable
    assert out["failed"] == 0 and drafters == {"draft"}, drafters  # both backends' drafters on the draft node
    # leave the cluster as found: cut off for longer than Ray's health checks, the node was declared dead and
    # its raylet ends once it hears so; a replacement takes its place
    wait_for(lambda: not netcluster.ray_alive("draft"), 120, "the cut-off draft node's raylet ending")
    netcluster.add_node("draft", RESOURCES["draft"])
