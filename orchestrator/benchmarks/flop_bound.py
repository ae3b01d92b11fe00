"""Drafter training against this machine's FLOP bound: matmul FLOPs per trained token (forward and backward,
counted by `torch.utils.flop_counter`), the GEMM peak at the drafter's shapes, and a bare training step's
tokens/s, in fp32 and bf16 autocast.

    python -m orchestrator.benchmarks.flop_bound --model models/smollm2-135m-instruct --threads 2

prints, per precision: `bf16: GEMM peak 389 GFLOP/s; step 969 tok/s; bound 1754 tok/s; 55% of it`.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from orchestrator.models.drafter import DrafterConfig
from orchestrator.models.init import new_drafter
from orchestrator.models.target import default_aux_layer_ids
from orchestrator.train.objective import Batch, DraftTrainingModel


def training_model(hf: dict, draft_vocab: int, variant: str = "eagle3.1") -> DraftTrainingModel:
    """A drafter initialised as training initialises it, on random stand-ins for the target's weights."""
    gen = torch.Generator().manual_seed(0)
    h, v = hf["hidden_size"], hf["vocab_size"]
    aux = default_aux_layer_ids(hf["num_hidden_layers"])
    config = DrafterConfig.for_target(hf, aux, draft_vocab, variant)
    head = 0.02 * torch.randn(v, h, generator=gen)
    vocab = torch.randperm(v, generator=gen)[:draft_vocab].sort().values
    drafter = new_drafter(config, head, torch.ones(h), vocab)
    return DraftTrainingModel(drafter, 0.02 * torch.randn(v, h, generator=gen), head[vocab].clone())


def random_batch(hf: dict, sequences: int, length: int) -> Batch:
    gen = torch.Generator().manual_seed(1)
    h, k = hf["hidden_size"], len(default_aux_layer_ids(hf["num_hidden_layers"]))
    shape = (sequences, length)
    return Batch(
        torch.randint(0, hf["vocab_size"], shape, generator=gen),
        torch.ones(shape, dtype=torch.bool),
        torch.full((sequences,), length),
        torch.randn(*shape, k * h, generator=gen),
        torch.randn(*shape, h, generator=gen),
    )


def flops_per_token(model: DraftTrainingModel, batch: Batch, ttt_steps: int) -> tuple[float, dict[str, float]]:
    """Matmul FLOPs of one forward and backward per token, total and per aten op."""
    with FlopCounterMode(display=False) as counter:
        loss, _ = model(batch, ttt_steps, 0.8)
        loss.backward()
    model.zero_grad(set_to_none=True)
    n = batch.num_tokens
    return counter.get_total_flops() / n, {str(op): f / n for op, f in counter.get_flop_counts()["Global"].items()}


def gemm_peak(dtype: torch.dtype, m: int, k: int, n: int, reps: int = 10) -> float:
    """FLOP/s of the best of three timed [m, k] @ [k, n] runs."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    best = 0.0
    for _ in range(3):
        a @ b
        began = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * m * k * n * reps / (time.perf_counter() - began))
    return best


def step_tokens_per_s(model: DraftTrainingModel, batch: Batch, ttt_steps: int, bf16: bool, steps: int = 4) -> float:
    """Best tokens/s of a bare training step (forward, backward, AdamW) after one warm-up step."""
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    best = float("inf")
    for i in range(steps + 1):
        began = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = model(batch, ttt_steps, 0.8)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if i:
            best = min(best, time.perf_counter() - began)
    return batch.num_tokens / best


def measure(hf: dict, draft_vocab: int, ttt_steps: int, sequences: int, length: int, steps: int = 4) -> dict:
    model, batch = training_model(hf, draft_vocab), random_batch(hf, sequences, length)
    per_token, by_op = flops_per_token(model, batch, ttt_steps)
    shape = (sequences * length, 2 * hf["hidden_size"], hf.get("intermediate_size", 4 * hf["hidden_size"]))
    out = {"flops_per_token": per_token, "by_op": by_op}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        peak = gemm_peak(dtype, *shape)
        tok_s = step_tokens_per_s(model, batch, ttt_steps, name == "bf16", steps)
        out[name] = {"gemm_flop_s": peak, "step_tok_s": tok_s, "bound_tok_s": peak / per_token}
    return out


def main(argv: list[str] | None = None) -> None:
    from orchestrator.models.target import read_hf_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a prepared target directory (its config.json)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--draft-vocab", type=int, default=4096)
    parser.add_argument("--ttt-steps", type=int, default=5)
    parser.add_argument("--sequences", type=int, default=2)
    parser.add_argument("--length", type=int, default=512)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    r = measure(read_hf_config(args.model), args.draft_vocab, args.ttt_steps, args.sequences, args.length)
    per_token = r["flops_per_token"] / 1e6
    print(f"{per_token:.0f} MFLOP of matmuls per trained token (forward + backward), {args.threads} threads")
    for name in ("fp32", "bf16"):
        m = r[name]
        print(
            f"{name}: GEMM peak {m['gemm_flop_s'] / 1e9:.0f} GFLOP/s; step {m['step_tok_s']:.0f} tok/s; "
            f"bound {m['bound_tok_s']:.0f} tok/s; {100 * m['step_tok_s'] / m['bound_tok_s']:.0f}% of it"
        )


if __name__ == "__main__":
    main()
