"""The EAGLE-3 / EAGLE-3.1 drafter, exactly as vLLM's `LlamaForCausalLMEagle3` computes it.

One drafting step for a token at sequence position t:

    aux [N, k*Ht] --(fc_norm per chunk | input_norm over all)--> fc --> hidden [N, H]      (first step only)
    x = layer0([input_layernorm(embed(token)); hidden_norm(hidden)], residual=hidden)      (q/k/v take 2H)
    x = layer_i(x) for further layers;   pre = x;   post = norm(pre)
    logits = lm_head(post) over the draft vocabulary;   target_id = draft_id + d2t[draft_id]
    the next step consumes post (EAGLE-3.1 `norm_output`) or pre (EAGLE-3)

The variants differ only by config flags: `fc_norm` (EAGLE-3.1), `norm_output` (EAGLE-3.1), `norm_before_fc`
(one RMSNorm over the concatenated aux states; exclusive with `fc_norm`) and `norm_before_residual`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from orchestrator.errors import AerieError
from orchestrator.models.kv_cache import KVCache
from orchestrator.models.layers import (
    AttentionContext,
    DecoderConfig,
    DecoderLayer,
    RMSNorm,
    attention_kernels,
    rope_inv_freq,
)


@dataclass(frozen=True)
class DrafterConfig:
    """Architecture of a drafter; `DrafterConfig.for_target` fills the shape from the target's."""

    decoder: DecoderConfig
    num_hidden_layers: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    stores_embeddings: bool = False  # False: the target's embedding is shared (vLLM's default)

    def __post_init__(self) -> None:
        if self.fc_norm and self.norm_before_fc:
            raise AerieError("fc_norm and norm_before_fc are mutually exclusive: set at most one of them")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise AerieError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..vocab_size ({self.vocab_size})")
        if self.num_hidden_layers < 1:
            raise AerieError(f"num_hidden_layers must be at least 1, got {self.num_hidden_layers}")
        if not self.aux_layer_ids:
            raise AerieError("a drafter needs at least one aux layer id")

    @property
    def variant(self) -> str:
        """'eagle3.1' when both 3.1 switches are on, 'eagle3' when neither, else the flags spelled out."""
        if self.fc_norm and self.norm_output:
            return "eagle3.1"
        if not (self.fc_norm or self.norm_output):
            return "eagle3"
        return f"eagle3(fc_norm={self.fc_norm},norm_output={self.norm_output})"

    @classmethod
    def for_target(
        cls,
        target_hf_config: dict,
        aux_layer_ids: tuple[int, ...],
        draft_vocab_size: int | None = None,
        variant: str = "eagle3.1",
        **overrides,
    ) -> DrafterConfig:
        """A one-layer drafter shaped like the target (vLLM's and the EAGLE authors' default).

        variant: 'eagle3' or 'eagle3.1' (= fc_norm and norm_output on); explicit flags in `overrides` win."""
        if variant not in ("eagle3", "eagle3.1"):
            raise AerieError(f"unknown drafter variant {variant!r} (use 'eagle3' or 'eagle3.1')")
        is_31 = variant == "eagle3.1"
        decoder = DecoderConfig.from_hf(target_hf_config).as_llama()  # always a Llama layer, as vLLM loads it
        fields = {
            "decoder": decoder,
            "num_hidden_layers": 1,
            "vocab_size": target_hf_config["vocab_size"],
            "draft_vocab_size": draft_vocab_size or target_hf_config["vocab_size"],
            "target_hidden_size": decoder.hidden_size,
            "aux_layer_ids": tuple(aux_layer_ids),
            "fc_norm": is_31,
            "norm_output": is_31,
        }
        fields.update(overrides)
        return cls(**fields)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DraftOutput:
    """One drafting step, packed like its input tokens."""

    logits: torch.Tensor  # [N, draft_vocab]
    next_hidden: torch.Tensor  # [N, H]: what the next step consumes (post-norm iff norm_output)


class EagleInputLayer(DecoderLayer):
    """The drafter's first layer: attention reads `[input_layernorm(embed); hidden_norm(hidden)]` (2H)."""

    def __init__(self, cfg: DecoderConfig, norm_before_residual: bool) -> None:
        super().__init__(cfg, layer_idx=0, attn_in_features=2 * cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward_eagle(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        normed = self.hidden_norm(hidden)  # [N, H]
        residual = normed if self.norm_before_residual else hidden
        return self(torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual, ctx)


class Drafter(nn.Module):
    """EAGLE-3 / EAGLE-3.1 drafter. Its KV cache comes from `new_cache`, one slot per sequence."""

    def __init__(self, config: DrafterConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        cfg = config.decoder
        hidden, num_aux = cfg.hidden_size, len(config.aux_layer_ids)
        fc_in = config.target_hidden_size * num_aux
        self.input_norm = RMSNorm(fc_in, cfg.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(config.target_hidden_size, cfg.rms_norm_eps) for _ in range(num_aux))
            if config.fc_norm
            else None
        )
        self.fc = nn.Linear(fc_in, hidden, bias=False)
        self.layers = nn.ModuleList(
            [EagleInputLayer(cfg, config.norm_before_residual)]
            + [DecoderLayer(cfg, i) for i in range(1, config.num_hidden_layers)]
        )
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if config.stores_embeddings else None
        self._shared_embed: tuple[nn.Embedding, ...] = ()  # a tuple, so it is not registered as a submodule
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.to(dtype)
        self.dtype = dtype

    def share_embedding(self, embedding: nn.Embedding) -> None:
        """Use the target's token embedding (for checkpoints that do not store their own)."""
        if embedding.weight.shape != (self.config.vocab_size, self.config.decoder.hidden_size):
            raise AerieError(
                f"target embedding {tuple(embedding.weight.shape)} does not fit this drafter "
                f"(vocab {self.config.vocab_size}, hidden {self.config.decoder.hidden_size})"
            )
        self._shared_embed = (embedding,)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(token_ids)
        if not self._shared_embed:
            raise AerieError("this drafter shares the target's embedding: call share_embedding(target.embed_tokens)")
        return self._shared_embed[0](token_ids)

    def combine_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """Fuse the target's aux hidden states [N, k*Ht] into the drafter's hidden [N, H]."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(aux)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def new_cache(self, num_slots: int, max_tokens: int | None = None) -> KVCache:
        """A KV cache on the drafter's device, `num_slots` sequences of at most `max_tokens` tokens each."""
        cfg = self.config.decoder
        return KVCache(
            self.config.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            num_slots,
            max_tokens or cfg.max_position_embeddings,
            self.dtype,
            device=self.device,
        )

    def forward(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        num_tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        block_mask: torch.Tensor | None = None,
        mask_start: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> DraftOutput:
        """One drafting step for a packed batch (layout as `TargetModel.forward`).

        token_ids: [N]; hidden: [N, H], `combine_aux(aux)` for tokens that follow target states, else the
        previous step's `next_hidden`. Appends to the drafter's KV cache like the target does. rows: [R] the
        rows whose outputs are wanted (default all; drafting wants each sequence's last committed one only, and
        the LM head costs as much per row as the layer).
        """
        ctx = AttentionContext.build(cache, slots, num_tokens, positions, block_mask, self.inv_freq, mask_start)
        with attention_kernels(self.device):
            x = self.layers[0].forward_eagle(self.embed(token_ids.to(self.device)), hidden, ctx)
            for layer in self.layers[1:]:
                x = layer(layer.input_layernorm(x), x, ctx)
        cache.advance(slots, num_tokens)
        if rows is not None:
            x = x[rows.to(x.device)]  # [R, H]
        post = self.norm(x)  # [N or R, H]
        return DraftOutput(self.lm_head(post), post if self.config.norm_output else x)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target-vocabulary ids (vLLM: target = draft + d2t[draft])."""
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[N, draft_vocab] -> [N, vocab] with -inf outside the draft vocabulary (what vLLM samples from)."""
        out = draft_logits.new_full((draft_logits.shape[0], self.config.vocab_size), float("-inf"))
        out[:, self.to_target_ids(torch.arange(self.config.draft_vocab_size, device=out.device))] = draft_logits
        return out
