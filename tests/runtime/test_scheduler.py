"""The scheduler's invariants, each a fast deterministic test over the real workers (fake models, no Ray):
every request ends exactly once; ending one never fails another; no KV slot leaks; what the scheduler holds
stays bounded; every loop iteration awaits; a worker failing at any call site harms only what it must."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest

from orchestrator.runtime.scheduler import MAX_BACKLOG
from orchestrator.spec.sampling import SamplingParams
from tests.runtime.fakes import POISON, CharTokenizer, reference
from tests.runtime.harness import assert_settled, build, ended_once, read, run, tokens_of

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    return [[(3 * i + k) % 20 for k in range(1 + i % 5)] for i in range(n)]


async def _all(h, prompts, params=GREEDY, abort_after=None):
    rs = [h.scheduler.submit(p, params) for p in prompts]
    await asyncio.gather(*[read(h, r, abort_after) for r in rs])
    return rs


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("adaptive", [False, True])
def test_a_burst_of_four_times_max_batch_is_served_exactly(micro_batches, adaptive):
    h = build(max_batch=4, micro_batches=micro_batches, adaptive=adaptive)
    prompts = _prompts(16)
    rs = run(h, lambda h: _all(h, prompts))
    for r, p in zip(rs, prompts, strict=True):
        assert ended_once(r, h.seen[r.id]).finish_reason == "length"
        assert tokens_of(h.seen[r.id]) == reference(p, GREEDY)
    assert h.scheduler.meter.acceptance.accepted > 0  # the drafts were partly right
    assert_settled(h)


def test_max_batch_one_with_two_requests_and_two_micro_batches_never_spins():
    """One micro-batch holds the only slot while a request waits: the other group's loop must wait, not spin
    (a loop that never awaits would freeze the event loop: the thread would not finish)."""
    h = build(max_batch=1, micro_batches=2)
    prompts = _prompts(2)
    done = []
    thread = threading.Thread(target=lambda: done.append(run(h, lambda h: _all(h, prompts))), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert done, "the scheduler stopped making progress"
    for r, p in zip(done[0], prompts, strict=True):
        assert tokens_of(h.seen[r.id]) == reference(p, GREEDY)
    assert_settled(h)


def test_abort_stop_disconnect_and_timeout_of_some_never_fail_the_others():
    h = build(max_batch=3, micro_batches=2, request_timeout_s=30.0, tick_s=0.1, context=600)
    prompts = _prompts(12)
    tok = CharTokenizer()

    async def body(h):
        from orchestrator.runtime.detok import TextStream

        s = h.scheduler
        normal = [s.submit(p, GREEDY) for p in prompts[:6]]
        aborted = s.submit(prompts[6], GREEDY)
        gone = s.submit(prompts[7], GREEDY)  # the client disconnects before reading anything
        ref = reference(prompts[8], GREEDY)
        stop = tok.decode(ref[2:4])
        stopped = s.submit(prompts[8], GREEDY.model_copy(update={"stop": (stop,)}))
        slow = s.submit(prompts[9], SamplingParams(max_tokens=500, ignore_eos=True))  # outlives its deadline

        async def by_text():
            text = TextStream(tok, (stop,))
            return [x async for x in s.text_events(stopped, text)], text

        results = await asyncio.gather(
            *[read(h, r) for r in normal], read(h, aborted, 2), read(h, gone, 0), by_text(), read(h, slow)
        )
        return normal, aborted, gone, stopped, slow, ref, stop, results[-2]

    normal, aborted, gone, stopped, slow, ref, stop, (_, text) = run(h, body)
    for r, p in zip(normal, prompts[:6], strict=True):
        assert ended_once(r, h.seen[r.id]).finish_reason == "length"
        assert tokens_of(h.seen[r.id]) == reference(p, GREEDY)
    assert ended_once(aborted, h.seen[aborted.id]).finish_reason == "abort"
    assert tokens_of(h.seen[aborted.id]) == reference(prompts[6], GREEDY)[: len(tokens_of(h.seen[aborted.id]))]
    assert ended_once(gone, []).finish_reason == "abort"
    assert text.stopped and stop not in text.text and text.ids == ref[: text.ids.__len__()]
    assert tok.decode(text.ids).endswith(stop) and ended_once(stopped, []).finish_reason == "abort"
    assert ended_once(slow, h.seen[slow.id]).status == 504
    assert_settled(h)


def test_requests_that_fail_in_the_worker_fail_alone():
    """In one micro-batch: a prompt whose distribution is NaN (500), one past the context and one with a token
    outside the vocabulary (400, nothing allocated), beside normal ones that are served exactly."""
    h = build(max_batch=8, micro_batches=1, context=40)
    prompts = _prompts(5)
    bad = {"nan": [3, 4, POISON], "long": [1] * 35, "vocab": [1, 999]}

    async def body(h):
        rs = [h.scheduler.submit(p, GREEDY) for p in [*prompts, *bad.values()]]
        await asyncio.gather(*[read(h, r) for r in rs])
        return rs

    rs = run(h, body)
    for r, p in zip(rs[:5], prompts, strict=True):
        assert tokens_of(h.seen[r.id]) == reference(p, GREEDY)
    statuses = [ended_once(r, h.seen[r.id]).status for r in rs[5:]]
    assert statuses == [500, 400, 400]
    assert_settled(h)


SITES = [
    ("target", "prefill", "die"),
    ("target", "prefill", "raise"),
    ("target", "prefill", "late"),
    ("target", "prefill", "restart"),
    ("target", "verify", "die"),
    ("target", "verify", "raise"),
    ("target", "verify", "late"),
    ("target", "verify", "restart"),
    ("target", "history", "die"),
    ("target", "history", "raise"),
    ("target", "ready", "raise"),
    ("draft", "propose", "die"),
    ("draft", "propose", "raise"),
    ("draft", "propose", "late"),
    ("draft", "propose", "restart"),
    ("draft", "ready", "raise"),
]


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize(("worker", "method", "fault"), SITES, ids=["-".join(s) for s in SITES])
def test_a_failing_worker_at_every_call_site(worker, method, fault, micro_batches):
    """The fault hits the 2nd call of the method (history and ready run after a draft death, set up here); with
    one micro-batch, draft calls are chained to verify calls, so a verify fault also meets a draft call in flight.
    Draft faults cost no request anything; a target call that raises or never answers ends the requests of
    that call with 503 (a prefill is retried instead); a target that dies or restarts loses what it held
    (at most max_batch requests, 503). Everything that finishes is exact, and nothing leaks."""
    # history and ready run only after a failure: a death sets them up (on the 2nd call of another method)
    setup = {"history": ("draft", "propose"), "ready": (worker, "verify" if worker == "target" else "propose")}
    faults = {(worker, method): (fault, {1, 2} if method == "ready" else {2})}
    if method in setup:
        faults[setup[method]] = ("die", {2})
    calls: dict = {}

    def planner(side):
        def plan(m):
            if (side, m) not in faults:
                return None
            calls[side, m] = calls.get((side, m), 0) + 1
            kind, when = faults[side, m]
            return kind if calls[side, m] in when else None

        return plan

    target_plan, draft_plan = planner("target"), planner("draft")
    h = build(max_batch=4, micro_batches=micro_batches, target_plan=target_plan, draft_plan=draft_plan)
    prompts = _prompts(12)
    rs = run(h, lambda h: _all(h, prompts))
    failed = 0
    for r, p in zip(rs, prompts, strict=True):
        last = ended_once(r, h.seen[r.id])
        if last.error:
            assert worker == "target" and last.status == 503, last
            failed += 1
        else:
            assert tokens_of(h.seen[r.id]) == reference(p, GREEDY)
    assert calls.get((worker, method), 0) >= 2, "the fault was never injected"
    target_lost = any(side == "target" and kind in ("die", "restart") for (side, _), (kind, _) in faults.items())
    if not target_lost and method != "verify":
        assert failed == 0  # drafts are optional; a lost prefill is retried
    assert failed <= 4  # max_batch
    assert_settled(h)


def test_a_draft_call_that_resends_histories_gets_the_targets_bound_and_one_in_sync_the_drafters():
    """After the draft worker dies, the next propose carries whole histories (long on a CPU): it is bounded by
    worker_timeout_s, so a slow catch-up is not taken for a lost drafter again; calls in sync get the draft
    worker's own short bound (None here: the client's)."""
    proposes = itertools.count()
    h = build(
        max_batch=4, micro_batches=1, draft_plan=lambda m: "die" if m == "propose" and next(proposes) == 3 else None
    )
    run(h, lambda h: _all(h, _prompts(4)))
    bounds = [t for m, t in h.draft.timeouts if m == "propose"]
    assert bounds[0] is None and h.scheduler.cfg.worker_timeout_s in bounds[4:]
    assert bounds.count(None) > len(bounds) // 2
    assert_settled(h)


def test_a_prefill_that_never_answers_is_retried_once_then_fails():
    h = build(max_batch=2, micro_batches=1, target_plan=lambda m: "late" if m == "prefill" else None)
    rs = run(h, lambda h: _all(h, _prompts(3)))
    assert [ended_once(r, h.seen[r.id]).status for r in rs] == [503, 503, 503]
    assert h.target.calls["prefill"] <= 2 * 3
    assert_settled(h)  # the late prefills' slots were released


def test_state_stays_bounded_while_drafting_is_skipped_for_10k_rounds():
    """Target-only for 10,000 rounds (the mode chooser says so), then drafting resumes: the backlog never
    exceeds MAX_BACKLOG, the drafter catches up from the target's history, and the output stays exact."""
    h = build(max_batch=2, micro_batches=2, adaptive=True, context=12_000)
    for group in h.scheduler.groups:
        group.modes.choose = lambda n: h.scheduler.meter.totals["rounds"] >= 10_000
    params = SamplingParams(max_tokens=5_020, ignore_eos=True)
    peak = {"backlog": 0}
    observe = h.scheduler._stash

    def stash(group, pairs):
        observe(group, pairs)
        peak["backlog"] = max(peak["backlog"], len(group.backlog))

    h.scheduler._stash = stash
    prompts = [[1, 2, 3], [4, 5]]
    rs = run(h, lambda h: _all(h, prompts, params), timeout_s=240)
    for r, p in zip(rs, prompts, strict=True):
        assert tokens_of(h.seen[r.id]) == reference(p, params)
    assert peak["backlog"] == MAX_BACKLOG
    assert h.target.calls["history"] >= 2  # each group caught up once drafting resumed
    assert h.scheduler.meter.totals["spec_rounds"] > 0 and len(h.scheduler.trace) <= h.scheduler.trace.maxlen
    assert_settled(h)


def test_state_stays_bounded_while_the_drafter_is_dead_for_10k_rounds():
    rounds = lambda: h.scheduler.meter.totals["rounds"]  # noqa: E731

    def draft_plan(m):
        if m == "propose" and rounds() < 2:
            return "die"
        return "raise" if m == "ready" and rounds() < 10_000 else None

    h = build(max_batch=2, micro_batches=1, draft_plan=draft_plan, context=12_000)
    params = SamplingParams(max_tokens=10_030, ignore_eos=True)
    rs = run(h, lambda h: _all(h, [[7, 8]], params), timeout_s=240)
    assert tokens_of(h.seen[rs[0].id]) == reference([7, 8], params)
    assert not h.scheduler.groups[0].backlog or h.scheduler.draft_alive
    assert h.scheduler.meter.totals["draft_failures"] == 1 and h.scheduler.draft_alive
    assert h.scheduler.meter.totals["spec_rounds"] > 0  # drafting resumed after the history resync
    assert_settled(h)


def test_speculation_off_holds_nothing_for_a_drafter():
    h = build(max_batch=2, micro_batches=2, speculation=False)
    rs = run(h, lambda h: _all(h, _prompts(5)))
    for r, p in zip(rs, _prompts(5), strict=True):
        assert tokens_of(h.seen[r.id]) == reference(p, GREEDY)
    assert all(not g.backlog for g in h.scheduler.groups)
    assert_settled(h)


def test_a_drafter_with_a_shorter_context_stops_drafting_those_requests_without_errors():
    """Requests that outgrow the drafter's context are retired from drafting (no error, no resync each round)."""
    h = build(max_batch=2, micro_batches=1, draft_context=16)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    rs = run(h, lambda h: _all(h, [[1, 2, 3, 4], [5, 6]], params))
    for r, p in zip(rs, [[1, 2, 3, 4], [5, 6]], strict=True):
        assert tokens_of(h.seen[r.id]) == reference(p, params)
        assert not r.draftable
    assert h.scheduler.meter.totals["draft_errors"] == 0 and h.target.calls.get("history", 0) == 0
    assert h.scheduler.meter.acceptance.drafts > 0
    assert_settled(h)


def test_each_micro_batch_has_its_own_mode_chooser():
    h = build(micro_batches=2)
    a, b = (g.modes for g in h.scheduler.groups)
    assert a is not b
    a.observe(True, 1, tokens=4, seconds=1.0)
    assert not b.measured


def test_drafted_rounds_excess_over_target_only_is_counted_from_the_clock():
    """Each worker call takes one tick: a target-only round 1 tick for 1 token, a drafted round 2 (3 when it
    catches up) for 1 + accepted tokens. The scheduler counts every round's time and what drafted rounds took
    beyond target-only's cost for their tokens (ModeChooser.excess), from its first target-only measurement on."""
    h = build(max_batch=1, micro_batches=1, adaptive=True, tick_s=1.0, context=400)
    modes = h.scheduler.groups[0].modes
    rounds, observe = [], modes.observe

    def record(drafted, n, tokens, seconds, catch_up=False):
        rounds.append((drafted, tokens, seconds, (False, 1) in modes.measured))
        observe(drafted, n, tokens, seconds, catch_up)

    modes.observe = record
    params = SamplingParams(max_tokens=300, ignore_eos=True)

    async def body(h):
        await read(h, h.scheduler.submit([1, 2, 3], params))

    run(h, body)
    t = h.scheduler.meter.totals
    expected = sum(seconds - tokens for drafted, tokens, seconds, plain in rounds if drafted and plain)
    assert sum(d for d, *_ in rounds) >= 8 and any(not d for d, *_ in rounds)  # both modes ran
    assert t["drafted_excess_s"] == pytest.approx(expected) and t["drafted_excess_s"] != 0
    assert t["round_s"] == pytest.approx(sum(seconds for _, _, seconds, _ in rounds))


def test_seeded_sampling_is_the_same_with_and_without_drafts_and_at_any_batch():
    prompts = _prompts(6)
    params = [SamplingParams(max_tokens=9, temperature=0.9, top_p=0.95, seed=s) for s in range(6)]
    outputs = []
    for speculation, max_batch in [(True, 4), (False, 1), (True, 1)]:
        h = build(max_batch=max_batch, micro_batches=2, speculation=speculation)

        async def body(h):
            rs = [h.scheduler.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
            await asyncio.gather(*[read(h, r) for r in rs])
            return rs

        outputs.append([tokens_of(h.seen[r.id]) for r in run(h, body)])
        assert_settled(h)
    assert outputs[0] == outputs[1] == outputs[2]
    assert outputs[0] == [reference(p, sp) for p, sp in zip(prompts, params, strict=True)]


def test_health_says_why_the_target_cannot_admit_work():
    """`/health` answers 503 with this reason: the target does not answer, a loop died, or every KV slot is
    taken while no request runs (leaked)."""
    down = {"ready": False}
    h = build(max_batch=2, target_plan=lambda m: "raise" if m == "ready" and down["ready"] else None)

    async def body(h):
        assert await h.scheduler.health() is None
        await _all(h, _prompts(3))
        assert await h.scheduler.health() is None  # all served: healthy again
        down["ready"] = True
        assert "injected failure" in await h.scheduler.health()
        down["ready"] = False
        leaked = [h.target.worker.cache.allocate() for _ in range(2)]
        assert await h.scheduler.health() == "no free KV slot on the target while no request runs"
        for slot in leaked:
            h.target.worker.cache.release(slot)
        assert await h.scheduler.health() is None
        h.scheduler._loops[0].cancel()
        await asyncio.sleep(0)
        assert await h.scheduler.health() == "the scheduler stopped"

    with pytest.raises(AssertionError, match="a scheduler loop ended"):
        run(h, body)


def test_slots_are_asked_of_both_workers_at_once_and_a_late_one_keeps_its_last_count():
    """`/stats` (the rollout polls it) asks both workers together: the target here answers only once the draft
    worker has been asked. A worker that does not answer in time keeps its last known count and reports why."""
    h = build(max_batch=2)
    draft_asked = asyncio.Event()
    target_call, draft_call = h.target.call, h.draft.call

    async def target(method, *args, **kw):
        if method == "ready":
            await draft_asked.wait()
        return await target_call(method, *args, **kw)

    async def draft(method, *args, **kw):
        if method == "ready":
            draft_asked.set()
            if hangs["draft"]:
                await asyncio.Event().wait()
        return await draft_call(method, *args, **kw)

    h.target.call, h.draft.call, hangs = target, draft, {"draft": False}

    async def body(h):
        answers = await h.scheduler.refresh_slots(timeout_s=30)
        assert answers["target"]["free_slots"] == answers["draft"]["free_slots"] == 2
        hangs["draft"] = True
        h.scheduler.free_slots["draft"] = 1  # a count from before
        answers = await h.scheduler.refresh_slots(timeout_s=0.05)
        assert answers["target"]["free_slots"] == 2 and answers["draft"] == {"error": "TimeoutError"}
        assert h.scheduler.free_slots == {"target": 2, "draft": 1}

    run(h, body)


def test_measuring_drafts_a_bounded_share_of_rounds_the_mode_chooser_would_not():
    """A rollout's canary window: the mode chooser says target-only, `measure(0.5, ...)` drafts half of the
    rounds anyway (no more), output exact; when it ends (or measure(0, 0)) the chooser decides again."""
    h = build(max_batch=2, micro_batches=1, adaptive=True, context=400)
    h.scheduler.groups[0].modes.choose = lambda n: False
    params = SamplingParams(max_tokens=120, ignore_eos=True)

    async def rounds_with(share: float) -> tuple[int, int]:
        before = dict(h.scheduler.meter.totals)
        h.scheduler.measure(share, 1e9)
        r = h.scheduler.submit([1, 2, 3], params)
        await read(h, r)
        assert tokens_of(h.seen[r.id]) == reference([1, 2, 3], params)
        t = h.scheduler.meter.totals
        return int(t["rounds"] - before["rounds"]), int(t["spec_rounds"] - before["spec_rounds"])

    async def body(h):
        return [await rounds_with(share) for share in (0.5, 0.0)]

    (rounds, drafted), (rounds_off, drafted_off) = run(h, body)
    assert drafted_off == 0 and rounds_off == 119  # target-only: one token a round after the prefill's first
    assert 0.5 * rounds - 1 <= drafted <= 0.5 * rounds + 1 and rounds < 120  # drafted rounds gain tokens
    t = h.scheduler.meter.totals  # why draft calls were made: the window, every one; most follow a plain round
    assert t["drafted_measuring"] == t["draft_calls"] >= drafted
    assert t["drafted_best"] == t["drafted_probe"] == t["drafted_start"] == 0
    assert t["draft_calls"] - 2 <= t["catch_ups"] <= t["draft_calls"]


def test_a_window_said_again_goes_on_and_another_share_or_an_ended_one_starts_afresh():
    """A rollout says its window again at every poll (so that every replica hears it): the open window's end
    moves and its counts go on; another share, or a window that had ended, starts afresh; 0 closes it."""
    h = build(max_batch=2, micro_batches=1)
    now = [0.0]
    h.scheduler.clock = lambda: now[0]
    h.scheduler.measure(0.5, 10)
    m = h.scheduler.measuring
    m.rounds, m.measured = 8, 4
    now[0] = 5.0
    h.scheduler.measure(0.5, 10)
    assert h.scheduler.measuring is m and (m.until, m.rounds, m.measured) == (15.0, 8, 4)
    h.scheduler.measure(0.2, 10)
    assert h.scheduler.measuring is not m and h.scheduler.measuring.rounds == 0
    m = h.scheduler.measuring
    now[0] = 16.0  # ended at 15
    h.scheduler.measure(0.2, 10)
    assert h.scheduler.measuring is not m and h.scheduler.measuring.until == 26.0
    h.scheduler.measure(0, 10)
    assert h.scheduler.measuring is None


def test_measurement_rounds_verify_whole_trees_whatever_the_budget_policy_trims():
    """A canary compares two backends whose budget policies learned differently (one trims to a node a draft,
    one verifies 8): its measurement rounds verify every request's whole tree and count apart
    (`acceptance_measured`), so both sides' drafts have the configured size. The mode chooser learns nothing
    from them (whole trees are not what it would draft)."""
    h = build(max_batch=2, micro_batches=1, adaptive=True, context=400, max_nodes=4)
    modes = h.scheduler.groups[0].modes
    modes.choose, observed = (lambda n: True), []
    modes.observe = lambda *a, **kw: observed.append(a)
    h.scheduler.policy.budget_tokens = 2  # one request: room for one draft node a round
    params = SamplingParams(max_tokens=120, ignore_eos=True)

    async def body(h):
        h.scheduler.measure(0.5, 1e9)
        r = h.scheduler.submit([1, 2, 3], params)
        await read(h, r)
        assert tokens_of(h.seen[r.id]) == reference([1, 2, 3], params)

    run(h, body)
    every, measured = h.scheduler.meter.acceptance, h.scheduler.meter.measured
    trimmed = every - measured
    stats = h.scheduler.stats()
    assert stats["acceptance_measured"] == measured.to_dict()
    assert measured.drafts > 10 and abs(measured.drafts - trimmed.drafts) <= 1  # half the rounds each
    assert trimmed.draft_tokens == trimmed.drafts  # the policy's one node
    # whole trees: 4 nodes a draft but where max_tokens caps the tree (its last rounds)
    assert measured.draft_tokens >= 4 * (measured.drafts - 3) and max(measured.accepted_per_pos, default=0) > 0
    rounds, window = h.scheduler.meter.totals["rounds"], h.scheduler.measuring
    assert window.rounds == rounds and window.measured - measured.drafts in (0, 1)  # the last: max_tokens, no node
    assert len(observed) == rounds - window.measured  # measurement rounds are not the mode chooser's to learn from


@pytest.mark.parametrize("stream", [False, True])
def test_streamed_states_spare_the_catch_up_when_drafting_resumes(stream):
    """`stream_states`: target-only rounds still send their states to the drafter (no nodes, not awaited), so a
    drafted round after a target-only stretch sends one round's states, not the stretch's; without it, every
    such round is a catch-up. Output exact either way; a stream that fails leaves the next draft to send whole
    histories (RESET), and nothing is left afterwards."""
    calls = {"propose": 0}

    def plan(method):
        if method == "propose":
            calls["propose"] += 1
            return "raise" if calls["propose"] in (7, 19) else None  # two failing calls, streamed or drafted
        return None

    h = build(max_batch=4, micro_batches=1, adaptive=True, context=200, draft_plan=plan, stream_states=stream)
    rounds = itertools.count()
    h.scheduler.groups[0].modes.choose = lambda n: next(rounds) % 6 == 5  # draft every 6th round
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]

    async def body(h):
        rs = [h.scheduler.submit(p, params) for p in prompts]
        await asyncio.gather(*[read(h, r) for r in rs])
        return rs

    rs = run(h, body)
    for r, p in zip(rs, prompts, strict=True):
        assert ended_once(r, h.seen[r.id]).finish_reason == "length"
        assert tokens_of(h.seen[r.id]) == reference(p, params)
    assert_settled(h)
    t = h.scheduler.meter.totals
    drafted = t["drafted_best"]
    assert drafted >= 6 and t["spec_rounds"] >= drafted - 1  # each drafted from its states (the last: capped)
    if stream:  # the first draft, and the two after a failing call (their whole histories), catch up
        assert t["catch_ups"] <= 3 and t["draft_errors"] == 2
    else:
        assert t["catch_ups"] == drafted


def _logged(h, log: list, requests: dict) -> None:
    """Log each call to either worker when it is sent: (worker, method, its args, its call, tokens delivered to
    each request so far)."""
    for name, worker in (("target", h.target), ("draft", h.draft)):

        def submit(method, *args, returns=1, _name=name, _submit=worker.submit):
            c = _submit(method, *args, returns=returns)
            log.append((_name, method, args, c, {rid: r.emitted for rid, r in requests.items()}))
            return c

        worker.submit = submit


@pytest.mark.parametrize("chain", [True, False])
def test_each_verify_call_carries_the_next_draft_call(chain):
    """`chain_drafts` (one micro-batch): the next round's draft call is sent with each verify call, before the
    scheduler has delivered that call's tokens, fed the verify call's own states (its ref, not a copy), so the
    drafter drafts while the scheduler delivers. Off, it is sent after. A request admitted while a chained call
    is out is drafted for from its whole history (its prefill's states go with the next one). Output exact
    either way, nothing left."""
    h = build(max_batch=2, micro_batches=1, chain_drafts=chain)
    log, requests = [], {}
    _logged(h, log, requests)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 1, 2]]

    async def body(h):
        first = h.scheduler.submit(prompts[0], params)
        requests[first.id] = first
        reading = asyncio.ensure_future(read(h, first))
        while first.emitted < 6:
            await asyncio.sleep(0)
        second = h.scheduler.submit(prompts[1], params)
        requests[second.id] = second
        await asyncio.gather(reading, read(h, second))
        return [first, second]

    rs = run(h, body)
    for r, p in zip(rs, prompts, strict=True):
        assert tokens_of(h.seen[r.id]) == reference(p, params)
        # the drafter holds its whole history but the last round's (a lost prefill: 8 pairs short, drafts rejected)
        assert r.draft_pairs >= len(p) + r.emitted - 1 - h.scheduler.policy.max_nodes_per_request
        assert r.acceptance.accepted > 0
    assert_settled(h)
    calls = [(w, m) for w, m, *_ in log if m in ("verify", "propose")]
    rounds = calls.count(("target", "verify"))
    assert rounds >= 10 and calls[:2] == [("draft", "propose"), ("target", "verify")]  # the first: after the prefill
    # (verify, the next call) pairs: a draft call fed the verify call's states, sent before its tokens were delivered
    pairs = [(log[i], log[i + 1]) for i in range(len(log) - 1) if log[i][:2] == ("target", "verify")]
    fed = [(v, d) for v, d in pairs if d[:2] == ("draft", "propose") and d[2][-1] is v[3].refs[0]]
    chained = [v for v, d in fed if d[4] == v[4]]
    if chain:  # every verify call but the last (its round ends both requests) has its draft call at once
        assert len(chained) >= rounds - 1
    else:  # each draft call after the verify call's tokens were delivered
        assert not chained and len(fed) >= rounds // 2


@pytest.mark.parametrize("fault", ["die", "raise", "late"])
def test_a_verify_call_that_fails_ends_its_requests_and_never_blames_the_chained_draft_call(fault):
    """A verify call that fails ends its requests (503), whatever became of the draft call chained to it (with Ray
    it fails too, its states never came): the drafter is neither counted failed nor taken out of service, and
    later requests are drafted for and exact."""
    verifies = itertools.count()
    h = build(
        max_batch=2, micro_batches=1, target_plan=lambda m: fault if m == "verify" and next(verifies) == 3 else None
    )

    async def body(h):
        first = await _all(h, [[1, 2, 3]])
        drafts = h.scheduler.meter.acceptance.drafts
        later = await _all(h, _prompts(2))
        return first + later, drafts

    rs, drafts = run(h, body)
    assert ended_once(rs[0], h.seen[rs[0].id]).status == 503
    for r, p in zip(rs[1:], _prompts(2), strict=True):
        assert tokens_of(h.seen[r.id]) == reference(p, GREEDY)
    t = h.scheduler.meter.totals
    assert t["draft_errors"] == 0 and t["draft_failures"] == 0 and h.scheduler.draft_alive
    assert h.scheduler.meter.acceptance.drafts > drafts  # the later requests were drafted for
    assert_settled(h)


def test_a_target_only_round_after_a_chained_draft_call_still_gives_the_drafter_its_states():
    """The mode chooser turns a round target-only after a draft call was chained to the last verify call: the
    drafter took that call's states all the same (it is awaited as a stream), so drafting resumes without whole
    histories (no `history` call, no reset), and the output is exact."""
    h = build(max_batch=4, micro_batches=1, adaptive=True, context=200)
    rounds = itertools.count()
    h.scheduler.groups[0].modes.choose = lambda n: next(rounds) % 5 in (0, 1, 3)  # drafted, target-only, in turn
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5]]

    async def body(h):
        return await _all(h, prompts, params)

    rs = run(h, body)
    for r, p in zip(rs, prompts, strict=True):
        assert tokens_of(h.seen[r.id]) == reference(p, params)
    t = h.scheduler.meter.totals
    assert t["drafted_best"] >= 8 and t["draft_errors"] == 0
    assert "history" not in h.target.calls and h.scheduler.meter.acceptance.accepted > 0
    assert_settled(h)


def test_the_mode_chooser_counts_a_chained_draft_call_whole():
    """A chained draft call runs while the scheduler delivers and admits, which the mode chooser's round time
    does not see; on cores the drafter shares, that work took longer for it. So a drafted round counts the part
    of its draft call's time it did not wait for, as if it had waited for all of it (here every draft call takes
    1 s of the clock and the rounds themselves take none)."""
    h = build(max_batch=2, micro_batches=1, adaptive=True)
    modes = h.scheduler.groups[0].modes
    observed = []
    modes.choose = lambda n: True
    modes.observe = lambda with_draft, n, emitted, seconds, catch_up=False: observed.append((with_draft, seconds))
    submit = h.draft.submit

    def slow(method, *args, returns=1):
        c = submit(method, *args, returns=returns)
        if method == "propose":
            answer = c.result

            async def result(timeout_s=None):
                h.clock.now += 1.0  # the call's own time, whoever waits for it
                return await answer(timeout_s)

            c.result = result
        return c

    h.draft.submit = slow
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    run(h, lambda h: _all(h, [[1, 2, 3]], params))
    drafted = [seconds for with_draft, seconds in observed if with_draft]
    assert len(drafted) >= 5 and all(s >= 1.0 for s in drafted), drafted
    t = h.scheduler.meter.totals
    assert t["draft_waited_s"] < t["draft_call_s"] - 3  # most chained calls ran while the scheduler was busy
