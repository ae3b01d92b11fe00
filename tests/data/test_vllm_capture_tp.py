"""Hidden-state capture through vLLM (`backend: vllm`) with tensor parallelism: the config checks without an
engine; and, with AERIE_TEST_VLLM_TP=1 (three more vLLM engines, ~4 min on 2 cores: CI leaves them out), the
same aux and final states at TP 1 and TP 2, every request's blocks given back (a cache of 16 blocks captures
more than 16 blocks of sequences), and the collection job at TP 2 on Ray."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from orchestrator.data.collect import CollectConfig
from orchestrator.data.shards import Sequence, ShardPlan, read_shard, target_states

RUN_TP = os.environ.get("AERIE_TEST_VLLM_TP") == "1"
needs_tp_engines = pytest.mark.skipif(
    not RUN_TP,
    reason="starts vLLM at TP 1 and TP 2 (~4 min on 2 cores): "
    "AERIE_TEST_VLLM_TP=1 pytest tests/data/test_vllm_capture_tp.py",
)
REPO = Path(__file__).resolve().parents[2]
AUX = (2, 4, 5)  # default_aux_layer_ids(8)
CACHE_BLOCKS = 16  # vLLM's KV cache, in blocks of 128 tokens on the CPU


def _collect_config(**overrides) -> dict:
    return {"model": "m", "sources": [{"kind": "mtbench"}], "output": "out"} | overrides


def test_tensor_parallel_capture_needs_backend_vllm():
    with pytest.raises(ValidationError, match="tensor_parallel_size > 1 needs backend: vllm"):
        CollectConfig.model_validate(_collect_config(tensor_parallel_size=2))
    CollectConfig.model_validate(_collect_config(tensor_parallel_size=2, backend="vllm"))


def test_the_baseline_is_measured_for_backend_target_on_a_sample():
    from orchestrator.data.collect import BASELINE_TOKENS

    assert CollectConfig.model_validate(_collect_config()).measure_baseline
    assert 0 < BASELINE_TOKENS <= 65536  # at most one default shard: not a second pass over the data set


def _plans() -> list[ShardPlan]:
    """Three shards of distinct random sequences, 8 blocks each (ragged: 1 to 3 blocks a sequence)."""
    gen = torch.Generator().manual_seed(0)
    plans = []
    for p in range(3):
        seqs = [
            Sequence(f"p{p}s{i}", "t", torch.randint(3, 49152, (n,), generator=gen), torch.ones(n, dtype=torch.bool))
            for i, n in enumerate([200, 256, 100, 300])
        ]
        plans.append(ShardPlan(f"shard-{p}", "train", seqs))
    return plans


def _capture_all(cap, plans: list[ShardPlan], timeout_s: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each plan in turn; a capture that waits for blocks no request gives back fails instead of hanging."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        out = []
        for plan in plans:
            try:
                out.append(pool.submit(cap.capture, plan).result(timeout=timeout_s))
            except concurrent.futures.TimeoutError:
                pytest.fail(f"{plan.name} not captured in {timeout_s} s: the finished requests' blocks were not freed")
        return out
    finally:
        pool.shutdown(wait=False)


@pytest.fixture(scope="module")
def captured(tiny_chat_vllm) -> dict:
    """{tp: (states of each plan, startup seconds)}, one engine at a time, each with a 16-block cache."""
    import vllm

    from orchestrator.data.vllm_capture import VllmCapture

    out = {}
    for tp in (1, 2):
        began = time.perf_counter()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(vllm, "LLM", functools.partial(vllm.LLM, num_gpu_blocks_override=CACHE_BLOCKS))
            cap = VllmCapture(tiny_chat_vllm, AUX, max_model_len=1024, dtype="float32", tensor_parallel_size=tp)
        startup_s = round(time.perf_counter() - began, 1)
        try:
            held_tokens = cap.llm.llm_engine.vllm_config.cache_config.block_size * CACHE_BLOCKS
            assert held_tokens < sum(p.num_tokens for p in _plans())
            out[tp] = (_capture_all(cap, _plans(), timeout_s=120), startup_s)
        finally:
            cap.close()
    return out


@pytest.mark.vllm
@pytest.mark.slow
@needs_tp_engines
def test_states_at_tp_2_equal_those_at_tp_1(captured, tiny_chat_vllm):
    """Rank 0 alone writes the states: they are whole (every layer's full hidden size) and equal TP 1's up to
    the all-reduce's summation order; both match the project's fp32 target."""
    from orchestrator.models.target import TargetModel

    target = TargetModel.from_pretrained(tiny_chat_vllm, AUX)
    report = {"startup_s": {tp: s for tp, (_, s) in captured.items()}}
    for (aux1, final1), (aux2, final2), plan in zip(captured[1][0], captured[2][0], _plans(), strict=True):
        ref_aux, ref_final = target_states(target, plan, 4096)
        assert aux2.shape == aux1.shape == (plan.num_tokens, len(AUX) * 128) and final2.shape == (plan.num_tokens, 128)
        for name, got, ref, want in (("aux", aux2, aux1, ref_aux), ("final", final2, final1, ref_final)):
            scale = want.abs().max().item()
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5 * scale)
            torch.testing.assert_close(ref, want, rtol=1e-4, atol=1e-5 * scale)
            diffs = report.setdefault(name, {"tp2_vs_tp1": 0.0, "tp1_vs_target": 0.0, "scale": 0.0})
            diffs["tp2_vs_tp1"] = max(diffs["tp2_vs_tp1"], (got - ref).abs().max().item())
            diffs["tp1_vs_target"] = max(diffs["tp1_vs_target"], (ref - want).abs().max().item())
            diffs["scale"] = max(diffs["scale"], scale)
    print(json.dumps(report, indent=1))


@pytest.mark.vllm
@pytest.mark.slow
@needs_tp_engines
def test_a_small_cache_captures_more_than_it_holds(captured):
    """3 shards x 8 blocks through a 16-block cache at both TP sizes: vLLM freed each request's blocks once its
    states were written (before, the connector never said so: the third shard waited for ever)."""
    assert [len(states) for states, _ in captured.values()] == [3, 3]


@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.slow
@needs_tp_engines
def test_collection_job_at_tp_2(tiny_chat_vllm, tmp_path):
    """jobs.collect_hidden_states with backend vllm at TP 2: the capture actor reserves a core per rank (2 of the
    local Ray's 2), and its shards match the project's target."""
    from orchestrator.models.target import TargetModel

    lines = [
        {"id": f"c{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for i, (q, a) in enumerate(
            [
                ("What is the capital of France?", "Paris."),
                ("Write a haiku about the sea.", "Waves fold into foam, salt wind carries gull voices."),
                ("List three uses of copper.", "Wires, pipes and coins."),
                ("Why is the sky blue?", "Air scatters blue light more than red light."),
            ]
        )
    ]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    cfg = {
        "model": str(tiny_chat_vllm),
        "sources": [{"kind": "jsonl", "path": str(tmp_path / "data.jsonl")}],
        "validation_fraction": 0.0,
        "aux_layer_ids": list(AUX),
        "max_length_tokens": 256,
        "shard_tokens": 80,
        "dtype": "float32",
        "backend": "vllm",
        "tensor_parallel_size": 2,
        "output": str(tmp_path / "out"),
    }
    (tmp_path / "collect.yaml").write_text(json.dumps(cfg))
    began = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.collect_hidden_states", "--config", str(tmp_path / "collect.yaml")],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_s = round(time.perf_counter() - began, 1)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    print(json.dumps({"job_s": job_s} | {k: result[k] for k in ("shards_written", "total_tokens", "capture_seconds")}))
    assert manifest["backend"] == "vllm" and len(manifest["shards"]) >= 2
    assert "baseline_forward_tokens_per_s" not in result  # measured for backend target only
    target = TargetModel.from_pretrained(tiny_chat_vllm, AUX)
    for record in manifest["shards"]:
        shard = read_shard((tmp_path / "out" / record["name"]).read_bytes())
        ids = shard["input_ids"].long().split(shard["seq_lens"].tolist())
        plan = ShardPlan(
            record["name"], "train", [Sequence("c", "t", s, torch.ones_like(s, dtype=torch.bool)) for s in ids]
        )
        ref_aux, ref_final = target_states(target, plan, 4096)
        for got, ref in ((shard["aux_hidden"], ref_aux), (shard["final_hidden"], ref_final)):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())
