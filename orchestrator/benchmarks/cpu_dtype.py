"""The target's step on this CPU in float32 and bfloat16: a decode step (1 token) and verify steps (a causal block
of k tokens) after a prompt of `--context` tokens, both dtypes in one process, interleaved in a shuffled order and
repeated, so the machine's drift falls on both alike. `--sequences N`: a batch of N such sequences, each stepping
k tokens at once (4 users verifying 6-node trees: `--sequences 4 --tokens 1 6`).

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


def step_ms(model: TargetModel, cache, slots: list[int], k: int) -> float:
    """One forward of k new tokens in each sequence of `slots` (k = 1: a decode step; else a causal block, as a
    chain is verified), then the cache back to where it was."""
    starts = [int(cache.lengths[s]) for s in slots]
    tokens = torch.randint(0, model.vocab_size, (k * len(slots),))
    block = torch.ones(k, k, dtype=torch.bool).tril().repeat(len(slots), 1, 1) if k > 1 else None
    positions = torch.cat([torch.arange(s, s + k) for s in starts]) if k > 1 else None
    num = torch.full((len(slots),), k)
    began = time.perf_counter()
    model(tokens, cache, torch.tensor(slots), num, positions=positions, block_mask=block)
    took = time.perf_counter() - began
    for slot, start in zip(slots, starts, strict=True):
        cache.truncate(slot, start)
    return 1e3 * took


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=300, help="prompt tokens before the timed steps")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 5, 9], help="tokens per timed step")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--sequences", type=int, default=1, help="sequences stepped together (a batch of users)")
    args = p.parse_args(argv)
    if min(args.sequences, args.context, args.repeats, *args.tokens) < 1:
        p.error("--sequences, --context, --repeats and --tokens take positive numbers")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    prompt = torch.randint(0, read_hf_config(args.model)["vocab_size"], (args.context,))
    runs = {}
    for dtype in ("float32", "bfloat16"):
        model = TargetModel.from_pretrained(args.model, dtype=dtype, device="cpu")
        cache = model.new_cache(args.sequences, args.context + max(args.tokens) + 1)
        slots = [cache.allocate() for _ in range(args.sequences)]
        for slot in slots:
            model(prompt, cache, torch.tensor([slot]), torch.tensor([args.context]), logits="last")
        runs[dtype] = (model, cache, slots)
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
