"""A scheduler over the fake workers, and the invariants every run must keep (used by the invariant tests and
the randomized schedules)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from orchestrator.runtime.scheduler import MAX_BACKLOG, Event, Request, SchedulerConfig, SpecScheduler
from orchestrator.runtime.workers import DraftWorker, TargetWorker
from tests.runtime.fakes import FakeClock, FaultyWorker, TableModel, TableProposer


@dataclass
class Harness:
    scheduler: SpecScheduler
    target: FaultyWorker
    draft: FaultyWorker | None
    clock: FakeClock
    seen: dict[str, list[Event]] = field(default_factory=dict)  # events each client read
    ended_at: dict[str, float] = field(default_factory=dict)  # the clock when a client read its last event


def build(
    max_batch: int = 4,
    micro_batches: int = 2,
    adaptive: bool = False,
    max_nodes: int = 4,
    speculation: bool = True,
    target_plan=None,
    draft_plan=None,
    rng: random.Random | None = None,
    eos: tuple[int, ...] = (),
    context: int = 64,
    draft_context: int | None = None,
    request_timeout_s: float = 1e9,
    tick_s: float = 0.0,
    depth: int = 3,
    width: int = 2,
    tap=None,
    stream_states: bool = False,
    chain_drafts: bool = True,
) -> Harness:
    clock = FakeClock()

    def tick():
        clock.now += tick_s * (rng.random() if rng else 1.0)

    model = TableModel(context)
    target = FaultyWorker(lambda: TargetWorker(model, eos, max_batch, tap=tap), target_plan, rng, tick)
    draft = None
    if speculation:
        seed = rng.randrange(1 << 30) if rng else 0

        def make_draft():
            return DraftWorker(TableProposer(depth, width, seed, max_batch, draft_context), max_batch)

        draft = FaultyWorker(make_draft, draft_plan, rng, tick)
    cfg = SchedulerConfig(
        max_batch=max_batch,
        budget_tokens=4 * max_batch,
        micro_batches=micro_batches,
        adaptive=adaptive,
        request_timeout_s=request_timeout_s,
        stream_states=stream_states,
        chain_drafts=chain_drafts,
    )
    scheduler = SpecScheduler(target, draft, cfg, max_nodes, clock=clock, watchdog_s=None, poll_s=0)
    return Harness(scheduler, target, draft, clock)


async def read(h: Harness, r: Request, abort_after: int | None = None) -> list[Event]:
    """A client: reads the request's events (aborting after `abort_after` token events, as one that leaves)."""
    events = h.seen.setdefault(r.id, [])
    if abort_after == 0:
        h.scheduler.abort(r.id)
        return events
    async for event in h.scheduler.events(r):
        events.append(event)
        h.ended_at[r.id] = h.clock.now
        if abort_after is not None and sum(1 for e in events if e.tokens) >= abort_after:
            h.scheduler.abort(r.id)
            break
    return events


def tokens_of(events: list[Event]) -> list[int]:
    return [t for e in events for t in e.tokens]


def ended_once(r: Request, read_events: list[Event]) -> Event:
    """Every request ends exactly once: its tokens, then one terminal event, nothing after it. Returns the
    terminal event (what the client read plus what is left in its queue)."""
    events = list(read_events)
    while not r.queue.empty():
        events.append(r.queue.get_nowait())
    terminal = [i for i, e in enumerate(events) if e.finish_reason or e.error]
    assert terminal == [len(events) - 1], f"{r.id}: events {events}"
    assert r.ended
    return events[-1]


def assert_settled(h: Harness) -> None:
    """Nothing is left anywhere once every request has ended: no request in the scheduler, every KV slot of
    both workers free, no drafting state."""
    s = h.scheduler
    assert not s.requests and not s.waiting and all(not g.requests for g in s.groups)
    assert all(len(g.backlog) <= MAX_BACKLOG for g in s.groups)
    target = h.target.worker
    assert not target.seqs and target.cache.free_slots == target.max_batch
    if h.draft is not None:
        draft = h.draft.worker
        assert not draft.generators and not draft.seen and not draft.retired and not draft.proposer.seqs
        assert draft.free_slots == draft.max_requests


def run(h: Harness, body, timeout_s: float = 60.0):
    """Run `body(h)` with the scheduler's loops (still alive after it: a loop that died would strand requests),
    then stop them."""

    async def main():
        h.scheduler.start()
        try:
            out = await asyncio.wait_for(body(h), timeout_s)
            assert h.scheduler.running, "a scheduler loop ended"
            return out
        finally:
            await h.scheduler.close()

    return asyncio.run(main())
