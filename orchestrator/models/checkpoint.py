"""Drafter checkpoints in exactly the layout vLLM's `LlamaForCausalLMEagle3` loads.

    DIR/config.json         architectures ["LlamaForCausalLMEagle3"], shape, vocab sizes, aux layer ids
                            (top level and in eagle_config), explicit fc_norm / norm_output / norm_before_fc
    DIR/model.safetensors   midlayer.* (layer 0), layers.{i}.* (further layers), fc.weight, fc_norm.{j}.weight,
                            input_norm.weight, norm.weight, lm_head.weight, d2t (int64), t2d (bool),
                            embed_tokens.weight (only when the drafter stores its own)

Loading accepts what vLLM 0.32 accepts: `layers.0.*` for `midlayer.*`, aux ids at the top level or only in
eagle_config or absent (then vLLM's default for the target's layer count), no draft_vocab_size, no
target_hidden_size, bf16/fp16 weights, speculators-format configs with Llama layers. It checks every tensor
against the config and names the first that disagrees; weights are read with safetensors only (never pickle).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from orchestrator.errors import CheckpointError
from orchestrator.files import publish_dir
from orchestrator.models.device import resolve_device, resolve_dtype
from orchestrator.models.drafter import Drafter, DrafterConfig
from orchestrator.models.layers import DecoderConfig, fuse_layer_weights, pack_linears_for_cpu, split_layer_weights
from orchestrator.models.target import default_aux_layer_ids, load_safetensors_dir

ARCHITECTURE = "LlamaForCausalLMEagle3"
# The drafter architectures vLLM 0.32's model registry builds with llama_eagle3.Eagle3LlamaForCausalLM (its
# PEagle names need parallel drafting; Eagle3Qwen3ForCausalLM and Eagle3DeepseekV* use other layers).
LLAMA_EAGLE3_ARCHITECTURES = (
    ARCHITECTURE,
    "Eagle3LlamaForCausalLM",
    "Eagle3Qwen2_5vlForCausalLM",
    "Eagle3Qwen3vlForCausalLM",
    "Eagle3MiniMaxM2ForCausalLM",
)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _layer_prefix(index: int) -> str:
    return "midlayer." if index == 0 else f"layers.{index}."


def drafter_hf_config(config: DrafterConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json vLLM reads for this drafter."""
    dec = config.decoder
    aux = list(config.aux_layer_ids)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": dec.hidden_size,
        "intermediate_size": dec.intermediate_size,
        "num_attention_heads": dec.num_attention_heads,
        "num_key_value_heads": dec.num_key_value_heads,
        "head_dim": dec.head_dim,
        "num_hidden_layers": config.num_hidden_layers,
        "rms_norm_eps": dec.rms_norm_eps,
        "max_position_embeddings": dec.max_position_embeddings,
        **dec.rope_hf_fields(),
        "attention_bias": dec.attention_bias,
        "mlp_bias": dec.mlp_bias,
        "tie_word_embeddings": False,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "torch_dtype": _DTYPE_NAMES[dtype],
        "eagle_aux_hidden_state_layer_ids": aux,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": aux,
            "use_aux_hidden_state": True,
            "norm_before_fc": config.norm_before_fc,
        },
        "fc_norm": config.fc_norm,
        "norm_output": config.norm_output,
        "norm_before_fc": config.norm_before_fc,
        "norm_before_residual": config.norm_before_residual,
    }


def drafter_config_from_hf(
    hf: dict, has_embed_tokens: bool = False, target_num_layers: int | None = None
) -> DrafterConfig:
    """Parse a drafter config.json as vLLM 0.32 reads it: the vLLM / EAGLE layout (EAGLE-3 configs without the
    3.1 keys read as EAGLE-3) or the speculators layout (`speculators_config` + `transformer_layer_config`).

    Without aux layer ids vLLM reads (2, N // 2, N - 3) of the N-layer target: give `target_num_layers` then."""
    if hf.get("speculators_config") is not None:
        hf = _from_speculators(hf)
    archs = hf.get("architectures") or []
    if not any(a in LLAMA_EAGLE3_ARCHITECTURES for a in archs):
        if any("Eagle3" in a for a in archs):
            raise CheckpointError(
                f"config.json architectures {archs}: vLLM builds this EAGLE-3 drafter from other layers than "
                f"Llama's; aerie loads Llama-layer drafters ({', '.join(LLAMA_EAGLE3_ARCHITECTURES)})"
            )
        raise CheckpointError(f"config.json architectures {archs} is not an EAGLE-3 drafter (expected {ARCHITECTURE})")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in hf]
    if missing:
        raise CheckpointError(f"config.json is missing {missing}")
    eagle = hf.get("eagle_config") or {}
    if not eagle.get("use_aux_hidden_state", True):
        raise CheckpointError("config.json sets eagle_config.use_aux_hidden_state: false (no fc over target states)")
    for key in ("eagle_aux_hidden_state_layer_ids", "norm_before_fc"):
        if key in hf and key in eagle and hf[key] != eagle[key]:
            raise CheckpointError(f"config.json says {key} = {hf[key]} at top level but {eagle[key]} in eagle_config")
    aux = hf.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    if not aux and target_num_layers is not None:
        aux = default_aux_layer_ids(target_num_layers)  # what vLLM's target then captures
    if not aux:
        raise CheckpointError(
            "config.json has no eagle_aux_hidden_state_layer_ids (top level or eagle_config): "
            "the target layers this drafter reads are unknown (vLLM then reads (2, N//2, N-3) of an N-layer "
            "target: load it with target_num_layers=N)"
        )
    return DrafterConfig(
        decoder=DecoderConfig.from_hf(hf).as_llama(),
        num_hidden_layers=hf.get("num_hidden_layers", 1),
        vocab_size=hf["vocab_size"],
        draft_vocab_size=hf.get("draft_vocab_size") or hf["vocab_size"],
        target_hidden_size=hf.get("target_hidden_size") or hf["hidden_size"],
        aux_layer_ids=tuple(aux),
        fc_norm=bool(hf.get("fc_norm", False)),
        norm_output=bool(hf.get("norm_output", False)),
        norm_before_fc=bool(eagle.get("norm_before_fc", hf.get("norm_before_fc", False))),
        norm_before_residual=bool(hf.get("norm_before_residual", False)),
        stores_embeddings=has_embed_tokens,
    )


def _from_speculators(hf: dict) -> dict:
    """A speculators-format config as vLLM 0.32 flattens it (configs/speculators/algos.py `update_eagle3`): the
    layer's config, plus the EAGLE-3 keys from the top level; `norm_before_residual` defaults to true there."""
    kind = hf.get("speculators_model_type")
    if kind != "eagle3":
        raise CheckpointError(f"config.json: speculators_model_type {kind!r} is not an EAGLE-3 drafter (eagle3)")
    flat = dict(hf.get("transformer_layer_config") or {})
    if flat.get("model_type", "llama") != "llama":
        raise CheckpointError(
            f"config.json: a speculators EAGLE-3 drafter with {flat['model_type']!r} layers (vLLM builds it "
            f"from other layers than Llama's); aerie loads Llama-layer drafters"
        )
    flat |= {
        "architectures": ["Eagle3LlamaForCausalLM"],
        "draft_vocab_size": hf.get("draft_vocab_size"),
        "norm_before_residual": hf.get("norm_before_residual", True),
        "norm_before_fc": hf.get("norm_before_fc", False),
        "fc_norm": hf.get("fc_norm", False),
        "norm_output": hf.get("norm_output", False),
    }
    for key in ("target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if hf.get(key):
            flat[key] = hf[key]
    return flat


def drafter_tensors(drafter: Drafter) -> dict[str, torch.Tensor]:
    """The drafter's weights under vLLM's checkpoint names."""
    cfg = drafter.config
    state = drafter.state_dict()
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_hidden_layers):
        layer = {k[len(f"layers.{i}.") :]: v for k, v in state.items() if k.startswith(f"layers.{i}.")}
        for name, tensor in split_layer_weights(layer, cfg.decoder).items():
            out[_layer_prefix(i) + name] = tensor
    for name, tensor in state.items():
        if not name.startswith("layers."):
            out[name] = tensor
    if cfg.draft_vocab_size == cfg.vocab_size:
        out.pop("d2t"), out.pop("t2d")  # identity mapping: vLLM expects no d2t then
    return {k: v.contiguous() for k, v in out.items()}


def save_drafter(drafter: Drafter, out_dir: str | Path, extra_config: dict | None = None) -> Path:
    """Write config.json + model.safetensors atomically (a complete checkpoint or none)."""
    config = drafter_hf_config(drafter.config, drafter.dtype) | (extra_config or {})

    def build(tmp: Path) -> None:
        save_file(drafter_tensors(drafter), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    return publish_dir(out_dir, build)


def _expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint with this config must hold, with its shape, under vLLM's names."""
    dec = cfg.decoder
    h, ht, k = dec.hidden_size, cfg.target_hidden_size, len(cfg.aux_layer_ids)
    q, kv = dec.num_attention_heads * dec.head_dim, dec.num_key_value_heads * dec.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, k * ht),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
    }
    for i in range(cfg.num_hidden_layers):
        p, attn_in = _layer_prefix(i), (2 * h if i == 0 else h)
        shapes |= {
            f"{p}self_attn.q_proj.weight": (q, attn_in),
            f"{p}self_attn.k_proj.weight": (kv, attn_in),
            f"{p}self_attn.v_proj.weight": (kv, attn_in),
            f"{p}self_attn.o_proj.weight": (h, q),
            f"{p}mlp.gate_proj.weight": (dec.intermediate_size, h),
            f"{p}mlp.up_proj.weight": (dec.intermediate_size, h),
            f"{p}mlp.down_proj.weight": (h, dec.intermediate_size),
            f"{p}input_layernorm.weight": (h,),
            f"{p}post_attention_layernorm.weight": (h,),
        }
        if i == 0:
            shapes[f"{p}hidden_norm.weight"] = (h,)
    if cfg.fc_norm:
        shapes |= {f"fc_norm.{j}.weight": (ht,) for j in range(k)}
    if cfg.norm_before_fc:
        shapes["input_norm.weight"] = (k * ht,)
    if cfg.draft_vocab_size != cfg.vocab_size:
        shapes["d2t"] = (cfg.draft_vocab_size,)
    if cfg.stores_embeddings:
        shapes["embed_tokens.weight"] = (cfg.vocab_size, h)
    return shapes


def _canonical_names(tensors: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    """Checkpoint tensor names -> the layout `save_drafter` writes, accepting exactly the names vLLM 0.32 does
    (llama_eagle3.py: `Eagle3LlamaForCausalLM.load_weights` and `LlamaModel.hf_to_vllm_mapper`).

    `midlayer.X` and `layers.0.X` (speculators' name) are both layer 0 -> `midlayer.X`. vLLM prefixes every name
    but lm_head's with `model.` itself, so it fails on names that already carry one (`model.layers.0.*`): refused
    here too, with the fix, rather than accepting a drafter vLLM cannot serve."""
    out: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    for name, tensor in tensors.items():
        if name.startswith("model."):
            raise CheckpointError(
                f"{where}: tensor {name}: vLLM 0.32 adds the 'model.' prefix to drafter weights itself and fails "
                f"on this checkpoint; save its tensors without it ({name.removeprefix('model.')})"
            )
        canonical = "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name
        if canonical in out:
            raise CheckpointError(f"{where}: tensors {source[canonical]} and {name} are the same layer-0 weight")
        out[canonical], source[canonical] = tensor, name
    return out


_FLAG_OF = {"fc_norm.": "fc_norm", "input_norm.": "norm_before_fc"}


def _check_tensors(cfg: DrafterConfig, tensors: dict[str, torch.Tensor], where: Path) -> None:
    expected = _expected_shapes(cfg)
    for name, shape in expected.items():
        if name not in tensors:
            flag = next((f for p, f in _FLAG_OF.items() if name.startswith(p)), None)
            why = f" (config says {flag}: true)" if flag else ""
            raise CheckpointError(f"{where}: tensor {name} is missing{why}")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"{where}: tensor {name} has shape {tuple(tensors[name].shape)}, the config implies {shape}"
            )
    optional = {"t2d"}
    unexpected = sorted(set(tensors) - set(expected) - optional)
    if unexpected:
        flag = next((f for p, f in _FLAG_OF.items() if unexpected[0].startswith(p)), None)
        why = f" (config says {flag}: false)" if flag else ""
        raise CheckpointError(f"{where}: unexpected tensor {unexpected[0]}{why}")
    if "d2t" in tensors:
        d2t = tensors["d2t"]
        if d2t.dtype != torch.int64:
            raise CheckpointError(f"{where}: tensor d2t must be int64, got {d2t.dtype}")
        targets = torch.arange(cfg.draft_vocab_size) + d2t
        if int(targets.min()) < 0 or int(targets.max()) >= cfg.vocab_size:
            raise CheckpointError(
                f"{where}: tensor d2t maps draft ids outside the target vocabulary of {cfg.vocab_size}"
            )
    if "t2d" in tensors and tuple(tensors["t2d"].shape) != (cfg.vocab_size,):
        raise CheckpointError(
            f"{where}: tensor t2d has shape {tuple(tensors['t2d'].shape)}, expected ({cfg.vocab_size},)"
        )


def read_drafter_hf(path: str | Path) -> dict:
    """A drafter directory's config.json, with a clear error when it is not one."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"drafter directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_file}: not valid JSON ({err})") from err


def drafter_aux_layer_ids(path: str | Path, target_num_layers: int | None = None) -> tuple[int, ...]:
    """The target layers a drafter reads (from its config, else vLLM's default for a `target_num_layers`-layer
    target; the target must capture exactly these)."""
    return tuple(drafter_config_from_hf(read_drafter_hf(path), target_num_layers=target_num_layers).aux_layer_ids)


def load_drafter(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    packed: bool = False,
    device: torch.device | str = "cpu",
    target_num_layers: int | None = None,
) -> Drafter:
    """Load an EAGLE-3 / 3.1 drafter directory in any layout vLLM 0.32 loads onto `device`, rejecting any tensor
    that disagrees with its config. dtype "auto": bfloat16 on CUDA, float32 on the CPU (bf16 or fp16 weights
    are cast, as vLLM does).

    packed: for inference on the CPU in float32 only, run the linear layers on oneDNN-packed weights (see
    `PackedLinear`): a drafting call at tree depth 4 costs about half as much here.
    target_num_layers: the target's layer count, needed only by a config without aux layer ids."""
    path = Path(path)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    hf = read_drafter_hf(path)
    if not list(path.glob("*.safetensors")):
        pickles = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
        hint = f" (found {pickles}: pickle weights are never loaded; convert them to safetensors)" if pickles else ""
        raise CheckpointError(f"{path}: no *.safetensors weights{hint}")
    tensors = _canonical_names(load_safetensors_dir(path), path)
    cfg = drafter_config_from_hf(hf, "embed_tokens.weight" in tensors, target_num_layers)
    _check_tensors(cfg, tensors, path)
    drafter = Drafter(cfg, dtype)
    state: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_hidden_layers):
        for name, tensor in fuse_layer_weights(tensors, _layer_prefix(i)).items():
            state[f"layers.{i}.{name}"] = tensor
    for name, tensor in tensors.items():
        if not (name.startswith("midlayer.") or name.startswith("layers.")):
            state[name] = tensor
    if "t2d" not in state:
        state["t2d"] = _t2d_from_d2t(state.get("d2t", drafter.d2t), cfg.vocab_size)
    if "d2t" not in state:
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    drafter.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    drafter.to(device)
    if packed and device.type == "cpu":
        drafter.requires_grad_(False)
        pack_linears_for_cpu(drafter)
    return drafter


def _t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t] = True
    return t2d
