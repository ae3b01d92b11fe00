"""Drafter checkpoints: exact round trips per variant, vLLM's format, and clear errors for bad ones."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from orchestrator.errors import AerieError, CheckpointError
from orchestrator.models import Drafter, load_drafter, save_drafter
from orchestrator.models.target import TargetModel
from tests.helpers import draft_two_steps, random_drafter, read_json

VARIANTS = {
    "eagle3": {"variant": "eagle3"},
    "eagle3.1": {"variant": "eagle3.1"},
    "norm_before_fc": {"variant": "eagle3", "norm_before_fc": True},
}


@pytest.fixture(scope="module")
def target(tiny_dir):
    return TargetModel.from_pretrained(tiny_dir)


def _draft_step(drafter: Drafter, target: TargetModel, seed: int = 0):
    return draft_two_steps(drafter, target.embed_tokens, seed)


@pytest.mark.parametrize("name", VARIANTS)
def test_round_trip_is_exact(tmp_path, target, name):
    drafter = random_drafter(target.hf_config, draft_vocab_size=40, **VARIANTS[name])
    save_drafter(drafter, tmp_path / "d")
    loaded = load_drafter(tmp_path / "d")
    assert loaded.config == drafter.config
    for key, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    for a, b in zip(_draft_step(drafter, target), _draft_step(loaded, target), strict=True):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.next_hidden, b.next_hidden)


def test_a_saved_drafter_is_readable_by_other_users(tmp_path, target):
    """A drafter is published for servers that may run as another user: not mkdtemp's 0700."""
    out = save_drafter(random_drafter(target.hf_config, "eagle3.1", draft_vocab_size=40), tmp_path / "d")
    assert out.stat().st_mode & 0o755 == 0o755
    for f in out.iterdir():
        assert f.stat().st_mode & 0o044 == 0o044, f.name


def test_written_config_is_what_vllm_reads(tmp_path, target):
    save_drafter(random_drafter(target.hf_config, "eagle3.1", draft_vocab_size=40), tmp_path / "d")
    config = read_json(tmp_path / "d" / "config.json")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (config["fc_norm"], config["norm_output"], config["norm_before_fc"]) == (True, True, False)
    assert config["eagle_aux_hidden_state_layer_ids"] == config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["draft_vocab_size"] == 40 and config["vocab_size"] == 96 and config["target_hidden_size"] == 64
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    assert {"fc_norm.0.weight", "fc_norm.2.weight", "midlayer.hidden_norm.weight", "d2t", "t2d"} <= set(tensors)
    assert "midlayer.self_attn.q_proj.weight" in tensors and tensors["midlayer.self_attn.q_proj.weight"].shape == (
        64,
        128,
    )
    assert tensors["d2t"].dtype == torch.int64 and "embed_tokens.weight" not in tensors


def test_variants_differ_only_in_flags(target):
    e3 = random_drafter(target.hf_config, "eagle3").config
    e31 = random_drafter(target.hf_config, "eagle3.1").config
    assert (e3.variant, e31.variant) == ("eagle3", "eagle3.1")
    assert e3.decoder == e31.decoder and e3.aux_layer_ids == e31.aux_layer_ids


def test_norm_output_changes_the_next_step(target):
    """EAGLE-3 feeds the pre-norm state forward, EAGLE-3.1 the post-norm one: the same weights disagree."""
    e3 = random_drafter(target.hf_config, "eagle3", fc_norm=True)
    e31 = random_drafter(target.hf_config, "eagle3.1")
    e31.load_state_dict(e3.state_dict())
    (a1, a2), (b1, b2) = _draft_step(e3, target), _draft_step(e31, target)
    assert torch.equal(a1.logits, b1.logits)
    assert torch.equal(b1.next_hidden, e31.norm(a1.next_hidden))
    assert not torch.allclose(a2.logits, b2.logits)


def _write(path, config: dict, tensors: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))


def _saved(tmp_path, target, **kwargs):
    save_drafter(random_drafter(target.hf_config, draft_vocab_size=40, **kwargs), tmp_path / "good")
    return read_json(tmp_path / "good" / "config.json"), load_file(tmp_path / "good" / "model.safetensors")


def test_eagle3_config_without_31_keys_loads_as_eagle3(tmp_path, target):
    config, tensors = _saved(tmp_path, target, variant="eagle3")
    for key in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual"):
        config.pop(key)
    config["eagle_config"].pop("norm_before_fc")
    _write(tmp_path / "old", config, tensors)
    loaded = load_drafter(tmp_path / "old")
    assert loaded.config.variant == "eagle3" and not loaded.config.norm_before_fc


def test_third_party_checkpoint_with_own_embeddings_loads(tmp_path, target):
    """A checkpoint as other trainers write it: aux ids only in eagle_config, no t2d, stored embed_tokens."""
    config, tensors = _saved(tmp_path, target, variant="eagle3")
    config.pop("eagle_aux_hidden_state_layer_ids")
    tensors.pop("t2d")
    tensors["embed_tokens.weight"] = torch.randn(96, 64)
    _write(tmp_path / "other", config, tensors)
    loaded = load_drafter(tmp_path / "other")
    assert loaded.config.stores_embeddings and loaded.config.aux_layer_ids == (2, 4, 5)
    assert torch.equal(loaded.embed(torch.tensor([3])), tensors["embed_tokens.weight"][3:4])
    assert int(loaded.t2d.sum()) == 40 and torch.equal(
        loaded.to_target_ids(torch.arange(40)).sort().values, torch.nonzero(loaded.t2d).squeeze(1)
    )


MALFORMED = [
    (
        "wrong shape",
        lambda c, t: t.__setitem__("fc.weight", torch.zeros(64, 100)),
        r"tensor fc\.weight has shape",
    ),
    (
        "fc_norm without weights",
        lambda c, t: t.pop("fc_norm.1.weight"),
        r"tensor fc_norm\.1\.weight is missing \(config says fc_norm: true\)",
    ),
    (
        "fc_norm weights but flag off",
        lambda c, t: c.__setitem__("fc_norm", False),
        r"unexpected tensor fc_norm\.0\.weight \(config says fc_norm: false\)",
    ),
    (
        "d2t wrong length",
        lambda c, t: t.__setitem__("d2t", torch.zeros(39, dtype=torch.long)),
        r"tensor d2t has shape",
    ),
    (
        "d2t out of range",
        lambda c, t: t.__setitem__("d2t", torch.full((40,), 90)),
        r"d2t maps draft ids outside",
    ),
    (
        "d2t wrong dtype",
        lambda c, t: t.__setitem__("d2t", torch.zeros(40, dtype=torch.int32)),
        r"d2t must be int64",
    ),
    (
        "both input norms",
        lambda c, t: (c.__setitem__("norm_before_fc", True), c["eagle_config"].pop("norm_before_fc")),
        r"mutually exclusive",
    ),
    (
        "flags disagree",
        lambda c, t: c.__setitem__("norm_before_fc", True),
        r"norm_before_fc = True at top level",
    ),
    (
        "missing layer weight",
        lambda c, t: t.pop("midlayer.mlp.down_proj.weight"),
        r"tensor midlayer\.mlp\.down_proj\.weight is missing",
    ),
    (
        "no aux layer ids",
        lambda c, t: (c.pop("eagle_aux_hidden_state_layer_ids"), c["eagle_config"].clear()),
        r"no eagle_aux_hidden_state_layer_ids",
    ),
    (
        "not an eagle drafter",
        lambda c, t: c.__setitem__("architectures", ["LlamaForCausalLM"]),
        r"not an EAGLE-3 drafter",
    ),
]


@pytest.mark.parametrize(("case", "spoil", "message"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_checkpoints_fail_clearly(tmp_path, target, case, spoil, message):
    config, tensors = _saved(tmp_path, target, variant="eagle3.1")
    spoil(config, tensors)
    _write(tmp_path / "bad", config, tensors)
    with pytest.raises(AerieError, match=message):
        load_drafter(tmp_path / "bad")


def test_pickle_only_checkpoint_is_refused(tmp_path, target):
    config, _ = _saved(tmp_path, target)
    bad = tmp_path / "pickle"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle weights are never loaded"):
        load_drafter(bad)


def test_missing_dir_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_drafter(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_drafter(tmp_path / "empty")
