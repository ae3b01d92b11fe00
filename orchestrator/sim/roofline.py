"""Step costs of a GPU from first principles: a forward reads the weights (and, for a MoE, the experts its tokens
touch) and the KV cache over HBM, computes 2 x active parameters FLOPs per token, and the two overlap (the
larger counts); on top, a floor per layer (kernel launches, the tensor-parallel all-reduces, the host) that no
bandwidth removes. Every constant comes with its public source in the config that sets it.

    Llama-3.1-8B, bf16, one GB200 GPU (8 TB/s): a decode step reads 16 GB -> 2.0 ms + 32 x floor
"""

from __future__ import annotations

from pydantic import Field

from orchestrator.config import StrictModel
from orchestrator.sim.costs import Link, StepCost


class Accelerator(StrictModel):
    """One GPU."""

    name: str = Field(description="the GPU's name (in the plan's table, plot and MLflow run)")
    hbm_bytes_s: float = Field(gt=0, description="HBM bandwidth, bytes/s")
    flops: dict[str, float] = Field(description="dense FLOP/s by compute dtype (bf16, fp8, fp4)")
    per_layer_s: float = Field(ge=0, description="floor per layer per forward on one GPU (launches, host)")
    sources: dict[str, str] = Field({}, description="where each constant comes from")


class ModelShape(StrictModel):
    """What a forward of a model reads and computes."""

    name: str = Field(description="the model's name (the target's, in the plan's table, plot and MLflow run)")
    layers: int = Field(ge=1, description="decoder layers (each adds the per-layer floor)")
    hidden_size: int = Field(
        ge=1,
        description="hidden width: the target's sizes the aux hidden states sent to the drafter (3 per token, bf16)",
    )
    dense_params: float = Field(gt=0, description="parameters every forward reads (all but the routed experts)")
    active_params: float = Field(gt=0, description="parameters one token computes with (FLOPs = 2 x this)")
    experts: int = Field(0, ge=0, description="routed experts per MoE layer (0: dense)")
    experts_per_token: int = Field(0, ge=0, description="routed experts each token computes with (MoE)")
    expert_params: float = Field(0.0, ge=0, description="one routed expert, over all MoE layers")
    weight_bytes: float = Field(2.0, gt=0, description="bytes per parameter: bf16 2, fp8 1, nvfp4 0.5625")
    compute_dtype: str = Field("bf16", description="the FLOP/s entry of the accelerator to use")
    kv_bytes_per_token: float = Field(ge=0, description="KV cache per token of context, all layers")
    sources: dict[str, str] = Field({}, description="where each constant comes from")


class Placement(StrictModel):
    """Where a model runs: on `gpus` GPUs with tensor parallelism."""

    gpus: int = Field(1, ge=1, description="GPUs, tensor parallel: reading and compute split evenly across them")
    all_reduce_s: float = Field(0.0, ge=0, description="per layer, with tensor parallelism: two all-reduces")


def roofline_cost(model: ModelShape, gpu: Accelerator, placement: Placement) -> StepCost:
    """The model's StepCost on `placement.gpus` of `gpu` (reading and compute split evenly across them)."""
    bandwidth = gpu.hbm_bytes_s * placement.gpus
    flops = gpu.flops[model.compute_dtype] * placement.gpus
    return StepCost(
        fixed_s=model.layers * (gpu.per_layer_s + (placement.all_reduce_s if placement.gpus > 1 else 0.0)),
        weights_s=model.dense_params * model.weight_bytes / bandwidth,
        per_token_s=2 * model.active_params / flops,
        per_context_s=model.kv_bytes_per_token / bandwidth,
        experts=model.experts,
        experts_per_token=model.experts_per_token,
        expert_s=model.expert_params * model.weight_bytes / bandwidth,
        roofline=True,
    )


class Network(StrictModel):
    """Links between two GPUs: in one NVLink domain (a GB200 tray, an NVL72 rack) or across InfiniBand."""

    nvlink: Link = Field(description="within one NVLink domain (a setup's link: nvlink)")
    infiniband: Link = Field(description="across InfiniBand (a setup's link: infiniband)")
    sources: dict[str, str] = Field({}, description="where each constant comes from")
