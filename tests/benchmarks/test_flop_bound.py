"""The FLOP-bound measurement on the tiny target: every number there, and the count matches the layer shapes."""

from __future__ import annotations

from orchestrator.benchmarks.flop_bound import measure
from tests.helpers import TINY_LLAMA


def test_flops_per_token_match_the_drafters_matmuls_and_every_precision_is_timed():
    r = measure(TINY_LLAMA, draft_vocab=64, ttt_steps=1, sequences=2, length=8, steps=1)
    h, i, dv = TINY_LLAMA["hidden_size"], TINY_LLAMA["intermediate_size"], 64
    heads, kv = TINY_LLAMA["num_attention_heads"], TINY_LLAMA["num_key_value_heads"]
    hd = h // heads
    # one TTT step, per token: fc (3h -> h), q/k/v from [embedding, hidden] (2h), o, the MLP, the draft head;
    # plus the frozen target head's draft-vocabulary logits (forward only); backward doubles the trainable ones
    trainable = 3 * h * h + 2 * h * (heads + 2 * kv) * hd + h * h + 3 * h * i + h * dv
    assert r["by_op"]["aten.mm"] == 2 * (3 * trainable + h * dv)
    assert r["flops_per_token"] > r["by_op"]["aten.mm"]  # + attention (bmm)
    for name in ("fp32", "bf16"):
        m = r[name]
        assert m["gemm_flop_s"] > 0 and m["step_tok_s"] > 0
        assert m["bound_tok_s"] == m["gemm_flop_s"] / r["flops_per_token"]
