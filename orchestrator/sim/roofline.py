"""Step costs of a GPU from first principles: a forward reads the weights (and, for a MoE, the experts its tokens
touch) and the KV cache over HBM, computes 2 x active parameters FLOPs per token, and the two overlap (the
larger counts); on top, a floor per layer (kernel launches, the tensor-parallel all-reduces, the host) that no
bandwidth removes. Every constant comes with its public source in the config that sets it.

    Llama-3.1-8B, bf16, one GB200 GPU (8 TB/s): a decode step reads 16 GB -> 2.0 ms + 32 x floor
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from orchestrator.config import StrictModel
from orchestrator.sim.costs import Link, Step, StepCost, fit_step_cost


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


DRAFT_ROUNDS = {"chain": (5, 1), "tree": (4, 4)}  # gpu-check's drafter rounds: (depth, top k)


def measured_costs(steps: dict) -> tuple[StepCost, StepCost]:
    """`make gpu-check`'s measured steps as the planner's costs (the summed form, least squares, as on a CPU):
    the target from its forwards (a forward of more than one new token per sequence verifies: masked), the
    drafter from its rounds, one forward per level over the pairs committed and the nodes expanded."""
    target = fit_step_cost(
        [Step(r["batch"] * r["new"], r["seconds"], r["batch"] * r["context"], r["new"] > 1) for r in steps["target"]]
    )
    context = steps.get("draft_context", 256)
    draft = []
    for r in steps["drafter"]:
        depth, topk = DRAFT_ROUNDS[r["shape"]]
        tokens = 2 * r["batch"] + (depth - 1) * r["batch"] * topk
        draft.append(Step(tokens, r["seconds"], r["batch"] * context, forwards=depth))
    return target, fit_step_cost(draft)


def against_measured(steps: dict, model: ModelShape, gpu: Accelerator) -> dict:
    """`make gpu-check`'s target step times (its `steps` section) beside this roofline on the same GPU and shape.

    Rows: measured and roofline seconds and their ratio per (batch, cached tokens, new tokens). `per_layer_s`:
    the floor the measurement implies, (batch-1 one-token step - the roofline's body) / layers, the constant
    that replaces the roofline's for that GPU when the measured engine is the one being planned."""
    cost = roofline_cost(model, gpu, Placement())
    rows = []
    for r in steps["target"]:
        tokens = r["batch"] * r["new"]
        roofline = cost.seconds(tokens, r["batch"] * r["context"])
        rows.append(r | {"roofline_s": roofline, "measured_over_roofline": r["seconds"] / roofline})
    decode = min(
        (r for r in steps["target"] if r["batch"] == 1 and r["new"] == 1), key=lambda r: r["context"], default=None
    )
    floor = None
    if decode is not None:
        body = cost.seconds(1, decode["context"]) - cost.fixed_s
        floor = max(0.0, (decode["seconds"] - body) / model.layers)
    return {
        "gpu": gpu.name,
        "model": model.name,
        "rows": rows,
        "per_layer_s": floor,
        "roofline_per_layer_s": gpu.per_layer_s,
    }


def against_measured_table(result: dict) -> str:
    lines = [
        f"{result['model']} on {result['gpu']}: measured target forward vs roofline (per-layer floor "
        f"{1e6 * result['roofline_per_layer_s']:.0f} us)",
        "| batch | cached tokens | new tokens | measured ms | roofline ms | measured / roofline |",
        "|---" * 6 + "|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['new']} | {1e3 * r['seconds']:.2f} | {1e3 * r['roofline_s']:.2f} | "
            f"{r['measured_over_roofline']:.2f} |"
        )
    if result["per_layer_s"] is not None:
        lines += ["", f"per-layer floor implied by the measured batch-1 decode: {1e6 * result['per_layer_s']:.0f} us"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """python -m orchestrator.sim.roofline --gpu-check FILE --plan PLAN.yaml [--hardware HW.yaml]"""
    import argparse
    import json

    import yaml

    parser = argparse.ArgumentParser(description="gpu-check's measured step times beside the roofline")
    parser.add_argument("--gpu-check", required=True, help="gpu-check.json of `make gpu-check`")
    parser.add_argument("--plan", required=True, help="a plan config: its target's shape")
    parser.add_argument("--hardware", help="the GPU the check ran on (default: the plan's)")
    args = parser.parse_args(argv)
    plan = yaml.safe_load(Path(args.plan).read_text())  # its target's shape and (default) hardware file
    hardware = yaml.safe_load(Path(args.hardware or plan["hardware"]).read_text())
    model, gpu = ModelShape.model_validate(plan["target"]), Accelerator.model_validate(hardware["gpu"])
    steps = json.loads(Path(args.gpu_check).read_text())["steps"]
    print(against_measured_table(against_measured(steps, model, gpu)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
