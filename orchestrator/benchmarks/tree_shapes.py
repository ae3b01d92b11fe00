"""Draft tree shapes side by side, in process: the `SpecEngine` (whole trees, every round drafted) at concurrency 1
on MT-Bench first turns, each request its own answer length as in the serving benchmark, the shapes in alternating
order over `--passes`, so the machine's drift falls on all of them. `off` is target-only decoding; `--batch B` serves
the prompts B at a time, as B users would (the next prompt takes the place of an answer that ended).

    python -m orchestrator.benchmarks.tree_shapes --drafter drafters/smollm2-135m-broad-eagle3.1 \
        --dtype bfloat16 --shapes 4/2/8 3/3/7 2/3/5 off

prints one line per shape and pass (DEPTH/TOPK/BUDGET): ms per generated token and user, tau, draft and verify
compute per round, and the share of drafts accepted to each depth; then each shape's mean ms per token. What a
shape costs served adds the actor calls to every round (~8 ms here, docs/benchmarks.md), which favours shapes that
accept more per round; `jobs.benchmark_serving` with `app_overrides=[spec.depth=..]` measures that.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from orchestrator.errors import AerieError, exit_status

OFF = (0, 0, 0)  # target-only decoding


def parse_shape(text: str) -> tuple[int, int, int]:
    """'DEPTH/TOPK/BUDGET' -> (depth, topk, budget), checked as the server's `spec` is; 'off': `OFF`."""
    from pydantic import ValidationError

    from orchestrator.spec.proposer import SpecConfig

    if text == "off":
        return OFF
    try:
        depth, topk, budget = (int(x) for x in text.split("/"))
        SpecConfig(method="tree", depth=depth, topk=topk, budget=budget)
    except (ValueError, ValidationError) as err:
        why = (
            err.errors()[0]["msg"] if isinstance(err, ValidationError) else "give DEPTH/TOPK/BUDGET (e.g. 2/3/5) or off"
        )
        raise AerieError(f"shape {text!r}: {why}") from None
    return depth, topk, budget


def name(shape: tuple[int, int, int]) -> str:
    return "off" if shape == OFF else "/".join(map(str, shape))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--drafter", required=True)
    p.add_argument("--shapes", nargs="+", required=True, help="DEPTH/TOPK/BUDGET each")
    p.add_argument("--prompts", type=int, default=16, help="MT-Bench first turns")
    p.add_argument("--lengths", type=int, nargs=2, default=[32, 96], help="answer lengths: request i gets its own")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="prompts generated together")
    args = p.parse_args(argv)
    return exit_status(lambda: run(args))


def run(args: argparse.Namespace) -> None:
    from orchestrator.benchmarks.serving import spread_lengths
    from orchestrator.data.prompts import mtbench_first_turns, render_chat
    from orchestrator.engine import load_engine
    from orchestrator.models.tokenizer import load_tokenizer
    from orchestrator.spec.acceptance import Acceptance
    from orchestrator.spec.proposer import SpecConfig
    from orchestrator.spec.sampling import SamplingParams

    shapes = [parse_shape(s) for s in args.shapes]
    lo, hi = args.lengths
    if not 1 <= lo <= hi or min(args.prompts, args.passes, args.batch) < 1:
        raise AerieError("--lengths LO HI with 1 <= LO <= HI, and --prompts, --passes and --batch of at least 1")
    torch.set_num_threads(args.threads)
    engines = {
        s: load_engine(
            args.model,
            None if s == OFF else args.drafter,
            None if s == OFF else SpecConfig(method="tree", depth=s[0], topk=s[1], budget=s[2]),
            max_batch=args.batch,
            dtype=args.dtype,
        )
        for s in shapes
    }
    tokenizer = load_tokenizer(args.model)
    prompts = [render_chat(tokenizer, r["messages"]) for r in mtbench_first_turns(args.prompts)]
    lengths = spread_lengths(lo, hi, len(prompts))  # as jobs.benchmark_serving's
    for engine in engines.values():  # warm-up, unmeasured
        engine.generate([prompts[0]], SamplingParams(max_tokens=8, ignore_eos=True))
    ms: dict[tuple[int, int, int], list[float]] = {s: [] for s in shapes}
    for n in range(args.passes):
        for shape in shapes if n % 2 == 0 else shapes[::-1]:
            engine, acceptance, tokens = engines[shape], Acceptance(), 0
            began = time.perf_counter()
            # up to `batch` at a time: the next prompt takes the place of an answer that ended
            for out in engine.generate(prompts, [SamplingParams(max_tokens=k, ignore_eos=True) for k in lengths]):
                acceptance, tokens = acceptance + out.acceptance, tokens + len(out.token_ids)
            totals = {k: engine.last_stats.get(k, 0) for k in ("rounds", "draft_compute_s", "verify_compute_s")}
            per_user = tokens / min(args.batch, len(prompts))  # up to `batch` users decode side by side
            ms[shape].append(1e3 * (time.perf_counter() - began) / max(1, per_user))
            rounds, drafts = max(1, totals["rounds"]), max(1, acceptance.drafts)
            per_depth = " / ".join(f"{a / drafts:.3f}" for a in acceptance.accepted_per_pos)
            print(
                f"{name(shape)} pass {n}: {ms[shape][-1]:.1f} ms per token, tau "
                f"{acceptance.acceptance_length:.3f}, draft {1e3 * totals['draft_compute_s'] / rounds:.1f} ms, "
                f"verify {1e3 * totals['verify_compute_s'] / rounds:.1f} ms per round, accepted to depth "
                f"{per_depth}",
                flush=True,
            )
    for shape, values in ms.items():
        print(f"{name(shape)}: {statistics.mean(values):.1f} ms per token over {len(values)} passes")


if __name__ == "__main__":
    raise SystemExit(main())
