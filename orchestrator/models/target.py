"""The target model: a compact Llama-family decoder with an explicit KV cache and aux hidden states.

One forward takes a packed batch of new tokens for several sequences (see `layers.py`), appends them to each
sequence's cache (under a tree mask if given) and returns logits, the EAGLE-3 aux hidden states and the
final-norm hidden state. Aux layer id k is transformers' `hidden_states[k]`: the output of decoder layer k-1
(k = 0 is the embedding), the same ids vLLM's `eagle_aux_hidden_state_layer_ids` use.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from torch import nn

from orchestrator.errors import AerieError
from orchestrator.models.device import resolve_device, resolve_dtype
from orchestrator.models.kv_cache import KVCache
from orchestrator.models.layers import (
    AttentionContext,
    DecoderConfig,
    DecoderLayer,
    RMSNorm,
    attention_kernels,
    fuse_layer_weights,
    pack_linears_for_cpu,
    rope_inv_freq,
)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
VLLM_BACKEND_HINT = (
    "use the vLLM backend for it (aerie serve --backend vllm; aerie generate --engine vllm; collection: backend: vllm)"
)


def check_target_supported(hf_config: dict) -> None:
    """Raise one AerieError naming the vLLM backend when the project's own target cannot run this model.

    Cheap (config only): call it wherever a config names a target for the project's own engine, before Ray
    starts. Sliding-window attention is refused rather than implemented: one attention mask serves every layer
    here, while Qwen mixes sliding and full layers; releases since Mistral-7B-v0.3 / Qwen2.5 leave it off."""
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise AerieError(
            f"model_type {model_type!r} is not supported by aerie's own target model (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}): {VLLM_BACKEND_HINT}"
        )
    window, context = _sliding_window(hf_config), hf_config.get("max_position_embeddings", 2048)
    if window is not None and window < context:
        raise AerieError(
            f"this {model_type} model attends through a {window}-token sliding window, shorter than its "
            f"{context}-token context, which aerie's own target model does not implement: {VLLM_BACKEND_HINT}"
        )
    try:
        rope_inv_freq(DecoderConfig.from_hf(hf_config))
    except ValueError as err:
        raise AerieError(f"{err} in aerie's own target model: {VLLM_BACKEND_HINT}") from err


def _sliding_window(hf: dict) -> int | None:
    """The window (tokens) of the config's sliding-window layers; None when every layer attends in full.

    transformers' rule: `layer_types` says it per layer; else Mistral slides whenever `sliding_window` is set,
    Qwen2/Qwen3 only with `use_sliding_window`, and then the layers from `max_window_layers` on."""
    window = hf.get("sliding_window")
    if window is None:
        return None
    if hf.get("layer_types") is not None:
        return window if "sliding_attention" in hf["layer_types"] else None
    if hf.get("model_type") in ("qwen2", "qwen3"):
        slides = hf.get("use_sliding_window", False) and hf.get("max_window_layers", 0) < hf["num_hidden_layers"]
        return window if slides else None
    return window


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 aux layers for an N-layer target: (2, N // 2, N - 3)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass
class TargetOutput:
    """Outputs of one forward, packed like the input tokens."""

    logits: torch.Tensor | None  # [N, vocab] ("all"), [B, vocab] ("last"), or None
    aux_hidden: torch.Tensor  # [N, k * hidden]: hidden_states[id] for each aux id, concatenated
    final_hidden: torch.Tensor  # [N, hidden]: after the final RMSNorm (what lm_head reads)


def config_sha256(model_dir: str | Path) -> str:
    """sha256 of a model directory's config.json: which target a collection, a drafter or a tap was made with."""
    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()


def read_hf_config(model_dir: str | Path) -> dict:
    """config.json of a Hugging Face model directory, with a clear error when it is not one."""
    path = Path(model_dir)
    if not path.is_dir():
        raise AerieError(f"model directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise AerieError(f"{str(path)!r} has no config.json: not a Hugging Face model directory")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise AerieError(f"{config_file}: not valid JSON ({err})") from err


def load_safetensors_dir(
    model_dir: str | Path,
    names: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
    missing_ok: bool = False,
) -> dict[str, torch.Tensor]:
    """Tensors of the *.safetensors files of a directory (sharded or not): all of them, or only `names`.

    Every shard's header is read, but only the named tensors' bytes (safetensors maps the file), so a training
    worker reads the three tensors it needs of a 32B target, not 64 GB."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise AerieError(f"{str(model_dir)!r} has no *.safetensors weights")
    wanted = None if names is None else set(names)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if wanted is None or name in wanted:
                    tensors[name] = f.get_tensor(name)
    if wanted is not None and wanted - set(tensors) and not missing_ok:
        raise AerieError(f"{str(model_dir)!r}: weights {sorted(wanted - set(tensors))[:5]} are missing")
    return tensors


class TargetModel(nn.Module):
    """A Llama-family causal LM (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3 dense) for verification and
    hidden-state capture; `check_target_supported` says which configs it runs."""

    def __init__(
        self,
        hf_config: dict,
        aux_layer_ids: tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """An uninitialised model; `from_pretrained` loads the weights and packs them for fast CPU inference."""
        super().__init__()
        check_target_supported(hf_config)
        self.hf_config = hf_config
        self.cfg = DecoderConfig.from_hf(hf_config)
        self.num_layers = hf_config["num_hidden_layers"]
        self.vocab_size = hf_config["vocab_size"]
        self.aux_layer_ids = tuple(aux_layer_ids or default_aux_layer_ids(self.num_layers))
        if list(self.aux_layer_ids) != sorted(set(self.aux_layer_ids)):
            raise AerieError(f"aux layer ids {list(self.aux_layer_ids)} must be strictly increasing")
        bad = [i for i in self.aux_layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise AerieError(
                f"aux layer ids {bad} are outside this {self.num_layers}-layer model (valid: 0..{self.num_layers - 1})"
            )
        self.dtype = dtype
        hidden = self.cfg.hidden_size
        self.embed_tokens = nn.Embedding(self.vocab_size, hidden)
        self.layers = nn.ModuleList(DecoderLayer(self.cfg, i) for i in range(self.num_layers))
        self.norm = RMSNorm(hidden, self.cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        self.lm_head = nn.Linear(hidden, self.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(self.cfg), persistent=False)
        self.to(dtype)
        self.requires_grad_(False)
        self.eval()

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        aux_layer_ids: tuple[int, ...] | None = None,
        dtype: torch.dtype | str = "auto",
        packed: bool = True,
        device: torch.device | str = "auto",
    ) -> TargetModel:
        """Load a Hugging Face safetensors directory onto `device` (auto: the GPU when there is one) in `dtype`
        (auto: bfloat16 on CUDA, float32 on the CPU).

        The model is built on the `meta` device and takes the checkpoint's tensors as they are read (straight
        to the device): no random initialisation, no second copy in host memory.
        packed: on the CPU in float32, run the linear layers on oneDNN-packed weights (1.4x faster decoding
        here). Unpacked, a single sequence reproduces transformers' logits bit for bit; packed, they differ by
        ~1e-4 on SmolLM2, whose hidden states reach 2.6e4 (transformers' own sdpa and eager attention differ by
        as much).
        """
        model_dir = Path(model_dir)
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        hf = read_hf_config(model_dir)
        with torch.device("meta"):
            model = cls(hf, aux_layer_ids, dtype)
        model.load_hf_weights(load_safetensors_dir(model_dir, device=device))
        model.inv_freq = rope_inv_freq(model.cfg).to(device)
        if packed and device.type == "cpu":
            pack_linears_for_cpu(model)
        return model

    def load_hf_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named weights (`model.layers.0.self_attn.q_proj.weight`, ...), strictly: Qwen2's
        q/k/v biases fuse into `qkv_proj.bias` like the weights; Qwen3's `self_attn.{q,k}_norm` load as named."""
        state = {
            "embed_tokens.weight": tensors.get("model.embed_tokens.weight"),
            "norm.weight": tensors.get("model.norm.weight"),
        }
        if not self.tie_word_embeddings:
            state["lm_head.weight"] = tensors.get("lm_head.weight")
        for i in range(self.num_layers):
            for name, tensor in fuse_layer_weights(tensors, f"model.layers.{i}.").items():
                state[f"layers.{i}.{name}"] = tensor
        missing = sorted(k for k, v in state.items() if v is None)
        if missing:
            raise AerieError(f"model weights are missing {missing[:5]}")
        expected = {k for k in self.state_dict() if not (self.tie_word_embeddings and k == "lm_head.weight")}
        unknown, absent = sorted(set(state) - expected), sorted(expected - set(state))
        if unknown or absent:
            raise AerieError(f"model weights do not match the config: unexpected {unknown[:5]}, missing {absent[:5]}")
        for name, param in self.state_dict().items():
            if name in state and state[name].shape != param.shape:
                raise AerieError(f"weight {name}: shape {tuple(state[name].shape)}, config says {tuple(param.shape)}")
        self.load_state_dict({k: v.to(self.dtype) for k, v in state.items()}, strict=False, assign=True)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, num_slots: int, max_tokens: int | None = None) -> KVCache:
        """A KV cache on the model's device for `num_slots` sequences of at most `max_tokens` tokens each
        (default: the model's context); it grows on demand up to that bound."""
        return KVCache(
            self.num_layers,
            self.cfg.num_key_value_heads,
            self.cfg.head_dim,
            num_slots,
            max_tokens or self.cfg.max_position_embeddings,
            self.dtype,
            device=self.device,
        )

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        num_tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        block_mask: torch.Tensor | None = None,
        mask_start: torch.Tensor | None = None,
        logits: Literal["all", "last", "none"] = "all",
    ) -> TargetOutput:
        """Append new tokens to the cached sequences in `slots` and run them through the model.

        token_ids: [N] packed new tokens; slots, num_tokens: [B]; positions: [N] rope positions (default: the
        cache index, i.e. contiguous after the cached prefix); block_mask: [B, T, T] bool over the new tokens
        (default causal). `logits="last"` computes them only for each sequence's last new token.
        """
        ctx = AttentionContext.build(cache, slots, num_tokens, positions, block_mask, self.inv_freq, mask_start)
        x = self.embed_tokens(token_ids.to(self.device))  # [N, hidden]
        aux = [x] if 0 in self.aux_layer_ids else []
        with attention_kernels(self.device):
            for i, layer in enumerate(self.layers):
                x = layer(layer.input_layernorm(x), x, ctx)
                if i + 1 in self.aux_layer_ids:
                    aux.append(x)
        cache.advance(slots, num_tokens)
        final = self.norm(x)  # [N, hidden]
        if logits == "all":
            out_logits = self.lm_head(final)
        elif logits == "last":
            out_logits = self.lm_head(final[(torch.cumsum(num_tokens, 0) - 1).to(final.device)])
        else:
            out_logits = None
        return TargetOutput(out_logits, torch.cat(aux, dim=-1), final)
