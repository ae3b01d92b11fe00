"""A fresh drafter for a target, initialised the way EAGLE trainers start: `lm_head` from the target's
output embeddings of the draft vocabulary and `norm` from the target's final norm (a large head start:
the drafter begins by predicting what the target's own head would say of its state)."""

from __future__ import annotations

import torch

from orchestrator.errors import AerieError
from orchestrator.models.drafter import Drafter, DrafterConfig
from orchestrator.models.layers import fuse_layer_weights
from orchestrator.models.target import TargetModel


def init_drafter(
    target: TargetModel,
    variant: str = "eagle3.1",
    draft_vocab: torch.Tensor | None = None,
    seed: int = 0,
    **flags,
) -> Drafter:
    """draft_vocab: [draft_vocab_size] ascending target ids the drafter may propose (default: all)."""
    vocab = target.vocab_size
    draft_vocab = torch.arange(vocab) if draft_vocab is None else draft_vocab.sort().values
    config = DrafterConfig.for_target(target.hf_config, target.aux_layer_ids, draft_vocab.numel(), variant, **flags)
    head = target.embed_tokens.weight if target.tie_word_embeddings else target_head_weight(target)
    drafter = new_drafter(config, head, target.norm.weight, draft_vocab, seed, target.dtype)
    drafter.share_embedding(target.embed_tokens)
    return drafter


def new_drafter(
    config: DrafterConfig,
    target_head: torch.Tensor,
    target_norm: torch.Tensor,
    draft_vocab: torch.Tensor,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Drafter:
    """target_head: [vocab, H] output embeddings; target_norm: [H]; draft_vocab: ascending target ids."""
    torch.manual_seed(seed)
    drafter = Drafter(config, dtype)
    with torch.no_grad():
        drafter.lm_head.weight.copy_(target_head[draft_vocab])
        drafter.norm.weight.copy_(target_norm)
        drafter.d2t.copy_(draft_vocab - torch.arange(draft_vocab.numel()))
        drafter.t2d.zero_()
        drafter.t2d[draft_vocab] = True
    return drafter


def target_head_weight(target: TargetModel) -> torch.Tensor:
    """The target's lm_head weight [vocab, hidden] (dense, also when packed for oneDNN)."""
    weight = target.lm_head.weight
    return weight.to_dense() if weight.is_mkldnn else weight


def copy_target_layer(drafter: Drafter, tensors: dict[str, torch.Tensor], layer: int) -> None:
    """The drafter's decoder layer started as the target's layer `layer` (Hugging Face names in `tensors`): the
    attention's q/k/v read the hidden half of the drafter's [embedding; hidden] input with the target's weights
    (the embedding half starts at zero, so the layer first acts on the fused target state as the target's own
    layer would), o_proj, the MLP and the norms as they are (the target's input norm becomes `hidden_norm`)."""
    fused = fuse_layer_weights(tensors, f"model.layers.{layer}.")
    if "self_attn.qkv_proj.weight" not in fused:
        raise AerieError(f"the target has no decoder layer {layer} to start the drafter's layer from")
    first = drafter.layers[0]
    hidden = drafter.config.decoder.hidden_size
    with torch.no_grad():
        qkv = first.self_attn.qkv_proj.weight  # [q + 2 kv, 2H]: [embedding half | hidden half]
        qkv.zero_()
        qkv[:, hidden:].copy_(fused.pop("self_attn.qkv_proj.weight"))
        fused["hidden_norm.weight"] = fused.pop("input_layernorm.weight")
        state = first.state_dict()
        for name, tensor in fused.items():
            if name not in state or state[name].shape != tensor.shape:
                raise AerieError(f"target layer {layer}'s {name} {tuple(tensor.shape)} does not fit the drafter")
            state[name].copy_(tensor)
