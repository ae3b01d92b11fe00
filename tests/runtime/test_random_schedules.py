"""Randomized schedules against the fake workers: 500 seeded runs, each a random mix of batch sizes, one or
two micro-batches, fixed or adaptive budgets, speculation on or off, draft calls chained to verify calls or
not, a drafter with a short context, clients
that submit at random moments and read, abort, disconnect, stop on a string or outlive their deadline,
requests that fail in the worker (NaN distribution, prompt past the context), and worker faults at random
call sites (death, silent restart, a raising call, a call whose answer never comes), and a rollout's measurement
window (whole trees drafted and verified on a share of the rounds) that opens and closes at random moments.
Each run checks every invariant: every request ends exactly once; a greedy or seeded request that finishes has
exactly the reference output and any other has a prefix of it; a request fails only for its own fault, a worker
fault or its deadline; measurement rounds count apart and never more than their share; and afterwards nothing
is held anywhere. A failing seed reproduces on its own."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import pytest
import torch

from orchestrator.runtime.detok import TextStream
from orchestrator.spec.sampling import SamplingParams
from tests.runtime.fakes import POISON, VOCAB, CharTokenizer, reference
from tests.runtime.harness import assert_settled, build, ended_once, read, run, tokens_of

SCHEDULES = 500
CONTEXT = 48


@dataclass
class Client:
    prompt: list[int]
    params: SamplingParams
    behaviour: str  # read | abort | disconnect | stop | poison | long
    delay: int  # event-loop turns before submitting
    abort_after: int = 1
    stop: str = ""


def _client(rng: random.Random, eos: tuple[int, ...]) -> Client:
    behaviour = rng.choice(["read"] * 6 + ["abort", "disconnect", "stop", "poison", "long"])
    prompt = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 8))]
    if behaviour == "poison":
        prompt.append(POISON)
    if behaviour == "long":
        prompt = prompt + [1] * CONTEXT
    kind = rng.choice(["greedy", "greedy", "seeded", "sampled"])
    params = SamplingParams(
        max_tokens=rng.randint(1, 14),
        temperature=0.0 if kind == "greedy" else rng.choice([0.7, 1.0, 1.3]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 5]),
        seed=rng.randrange(1 << 40) if kind == "seeded" else None,
        ignore_eos=rng.random() < 0.5,
    )
    stop = ""
    if behaviour == "stop":
        stop = CharTokenizer().decode([rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 2))])
        params = params.model_copy(update={"stop": (stop,)})
    return Client(prompt, params, behaviour, rng.randrange(8), rng.randint(0, 3), stop)


def _expected(c: Client, eos: tuple[int, ...]) -> list[int] | None:
    """The exact output of a greedy or seeded client that finishes (None: sampled without a seed)."""
    if c.params.seed is None and not c.params.greedy:
        return None
    out = reference(c.prompt, c.params, frozenset(eos))
    if c.stop:
        text = TextStream(CharTokenizer(), (c.stop,))
        text.add(out)
        out = text.ids
    return out


def run_schedule(seed: int) -> dict:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    max_batch = rng.choice([1, 2, 3, 4, 6])
    fault_rate = rng.choice([0.0, 0.0, 0.02, 0.08])
    timeout_s = rng.choice([1e9, 1e9, 0.5])
    eos = (rng.randrange(VOCAB - 1),) if rng.random() < 0.5 else ()

    def plan(method: str):
        if rng.random() >= fault_rate:
            return None
        return "raise" if method == "ready" else rng.choice(["die", "restart", "raise", "late"])

    h = build(
        max_batch=max_batch,
        micro_batches=rng.choice([1, 2]),
        adaptive=rng.random() < 0.3,
        max_nodes=rng.choice([1, 3, 6]),
        speculation=rng.random() < 0.85,
        target_plan=plan,
        draft_plan=plan,
        rng=rng,
        eos=eos,
        context=CONTEXT,
        draft_context=rng.choice([None, None, 20]),
        stream_states=rng.random() < 0.3,
        chain_drafts=rng.random() < 0.7,
        request_timeout_s=timeout_s,
        tick_s=0.05,
        depth=rng.choice([1, 2, 4]),
        width=rng.choice([1, 2, 3]),
    )
    clients = [_client(rng, eos) for _ in range(rng.randint(1, 4 * max_batch + 2))]
    texts: dict[int, TextStream] = {}
    window = _window(seed)

    async def one(i: int, c: Client):
        for _ in range(c.delay):
            await asyncio.sleep(0)
        r = h.scheduler.submit(c.prompt, c.params)
        if c.behaviour == "stop":
            texts[i] = TextStream(CharTokenizer(), (c.stop,))
            seen = h.seen.setdefault(r.id, [])
            async for _delta, _reason, error in h.scheduler.text_events(r, texts[i]):
                if error is not None:
                    seen.append(error)
            return r
        abort_after = {"abort": c.abort_after or 1, "disconnect": 0}.get(c.behaviour)
        await read(h, r, abort_after)
        return r

    opened: list = []  # the Measuring of the window, once open

    async def measure():  # a rollout's window: opens after some turns, lasts a random span of the virtual clock
        share, opens, lasts, closes, every = window
        for _ in range(opens):
            await asyncio.sleep(0)
        h.scheduler.measure(share, lasts)
        opened.append(h.scheduler.measuring)
        for turn in range(1, max(closes, 20) + 1):
            await asyncio.sleep(0)
            if turn == closes:  # the window is closed early (a rollout that ends or is interrupted)
                h.scheduler.measure(0, 0)
                return
            if every and turn % every == 0:  # said again, as a rollout does at every poll: an open window goes on
                h.scheduler.measure(share, lasts)
                if h.scheduler.measuring is not opened[-1]:  # (it had ended: a new one)
                    opened.append(h.scheduler.measuring)

    async def body(h):
        return await asyncio.gather(*[one(i, c) for i, c in enumerate(clients)], *([measure()] if window else []))

    requests = run(h, body)[: len(clients)]
    faults = fault_rate > 0 or timeout_s < 1e6
    for i, (c, r) in enumerate(zip(clients, requests, strict=True)):
        if c.behaviour == "stop":  # read through text_events: a stop string ends it here, with an abort left
            rest = [r.queue.get_nowait() for _ in range(r.queue.qsize())]
            assert r.ended and len(rest) <= 1 and not any(e.tokens for e in rest), f"seed {seed}: client {i}"
            failed, got = bool(h.seen[r.id]), texts[i].ids
        else:
            last = ended_once(r, h.seen[r.id])
            failed, got = bool(last.error), tokens_of(h.seen[r.id])
            if last.finish_reason in ("stop", "length"):  # deadlines hold (a round of slack: ~3 calls of 0.05 s)
                assert h.ended_at[r.id] <= r.deadline + 1.0, f"seed {seed}: client {i} outlived its deadline"
        if c.behaviour in ("poison", "long"):
            assert failed, f"seed {seed}: client {i} ({c.behaviour}) was served"
            continue
        assert not failed or faults, f"seed {seed}: client {i} failed without a fault: {h.seen[r.id][-1]}"
        want = _expected(c, eos)
        if want is not None and not failed and c.behaviour in ("read", "stop"):
            assert got == want, f"seed {seed}: client {i}: {got} != {want}"
        elif want is not None:
            assert got == want[: len(got)], f"seed {seed}: client {i}: {got} is not a prefix of {want}"
        assert all(0 <= t < VOCAB - 1 for t in got)
    meter = h.scheduler.meter
    measured, acceptance = meter.measured, meter.acceptance
    assert measured.drafts <= acceptance.drafts and measured.accepted <= acceptance.accepted, f"seed {seed}"
    assert measured.accepted <= measured.draft_tokens, f"seed {seed}"
    if not window:
        assert measured.drafts == 0, f"seed {seed}: measured without a window"
    for m in opened:  # a measurement round only while the measured share is below `share`
        assert m.measured <= m.share * m.rounds + 1, f"seed {seed}: {m}"
    assert_settled(h)
    return {"requests": len(clients), "rounds": meter.totals["rounds"], "measured": measured.drafts}


def _window(seed: int) -> tuple[float, int, float, int, int] | None:
    """A measurement window for this schedule (drawn apart, so the other draws stay those of the seed): share,
    turns before it opens, virtual seconds it lasts, turns before it is closed early (0: never), every how many
    turns it is said again (0: never), or None."""
    rng = random.Random(f"window-{seed}")
    if rng.random() < 0.5:
        return None
    window = rng.choice([0.2, 0.5, 1.0]), rng.randrange(8), rng.choice([0.05, 0.5, 1e9]), rng.choice([0, 0, 20])
    return *window, rng.choice([0, 0, 3, 7])


@pytest.mark.parametrize("block", range(5))
def test_random_schedules_keep_every_invariant(block):
    """100 schedules per block (500 in all); the time and size of each block are printed."""
    began, rounds, requests, measured = time.perf_counter(), 0, 0, 0
    for seed in range(block * SCHEDULES // 5, (block + 1) * SCHEDULES // 5):
        stats = run_schedule(seed)
        rounds += stats["rounds"]
        requests += stats["requests"]
        measured += stats["measured"]
    assert measured > 0, "no schedule of the block measured a draft: the windows test nothing"
    print(
        f"\nschedules {block * 100}..{block * 100 + 99}: {requests} requests, {rounds:.0f} rounds, "
        f"{measured} measured drafts, {time.perf_counter() - began:.1f} s"
    )
