"""EAGLE-3 training-time test (TTT): the drafter unrolled over `steps` drafting steps, every position of a
sequence in parallel, computing exactly what the serving engine computes when it drafts a chain.

Rows are sequence positions i of a padded batch [B, T]. In serving, the committed pair at position t is
(target aux h[t], token x[t+1]) and drafts x[t+2]; depth d of the chain sits at rope position t+d. So:

    step 0, row i:  token x[i+1], hidden fc(aux[i])           rope i      predicts x[i+2]
    step j, row i:  token x[i+j+1], step j-1's hidden at row i rope i+j    predicts x[i+j+2]

The hidden a step hands on is pre-norm (EAGLE-3) or post-norm (EAGLE-3.1 `norm_output`): `Drafter` decides.
A step-j query sees the step-0 keys of rows 0..i (the committed prefix) and row i's own keys of steps
1..j (its chain), the anchors' "diagonal" extension of the causal mask:

    step 2, row i:   K0[0], K0[1], ..., K0[i]  |  K1[i]  |  K2[i]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from orchestrator.models.drafter import Drafter
from orchestrator.models.layers import DecoderLayer, _rotate_half


@dataclass
class _StepKV:
    """Keys and values of every step so far, per layer: lists of [B, kv_heads, T, hd]."""

    keys: list[list[torch.Tensor]]
    values: list[list[torch.Tensor]]


def _rope(positions_bt: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions_bt.to(inv_freq.dtype)[..., None] * inv_freq  # [B, T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[:, None], emb.sin()[:, None]  # [B, 1, T, hd]


def _attention(
    layer: DecoderLayer, x_btd: torch.Tensor, cos, sin, kv: _StepKV, layer_idx: int, causal: torch.Tensor, probe=None
) -> torch.Tensor:
    """Self-attention of one layer at the current step; appends this step's keys/values to `kv`. probe: called
    with (layer_idx, probs [B, heads, T, T + chain]): the committed prefix's columns, then the row's own chain."""
    attn = layer.self_attn
    b, t, _ = x_btd.shape
    heads, kv_heads, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = attn.qkv_proj(x_btd).split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q = q.view(b, t, heads, hd).transpose(1, 2)  # [B, heads, T, hd]
    k = k.view(b, t, kv_heads, hd).transpose(1, 2)  # [B, kv_heads, T, hd]
    v = v.view(b, t, kv_heads, hd).transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    kv.keys[layer_idx].append(k)
    kv.values[layer_idx].append(v)
    group = heads // kv_heads
    keys = [key.repeat_interleave(group, dim=1) for key in kv.keys[layer_idx]]
    values = [val.repeat_interleave(group, dim=1) for val in kv.values[layer_idx]]
    scale = 1.0 / math.sqrt(hd)
    prefix = (q @ keys[0].transpose(-1, -2)) * scale  # [B, heads, T, T]: the committed prefix
    prefix = prefix.masked_fill(~causal, float("-inf"))
    chain = [(q * key).sum(-1, keepdim=True) * scale for key in keys[1:]]  # each [B, heads, T, 1]
    probs = torch.softmax(torch.cat([prefix, *chain], dim=-1).float(), dim=-1).to(q.dtype)
    if probe is not None:
        probe(layer_idx, probs)
    out = probs[..., :t] @ values[0]  # [B, heads, T, hd]
    for s, val in enumerate(values[1:]):
        out = out + probs[..., t + s : t + s + 1] * val
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, heads * hd))


def _layer(layer: DecoderLayer, attn_input, residual, cos, sin, kv: _StepKV, idx: int, causal, probe) -> torch.Tensor:
    h = residual + _attention(layer, attn_input, cos, sin, kv, idx, causal, probe)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def unroll(drafter: Drafter, input_ids: torch.Tensor, aux: torch.Tensor, steps: int, probe=None) -> list[torch.Tensor]:
    """Draft logits of every TTT step: a list of `steps` tensors [B, T, draft_vocab].

    input_ids: [B, T] (padding anywhere after a sequence's end); aux: [B, T, k*Ht]. Row i of step j is only
    meaningful while i + j + 2 < the sequence's length; the loss masks the rest. probe(step, layer, probs): sees
    every attention distribution (`jobs.diagnose_drafter`).
    """
    b, t = input_ids.shape
    layers = drafter.layers
    kv = _StepKV([[] for _ in layers], [[] for _ in layers])
    causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
    rows = torch.arange(t, device=input_ids.device).expand(b, t)
    hidden = drafter.combine_aux(aux)  # [B, T, H]
    out = []
    for j in range(steps):
        tokens = F.pad(input_ids[:, j + 1 :], (0, j + 1))  # x[i+j+1], zero past the end
        cos, sin = _rope(rows + j, drafter.inv_freq)
        first = layers[0]
        normed = first.hidden_norm(hidden)
        residual = normed if first.norm_before_residual else hidden
        attn_input = torch.cat([first.input_layernorm(drafter.embed(tokens)), normed], dim=-1)
        seen = (lambda idx, probs, j=j: probe(j, idx, probs)) if probe is not None else None
        x = _layer(first, attn_input, residual, cos, sin, kv, 0, causal, seen)
        for idx, layer in enumerate(layers[1:], start=1):
            x = _layer(layer, layer.input_layernorm(x), x, cos, sin, kv, idx, causal, seen)
        post = drafter.norm(x)
        out.append(drafter.lm_head(post))
        hidden = post if drafter.config.norm_output else x
    return out
