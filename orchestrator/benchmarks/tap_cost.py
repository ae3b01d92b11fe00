"""What the traffic tap costs the serving target worker itself, without a deployment around it.

    python -m orchestrator.benchmarks.tap_cost --actors --batch 4 --repeats 8

Two `TargetWorker`s of the same model, one with the tap on (a `--sample` share of requests captured, shards
written by its thread as in a server) and one without: each in a Ray actor of its own (`--actors`), as the server
runs them, or both in this process. Only the first shows what the tap costs its whole process: in one process both
workers pay it (the writer's OpenMP team slowed the forward 29% that way, unseen in one process: docs/benchmarks.md).
Each block prefills `--batch` requests and decodes them to their end (each finished request is offered to the
tap); blocks alternate ABBA, and the ratio of block times, tap on / off, comes with a bootstrap interval over the
pairs. The serving benchmark
(`configs/smollm2-135m/benchmark_serving-tap.yaml`) measures the same through two deployments, which differ by
more than the tap: this separates the two.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from orchestrator.console import bar
from orchestrator.errors import AerieError


def block_seconds(worker, batch: int, max_tokens: int, tag: str) -> float:
    """Prefill `batch` requests and decode them to their end (greedy, EOS ignored); wall seconds."""
    from orchestrator.runtime.messages import NewSequence
    from orchestrator.spec.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    began = time.perf_counter()
    prompts = [[3 + (7 * j) % 90 for j in range(40 + 3 * i)] for i in range(batch)]  # any vocabulary of 100 or more
    worker.prefill([NewSequence(r, p, params, capture=True) for r, p in zip(ids, prompts, strict=True)])
    while live := [r for r in ids if r in worker.seqs]:
        worker.verify({r: [] for r in live}, None)
    return time.perf_counter() - began


class Arm:
    """One target worker and the blocks it runs (a Ray actor with `--actors`)."""

    def __init__(self, model: str, batch: int, threads: int, tap=None) -> None:
        from orchestrator.runtime.workers import TargetWorker

        self.worker = TargetWorker(model, [], max_batch=batch, torch_threads=threads, tap=tap)

    def block(self, batch: int, max_tokens: int, tag: str) -> float:
        return block_seconds(self.worker, batch, max_tokens, tag)

    def close(self) -> dict | None:
        return self.worker.close_tap()


def measure(
    model: str, batch: int, repeats: int, max_tokens: int, threads: int, output: str, sample=1.0, actors=False
) -> dict:
    from orchestrator.data.traffic import TapConfig
    from orchestrator.stats import paired_ratio

    tap = TapConfig(enabled=True, output=output, sample=sample, flush_s=5.0)
    if actors:
        import ray

        ray.init(num_cpus=threads, include_dashboard=False, log_to_driver=False)
        remote = ray.remote(num_cpus=0)(Arm)
        arms = {"on": remote.remote(model, batch, threads, tap), "off": remote.remote(model, batch, threads)}

        def run(arm: str, tag: str) -> float:
            return ray.get(arms[arm].block.remote(batch, max_tokens, tag))

        def close() -> dict:
            return ray.get(arms["on"].close.remote())
    else:
        torch.set_num_threads(threads)
        arms = {"on": Arm(model, batch, threads, tap), "off": Arm(model, batch, threads)}

        def run(arm: str, tag: str) -> float:
            return arms[arm].block(batch, max_tokens, tag)

        def close() -> dict:
            return arms["on"].close()

    run("on", "warm-on")
    run("off", "warm-off")
    times: dict[str, list[float]] = {"on": [], "off": []}
    for r in bar(iterable=range(repeats), desc="tap on / off", unit="pair"):
        for arm in ("on", "off") if r % 2 == 0 else ("off", "on"):
            times[arm].append(run(arm, f"{arm}-{r}"))
    stats = close()
    expected = round(batch * (repeats + 1) * sample)
    if sample == 1.0 and stats["written_requests"] < expected:  # a benchmark of nothing (prompts refused, tap failing)
        raise AerieError(f"the tap wrote {stats['written_requests']} of {expected} requests: {stats}")
    return {
        "batch": batch,
        "repeats": repeats,
        "sample": sample,
        "actors": actors,
        "block_s": {arm: sum(t) / len(t) for arm, t in times.items()},
        "tap_on_over_off": paired_ratio(times["on"], times["off"]),
        "tap": stats,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m orchestrator.benchmarks.tap_cost", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=4, help="requests per block")
    p.add_argument("--repeats", type=int, default=8, help="pairs of blocks (ABBA)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sample", type=float, default=1.0, help="share of requests the tap keeps (0: its thread only)")
    p.add_argument("--actors", action="store_true", help="each worker in a Ray actor of its own, as served")
    args = p.parse_args(argv)
    if args.repeats < 2:
        p.error("--repeats must be at least 2: the interval is over pairs of blocks")
    with tempfile.TemporaryDirectory() as out:
        result = measure(
            args.model, args.batch, args.repeats, args.max_tokens, args.threads, out, args.sample, args.actors
        )
    r = result["tap_on_over_off"]
    print(json.dumps(result, indent=1))
    print(f"tap on / off, block time at batch {args.batch}: {r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}]")


if __name__ == "__main__":
    main()
