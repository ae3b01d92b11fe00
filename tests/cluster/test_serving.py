"""Serving across nodes: `aerie serve` on the head of a cluster of network namespaces, the target worker on the
target node and the draft worker on the draft node; greedy output exact, and the bytes the workers exchange
measured on the draft node's link against the scheduler's own transfer counters."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.cluster.conftest import serve
from tests.helpers import AUTH, QUESTIONS

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


def test_serving_across_nodes(netcluster, smollm2_dir, references, tmp_path):
    server = serve(netcluster, app_args(smollm2_dir), tmp_path)
    try:
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
    finally:
        server.stop()
