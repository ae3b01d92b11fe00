"""A simulated serving run: the project's own `SpecScheduler` (its `BudgetPolicy` and `ModeChooser`) over
simulated workers on a virtual clock, fed by clients that behave like `jobs.benchmark_serving`'s (closed loop at
N users) or arrive as a Poisson process. Thousands of requests take seconds; no Ray, no sleeping.

    result = simulate(SimConfig(...))   # per-user tok/s as the benchmark measures it, tau, the invariants held

Every run checks what the randomized schedules check (tests/runtime): each request ends exactly once (its
tokens, then one finish), and nothing is left anywhere afterwards (no request in the scheduler, every slot of
both workers free, every backlog within bounds). A run that would hang raises `Stalled`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from typing import Literal

from pydantic import Field, model_validator

from orchestrator.config import StrictModel
from orchestrator.runtime.scheduler import MAX_BACKLOG, SchedulerConfig, SpecScheduler
from orchestrator.sim.costs import AcceptanceProfile, CostModel
from orchestrator.sim.virtual import VirtualClock, run_virtual
from orchestrator.sim.workers import Device, SimDraft, SimTarget
from orchestrator.spec.proposer import SpecConfig
from orchestrator.spec.sampling import SamplingParams


class Workload(StrictModel):
    """Who sends what."""

    users: int | None = Field(None, ge=1, description="closed loop: this many users, each sends its next at once")
    rate_per_s: float | None = Field(None, gt=0, description="open loop: Poisson arrivals at this rate")
    requests: int = Field(100, ge=1, description="requests measured")
    warmup: int = Field(0, ge=0, description="requests sent first and not measured (as the benchmark's warm-up)")
    prompt_tokens: list[int] = Field([128], min_length=1, description="prompt lengths, drawn uniformly")
    max_tokens: int = Field(64, ge=1)
    answer_tokens: list[int] | None = Field(
        None, description="where EOS falls, drawn uniformly (None: never, as the benchmark's ignore_eos)"
    )
    seed: int = 0

    @model_validator(mode="after")
    def _one_arrival_process(self) -> Workload:
        if (self.users is None) == (self.rate_per_s is None):
            raise ValueError("a workload has exactly one of `users` (closed loop) or `rate_per_s` (Poisson)")
        return self


class SimConfig(StrictModel):
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    spec: SpecConfig = Field(default_factory=SpecConfig)
    speculation: bool = True
    costs: CostModel
    acceptance: AcceptanceProfile
    workload: Workload
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="colocated: drafter and target on one device (vLLM's EAGLE)"
    )


def simulate(cfg: SimConfig, keep_trace: bool = False) -> dict:
    """Run the workload to its end: what the benchmark measures, and how the scheduler got there (`keep_trace`:
    also its totals and its worker calls, as the server's /stats?trace=true gives them)."""
    clock = VirtualClock()
    costs = cfg.costs.model_copy(update={"colocated": cfg.mode == "colocated" or cfg.costs.colocated})
    target_device = Device()
    draft_device = target_device if costs.colocated else Device()
    shape = cfg.spec.shape()
    target = SimTarget(clock, costs, target_device, cfg.acceptance, cfg.scheduler.max_batch, cfg.workload.seed)
    draft = None
    if cfg.speculation:
        draft = SimDraft(clock, costs, draft_device, cfg.acceptance, shape, cfg.scheduler.max_batch)
    scheduler = SpecScheduler(
        target,
        draft,
        cfg.scheduler,
        shape[2],
        clock=clock,
        watchdog_s=None,
        poll_s=0,
        trace_size=10**6 if keep_trace else 0,
    )
    began = time.perf_counter()
    chooser = logging.getLogger("orchestrator.runtime.policies")  # a simulated switch of mode is no server's news
    level = chooser.level
    chooser.setLevel(logging.WARNING)
    try:
        records = run_virtual(_drive(scheduler, target, cfg.workload, clock), clock)
    finally:
        chooser.setLevel(level)
    wall = time.perf_counter() - began
    _check_settled(scheduler, target, draft)
    out = _summary(records, scheduler, clock.now, wall, target_device, draft_device if draft else None)
    if keep_trace:
        out |= {"totals": dict(scheduler.meter.totals), "trace": list(scheduler.trace)}
    return out


async def _drive(scheduler: SpecScheduler, target: SimTarget, w: Workload, clock: VirtualClock) -> list[dict]:
    rng = random.Random(w.seed)
    records: list[dict] = []
    params = SamplingParams(max_tokens=w.max_tokens, ignore_eos=w.answer_tokens is None)

    async def one(measured: bool = True) -> None:
        prompt = [1] * rng.choice(w.prompt_tokens)
        sent = clock.now
        r = scheduler.submit(prompt, params)
        target.answers[r.id] = rng.choice(w.answer_tokens) if w.answer_tokens else w.max_tokens
        stamps, tokens, ends = [], 0, []
        async for event in scheduler.events(r):
            if event.tokens:
                stamps.append(clock.now)
                tokens += len(event.tokens)
            if event.finish_reason or event.error:
                ends.append(event)
        while not r.queue.empty():  # nothing may follow the end
            ends.append(r.queue.get_nowait())
        if len(ends) != 1 or not r.ended:
            raise AssertionError(f"request {r.id} ended {len(ends)} times")
        if measured:
            records.append({"sent": sent, "stamps": stamps, "tokens": tokens, "error": ends[0].error})

    scheduler.start()
    try:
        if w.warmup:  # as the benchmark warms up: the level's users, then the measured requests
            warm = iter(range(w.warmup))

            async def warm_user() -> None:
                for _ in warm:
                    await one(measured=False)

            await asyncio.gather(*(warm_user() for _ in range(w.users or 1)))
        if w.users is not None:
            left = iter(range(w.requests))

            async def user() -> None:
                for _ in left:
                    await one()

            await asyncio.gather(*(user() for _ in range(w.users)))
        else:
            tasks = []
            for _ in range(w.requests):
                tasks.append(asyncio.create_task(one()))
                await asyncio.sleep(rng.expovariate(w.rate_per_s))
            await asyncio.gather(*tasks)
    finally:
        await scheduler.close()
    return records


def _check_settled(scheduler: SpecScheduler, target: SimTarget, draft: SimDraft | None) -> None:
    """Nothing is left anywhere once every request has ended (tests/runtime/harness.assert_settled's checks)."""
    problems = []
    if scheduler.requests or scheduler.waiting or any(g.requests for g in scheduler.groups):
        problems.append("requests left in the scheduler")
    if any(len(g.backlog) > MAX_BACKLOG for g in scheduler.groups):
        problems.append("a backlog past MAX_BACKLOG")
    if target.seqs:
        problems.append(f"{len(target.seqs)} target slots still held")
    if draft is not None and draft.seen:
        problems.append(f"{len(draft.seen)} draft slots still held")
    if problems:
        raise AssertionError("simulation did not settle: " + "; ".join(problems))


def _summary(records, scheduler: SpecScheduler, sim_s: float, wall_s: float, target: Device, draft) -> dict:
    ok = [r for r in records if r["error"] is None and r["stamps"]]
    per_request = [r["tokens"] / (r["stamps"][-1] - r["sent"]) for r in ok]
    ttft = sorted(r["stamps"][0] - r["sent"] for r in ok)
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    totals = scheduler.meter.totals
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "per_user_tok_s": statistics.mean(per_request) if per_request else 0.0,
        "total_tok_s": sum(r["tokens"] for r in ok) / sim_s if sim_s else 0.0,
        "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None,
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))] if ttft else None,
        "tpot_mean_s": statistics.mean(tpot) if tpot else None,
        "tau": scheduler.meter.acceptance.acceptance_length,
        "drafted_share": totals["spec_rounds"] / max(1, totals["rounds"]),
        "rounds": int(totals["rounds"]),
        "mean_batch": totals["batch"] / max(1, totals["rounds"]),
        "target_busy": target.busy_s / sim_s if sim_s else 0.0,
        "draft_busy": (draft.busy_s / sim_s if sim_s else 0.0) if draft is not None else None,
        "simulated_s": sim_s,
        "wall_s": wall_s,
    }
