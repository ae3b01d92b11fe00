"""Drafter checkpoints in every layout vLLM 0.32 loads for EAGLE-3 load here to the same drafter, and the layouts
it refuses are refused here too, with the fix (vllm/model_executor/models/llama_eagle3.py `load_weights`,
vllm/transformers_utils/configs/speculators/algos.py `update_eagle3`, gpu_model_runner's aux-layer lookup).

Each layout is rewritten from one canonical `save_drafter` checkpoint of the tiny 8-layer target's drafter.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from orchestrator.errors import CheckpointError
from orchestrator.models import Drafter, load_drafter, save_drafter
from orchestrator.models.checkpoint import drafter_aux_layer_ids
from tests.helpers import TINY_LLAMA, draft_two_steps, random_drafter, read_json

TARGET_LAYERS = TINY_LLAMA["num_hidden_layers"]  # 8: vLLM's default aux ids are (2, 4, 5)
EMBED = nn.Embedding(TINY_LLAMA["vocab_size"], TINY_LLAMA["hidden_size"])  # the target's, shared
with torch.no_grad():
    EMBED.weight.copy_(torch.randn(EMBED.weight.shape, generator=torch.Generator().manual_seed(7)))


def _drafter(draft_vocab_size: int | None, **flags) -> Drafter:
    """A random drafter whose float weights are bf16 values, so a bf16 checkpoint of it is exact."""
    drafter = random_drafter(TINY_LLAMA, "eagle3.1", draft_vocab_size=draft_vocab_size, **flags)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(p.bfloat16().float())
    return drafter


def _outputs(drafter: Drafter) -> list[torch.Tensor]:
    """Two drafting steps of a ragged batch, and the drafter's target ids."""
    first, second = draft_two_steps(drafter, EMBED if drafter.embed_tokens is None else None)
    ids = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size))
    return [first.logits, first.next_hidden, second.logits, second.next_hidden, ids]


@pytest.fixture(scope="module")
def canonical(tmp_path_factory):
    """{name: (config.json, tensors, outputs)} of the canonical saves: a 40-token draft vocabulary, the full one."""
    out = {}
    for name, vocab in (("draft40", 40), ("full", None)):
        path = save_drafter(_drafter(vocab), tmp_path_factory.mktemp(name) / "d")
        out[name] = (
            read_json(path / "config.json"),
            load_file(path / "model.safetensors"),
            _outputs(load_drafter(path)),
        )
    return out


def _write(path, config: dict, tensors: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _rename(tensors: dict, old: str, new: str) -> dict:
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in tensors.items()}


def _pop(config: dict, *keys: str) -> dict:
    config = json.loads(json.dumps(config))
    for key in keys:
        config.pop(key, None)
        (config.get("eagle_config") or {}).pop(key, None)
    return config


def _speculators(config: dict, **top) -> dict:
    """The canonical config in the speculators layout (what its Eagle3Speculator.save_pretrained writes)."""
    layer_keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    layer_keys += ("rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling", "vocab_size")
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny-target", "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu"}
        | {k: config[k] for k in layer_keys},
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"],
        "fc_norm": True,
        "norm_output": True,
        "norm_before_residual": False,
    } | top


# name: (canonical save, rewrite (config, tensors) -> (config, tensors), load_drafter kwargs)
LAYOUTS = {
    "ours (midlayer.*)": ("draft40", lambda c, t: (c, t), {}),
    "speculators names (layers.0.*)": ("draft40", lambda c, t: (c, _rename(t, "midlayer.", "layers.0.")), {}),
    "architectures Eagle3LlamaForCausalLM": (
        "draft40",
        lambda c, t: (c | {"architectures": ["Eagle3LlamaForCausalLM"]}, t),
        {},
    ),
    "aux ids only in eagle_config": (
        "draft40",
        lambda c, t: ({k: v for k, v in c.items() if k != "eagle_aux_hidden_state_layer_ids"}, t),
        {},
    ),
    "no aux ids (the target's default)": (
        "draft40",
        lambda c, t: (_pop(c, "eagle_aux_hidden_state_layer_ids"), t),
        {"target_num_layers": TARGET_LAYERS},
    ),
    "no draft_vocab_size (full vocabulary)": ("full", lambda c, t: (_pop(c, "draft_vocab_size"), t), {}),
    "no target_hidden_size": ("draft40", lambda c, t: (_pop(c, "target_hidden_size"), t), {}),
    "bf16 weights": (
        "draft40",
        lambda c, t: (
            c | {"torch_dtype": "bfloat16"},
            {k: v.bfloat16() if v.is_floating_point() else v for k, v in t.items()},
        ),
        {},
    ),
    "no t2d, own embed_tokens": (
        "draft40",
        lambda c, t: (c, {k: v for k, v in t.items() if k != "t2d"} | {"embed_tokens.weight": EMBED.weight.detach()}),
        {},
    ),
    "speculators config": (
        "draft40",
        lambda c, t: (
            _speculators(c),
            _rename(t, "midlayer.", "layers.0.") | {"embed_tokens.weight": EMBED.weight.detach()},
        ),
        {},
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_loads_to_the_same_drafter(tmp_path, canonical, layout):
    base, rewrite, kwargs = LAYOUTS[layout]
    config, tensors, expected = canonical[base]
    path = _write(tmp_path / "d", *rewrite(config, dict(tensors)))
    loaded = load_drafter(path, **kwargs)
    assert loaded.config.aux_layer_ids == (2, 4, 5)
    assert drafter_aux_layer_ids(path, **kwargs) == (2, 4, 5)
    for got, want in zip(_outputs(loaded), expected, strict=True):
        assert torch.equal(got, want), layout


def test_speculators_defaults_norm_before_residual_to_true(tmp_path, canonical):
    """vLLM's update_eagle3 reads an absent norm_before_residual as true (the vLLM layout: false)."""
    config, tensors, _ = canonical["draft40"]
    speculators = {k: v for k, v in _speculators(config).items() if k != "norm_before_residual"}
    path = _write(tmp_path / "d", speculators, _rename(tensors, "midlayer.", "layers.0."))
    assert load_drafter(path).config.norm_before_residual
    assert not load_drafter(_write(tmp_path / "v", config, tensors)).config.norm_before_residual


def test_no_aux_ids_without_the_target_layer_count_is_refused(tmp_path, canonical):
    config, tensors, _ = canonical["draft40"]
    path = _write(tmp_path / "d", _pop(config, "eagle_aux_hidden_state_layer_ids"), tensors)
    with pytest.raises(CheckpointError, match=r"no eagle_aux_hidden_state_layer_ids .* target_num_layers=N"):
        load_drafter(path)


REFUSED = {
    # vLLM: "There is no module or parameter named 'model' in LlamaModel" (it prefixes names with model. itself)
    "model.layers.0.*": (
        lambda c, t: (c, _rename(t, "midlayer.", "model.layers.0.")),
        r"tensor model\.layers\.0\.\S+: vLLM 0\.32 adds the 'model\.' prefix .* \(layers\.0\.",
    ),
    "model.-prefixed names": (
        lambda c, t: (c, {(k if k == "lm_head.weight" else "model." + k): v for k, v in t.items()}),
        r"vLLM 0\.32 adds the 'model\.' prefix to drafter weights itself",
    ),
    "midlayer.* and layers.0.* both": (
        lambda c, t: (c, t | {k: v.clone() for k, v in _rename(t, "midlayer.", "layers.0.").items()}),
        r"tensors layers\.0\.(\S+) and midlayer\.\1 are the same layer-0 weight",
    ),
    "Qwen3-layer drafter": (
        lambda c, t: (c | {"architectures": ["Eagle3Qwen3ForCausalLM"]}, t),
        r"vLLM builds this EAGLE-3 drafter from other layers than Llama's",
    ),
    "speculators Qwen3-layer drafter": (
        lambda c, t: (_speculators(c) | {"transformer_layer_config": {"model_type": "qwen3"}}, t),
        r"speculators EAGLE-3 drafter with 'qwen3' layers",
    ),
    "speculators dflash": (
        lambda c, t: (_speculators(c, speculators_model_type="dflash"), t),
        r"speculators_model_type 'dflash' is not an EAGLE-3 drafter",
    ),
    "no aux hidden states": (
        lambda c, t: (c | {"eagle_config": c["eagle_config"] | {"use_aux_hidden_state": False}}, t),
        r"use_aux_hidden_state: false",
    ),
}


@pytest.mark.parametrize("layout", REFUSED)
def test_layouts_vllm_refuses_are_refused_clearly(tmp_path, canonical, layout):
    rewrite, message = REFUSED[layout]
    config, tensors, _ = canonical["draft40"]
    with pytest.raises(CheckpointError, match=message):
        load_drafter(_write(tmp_path / "d", *rewrite(config, dict(tensors))))
