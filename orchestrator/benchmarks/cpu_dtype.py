"""The target's step on this CPU in float32 and bfloat16: a decode step (1 token) and verify steps (a causal block
of k tokens) after a prompt of `--context` tokens, both dtypes in one process, interleaved in a shuffled order and
repeated, so the machine's drift falls on both alike.

    python -m orchestrator.benchmarks.cpu_dtype --model models/smollm2-135m-instruct --threads 2

prints one line per (dtype, tokens): median ms and the interquartile range, and each dtype's verify cost beyond its
decode step. bfloat16 runs the row-exact products and attention of `models.layers` (greedy speculation equals
target-only decoding; tests/engine/test_spec_engine.py).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from orchestrator.models.target import TargetModel, read_hf_config


def step_ms(model: TargetModel, cache, slot: int, k: int) -> float:
    """One forward of k new tokens (k = 1: a decode step; else a causal block, as a chain is verified), then the
    cache back to where it was."""
    start = int(cache.lengths[slot])
    tokens = torch.randint(0, model.vocab_size, (k,))
    block = torch.ones(k, k, dtype=torch.bool).tril()[None] if k > 1 else None
    positions = torch.arange(start, start + k) if k > 1 else None
    began = time.perf_counter()
    model(tokens, cache, torch.tensor([slot]), torch.tensor([k]), positions=positions, block_mask=block)
    took = time.perf_counter() - began
    cache.truncate(slot, start)
    return 1e3 * took


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=300, help="prompt tokens before the timed steps")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 5, 9], help="tokens per timed step")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    prompt = torch.randint(0, read_hf_config(args.model)["vocab_size"], (args.context,))
    runs = {}
    for dtype in ("float32", "bfloat16"):
        model = TargetModel.from_pretrained(args.model, dtype=dtype, device="cpu")
        cache = model.new_cache(1, args.context + max(args.tokens) + 1)
        slot = cache.allocate()
        model(prompt, cache, torch.tensor([slot]), torch.tensor([args.context]), logits="last")
        runs[dtype] = (model, cache, slot)
    times: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.repeats):
        order = [(d, k) for d in runs for k in args.tokens]
        random.Random(rep).shuffle(order)
        for dtype, k in order:
            times.setdefault((dtype, k), []).append(step_ms(*runs[dtype], k))
    for (dtype, k), ms in sorted(times.items()):
        ms.sort()
        med = statistics.median(ms)
        extra = med - statistics.median(times[(dtype, args.tokens[0])])
        print(
            f"{dtype:8s} {k} tokens: {med:5.1f} ms [{ms[len(ms) // 4]:.1f}, {ms[3 * len(ms) // 4]:.1f}]"
            + (f", +{extra:.1f} ms over {args.tokens[0]}" if k != args.tokens[0] else "")
        )


if __name__ == "__main__":
    main()
