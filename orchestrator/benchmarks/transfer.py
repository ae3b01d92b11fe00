"""Bytes per round between the target and draft workers (what crosses nodes in disaggregated serving), measured
with the in-process engine (LocalWorker clients, no Ray) on MT-Bench prompts: every message sized by
`payload_nbytes` (the scheduler's counters) and pickled (a cross-check of what Ray sends); batch 1 and 8, chain
and tree, greedy and sampling. One JSON line per run.

    python -m orchestrator.benchmarks.transfer --model DIR --drafter DIR [--max-tokens 64] [--only 8/tree/greedy]

A pair (aux hidden state + token) goes from target to draft per emitted token: 8 + k * H * itemsize bytes
(Llama-3.1-8B, 3 aux layers, bf16: 24,584 B). Trees come back: 20 B per node greedy; sampling also carries each
expanded parent's draft distribution over the vocabulary (vocab * 4 B).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import time
from collections import defaultdict

import torch

from orchestrator.data.prompts import PromptItem, encode_prompt, mtbench_first_turns
from orchestrator.engine.engine import load_engine
from orchestrator.models.tokenizer import load_tokenizer
from orchestrator.runtime.clients import LocalWorker
from orchestrator.runtime.messages import payload_nbytes
from orchestrator.runtime.scheduler import SchedulerConfig, SpecScheduler
from orchestrator.spec import SamplingParams
from orchestrator.spec.proposer import SpecConfig


class Metered(LocalWorker):
    """A LocalWorker that sizes every call's arguments and results."""

    def __init__(self, worker, log):
        super().__init__(worker)
        self.log = log

    def submit(self, method, *args, returns=1):
        done = super().submit(method, *args, returns=returns)
        if done.error is None:
            self.log.append((method, args, (done.value, *done.refs) if returns > 1 else done.value))
        return done


def measure(engine, prompts, params):
    log = []
    n = engine.target.max_batch
    cfg = SchedulerConfig(
        max_batch=n, budget_tokens=n * (1 + engine.max_nodes), micro_batches=1, adaptive=False, request_timeout_s=1e12
    )

    async def go():
        s = SpecScheduler(
            Metered(engine.target, log), Metered(engine.draft, log), cfg, engine.max_nodes, watchdog_s=None
        )
        s.start()
        try:
            rs = [s.submit(list(p), params) for p in prompts]
            for r in rs:
                async for _ in s.events(r):
                    pass
            return s.stats()
        finally:
            await s.close()

    t = time.time()
    stats = asyncio.run(go())
    took = time.time() - t
    acc = defaultdict(float)
    for method, args, out in log:
        if method == "prefill":
            acc["prefill_calls"] += 1
            acc["prefill_pairs"] += out[1].nbytes
            acc["sched_to_target"] += payload_nbytes(args[0])
            acc["target_to_sched"] += out[0].nbytes
        elif method == "verify":
            keep, trees = args
            ro, pairs = out
            acc["rounds"] += 1
            acc["trees"] += payload_nbytes(trees) if trees is not None else 0
            acc["trees_pickled"] += len(pickle.dumps(trees, protocol=5)) if trees is not None else 0
            acc["pairs"] += pairs.nbytes
            acc["pairs_pickled"] += len(pickle.dumps(pairs, protocol=5))
            acc["pair_count"] += pairs.tokens.numel()
            acc["accepted"] += sum(u.accepted for u in ro.updates)
            acc["drafted"] += sum(u.drafted for u in ro.updates)
            acc["emitted"] += sum(len(u.tokens) for u in ro.updates)
            acc["request_rounds"] += len(ro.updates)
            acc["sched_to_target"] += payload_nbytes(keep)
            acc["target_to_sched"] += ro.nbytes
        elif method == "propose":
            requests, reset, *_ = args
            acc["draft_calls"] += 1
            acc["sched_to_draft"] += payload_nbytes(requests) + payload_nbytes(list(reset))
            acc["draft_to_sched"] += out[0].nbytes
    assert stats["draft_to_target_bytes"] == acc["trees"], (stats["draft_to_target_bytes"], acc["trees"])
    r = acc["rounds"]
    return {
        "wall_s": round(took, 1),
        "rounds": int(r),
        "tau": round(1 + acc["accepted"] / max(1, acc["request_rounds"]), 3),
        "t2d_B_per_round": round(acc["pairs"] / r),
        "d2t_B_per_round": round(acc["trees"] / r),
        "t2d_pickled_per_round": round(acc["pairs_pickled"] / r),
        "d2t_pickled_per_round": round(acc["trees_pickled"] / r),
        "pairs_per_round": round(acc["pair_count"] / r, 2),
        "accepted_per_round": round(acc["accepted"] / r, 2),
        "emitted_per_round": round(acc["emitted"] / r, 2),
        "B_per_accepted_token": round((acc["pairs"] + acc["trees"]) / max(1, acc["accepted"])),
        "B_per_emitted_token": round((acc["pairs"] + acc["trees"]) / acc["emitted"]),
        "prefill_pairs_B": int(acc["prefill_pairs"]),
        "sched_msgs_B_per_round": round(
            (acc["sched_to_target"] + acc["target_to_sched"] + acc["sched_to_draft"] + acc["draft_to_sched"]) / r
        ),
        "stats_t2d_total": stats["target_to_draft_bytes"],
        "stats_per_round": {k: round(v) for k, v in stats["transfer_bytes_per_round"].items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="bytes per round between the target and draft workers")
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--drafter", default="models/drafters/smollm2-chitchat-eagle3.1")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=[], help="runs as batch/shape/mode, e.g. 8/tree/greedy")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(a.model)
    prompts = [encode_prompt(tok, PromptItem(0, messages=r["messages"])) for r in mtbench_first_turns(8)]
    shapes = {"chain": SpecConfig(method="chain", num_spec_tokens=3), "tree": SpecConfig(method="tree")}
    for batch in (1, 8):
        for shape, spec in shapes.items():
            if a.only and not any(o.startswith(f"{batch}/{shape}/") for o in a.only):
                continue
            engine = load_engine(a.model, a.drafter, spec, max_batch=batch, tokenizer=tok)
            for mode, params in (
                ("greedy", SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)),
                ("sampling", SamplingParams(max_tokens=a.max_tokens, temperature=0.7, seed=1, ignore_eos=True)),
            ):
                if a.only and f"{batch}/{shape}/{mode}" not in a.only:
                    continue
                ps = prompts[:2] if batch == 1 else prompts[:8]
                row = {"batch": batch, "shape": shape, "mode": mode} | measure(engine, ps, params)
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
