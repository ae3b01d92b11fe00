"""The disaggregated server under concurrency and hostile input, over HTTP with the official `openai` client:
two micro-batches, max_batch 8, drafts that are partly right.

- a burst of 6 x max_batch concurrent chat requests, each with the greedy text of its prompt alone;
- 6 requests whose stop string matches early beside 6 normal ones, all 12 correct, 20 times in a row;
- each hostile value sent 2 x max_batch times at once gets 400, then every KV slot is free and a normal
  request is served.

By default the target is a tiny random Llama speaking SmolLM2's tokenizer, drafted for by the replay proposer
(acceptance 0 .. whole trees). With AERIE_TEST_SERVE_MODEL=DIR and AERIE_TEST_SERVE_DRAFTER=DIR the same
tests run against a real target and a trained EAGLE drafter (references from the in-process engine).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from tests.helpers import API_KEY, AUTH, QUESTIONS
from tests.serving.conftest import app_args, deploy

pytestmark = [pytest.mark.ray, pytest.mark.slow]
MAX_BATCH, TOKENS = 8, 24


@pytest.fixture(scope="module")
def served(serve_session, tiny_chat, references, tmp_path_factory):
    """(url, model name, prompts as chat messages, greedy reference texts)."""
    from ray import serve

    from orchestrator.engine import load_engine
    from orchestrator.models.tokenizer import load_tokenizer
    from orchestrator.spec import SamplingParams

    scheduler = {"max_batch": MAX_BATCH, "micro_batches": 2, "budget_tokens": 48, "request_timeout_s": 300}
    model, drafter = os.environ.get("AERIE_TEST_SERVE_MODEL"), os.environ.get("AERIE_TEST_SERVE_DRAFTER")
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    if model:
        tok = load_tokenizer(model)
        prompts = [
            tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True) for m in messages
        ]
        prompts = [list(p["input_ids"]) for p in prompts]
        engine = load_engine(model, max_batch=8)
        outs = engine.generate(prompts, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
        texts = [tok.decode(g.token_ids, skip_special_tokens=True) for g in outs]
        args = app_args(model, drafter=drafter, spec={"method": "tree", "depth": 4, "topk": 2, "budget": 8})
    else:
        ids = {json.dumps(p): o for p, o in zip(references["prompts"], references["outputs"], strict=True)}
        tok = references["tokenizer"]
        texts = [tok.decode(ids[json.dumps(p)][:TOKENS], skip_special_tokens=True) for p in references["prompts"]]
        args = app_args(
            tiny_chat,
            spec={"method": "tree", "depth": 4, "topk": 2, "budget": 8},
            proposer_factory="tests.helpers:ReplayProposer",
            proposer_args={"references": references["path"], "depth": 4, "width": 2},
        )
    args["scheduler"] = args["scheduler"] | scheduler
    url = deploy("concurrency", args, serve_session)
    name = httpx.get(f"{url}/v1/models", timeout=300, headers=AUTH).json()["data"][0]["id"]
    yield url, name, messages, texts
    serve.delete("concurrency")


def _client(url: str):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


async def _chat(client, name: str, messages, stream: bool = False, **kw) -> tuple[str, str, int | None]:
    """(text, finish reason, completion tokens) of one greedy chat request, streamed or not."""
    extra = {"ignore_eos": True} | kw.pop("extra_body", {})
    common = dict(model=name, messages=messages, max_tokens=TOKENS, temperature=0, extra_body=extra, **kw)
    if not stream:
        r = await client.chat.completions.create(**common)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    chunks = [c async for c in await client.chat.completions.create(stream=True, **common)]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1], None


def _acceptance(url: str) -> dict:
    return httpx.get(f"{url}/stats", timeout=60, headers=AUTH).json()["acceptance"]


def _report(what: str, before: dict, after: dict, seconds: float) -> None:
    from orchestrator.spec import Acceptance

    a = Acceptance.from_dict(after) - Acceptance.from_dict(before)
    print(f"\n{what}: {seconds:.1f} s, tau {a.acceptance_length:.2f} over {a.drafts} drafted request-steps")


def _slots_free(url: str) -> dict:
    stats = httpx.get(f"{url}/stats", timeout=60, headers=AUTH).json()
    assert stats["slots_stale"] == [], "a worker did not answer within /stats' 2 s: these are old counts"
    return {side: (s["free"], s["total"]) for side, s in stats["kv_slots"].items()} | {"waiting": stats["waiting"]}


def test_a_burst_of_six_times_max_batch_gets_the_greedy_text_of_each_prompt_alone(served):
    url, name, messages, texts = served

    async def run():
        async with _client(url) as client:
            return await asyncio.gather(*[_chat(client, name, messages[i % 8]) for i in range(6 * MAX_BATCH)])

    before, began = _acceptance(url), time.perf_counter()
    out = asyncio.run(run())
    _report(f"burst of {6 * MAX_BATCH}", before, _acceptance(url), time.perf_counter() - began)
    assert [text for text, _, _ in out] == [texts[i % 8] for i in range(6 * MAX_BATCH)]
    assert all(finish == "length" and tokens == TOKENS for _, finish, tokens in out)
    assert _slots_free(url) == {"target": (MAX_BATCH, MAX_BATCH), "draft": (MAX_BATCH, MAX_BATCH), "waiting": 0}


def test_early_stop_strings_beside_normal_requests_twenty_times_in_a_row(served):
    """A stop string that matches after a few tokens ends its request at once (its slots freed while the others'
    rounds go on); the others are untouched. Streamed and not."""
    url, name, messages, texts = served
    stops = [t[4:7] if len(t) > 8 else t[:1] for t in texts]

    async def round_(client):
        stopped = [_chat(client, name, messages[i], stream=i % 2 == 1, stop=[stops[i]]) for i in range(6)]
        normal = [_chat(client, name, messages[i], stream=i % 2 == 0) for i in range(2, 8)]
        return await asyncio.gather(*stopped, *normal)

    async def run():
        async with _client(url) as client:
            return [await round_(client) for _ in range(20)]

    before, began = _acceptance(url), time.perf_counter()
    rounds = asyncio.run(run())
    _report("20 x (6 early stops + 6 normal)", before, _acceptance(url), time.perf_counter() - began)
    for results in rounds:
        for i, (text, finish, _) in enumerate(results[:6]):
            assert (text, finish) == (texts[i][: texts[i].find(stops[i])], "stop")
        for i, (text, finish, _) in zip(range(2, 8), results[6:], strict=True):
            assert (text, finish) == (texts[i], "length")
    assert _slots_free(url) == {"target": (MAX_BATCH, MAX_BATCH), "draft": (MAX_BATCH, MAX_BATCH), "waiting": 0}


HOSTILE = {
    "seed 2**64": {"seed": 2**64, "temperature": 1},
    "seed -2**63-1": {"seed": -(2**63) - 1, "temperature": 1},
    "temperature 1e-40": {"temperature": 1e-40},
    "top_p 0": {"top_p": 0},
    "top_k -7": {"top_k": -7},
    "text part without text": {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    "image part": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    "content null": {"messages": [{"role": "user", "content": None}]},
    "max_tokens -1": {"max_tokens": -1},
    "stop list of numbers": {"stop": [1, 2]},
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_values_get_400_and_leave_every_slot_free(served, case):
    url, name, messages, texts = served
    body = {"model": name, "messages": messages[0], "max_tokens": TOKENS} | HOSTILE[case]

    async def run():
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
            return await asyncio.gather(
                *[client.post(f"{url}/v1/chat/completions", json=body) for _ in range(2 * MAX_BATCH)]
            )

    for r in asyncio.run(run()):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"] and error["param"]
    assert _slots_free(url) == {"target": (MAX_BATCH, MAX_BATCH), "draft": (MAX_BATCH, MAX_BATCH), "waiting": 0}
    assert httpx.get(f"{url}/health", timeout=60, headers=AUTH).status_code == 200

    async def normal():
        async with _client(url) as client:
            return await _chat(client, name, messages[1])

    assert asyncio.run(normal())[0] == texts[1]


def test_a_full_replica_answers_429_with_retry_after_and_serves_every_request_it_took(served):
    """max_batch + limits.max_queued (8 + 64) requests in the replica: the rest of a burst of 90 get 429 with
    Retry-After at once; every request taken gets its exact greedy text, and the refused ones, sent again, too."""
    url, name, messages, texts = served
    n = 90

    async def send(client, i):
        body = {"model": name, "messages": messages[i % 8], "max_tokens": TOKENS, "temperature": 0}
        return await client.post(f"{url}/v1/chat/completions", json=body | {"ignore_eos": True})

    async def run(indices):
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(timeout=300, headers=AUTH, limits=limits) as client:
            return await asyncio.gather(*[send(client, i) for i in indices])

    answers = asyncio.run(run(range(n)))
    refused = [i for i, r in enumerate(answers) if r.status_code == 429]
    print(f"\n429 for {len(refused)} of {n}")
    assert 0 < len(refused) <= n - (MAX_BATCH + 64)  # fewer when some end while the burst arrives
    assert all(answers[i].headers["retry-after"] == "1" for i in refused)
    for i, r in enumerate(answers):
        if i not in refused:
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == texts[i % 8], r.text
    for i, r in zip(refused, asyncio.run(run(refused)), strict=True):
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == texts[i % 8], r.text
    assert _slots_free(url) == {"target": (MAX_BATCH, MAX_BATCH), "draft": (MAX_BATCH, MAX_BATCH), "waiting": 0}


def test_nan_in_a_raw_body_gets_400(served):
    url, name, messages, _ = served
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "hi"}]})
    raw = body[:-1] + ', "temperature": NaN}'
    r = httpx.post(f"{url}/v1/chat/completions", content=raw, headers=AUTH | {"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
