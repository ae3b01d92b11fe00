"""The disaggregated server end to end over HTTP: exact greedy output (chain and tree, 1 and 8 concurrent
users), the openai client, bad requests, faults (draft and target actors killed), and a 200-request load."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from orchestrator.serving.guard import key_id
from tests.helpers import API_KEY, AUTH, NO_CAPTURE_KEY, wait_for
from tests.serving.conftest import app_args, deploy

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def traffic(tmp_path_factory):
    """Where the chain app's traffic tap writes."""
    return tmp_path_factory.mktemp("traffic")


@pytest.fixture(scope="module")
def apps(serve_session, tiny_chat, tiny_drafter, references, traffic):
    """chain and tree apps with the replay proposer (acceptance 0..all; the chain app with the traffic tap on),
    two replicas with the real EAGLE drafter ("dp", also the "eagle" case), a target-only one and one with a
    0.5 s request deadline."""
    replay = {"proposer_factory": "tests.helpers:ReplayProposer"}
    tap = {"enabled": True, "output": str(traffic), "shard_tokens": 1, "dtype": "float32"}
    urls = {
        "chain": deploy(
            "chain",
            app_args(
                tiny_chat,
                spec={"method": "chain", "num_spec_tokens": 4},
                **replay,
                proposer_args={"references": references["path"], "depth": 4},
                scheduler={"adaptive": False},
                tap=tap | {"no_capture_key_ids": [key_id(NO_CAPTURE_KEY)]},
            ),
            serve_session,
        ),
        "tree": deploy(
            "tree",
            app_args(
                tiny_chat,
                spec={"method": "tree", "depth": 4, "topk": 2, "budget": 8},
                **replay,
                proposer_args={"references": references["path"], "depth": 4, "width": 2},
                scheduler={"budget_tokens": 24, "adaptive": False},  # whole trees: acceptance 0 .. all
                placement_strategy="PACK",  # the two workers in one placement group
            ),
            serve_session,
        ),
        "plain": deploy("plain", app_args(tiny_chat, speculation=False), serve_session),
        "dp": deploy("dp", app_args(tiny_chat, drafter=str(tiny_drafter), num_replicas=2), serve_session),
        "deadline": deploy(
            "deadline", app_args(tiny_chat, speculation=False, scheduler={"request_timeout_s": 0.5}), serve_session
        ),
    }
    yield urls | {"eagle": urls["dp"]}
    from ray import serve

    for name in urls:  # free their workers for the modules that follow
        serve.delete(name)


def _chat(url: str, messages, **kw) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": 32, "temperature": 0, "ignore_eos": True} | kw
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def _concurrently(fn, args_list):
    async def run():
        return await asyncio.gather(*[asyncio.to_thread(fn, *a) for a in args_list])

    return asyncio.run(run())


@pytest.mark.parametrize("kind", ["chain", "tree", "eagle"])
@pytest.mark.parametrize("users", [1, 8])
def test_greedy_output_equals_target_only(apps, references, kind, users):
    url = apps[kind]
    messages = references["messages"]
    if users == 1:
        got = [_chat(url, m) for m in messages[:3]]
        want = references["texts"][:3]
    else:
        got = _concurrently(lambda m: _chat(url, m), [(m,) for m in messages])
        want = references["texts"]
    assert [g["choices"][0]["message"]["content"] for g in got] == want
    assert all(g["usage"]["completion_tokens"] == 32 for g in got)
    stats = httpx.get(f"{url}/stats", headers=AUTH).json()
    if kind != "eagle":  # the replayed drafts are partly right: rounds accept 0 .. all
        acceptance = stats["acceptance"]
        assert 0 < acceptance["accepted"] < acceptance["draft_tokens"]
        assert len(acceptance["accepted_per_pos"]) >= 3


def test_data_parallel_replicas_each_with_their_workers(apps, references):
    """Two replicas, each with its own TargetWorker and DraftWorker; both serve, output stays exact."""
    got = _concurrently(lambda m: _chat(apps["dp"], m), [(m,) for m in references["messages"]])
    assert [g["choices"][0]["message"]["content"] for g in got] == references["texts"]
    seen = {
        json.dumps(httpx.get(f"{apps['dp']}/health", headers=AUTH).json()["actor_names"], sort_keys=True)
        for _ in range(30)
    }
    assert len(seen) == 2
    # /stats answers from one replica per request and says which: the rollout's watch keeps a series per replica.
    reads = [httpx.get(f"{apps['dp']}/stats", headers=AUTH).json() for _ in range(30)]
    series = {s["replica"]: s["acceptance"] for s in reads}
    assert len(series) == 2 and all(a["drafts"] > 0 for a in series.values())
    assert all("acceptance_measured" in s for s in reads)  # what a canary compares (none measured here)


def test_openai_client_streaming_and_not(apps, references):
    from openai import OpenAI

    client = OpenAI(base_url=f"{apps['tree']}/v1", api_key=API_KEY)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    m = references["messages"][0]
    extra = {"ignore_eos": True}
    full = client.chat.completions.create(model="tiny", messages=m, max_tokens=32, temperature=0, extra_body=extra)
    assert full.choices[0].message.content == references["texts"][0]
    assert full.usage.completion_tokens == 32 and full.usage.prompt_tokens == len(references["prompts"][0])
    stream = client.chat.completions.create(
        model="tiny",
        messages=m,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == references["texts"][0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 32
    done = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 8


def test_stop_strings_and_seeded_sampling(apps, references):
    """A stop string cuts the text before it; seeded sampling is reproducible across deployments."""
    url = apps["tree"]
    m = references["messages"][1]
    text = references["texts"][1]
    stop = text[10:13]
    cut = _chat(url, m, stop=[stop])
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == text[: text.find(stop)]
    sampled = {
        (kind, seed): _chat(apps[kind], m, temperature=0.9, top_p=0.9, top_k=50, seed=seed)["choices"][0]["message"]
        for kind in ("eagle", "tree", "plain")
        for seed in (7, 8)
    }
    # a seeded request's tokens depend on (seed, position) only: speculation on or off, any tree
    for seed in (7, 8):
        assert sampled[("eagle", seed)] == sampled[("tree", seed)] == sampled[("plain", seed)]
    assert sampled[("plain", 7)] != sampled[("plain", 8)]


def test_aerie_generate_seed_gives_the_servers_tokens(apps, references, tiny_chat, tiny_drafter, tmp_path):
    """The same seeded, sampled text from `aerie generate --seed` and from the server, speculation on and off:
    both run the same target worker, whose seeded tokens depend on (seed, position) only."""
    from orchestrator.cli import main

    messages = references["messages"][:3]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n" for m in messages))
    local = {}
    for label, extra in (("off", []), ("on", ["--drafter", str(tiny_drafter), "--spec", "tree", "--topk", "2"])):
        out = tmp_path / f"{label}.jsonl"
        args = ["generate", "--model", str(tiny_chat), "--prompts", str(prompts), "--out", str(out), *extra]
        assert main([*args, "--max-tokens", "32", "--temperature", "0.9", "--seed", "1234"]) == 0
        local[label] = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    served = {
        kind: [_chat(apps[kind], m, temperature=0.9, seed=1234, ignore_eos=False) for m in messages]
        for kind in ("eagle", "plain")
    }
    served = {kind: [r["choices"][0]["message"]["content"] for r in rs] for kind, rs in served.items()}
    assert local["off"] == local["on"] == served["eagle"] == served["plain"]
    greedy = [r["choices"][0]["message"]["content"] for r in (_chat(apps["plain"], m) for m in messages)]
    assert local["off"] != greedy  # it did sample


BAD = {
    "unknown model": ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    "missing messages": ({"model": "tiny"}, "messages"),
    "empty messages": ({"model": "tiny", "messages": []}, "messages"),
    "bad role": ({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    "max_tokens 0": ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    "max_tokens past context": (
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000},
        "max_tokens",
    ),
    "prompt longer than context": ({"model": "tiny", "messages": [{"role": "user", "content": "word " * 1200}]}, None),
    "n > 1": ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    "temperature 3": ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 3}, None),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests_get_4xx_and_harm_nothing(apps, references, case):
    body, param = BAD[case]
    r = httpx.post(f"{apps['chain']}/v1/chat/completions", json=body, timeout=30, headers=AUTH)
    assert r.status_code == (404 if case == "unknown model" else 400), r.text  # OpenAI's model_not_found
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param:
        assert error["param"] == param
    assert _chat(apps["chain"], references["messages"][0])["choices"][0]["message"]["content"] == references["texts"][0]


def test_bad_json_gets_400(apps):
    r = httpx.post(
        f"{apps['chain']}/v1/chat/completions",
        content=b"{not json",
        headers=AUTH | {"content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{apps['chain']}/v1/completions", json={"model": "tiny", "prompt": ["a", "b"]}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def _stream_text(url: str, messages, max_tokens: int, on_chunk=None) -> tuple[str, list[dict]]:
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    text, events = "", []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120, headers=AUTH) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(event)
            if "error" in event:
                break
            text += event["choices"][0]["delta"].get("content") or ""
            if on_chunk:
                on_chunk(len(events))
    return text, events


def test_draft_worker_killed_mid_stream(apps, references):
    """The stream completes with the exact greedy text; the restarted drafter resumes speculation."""
    import ray

    url = apps["chain"]  # drafts every round (no ModeChooser): the kill always meets a draft call
    names = httpx.get(f"{url}/health", headers=AUTH).json()["actor_names"]
    draft = ray.get_actor(names["draft"], namespace="aerie")
    killed = threading.Event()

    def kill(n):
        if n == 4 and not killed.is_set():
            ray.kill(draft, no_restart=False)
            killed.set()

    before = httpx.get(f"{url}/stats", headers=AUTH).json()
    text, events = _stream_text(url, references["messages"][2], 32, kill)
    assert killed.is_set() and not any("error" in e for e in events)
    assert text == references["texts"][2]
    for _ in range(120):  # the drafter comes back (restart + history resync) and drafts again
        after = httpx.get(f"{url}/stats", headers=AUTH).json()
        if after["draft_alive"]:
            break
        time.sleep(0.5)
    assert after["draft_failures"] == before["draft_failures"] + 1
    got = _chat(url, references["messages"][3])
    assert got["choices"][0]["message"]["content"] == references["texts"][3]
    assert httpx.get(f"{url}/stats", headers=AUTH).json()["draft_calls"] > after["draft_calls"]  # drafting again


def test_target_worker_killed(apps, references):
    """In-flight requests end with an error (no hang); the next request is served by the restarted target."""
    import ray

    url = apps["chain"]
    health = httpx.get(f"{url}/health", headers=AUTH).json()
    assert "actor_names" in health, health
    names = health["actor_names"]
    target = ray.get_actor(names["target"], namespace="aerie")

    def kill(n):
        if n == 3:
            ray.kill(target, no_restart=False)

    began = time.perf_counter()
    _, events = _stream_text(url, references["messages"][4], 32, kill)
    assert "error" in events[-1] and events[-1]["status"] == 503
    assert time.perf_counter() - began < 60
    got = _chat(url, references["messages"][5])
    assert got["choices"][0]["message"]["content"] == references["texts"][5]


def test_a_request_past_its_deadline_ends_with_an_error(apps, references):
    body = {"model": "tiny", "messages": references["messages"][0], "max_tokens": 900, "ignore_eos": True}
    began = time.perf_counter()
    r = httpx.post(f"{apps['deadline']}/v1/chat/completions", json=body, timeout=60, headers=AUTH)
    assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
    assert time.perf_counter() - began < 10
    short = httpx.post(
        f"{apps['deadline']}/v1/chat/completions", json=body | {"max_tokens": 2}, timeout=60, headers=AUTH
    )
    assert short.status_code == 200


def test_load_200_requests_at_concurrency_16(apps, references):
    """None lost, none failed; the latency distribution is printed."""
    url = apps["tree"]
    messages = references["messages"]

    async def run():
        sem = asyncio.Semaphore(16)
        async with httpx.AsyncClient(timeout=300, headers=AUTH) as client:

            async def one(i):
                async with sem:
                    began = time.perf_counter()
                    r = await client.post(
                        f"{url}/v1/chat/completions",
                        json={
                            "model": "tiny",
                            "messages": messages[i % 8],
                            "max_tokens": 16,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                    )
                    return i, r.status_code, r.json(), time.perf_counter() - began

            return await asyncio.gather(*[one(i) for i in range(200)])

    results = asyncio.run(run())
    assert len(results) == 200
    failed = [(i, s) for i, s, _, _ in results if s != 200]
    assert not failed, failed
    for i, _, body, _ in results:
        ref = references["outputs"][i % 8][:16]
        assert body["usage"]["completion_tokens"] == 16
        assert body["choices"][0]["message"]["content"] == references["tokenizer"].decode(ref, skip_special_tokens=True)
    latencies = sorted(t for *_, t in results)
    q = {p: latencies[min(199, int(p / 100 * 200))] for p in (50, 90, 99)}
    print(
        f"\nload: 200 requests at concurrency 16: p50 {q[50]:.2f} s, p90 {q[90]:.2f} s, p99 {q[99]:.2f} s, "
        f"max {latencies[-1]:.2f} s"
    )


def test_metrics_reach_prometheus_under_the_dashboard_names(apps):
    """Every series the Grafana dashboard queries is on Ray's Prometheus endpoint."""
    import re
    import urllib.request

    import ray

    from tests.serving.conftest import REPO

    dashboard = (REPO / "dashboards" / "aerie-serving.json").read_text()
    wanted = {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"ray_aerie_\w+", dashboard)}
    wanted.discard("ray_aerie_errors_total")  # only once an error happened
    port = ray._private.worker.global_worker.node.metrics_export_port
    missing = wanted
    for _ in range(60):
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        exported = {re.sub(r"_(bucket|sum|count)$", "", line.split("{")[0]) for line in text.splitlines()}
        missing = wanted - exported
        if not missing:
            break
        time.sleep(1)
    assert not missing
    assert 'model="tiny"' in text


def test_steady_load_keeps_users_busy_for_its_duration_and_counts_failures(apps, references):
    """`aerie load`'s engine: closed-loop users for a few seconds against a served model, every response
    checked; a server that refuses the client fails in one line before any load."""
    from orchestrator.benchmarks.load import steady_load
    from orchestrator.data.prompts import humaneval_prompts

    prompts = [{"messages": m, "task_id": i} for i, m in enumerate(references["messages"][:4])]  # ids are not sent
    summary = asyncio.run(steady_load(apps["chain"], prompts, users=2, seconds=3, max_tokens=8, headers=AUTH))
    assert summary["requests"] >= 2 and summary["failed"] == 0 and summary["tokens"] == 8 * summary["requests"]
    once = asyncio.run(
        steady_load(apps["chain"], prompts[:3], users=2, seconds=60, max_tokens=8, headers=AUTH, once=True)
    )
    assert once["requests"] == 3 and once["failed"] == 0  # each prompt once, then the load ends
    from orchestrator.errors import AerieError

    with pytest.raises(AerieError, match="answered 401"):  # no key: refused before any load
        asyncio.run(steady_load(apps["chain"], humaneval_prompts(2), users=1, seconds=1, max_tokens=8, headers={}))


def test_the_tap_keeps_only_requests_it_may_keep(apps, traffic):
    """Three requests to the app with the tap on: one it may keep, one that opts out with `X-Aerie-Capture: off`,
    one sent with a key configured as never captured. Only the first reaches storage (its prompt's token ids
    are the start of a captured sequence). (That the tap changes no answer: the greedy tests run on this app.)"""
    from orchestrator.data.shards import read_shard
    from orchestrator.data.storage import LocalStorage
    from orchestrator.data.traffic import traffic_shards

    prompts = {name: [11 + i, 23, 57, 91 + i, 7, 64] for i, name in enumerate(("kept", "opted-out", "no-capture-key"))}
    headers = {
        "kept": AUTH,
        "opted-out": AUTH | {"X-Aerie-Capture": "off"},
        "no-capture-key": {"Authorization": f"Bearer {NO_CAPTURE_KEY}"},
    }
    for name, prompt in prompts.items():
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{apps['chain']}/v1/completions", json=body, timeout=120, headers=headers[name])
        assert r.status_code == 200, r.text

    def captured() -> list[list[int]]:
        storage, seqs = LocalStorage(traffic), []
        for record in traffic_shards(storage):
            shard = read_shard(storage.read_bytes(record["name"]))
            ids, start = shard["input_ids"].tolist(), 0
            for n in shard["seq_lens"].tolist():
                seqs.append(ids[start : start + n])
                start += n
        return seqs

    kept = prompts["kept"]
    wait_for(lambda: any(s[: len(kept)] == kept for s in captured()), 60, "the tap wrote the request it may keep")
    time.sleep(2)  # the others, had they been queued, would be written by now
    for name in ("opted-out", "no-capture-key"):
        assert not any(s[: len(prompts[name])] == prompts[name] for s in captured()), name
