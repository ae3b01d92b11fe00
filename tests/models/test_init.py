"""A fresh drafter's decoder layer started from one of the target's layers (`drafter.init_layer_from`)."""

from __future__ import annotations

import pytest
import torch

from orchestrator.errors import AerieError
from orchestrator.models.init import copy_target_layer, init_drafter
from orchestrator.models.target import TargetModel, load_safetensors_dir
from tests.helpers import write_tiny_llama


def test_the_drafter_layer_acts_on_the_hidden_half_as_the_target_layer(tmp_path):
    model_dir = write_tiny_llama(tmp_path / "tiny")
    target = TargetModel.from_pretrained(model_dir, (0, 1, 2))
    drafter = init_drafter(target)
    tensors = load_safetensors_dir(model_dir)
    copy_target_layer(drafter, tensors, 1)
    ours, theirs = drafter.layers[0], target.layers[1]
    hidden = target.hidden_size
    h, e = torch.randn(5, hidden), torch.randn(5, hidden)  # any embedding: its half of the weights is zero
    torch.testing.assert_close(ours.self_attn.qkv_proj(torch.cat([e, h], -1)), theirs.self_attn.qkv_proj(h))
    torch.testing.assert_close(ours.mlp(h), theirs.mlp(h))
    torch.testing.assert_close(ours.hidden_norm.weight, theirs.input_layernorm.weight)
    torch.testing.assert_close(ours.self_attn.o_proj.weight, tensors["model.layers.1.self_attn.o_proj.weight"])
    with pytest.raises(AerieError, match="no decoder layer 99"):
        copy_target_layer(drafter, tensors, 99)
