"""Llama-family building blocks shared by the target model and the EAGLE drafter.

Tokens of a batch travel packed, one row per token, sequences back to back:

    token rows [N]:  [a1, a2 | b1 | c1, c2, c3]      num_tokens = [2, 1, 3]

Linear layers run on the packed rows; only attention pads them to [B, heads, T, head_dim]. Each new token has
an explicit rope position and sees (a) every cached token of its sequence and (b) the new tokens of its own
sequence that `block_mask` allows (causal by default; a draft tree for verification).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from orchestrator.models.kv_cache import KVCache

# Attention kernels. On CUDA every forward, decoding one token or verifying a tree, runs the memory-efficient
# kernel with an additive bias (zeros where nothing is masked), so a token's attention sums in the same order in a
# decode step as in a verify step, and a short sequence batched beside a long one as alone (its masked keys add
# exact zeros): the conditions for greedy speculation to equal target-only decoding in bfloat16 (`make gpu-check`,
# H200, 2026-12-04: 6/6 sequences of 384 tokens, chain and tree; before, with flash for decoding, 2/6).
# Flash attention (mask-free calls only) would put decoding on another kernel; cuDNN's fused attention builds an
# execution plan for each new shape, about 20 ms of host time per new (span, mask) on an H200 (`make gpu-check`'s
# profile, 2026-12-04), and decoding changes the shape every step. Grouped-query heads are folded into the query
# rows (`_attend`), so masked attention reads each key/value head once instead of copying it per query head.
# On the CPU, PyTorch's flash kernel takes masks and any shape; in fp32 a verify step and a decode step agree to
# ~1e-5 of the logits, which has not changed a greedy output in any run. In bf16 they differ by up to 0.5, so
# inference in bf16 on a CPU takes `_attend_rowwise` instead (and `RowBlockLinear` for the products).
_CUDA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_CPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def attention_kernels(device: torch.device) -> AbstractContextManager:
    """The attention kernels a forward on `device` may use (around the whole layer stack, once)."""
    return sdpa_kernel(_CUDA_BACKENDS if device.type == "cuda" else _CPU_BACKENDS)


def _attend(
    q_bhtd: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    sizes: tuple[tuple[int, int], ...] | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention -> [B, heads, T, hd]. q: [B, heads, T, hd]; keys, values: [B, kv_heads, S, hd];
    mask: [B, 1, T, S] bool or None (the CPU's way); or, on CUDA, `bias` from `gqa_bias`: the query heads that
    share a key/value head become `groups x T` query rows of that head, [B, kv_heads, groups * T, hd] (query head
    h uses key/value head h // groups, as with `enable_gqa`). sizes: (new tokens, keys) of each sequence, for
    `_attend_rowwise`."""
    if bias is None and q_bhtd.dtype == torch.bfloat16 and not q_bhtd.is_cuda and torch.is_inference_mode_enabled():
        return _attend_rowwise(q_bhtd, keys, values, mask, sizes)  # serving in bf16 on a CPU (training keeps flash)
    if bias is None:
        return F.scaled_dot_product_attention(q_bhtd, keys, values, attn_mask=mask, enable_gqa=True)
    b, heads, t, hd = q_bhtd.shape
    kv_heads = keys.shape[1]
    out = F.scaled_dot_product_attention(q_bhtd.reshape(b, kv_heads, heads // kv_heads * t, hd), keys, values, bias)
    return out.reshape(b, heads, t, hd)  # the kernel may return a transposed layout


def _attend_rowwise(
    q_bhtd: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    sizes: tuple[tuple[int, int], ...] | None = None,
    rows: int = 256,
) -> torch.Tensor:
    """bfloat16 attention on the CPU that gives a token the same bits in a decode step as in a verify step, and
    in a batch as alone, by plain matrix products. PyTorch's CPU flash kernel sums a row in another order beside
    tree nodes under a mask than alone, which in bf16 changed greedy outputs (SmolLM2 on MT-Bench: 12 of 40
    answers equal to target-only decoding).

    A tree node's keys sit between masked siblings, and a short sequence's beside a longer one's padding, so a
    vectorised sum over keys adds them in other lanes than the decode step of the same tokens alone does: with
    fp32 sums, 8 of 40 tree answers still differed. Blocks of up to 64 queries (decoding, verification)
    therefore take the scores, the softmax and the weighted sum in fp64, whose rounding differences lie far below
    what the cast back to bf16 keeps. (fp32 scores were the same dot product wherever a key sat on an Intel CPU
    with AMX, not on an AMD EPYC: there MKL's fp32 product changed with the number of keys, and a sequence
    decoded in a batch of 8 got other attention outputs than alone from its 6th step on; fp64 costs a
    16-sequence decode step ~6 ms of 60 there, one sequence's <1%.) Longer blocks (prefill) stay in fp32, each
    sequence over its own `sizes` (new tokens, keys), `rows` queries at a time: the products a prompt has alone,
    whatever it is batched with."""
    b, heads, t, hd = q_bhtd.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    if t > 64 and b > 1 and sizes is not None:
        out = torch.zeros_like(q_bhtd)
        for i, (new, seen) in enumerate(sizes):
            m = None if mask is None else mask[i : i + 1, :, :new, :seen]
            out[i : i + 1, :, :new] = _attend_rowwise(
                q_bhtd[i : i + 1, :, :new], keys[i : i + 1, :, :seen], values[i : i + 1, :, :seen], m
            )
        return out
    exact = torch.float64 if t <= 64 else torch.float32
    q = q_bhtd.reshape(b, kv_heads, groups, t, hd).to(exact)
    k, v = keys.to(exact).transpose(-1, -2), values.to(exact)  # [B, kv, hd, S], [B, kv, S, hd]
    out = []
    for start in range(0, t, rows):
        r = min(rows, t - start)
        chunk = q[:, :, :, start : start + r].reshape(b, kv_heads, groups * r, hd)  # query heads of a kv head as rows
        scores = torch.matmul(chunk, k).mul_(1.0 / math.sqrt(hd))  # [B, kv, g * r, S]
        if mask is not None:
            seen = mask[:, :, start : start + r].unsqueeze(2).expand(b, 1, groups, r, span)
            scores.masked_fill_(~seen.reshape(b, 1, groups * r, span), float("-inf"))
        out.append(torch.matmul(torch.softmax(scores, dim=-1), v).view(b, kv_heads, groups, r, hd))
    out = out[0] if len(out) == 1 else torch.cat(out, dim=3)
    return out.reshape(b, heads, t, hd).to(q_bhtd.dtype)


def gqa_bias(
    mask: torch.Tensor | None, b: int, groups: int, t: int, span: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The additive bias `_attend` folds grouped-query heads with: [B, 1, groups * T, S], 0 where a key is visible
    and -inf where `mask` ([B, 1, T, S] bool or None) hides it; its rows padded to a multiple of 16 elements, the
    alignment the memory-efficient kernel wants (else it copies)."""
    padded = -(-span // 16) * 16
    bias = torch.zeros((b, 1, groups * t, padded), dtype=dtype, device=device)[..., :span]
    if mask is not None:
        rows = mask.expand(b, 1, t, span).unsqueeze(2).expand(b, 1, groups, t, span).reshape(b, 1, groups * t, span)
        bias.masked_fill_(~rows, float("-inf"))
    return bias


@dataclass(frozen=True)
class DecoderConfig:
    """The shape of a Llama-family decoder stack (the fields of a Hugging Face config that matter here).

    Llama and Mistral are plain; Qwen2 adds a bias to q/k/v only (`qkv_bias`); Qwen3 adds an RMSNorm over
    head_dim to every query and key head before rope (`qk_norm`). `attention_bias` is Llama's: q, k, v and o.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    attention_bias: bool = False
    mlp_bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf(cls, hf: dict) -> DecoderConfig:
        """Read the decoder shape from a Hugging Face config dict (transformers 4.x or 5.x layout)."""
        heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type == "default" else rope
        return cls(
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qkv_bias=hf.get("model_type") == "qwen2",  # transformers' Qwen2Attention: always, and never on o_proj
            qk_norm=hf.get("model_type") == "qwen3",
        )

    def as_llama(self) -> DecoderConfig:
        """This shape without Qwen's q/k/v bias and q/k norms: the decoder of an EAGLE-3 drafter for this target
        (vLLM's `LlamaForCausalLMEagle3` has neither, and would silently skip such weights)."""
        return replace(self, qkv_bias=False, qk_norm=False)

    def rope_hf_fields(self) -> dict:
        """The rope fields in the layout both transformers and vLLM read."""
        scaling = self.rope_scaling or {"rope_type": "default"}
        return {"rope_theta": self.rope_theta, "rope_scaling": scaling}


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim // 2], with Llama-3 long-context scaling when configured."""
    dim = cfg.head_dim
    # fp32 arithmetic, exactly as transformers and vLLM compute it (float64 would differ in the last bit).
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq.float()
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type != "llama3":
        raise ValueError(f"rope scaling {rope_type!r} is not supported (supported: default, llama3)")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(mid, blended, scaled).float()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # As transformers does it in low precision: normalise in fp32, cast, then scale.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class AttentionContext:
    """Everything attention needs for one forward, computed once and shared by all layers.

    Sizes and decisions (`span`, `max_new`, whether a mask is needed, whether the slots are contiguous) come
    from the CPU bookkeeping before anything runs; every tensor here is on the model's device, so no layer
    waits for the host."""

    cache: KVCache
    read_slots: torch.Tensor | slice  # [B] cache slot of each sequence, or the slice they form
    write_slot: torch.Tensor  # [N] cache slot of each token
    tok_b: torch.Tensor  # [N] batch row of each token
    tok_t: torch.Tensor  # [N] index of each token within its sequence's new block
    write_pos: torch.Tensor  # [N] cache index each token's key/value goes to
    cos: torch.Tensor  # [N, head_dim]
    sin: torch.Tensor  # [N, head_dim]
    mask: torch.Tensor | None  # [B, 1, T, span] bool, None when every key is visible
    span: int  # keys to attend over: max over the batch of (cached + new) tokens
    max_new: int  # T: the longest new block
    batch: int  # B
    _bias: torch.Tensor | None = field(default=None, repr=False)  # CUDA: `gqa_bias`, built by the first layer
    sizes: tuple[tuple[int, int], ...] | None = None  # (new tokens, keys) per sequence, for bf16 on the CPU

    @classmethod
    def build(
        cls,
        cache: KVCache,
        slots: torch.Tensor,
        num_tokens: torch.Tensor,
        positions: torch.Tensor | None,
        block_mask: torch.Tensor | None,
        inv_freq: torch.Tensor,
        mask_start: torch.Tensor | None = None,
    ) -> AttentionContext:
        """Lay out a batch: slots [B], num_tokens [B] (CPU), positions [N] or None (= cache index),
        block_mask [B, T, W] bool or None (= causal), mask_start [B] or None (see `_attention_mask`)."""
        slots, num_tokens = slots.cpu(), num_tokens.cpu()
        batch = slots.numel()
        cache.reserve(slots, num_tokens)
        cached_cpu = cache.lengths[slots]  # [B]
        sizes = tuple(zip(num_tokens.tolist(), (cached_cpu + num_tokens).tolist(), strict=True))  # (new, keys) each
        max_new = int(num_tokens.max())
        span = int((cached_cpu + num_tokens).max())
        first = int(slots[0])
        contiguous = torch.equal(slots, torch.arange(first, first + batch))
        needs_mask = not (block_mask is None and max_new == 1 and bool((cached_cpu == cached_cpu[0]).all()))
        device, total = cache.device, int(num_tokens.sum())
        slots, num_tokens, cached = (t.to(device, non_blocking=True) for t in (slots, num_tokens, cached_cpu))
        tok_b = torch.repeat_interleave(torch.arange(batch, device=device), num_tokens, output_size=total)  # [N]
        starts = torch.cumsum(num_tokens, 0) - num_tokens  # [B]
        tok_t = torch.arange(tok_b.numel(), device=device) - starts[tok_b]  # [N]
        write_pos = cached[tok_b] + tok_t
        positions = write_pos if positions is None else positions.to(device)
        freqs = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]  # [N, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = cache.keys[0].dtype if cache.keys else emb.dtype  # rope in fp32, applied in the model's dtype
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        mask = None
        if needs_mask:
            if block_mask is not None:
                block_mask = block_mask.to(device)
            if mask_start is not None:
                mask_start = mask_start.to(device)
            mask = _attention_mask(cached, num_tokens, block_mask, mask_start, max_new, span)
        read = slice(first, first + batch) if contiguous else slots
        return cls(
            cache, read, slots[tok_b], tok_b, tok_t, write_pos, cos, sin, mask, span, max_new, batch, sizes=sizes
        )

    def bias(self, q_bhtd: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """`gqa_bias` of this batch for queries shaped like `q_bhtd` (every layer's are), built once per forward."""
        if self._bias is None:
            b, heads, t, _ = q_bhtd.shape
            self._bias = gqa_bias(self.mask, b, heads // kv_heads, t, self.span, q_bhtd.dtype, q_bhtd.device)
        return self._bias

    def pad(self, x_nd: torch.Tensor) -> torch.Tensor:
        """Packed rows [N, ...] -> padded [B, T, ...] (zeros in the padding)."""
        if self.batch == 1:
            return x_nd.unsqueeze(0)
        out = x_nd.new_zeros((self.batch, self.max_new) + tuple(x_nd.shape[1:]))
        out[self.tok_b, self.tok_t] = x_nd
        return out

    def unpad(self, x_btd: torch.Tensor) -> torch.Tensor:
        """Padded [B, T, ...] -> packed rows [N, ...]."""
        if self.batch == 1:
            return x_btd[0]
        return x_btd[self.tok_b, self.tok_t]


def _attention_mask(
    cached: torch.Tensor,
    num_tokens: torch.Tensor,
    block_mask: torch.Tensor | None,
    mask_start: torch.Tensor | None,
    max_new: int,
    span: int,
) -> torch.Tensor:
    """[B, 1, T, span] bool: query t of sequence b sees key j iff j < start[b] (the shared prefix), or
    start[b] <= j < cached[b] + num_tokens[b] and block_mask[b, t, j - start[b]].

    start = mask_start, or cached (then block_mask [B, T, T] covers the new tokens only, causal by default).
    A start below `cached` lets the mask cover speculative entries already in the cache (a draft tree grown
    one depth per forward). Built on the device of `cached`.
    """
    device = cached.device
    batch = cached.numel()
    start = cached if mask_start is None else mask_start
    if block_mask is None:
        assert mask_start is None, "a mask_start needs an explicit block_mask"
        block_mask = torch.ones(max_new, max_new, dtype=torch.bool, device=device).tril().expand(batch, -1, -1)
    width = block_mask.shape[-1]
    keys = torch.arange(span, device=device)  # [span]
    prefix = keys[None, :] < start[:, None]  # [B, span]
    offset = keys[None, :] - start[:, None]  # [B, span] column of block_mask
    in_block = (offset >= 0) & (offset < (cached - start + num_tokens)[:, None])
    gathered = torch.gather(
        block_mask, 2, offset.clamp(0, width - 1)[:, None, :].expand(-1, max_new, -1)
    )  # [B, T, span]
    mask = prefix[:, None, :] | (in_block[:, None, :] & gathered)
    pad_rows = torch.arange(max_new, device=device)[None, :] >= num_tokens[:, None]  # [B, T]
    mask = mask | pad_rows[:, :, None]  # padding queries see everything (output dropped): no all-masked NaN rows
    return mask[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int, in_features: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(in_features, qkv_out, bias=cfg.attention_bias or cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        # Qwen3: one RMSNorm over head_dim, shared by all query heads (and one by all key heads), before rope.
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x_nd: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        n = x_nd.shape[0]
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x_nd).split([self.num_heads * self.head_dim, kv_size, kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)  # [N, heads, hd]
        k = k.view(n, self.num_kv_heads, self.head_dim)  # [N, kv_heads, hd]
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = ctx.cos[:, None, :], ctx.sin[:, None, :]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = ctx.cache.append(self.layer_idx, ctx.write_slot, ctx.write_pos, ctx.read_slots, k, v, ctx.span)
        q_bhtd = ctx.pad(q).transpose(1, 2)  # [B, heads, T, hd]
        bias = ctx.bias(q_bhtd, self.num_kv_heads) if q.is_cuda else None
        out = _attend(q_bhtd, keys, values, ctx.mask, bias, ctx.sizes)
        out = ctx.unpad(out.transpose(1, 2))  # [N, heads, hd]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """A pre-norm Llama block. `attn_input` is the already-normalised attention input, so the EAGLE
    drafter's first layer can feed `[input_layernorm(embed); hidden_norm(hidden)]` (2H wide) through it."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int, attn_in_features: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, attn_in_features or cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, attn_input: torch.Tensor, residual: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        h = residual + self.self_attn(attn_input, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class PackedLinear(nn.Module):
    """An inference-only `nn.Linear` whose weight is packed for oneDNN (CPU).

    On the 2-core CPU here it is 1.3-2x faster than `F.linear` for the row counts of decoding and
    verification (60 fp32 [3072 x 576] weights: 31 vs 48 ms at 1 row, 44 vs 59 ms at 16, 117 vs 151 at 64)
    because F.linear's matrix-vector path streams the weights at about 9 GB/s. Results agree with F.linear
    to ~1e-6.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.out_features = linear.out_features
        self.register_buffer("weight", linear.weight.detach().to_mkldnn(), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().to_mkldnn()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.aten.mkldnn_linear(rows.to_mkldnn(), self.weight, self.bias).to_dense()
        return out.view(*x.shape[:-1], self.out_features)


class RowBlockLinear(nn.Module):
    """An inference-only bfloat16 `nn.Linear` on the CPU that multiplies at most `rows` rows at a time.

    oneDNN computes a row of a bf16 product to the same bits whatever the row count, up to a size where it
    switches kernels (32 rows on the AMX CPU here: past it, results move by up to 0.5 in SmolLM2's logits). Cut
    into blocks below that size, a token's output is the same in a decode step, a verify step and any batch: what
    greedy speculation needs to equal target-only decoding. `row_exact_block` finds the size on this CPU. A lone
    row goes through the same matrix kernel as the others (`_row_block`)."""

    def __init__(self, linear: nn.Linear, rows: int) -> None:
        super().__init__()
        self.rows = rows
        self.register_buffer("weight", linear.weight.detach(), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= self.rows:
            out = _row_block(flat, self.weight, self.bias)
        else:
            out = torch.cat([_row_block(part, self.weight, self.bias) for part in flat.split(self.rows)])
        return out.view(*x.shape[:-1], out.shape[-1])


def _row_block(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear on a block of rows, a lone row with a zero row beside it: alone, a row takes a matrix-vector
    kernel that sums in another order than the matrix kernel of two or more (on an AMD EPYC with AVX512-BF16,
    SmolLM2's down projection [576 x 1536]: one row alone differed from the same row in any block, and greedy
    decoding alone from decoding in a batch), at no cost here (1 row of the LM head: 3.6 ms, 2 rows: 3.4)."""
    if x.shape[0] == 1:
        return F.linear(torch.cat([x, torch.zeros_like(x)]), weight, bias)[:1]
    return F.linear(x, weight, bias)


_ROW_EXACT: dict[tuple[int, int], int] = {}


def row_exact_block(in_features: int, out_features: int, most: int = 64) -> int:
    """The most rows (<= `most`) a bf16 CPU product of this shape takes while every row keeps the bits it has
    alone (`_row_block` of the row), probed once per shape and process on random rows of three kinds (plain;
    scaled over six orders of magnitude with a tenth of zeros, as activations are; the two mixed): on one kind
    alone the size found can be too large (SmolLM2's q|k|v: 63 on plain rows, 32 on scaled ones)."""
    key = (in_features, out_features)
    if key not in _ROW_EXACT:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
        plain = torch.randn(most, in_features, generator=gen)
        zeros = torch.rand(most, in_features, generator=gen) < 0.1
        scale = torch.exp(3 * torch.randn(most, 1, generator=gen)).masked_fill(zeros, 0.0)
        mixed = torch.where(torch.rand(most, 1, generator=gen) < 0.5, plain, plain * scale)
        best = most
        for x in (plain.to(torch.bfloat16), (plain * scale).to(torch.bfloat16), mixed.to(torch.bfloat16)):
            alone = torch.cat([_row_block(x[i : i + 1], weight, None) for i in range(most)])
            rows = 2
            while rows <= best and torch.equal(_row_block(x[:rows], weight, None), alone[:rows]):
                rows += 1
            best = rows - 1
        _ROW_EXACT[key] = best
    return _ROW_EXACT[key]


def pack_linears_for_cpu(module: nn.Module) -> None:
    """Replace every `nn.Linear` below `module` for frozen inference on the CPU: fp32 ones by a `PackedLinear`,
    bf16 ones by a `RowBlockLinear`."""
    for name, child in module.named_children():
        cpu = isinstance(child, nn.Linear) and not child.weight.is_cuda
        if cpu and child.weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            setattr(module, name, PackedLinear(child))
        elif cpu and child.weight.dtype == torch.bfloat16:
            setattr(module, name, RowBlockLinear(child, row_exact_block(child.in_features, child.out_features)))
        else:
            pack_linears_for_cpu(child)


FUSED_PARAMS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_layer_weights(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Hugging Face per-projection weights of one layer -> this module's fused ones (q|k|v, gate|up).

    `prefix` is the layer's name prefix (e.g. "model.layers.3."); returned names drop it. Biases fuse like
    weights (Qwen2's q|k|v bias). A part without its siblings (a lone q_proj.bias) keeps its own name, so the
    caller's strict check reports it instead of it being dropped."""
    out, fused_names = {}, set()
    for fused, parts in FUSED_PARAMS.items():
        for kind in ("weight", "bias"):
            names = [f"{prefix}{p}.{kind}" for p in parts]
            if all(n in tensors for n in names):
                out[f"{fused}.{kind}"] = torch.cat([tensors[n] for n in names], dim=0)
                fused_names.update(names)
    for name, tensor in tensors.items():
        if name.startswith(prefix) and name not in fused_names:
            out[name[len(prefix) :]] = tensor
    return out


def split_layer_weights(state: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """This module's fused weights of one layer -> Hugging Face / vLLM per-projection names (weights and
    biases split alike; everything else, e.g. Qwen3's self_attn.q_norm.weight, keeps its name)."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    sizes = {"self_attn.qkv_proj": [q, kv, kv], "mlp.gate_up_proj": [cfg.intermediate_size] * 2}
    out = {}
    for name, tensor in state.items():
        module, _, kind = name.rpartition(".")
        if module in FUSED_PARAMS:
            for part, piece in zip(FUSED_PARAMS[module], tensor.split(sizes[module], dim=0), strict=True):
                out[f"{part}.{kind}"] = piece.contiguous()
        else:
            out[name] = tensor
    return out
