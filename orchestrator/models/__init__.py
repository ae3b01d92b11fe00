"""Models: the target (Llama family, explicit KV cache), the EAGLE-3 / 3.1 drafter, checkpoint I/O."""

from orchestrator.models.checkpoint import drafter_hf_config, load_drafter, save_drafter
from orchestrator.models.drafter import Drafter, DrafterConfig, DraftOutput
from orchestrator.models.kv_cache import KVCache
from orchestrator.models.prepare import PACKAGED_MODELS, prepare_model
from orchestrator.models.target import TargetModel, TargetOutput, default_aux_layer_ids, read_hf_config

__all__ = [
    "PACKAGED_MODELS",
    "DraftOutput",
    "Drafter",
    "DrafterConfig",
    "KVCache",
    "TargetModel",
    "TargetOutput",
    "default_aux_layer_ids",
    "drafter_hf_config",
    "load_drafter",
    "prepare_model",
    "read_hf_config",
    "save_drafter",
]
