"""The capture's compute precision (`compute_dtype`): a bf16 target forward (what GPUs run, and ~1.7x faster than
fp32 on a CPU with AVX512-BF16) gives the fp32 forward's hidden states to bf16's precision and the same greedy
tokens; the capture worker loads its target in that precision. No Ray: the worker's class is called directly."""

from __future__ import annotations

import pytest
import torch

from orchestrator.config import load_config
from orchestrator.data.collect import CollectConfig, _capture_worker_class
from orchestrator.data.shards import Sequence, ShardPlan, read_shard
from orchestrator.errors import AerieError
from orchestrator.models.target import load_safetensors_dir

AUX = (2, 15, 27)


@pytest.fixture(scope="module")
def plan(smollm2_tokenizer) -> ShardPlan:
    texts = ["The capital of France is Paris, and it is known for", "def fib(n):\n    if n < 2:\n        return n\n"]
    seqs = []
    for i, text in enumerate(texts * 2):
        ids = torch.tensor(smollm2_tokenizer(text * (i + 1))["input_ids"])
        seqs.append(Sequence(f"c{i}", "chatml", ids, torch.ones_like(ids, dtype=torch.bool)))
    return ShardPlan("train-00000.safetensors", "train", seqs)


def _shard(smollm2_dir, plan: ShardPlan, compute_dtype: str) -> dict:
    worker_cls = _capture_worker_class().__ray_actor_class__
    cfg = CollectConfig(
        model=str(smollm2_dir),
        sources=[{"kind": "chitchat"}],
        output="unused",
        dtype="float32",
        compute_dtype=compute_dtype,
        batch_tokens=1024,
        max_length_tokens=256,
        worker={"torch_threads": 2, "device": "cpu"},
    )
    worker = worker_cls(cfg, str(smollm2_dir), AUX, write=False)
    return read_shard(worker.shard(plan))


def test_a_bf16_forward_captures_the_fp32_states_to_bf16_precision(smollm2_dir, plan):
    fp32, bf16 = _shard(smollm2_dir, plan, "auto"), _shard(smollm2_dir, plan, "bfloat16")
    assert not torch.equal(fp32["aux_hidden"], bf16["aux_hidden"]), "compute_dtype must reach the worker's target"
    aux32, aux16 = fp32["aux_hidden"].view(-1, 3, 576), bf16["aux_hidden"].view(-1, 3, 576)
    for j in range(3):  # bf16 keeps 8 bits of mantissa; 30 layers of it stay within ~1.5% of each layer's scale
        scale = aux32[:, j].abs().max()
        assert (aux16[:, j] - aux32[:, j]).abs().max() < 0.02 * scale
    emb = load_safetensors_dir(smollm2_dir, ["model.embed_tokens.weight"])["model.embed_tokens.weight"]  # tied head
    greedy32, greedy16 = (fp32["final_hidden"] @ emb.T).argmax(-1), (bf16["final_hidden"] @ emb.T).argmax(-1)
    assert (greedy32 == greedy16).float().mean() >= 0.95


def test_compute_dtype_is_checked_with_the_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: m\nsources: [{kind: chitchat}]\noutput: out\n")
    assert load_config(CollectConfig, path, []).compute_dtype == "auto"
    assert load_config(CollectConfig, path, ["compute_dtype=bfloat16"]).compute_dtype == "bfloat16"
    with pytest.raises(AerieError, match="compute_dtype"):
        load_config(CollectConfig, path, ["compute_dtype=int8"])
