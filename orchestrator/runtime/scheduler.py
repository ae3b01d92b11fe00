"""SpecScheduler: continuous batching of many users' requests over a TargetWorker and a DraftWorker.

    client ──submit() / text_events()──> SpecScheduler ──> TargetWorker (in-process, or a Ray actor on a target node)
                                              └─────────> DraftWorker  (in-process, or a Ray actor on a draft node)

The one driver of speculative decoding: the HTTP server runs it over Ray actors, the in-process engine over
local objects. Live requests may be split into two micro-batches (`micro_batches: 2`) that take turns, each running

    admit waiting requests (prefill) -> draft -> BudgetPolicy picks the nodes to verify -> verify -> deliver

so while the target verifies group A's trees the drafter drafts group B's, and neither side idles. With one
micro-batch, each round's verify call carries the next round's draft call chained to it (`chain_drafts`): Ray
hands the drafter the verified states as soon as the target returns them, and the drafter drafts while the
scheduler delivers tokens, admits requests and chooses the next round. Each round the global verification
budget is split among the group's requests by expected acceptance, and the group's `ModeChooser` runs rounds
target-only while they measure faster than drafted ones (both off with `adaptive: false`: every round verifies
whole trees).

Invariants (tests/runtime): every submitted request ends exactly once (its tokens, then a finish reason or an
error); ending one request (abort, stop string, client gone, timeout, its own failure) never fails another;
every slot a request takes on either worker is released; what the scheduler holds is bounded (at most
`MAX_BACKLOG` undrafted pair batches per group: beyond that the drafter catches up from the target's
history); every loop iteration awaits.

Faults: a draft call that fails turns the round target-only (greedy output is unchanged; sampling stays
exact) and the drafter is brought up to date from the target's history; a dead draft worker is waited for
in the background. A target call that fails ends the requests of that call (503; a failed prefill is retried
once); a restarted target serves new ones. Every request ends by `request_timeout_s`.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import Field

from orchestrator.config import StrictModel
from orchestrator.runtime.clients import WorkerFailed, WorkerLost
from orchestrator.runtime.detok import TextStream
from orchestrator.runtime.messages import NewSequence, RoundOutput
from orchestrator.runtime.metrics import Meter
from orchestrator.runtime.policies import BudgetPolicy, ModeChooser
from orchestrator.spec.acceptance import Acceptance
from orchestrator.spec.sampling import SamplingParams

log = logging.getLogger(__name__)
MAX_BACKLOG = 16  # undrafted pair batches a micro-batch holds; beyond, the drafter catches up from the target


class SchedulerConfig(StrictModel):
    """How the scheduler batches and speculates."""

    max_batch: int = Field(16, ge=1, description="requests decoded at once (KV slots of each worker)")
    budget_tokens: int = Field(64, ge=1, description="global verification budget: tokens per target round")
    micro_batches: int = Field(
        1,
        ge=1,
        le=2,
        description="groups that take turns (2: one drafts while the other verifies, but a memory-bound target step "
        "then reads its weights twice per round; jobs.plan finds 1 faster on GB200 and CPUs alike)",
    )
    adaptive: bool = Field(True, description="trim trees and skip drafting by measured speed (False: whole trees)")
    request_timeout_s: float = Field(300.0, gt=0, description="every request ends by then")
    worker_timeout_s: float = Field(120.0, gt=0, description="a target call that takes longer counts as failed")
    draft_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a draft call that takes longer counts as the drafter lost: rounds go on target-only while it is "
        "polled (a draft node cut off by the network stalls the target this long once, not worker_timeout_s); a "
        "catch-up call, which sends whole histories, has worker_timeout_s",
    )
    max_prefill_attempts: int = Field(2, ge=1, description="prefills a request may lose to worker failures")
    chain_drafts: bool = Field(
        True,
        description="with one micro-batch, send the next round's draft call with each verify call, fed the verified "
        "states as the target returns them: no scheduler hop between the calls, and the drafter drafts while the "
        "scheduler delivers (a request admitted meanwhile is drafted for a round later; the draft worker runs the "
        "scheduler's later calls after it). False: the draft call is sent when the next round begins",
    )
    stream_states: bool = Field(
        False,
        description="target-only rounds still send the drafter their states (one call in flight per micro-batch, "
        "not awaited), so drafting resumes without a catch-up of every skipped round: for a drafter on a device "
        "of its own, or behind a thin link (on shared CPU cores its ingestion competes with the target)",
    )


@dataclass
class Event:
    """What a request's stream receives: new tokens, then a finish reason or an error."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    status: int = 200


@dataclass(eq=False)
class Request:
    """A submitted request, as the scheduler tracks it."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    deadline: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    group: int = -1  # micro-batch, -1 while waiting
    emitted: int = 0
    attempts: int = 0  # prefills lost to worker failures
    draft_pairs: int = 0  # pairs the drafter holds (as it last said)
    draftable: bool = True  # False once past the drafter's context
    ended: bool = False
    submitted: float = 0.0  # the scheduler's clock at submit
    last_token: float | None = None
    acceptance: Acceptance = field(default_factory=Acceptance)
    capture: bool = False  # the traffic tap may keep it


class Sync(enum.Enum):
    """What the drafter holds of a micro-batch's requests, so what their next draft call sends it."""

    IN_SYNC = "in sync"  # all but the backlog: the backlog
    CATCH_UP = "catch up"  # the backlog overflowed: the pairs it has not seen, fetched from the target
    RESET = "reset"  # nothing (it restarted, or its state of them was dropped): their whole histories


@dataclass
class Ahead:
    """A draft call sent with a verify call and fed its states (`chain_drafts`), for the group's next round."""

    requests: list[Request]  # the requests it drafts (as they were when it was sent)
    verified: asyncio.Future  # the clock when the verify call answered (the draft call's own time starts then)
    task: asyncio.Task  # -> (DraftOutput, trees ref, began, done)

    @property
    def ids(self) -> set[str]:
        return {r.id for r in self.requests}


@dataclass
class _Group:
    """One micro-batch and its drafting state."""

    requests: dict[str, Request] = field(default_factory=dict)
    sync: Sync = Sync.IN_SYNC
    backlog: list = field(default_factory=list)  # Pairs (refs) the drafter has not seen, oldest first; IN_SYNC only
    modes: ModeChooser = field(default_factory=ModeChooser)
    drafter_current: bool = False  # it has every round's states (drafted or streamed): a next draft is no catch-up
    streaming: asyncio.Task | None = None  # target-only rounds' states on their way to the drafter (stream_states)
    ahead: Ahead | None = None  # the next round's draft call, chained to the last verify call (chain_drafts)

    def to(self, sync: Sync) -> None:
        """The one place the sync state changes. Every change empties the backlog: after a draft call it was
        sent; otherwise the target's history replaces it."""
        self.sync, self.backlog = sync, []

    def stash(self, pairs) -> None:
        """Keep a call's pairs for the next draft call (in sync only); past MAX_BACKLOG (a long target-only
        stretch), the drafter catches up from the target instead."""
        if self.sync is not Sync.IN_SYNC:
            return
        self.backlog.append(pairs)
        if len(self.backlog) > MAX_BACKLOG:
            self.to(Sync.CATCH_UP)


@dataclass
class Measuring:
    """Drafting for measurement (a rollout's canary window): until `until`, `share` of the rounds are measurement
    rounds, whatever the mode chooser says. A measurement round drafts and verifies every request's whole tree
    (the configured shape, not the budget policy's trim) and counts in the scheduler's `measured` acceptance, so
    two backends, whatever their policies learned, are compared on drafts of the same size, at a bounded cost."""

    share: float
    until: float
    rounds: int = 0
    measured: int = 0


@dataclass
class Drafted:
    """A draft call's result for one micro-batch."""

    sketches: dict[str, tuple[list[int], list[float]]]  # request id -> its tree's (parent index, score) per node
    trees: object  # the draft trees the target verifies (a Ray ref between actors)
    trees_bytes: int
    hidden_s: float = 0.0  # of the call's own time, what its round did not wait for (a chained call's overlap)


class SpecScheduler:
    """Owns the request queue and drives the two workers (`runtime.clients`) from one asyncio loop."""

    def __init__(
        self,
        target,
        draft,
        cfg: SchedulerConfig,
        max_nodes: int,
        metrics=None,
        clock: Callable[[], float] = time.perf_counter,
        watchdog_s: float | None = 0.5,
        poll_s: float = 0.5,
        trace_size: int = 4000,
    ) -> None:
        """target, draft: worker clients (`LocalWorker` / `RemoteWorker`; draft None: target-only);
        max_nodes: most draft nodes one request verifies per round (the tree's budget); clock: every time the
        scheduler reads (deadlines, latencies, the mode chooser's rates: a simulation passes its virtual clock);
        watchdog_s: how often deadlines are checked besides every round (None: rounds only); poll_s: how
        often a restarting worker is asked whether it answers."""
        self.target, self.draft, self.cfg = target, draft, cfg
        self.meter = Meter(cfg.budget_tokens, export=metrics)
        self.policy = BudgetPolicy(cfg.budget_tokens, max_nodes, adaptive=cfg.adaptive)
        self.clock, self.watchdog_s, self.poll_s = clock, watchdog_s, poll_s
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.groups = [_Group() for _ in range(cfg.micro_batches)]
        self.draft_alive = draft is not None
        self.draft_incarnation: str | None = None  # changes when the draft worker restarts
        self.measuring: Measuring | None = None
        self.free_slots = {"target": cfg.max_batch, "draft": cfg.max_batch if draft is not None else 0}
        self.trace: deque[dict] = deque(maxlen=trace_size)
        self._ids = itertools.count()
        self._changed = asyncio.Event()
        self._loops: list[asyncio.Task] = []  # the group loops and the watchdog: they never end
        self._helpers: set[asyncio.Task] = set()  # waiting for a restarting draft worker; states being streamed
        self._draft_ema = 0.0

    # -- client side -----------------------------------------------------------------------------------------

    def start(self) -> None:
        loops = [self._group_loop(g) for g in range(len(self.groups))]
        if self.watchdog_s is not None:
            loops.append(self._watchdog())
        self._loops = [asyncio.create_task(c) for c in loops]

    async def close(self) -> None:
        tasks = [*self._loops, *self._helpers]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loops, self._helpers = [], set()

    @property
    def running(self) -> bool:
        """The loops are alive (a dead loop would leave its requests hanging)."""
        return bool(self._loops) and not any(t.done() for t in self._loops)

    def submit(self, prompt_ids: list[int], params: SamplingParams, capture: bool = False) -> Request:
        """Queue a request; `capture`: the target worker's traffic tap may keep it (the server checked consent)."""
        now = self.clock()
        r = Request(f"r{next(self._ids)}", list(prompt_ids), params, now + self.cfg.request_timeout_s, submitted=now)
        r.capture = capture
        self.requests[r.id] = r
        self.waiting.append(r)
        self._changed.set()
        self._gauges()
        return r

    async def events(self, r: Request):
        """The request's events until it finishes or fails."""
        while True:
            event = await r.queue.get()
            yield event
            if event.finish_reason or event.error:
                return

    async def text_events(self, r: Request, text: TextStream):
        """(text delta, finish reason, error event) per event; a stop string ends the request at once (its
        slots are freed, no more rounds are spent on it)."""
        async for event in self.events(r):
            if event.error:
                yield "", None, event
                return
            delta = text.add(event.tokens) if event.tokens else ""
            if text.stopped:
                self.abort(r.id)
                yield delta, "stop", None
                return
            if event.finish_reason:
                yield delta + text.finish(), event.finish_reason, None
                return
            yield delta, None, None

    def measure(self, share: float, seconds: float) -> None:
        """Draft at least `share` of the rounds for the next `seconds` (0: stop), whatever the mode chooser says.
        The same share said again while its window is open moves the window's end and keeps its counts: a rollout
        repeats it at every poll, so that every replica hears it, a restarted one included."""
        if share <= 0 or seconds <= 0:
            self.measuring = None
            return
        m, until = self.measuring, self.clock() + seconds
        if m is not None and m.share == share and self.clock() <= m.until:
            m.until = until
        else:
            self.measuring = Measuring(share, until)

    def abort(self, request_id: str) -> None:
        """The client left (or a stop string matched): end the request, free its slots."""
        r = self.requests.get(request_id)
        if r is not None:
            self._end(r, Event(finish_reason="abort"))

    # -- the loops -------------------------------------------------------------------------------------------

    def _room(self) -> int:
        return self.cfg.max_batch - sum(len(g.requests) for g in self.groups)

    async def _group_loop(self, g: int) -> None:
        group = self.groups[g]
        while True:
            while not (group.requests or (self.waiting and self._room() > 0)):
                self._changed.clear()
                await self._changed.wait()
            try:
                self._expire()
                await self._admit(g)
                if group.requests:
                    await self._round(g)
            except Exception as err:  # a bug must not take the other group down: fail this group's requests
                log.exception("scheduler round failed")
                for r in list(group.requests.values()):
                    self._fail(r, f"internal error: {err}", 500, "internal")
            await asyncio.sleep(0)  # every iteration yields: the other micro-batch and the clients run

    async def _admit(self, g: int) -> None:
        group = self.groups[g]
        live = sum(len(x.requests) for x in self.groups)
        share = -(-(live + len(self.waiting)) // len(self.groups))  # ceil: balance the groups
        take = min(self.cfg.max_batch - live, max(0, share - len(group.requests)), len(self.waiting))
        new = [self.waiting.popleft() for _ in range(take)]
        if not new:
            return
        for r in new:
            r.group = g
            group.requests[r.id] = r
        self._gauges()
        sequences = [NewSequence(r.id, r.prompt_ids, r.params, r.capture) for r in new]
        try:
            out, pairs = await self.target.call("prefill", sequences, returns=2)
        except (WorkerLost, WorkerFailed) as err:
            await self._target_failed([r for r in new if not r.ended], err, prefill=True)
            return
        self._span("prefill", "target", g, out.started, out.compute_s, len(new), out.verified_tokens)
        self._stash(group, pairs)
        self._deliver(out)

    async def _round(self, g: int) -> None:
        group = self.groups[g]
        ids = list(group.requests)
        round_began = self.clock()
        drafted, predicted = None, 0.0
        draftable = any(r.draftable for r in group.requests.values())
        want = not self.cfg.adaptive or group.modes.choose(len(ids))
        why = group.modes.why if self.cfg.adaptive else "fixed"
        m = self.measuring
        if m is not None and self.clock() > m.until:
            self.measuring = m = None
        measuring = False
        if m is not None:
            m.rounds += 1
            measuring = m.measured < m.share * m.rounds
            if measuring:  # counted now, not after drafting: the other micro-batch's round must see it
                m.measured += 1
                if not want:
                    want, why = True, "measuring"
        catch_up = False
        ahead = group.ahead
        if ahead is not None and not (
            want and self.draft_alive and draftable and group.sync is Sync.IN_SYNC and ahead.ids & group.requests.keys()
        ):  # not drafting this round, or for none of its requests now: the drafter still takes its states,
            self._ahead_as_stream(g)  # before this round's calls (its time was the drafted round's: see `hidden_s`)
            if group.streaming is not None:
                await asyncio.wait([group.streaming])
            round_began = self.clock()
        if self.draft_alive and draftable and want:
            if group.streaming is not None:  # the drafter first takes what was streamed (or its failure is known)
                await asyncio.wait([group.streaming])
            catch_up = group.sync is not Sync.IN_SYNC or not group.drafter_current
            drafted = await self._draft(g)
            if drafted is not None:
                self.meter.drafted(why, catch_up)
        if measuring and drafted is None:  # nothing drafted: not a measurement round after all
            m.measured -= 1
            measuring = False
        sketches = drafted.sketches if drafted is not None else {}
        ids = [rid for rid in ids if rid in group.requests]  # requests that ended meanwhile are not verified
        if not ids:
            return
        keep: dict[str, list[int]] = {rid: [] for rid in ids}
        have = [rid for rid in ids if rid in sketches]
        if have:
            overhead = 0.0 if len(self.groups) > 1 else self._draft_ema  # pipelined: drafting is hidden
            caps = [self._node_cap(group.requests[rid]) for rid in have]
            chosen, predicted = self.policy.allocate([sketches[rid] for rid in have], overhead, measuring, caps)
            keep.update(zip(have, chosen, strict=True))
        began = self.clock()
        self.meter.transfer("draft_to_target", drafted.trees_bytes if drafted is not None else 0)
        verify = self.target.submit("verify", keep, drafted.trees if drafted else None, returns=2)
        if drafted is not None:
            self._chain(g, verify)
        try:
            out = await verify.result()
        except (WorkerLost, WorkerFailed) as err:
            if group.ahead is not None:  # its requests end here: nothing of it is the drafter's fault
                group.ahead.task.cancel()
                group.ahead = None
            await self._target_failed([group.requests[rid] for rid in ids if rid in group.requests], err)
            return
        latency = self.clock() - began
        self._span("verify", "target", g, out.started, out.compute_s, len(ids), out.verified_tokens)
        if group.ahead is not None:
            group.ahead.verified.set_result(self.clock())
        else:
            self._stash(group, verify.refs[0])
        accepted = sum(u.accepted for u in out.updates)
        self.policy.observe(len(ids), out.verified_tokens, out.compute_s, predicted, accepted)
        with_draft = drafted is not None
        # a chained draft call's time counts whole, as if the round had waited for all of it: on cores the drafter
        # shares, what it overlapped (delivery, prefills, HTTP) took longer for it (16 users on 2 cores, counting
        # only the wait: the mode chooser drafted 45% of the rounds instead of 8%, at 0.79x)
        hidden = drafted.hidden_s if drafted is not None else 0.0
        seconds, emitted = self.clock() - round_began + hidden, sum(len(u.tokens) for u in out.updates)
        excess = group.modes.excess(len(ids), emitted, seconds) if with_draft and self.cfg.adaptive else None
        self.meter.round_time(seconds, excess)
        if self.cfg.adaptive and not measuring:  # whole trees are not what the mode chooser would draft
            catch_up = with_draft and catch_up
            group.modes.observe(with_draft, len(ids), emitted, seconds, catch_up=catch_up)
        group.drafter_current = with_draft or self._stream(g)
        self._account(out, latency, measuring)
        self._deliver(out)

    async def _draft(self, g: int) -> Drafted | None:
        """Draft trees for the group, or None when the draft worker is gone or failed (the round goes
        target-only: drafts are an optimisation, never needed for a correct answer)."""
        group = self.groups[g]
        if group.ahead is not None:  # sent with the last verify call
            ahead, group.ahead = group.ahead, None
            return await self._drafted(g, ahead.requests, ahead.task, took_backlog=False)
        sync, pairs = group.sync, group.backlog
        if sync is not Sync.IN_SYNC:
            rs = [r for r in group.requests.values() if r.draftable]
            since = {} if sync is Sync.RESET else {r.id: r.draft_pairs for r in rs}
            try:
                _, history = await self.target.call("history", [r.id for r in rs], since, returns=2)
            except (WorkerLost, WorkerFailed) as err:
                log.warning("history for the drafter failed, round target-only: %s", err)
                return None
            pairs = [history]
        rs = [r for r in group.requests.values() if r.draftable]  # after the await: without those that ended
        reset = [r.id for r in rs] if sync is Sync.RESET else []
        requests = [(r.id, r.params, self._node_cap(r)) for r in rs]
        # a catch-up carries whole histories (long on a CPU): it gets the target's bound, not the drafter's
        timeout = None if sync is Sync.IN_SYNC else self.cfg.worker_timeout_s
        call = self.draft.submit("propose", requests, reset, *pairs, returns=2)
        began = self.clock()
        return await self._drafted(g, rs, self._draft_answer(call, began, timeout), took_backlog=True)

    async def _draft_answer(self, call, began, timeout_s: float | None = None) -> tuple:
        """(DraftOutput, trees ref, began, answered): a draft call's answer, with the clock when its time began
        (sent; a chained call: when its verify call answered, `began` a future of that) and when it came."""
        if isinstance(began, asyncio.Future):
            began = await began
        out = await call.result(timeout_s)
        return out, call.refs[0], began, self.clock()

    async def _drafted(self, g: int, rs: list[Request], answer, took_backlog: bool, used: bool = True):
        """A draft call's answer taken in: the drafter's state of the group (what it holds; a failed call: it
        starts over), the metrics, and the trees (`used`: this round verifies them; else the call only carried
        states). took_backlog: the call was sent the group's whole backlog, so the group is in sync after it."""
        group = self.groups[g]
        waiting = self.clock()
        try:
            out, trees_ref, began, answered = await answer
        except WorkerLost as err:
            self._draft_lost(str(err))
            return None
        except WorkerFailed as err:  # the drafter raised: this round target-only, its state of them starts over
            log.error("draft call failed (its round goes target-only; the next sends whole histories): %s", err)
            self.meter.draft_error()
            self.draft.cast("release", [r.id for r in rs])
            group.to(Sync.RESET)
            return None
        if took_backlog:
            group.to(Sync.IN_SYNC)
        self._took(out)
        self.meter.transfer("target_to_draft", out.pairs_bytes)
        if not used:
            self._span("stream", "draft", g, out.started, out.compute_s, len(rs), out.ingested)
            return None
        latency = answered - began  # its own time, and what the round waited for of it:
        waited = min(latency, self.clock() - waiting)
        self._draft_ema = 0.8 * self._draft_ema + 0.2 * latency if self._draft_ema else latency
        self.meter.draft_call(latency, out.compute_s, waited)
        self._span("draft", "draft", g, out.started, out.compute_s, len(rs), out.ingested)
        sketches = {rid: (s.parents, s.scores) for rid, s in out.sketches.items()}
        return Drafted(sketches, trees_ref, out.trees_bytes, max(0.0, latency - waited))

    def _chain(self, g: int, verify) -> None:
        """Send the next round's draft call now, fed this verify call's states (`chain_drafts`): with one
        micro-batch, the group in sync, and the verify call not failed already. Its requests are the group's
        draftable ones (the backlog, new requests' prefill states, goes with it)."""
        group = self.groups[g]
        chain = self.cfg.chain_drafts and len(self.groups) == 1 and self.draft_alive and group.sync is Sync.IN_SYNC
        rs = [r for r in group.requests.values() if r.draftable]
        if not (chain and rs and verify.refs is not None):
            return
        requests = [(r.id, r.params, self._node_cap(r)) for r in rs]
        pairs = [*group.backlog, verify.refs[0]]
        group.to(Sync.IN_SYNC)  # the backlog goes with it
        call = self.draft.submit("propose", requests, [], *pairs, returns=2)
        verified = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._draft_answer(call, verified))
        self._helpers.add(task)
        task.add_done_callback(self._helpers.discard)
        group.ahead = Ahead(rs, verified, task)

    def _ahead_as_stream(self, g: int) -> None:
        """The round does not draft from the chained call (target-only, or none of its requests is left): the
        drafter took its states all the same, so its answer is taken in as a stream's (`group.streaming`, which
        the round awaits before its own calls); dropped when the draft worker is lost (its state of the group
        starts over)."""
        group = self.groups[g]
        ahead, group.ahead = group.ahead, None
        if not self.draft_alive:
            ahead.task.cancel()
            return
        task = asyncio.create_task(self._drafted(g, ahead.requests, ahead.task, took_backlog=False, used=False))
        group.streaming = task
        self._helpers.add(task)
        task.add_done_callback(self._helpers.discard)

    def _took(self, out) -> None:
        """What a propose call's answer says of the draft worker (a draft call's or a stream's)."""
        if self.draft_incarnation not in (None, out.incarnation):  # restarted between calls: its drafts are
            self._draft_restarted()  # still valid (verification is exact) but its caches miss history
        self.draft_incarnation = out.incarnation
        self.free_slots["draft"] = out.free_slots
        for rid in out.retired:  # (a request may have ended while the call ran)
            if rid in self.requests:
                self.requests[rid].draftable = False
        for rid, n in out.seen.items():
            if rid in self.requests:
                self.requests[rid].draft_pairs = n

    def _stream(self, g: int) -> bool:
        """After a target-only round (`stream_states`): send the drafter the group's held states but the newest
        without drafting, in the background, one call at a time per group (what arrives meanwhile waits for the
        next). True when the drafter has, or will have, all of them but the newest round's."""
        group = self.groups[g]
        if group.streaming is not None and not group.streaming.done():
            return True  # the next stream (or draft call) sends this round's states
        group.streaming = None
        if not (self.cfg.stream_states and self.draft_alive and group.sync is Sync.IN_SYNC):
            return False
        if len(group.backlog) < 2:
            return True
        # all but the newest: a draft call drafts from the states it is sent, so the next one must carry some
        pairs, group.backlog = group.backlog[:-1], group.backlog[-1:]
        task = asyncio.create_task(self._send_states(g, pairs))
        group.streaming = task
        self._helpers.add(task)
        task.add_done_callback(self._helpers.discard)
        return True

    async def _send_states(self, g: int, pairs: list) -> None:
        group = self.groups[g]
        if group.sync is not Sync.IN_SYNC or not self.draft_alive:  # changed before the task began
            return
        rs = [r for r in group.requests.values() if r.draftable]  # now: a request that ended is not sent again
        requests = [(r.id, r.params, 0) for r in rs]  # no nodes: the drafter commits the states, drafts nothing
        call = self.draft.submit("propose", requests, [], *pairs, returns=2)
        await self._drafted(g, rs, self._draft_answer(call, self.clock()), took_backlog=False, used=False)

    def _node_cap(self, r: Request) -> int:
        """Never draft or verify past max_tokens: a round emits at most (nodes on the path) + 1 tokens. (A chained
        draft call is capped before its verify call's tokens count: the round that verifies it caps again.)"""
        return max(0, min(self.policy.max_nodes_per_request, r.params.max_tokens - r.emitted - 1))

    def _stash(self, group: _Group, pairs) -> None:
        """Keep a call's pairs for the group's next draft (nothing when no drafter will read them)."""
        if self.draft is not None and self.draft_alive:
            group.stash(pairs)

    # -- results ---------------------------------------------------------------------------------------------

    def _deliver(self, out: RoundOutput) -> None:
        self.free_slots["target"] = out.free_slots
        now = self.clock()
        for u in out.updates:
            r = self.requests.get(u.request_id)
            if r is None:  # ended while the call ran (its release followed the call)
                continue
            if u.error is not None and u.retry and r.attempts + 1 < self.cfg.max_prefill_attempts:
                r.attempts += 1
                self._requeue([r])
            elif u.error is not None:
                self._fail(r, u.error, u.status, "worker", released=True)
            else:
                self.meter.tokens(
                    now - r.submitted, None if r.last_token is None else now - r.last_token, len(u.tokens)
                )
                r.last_token = now
                r.emitted += len(u.tokens)
                r.acceptance.record(u.drafted, u.accepted)
                r.queue.put_nowait(Event(list(u.tokens)))
                if u.finish_reason is not None:
                    self._end(r, Event(finish_reason=u.finish_reason), released=True)

    def _account(self, out: RoundOutput, latency: float, measuring: bool = False) -> None:
        drafted = [u.drafted for u in out.updates if u.error is None]
        accepted = [u.accepted for u in out.updates if u.error is None]
        self.meter.verify_round(
            drafted, accepted, out.verified_tokens, latency, out.compute_s, out.pairs_bytes, measuring
        )

    def _requeue(self, rs: list[Request]) -> None:
        """Back to the front of the queue (nothing of them reached a client or is held by the target)."""
        for r in reversed(rs):
            self.groups[r.group].requests.pop(r.id, None)
            r.group = -1
            self.waiting.appendleft(r)
        self._changed.set()

    def _end(self, r: Request, event: Event, released: bool = False) -> None:
        """Finish a request once: its last event, out of its group, its state freed in both workers."""
        if r.ended:
            return
        r.ended = True
        self.requests.pop(r.id, None)
        if r.group < 0:
            self.waiting.remove(r)
        else:
            self.groups[r.group].requests.pop(r.id, None)
            if not released:
                self.target.cast("release", [r.id])
            if self.draft is not None:
                self.draft.cast("release", [r.id])
        r.queue.put_nowait(event)
        self._changed.set()  # a slot is free
        self._gauges()

    def _fail(self, r: Request, message: str, status: int, kind: str, released: bool = False) -> None:
        self.meter.request_error(kind)
        self._end(r, Event(error=message, status=status), released=released)

    async def _target_failed(self, rs: list[Request], err: Exception, prefill: bool = False) -> None:
        """A target call failed: whatever it held of these requests is freed (a late call is followed by the
        release); a lost prefill is retried, anything else ends with 503. A dead target is waited for."""
        log.error("target call failed for %d requests: %s", len(rs), err)
        self.meter.target_failure()
        self.target.cast("release", [r.id for r in rs])
        retry = [r for r in rs if prefill and r.attempts + 1 < self.cfg.max_prefill_attempts]
        for r in rs:
            r.attempts += 1
            if r not in retry:
                self._fail(r, f"target worker: {err}; the request was lost, retry it", 503, "target_lost", True)
        self._requeue(retry)
        if isinstance(err, WorkerLost):
            await self._await_ready(self.target, "target")

    def _draft_lost(self, reason: str) -> None:
        if not self.draft_alive:
            return
        log.warning("%s: target-only rounds until the draft worker is back", reason)
        self.meter.draft_lost()
        self.draft_alive = False
        self._draft_restarted()
        task = asyncio.create_task(self._await_draft())
        self._helpers.add(task)
        task.add_done_callback(self._helpers.discard)

    def _draft_restarted(self) -> None:
        """The draft worker lost its caches: each group's next draft sends the whole histories."""
        for group in self.groups:
            group.to(Sync.RESET)

    async def _await_draft(self) -> None:
        await self._await_ready(self.draft, "draft")
        self.draft_alive = True

    async def _await_ready(self, worker, name: str) -> None:
        """Poll a restarting worker until it answers (requests keep their deadlines meanwhile)."""
        while True:
            try:
                await worker.call("ready")
                break
            except (WorkerLost, WorkerFailed):
                await asyncio.sleep(self.poll_s)
        log.warning("%s worker is answering", name)

    def _expire(self) -> None:
        now = self.clock()
        for r in [r for r in self.requests.values() if r.deadline < now]:
            self._fail(r, f"request timed out after {self.cfg.request_timeout_s:g} s", 504, "timeout")

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(self.watchdog_s)
            self._expire()

    # -- observability ---------------------------------------------------------------------------------------

    def _span(self, name: str, worker: str, g: int, started: float, dur: float, batch: int, tokens: int) -> None:
        """One worker call on the timeline: `tokens` it computed (verified, prefilled, or states the drafter took
        in), `context` the group's tokens in the KV cache (what `sim.costs.fit_step_cost` fits step times to)."""
        if self.trace.maxlen == 0:  # not kept (a simulation without a trace): nothing to compute per round
            return
        context = sum(len(r.prompt_ids) + r.emitted for r in self.groups[g].requests.values())
        self.trace.append(
            {
                "name": name,
                "worker": worker,
                "group": g,
                "ts": started,
                "dur": dur,
                "batch": batch,
                "tokens": tokens,
                "context": context,
            }
        )

    def _gauges(self) -> None:
        running = sum(len(g.requests) for g in self.groups)
        self.meter.load(len(self.waiting), running, self.free_slots, self.cfg.max_batch)

    async def refresh_slots(self, timeout_s: float = 10.0) -> dict:
        """Ask both workers at once for their free KV slots; returns each worker's `ready` answer (or the error)
        within `timeout_s` (a worker busy with queued rounds answers late: its last known count stays)."""

        async def ask(name: str, worker) -> tuple[str, dict]:
            try:
                answer = await asyncio.wait_for(worker.call("ready"), timeout_s)
                self.free_slots[name] = answer["free_slots"]
                return name, answer
            except (WorkerLost, WorkerFailed, TimeoutError) as err:
                return name, {"error": str(err) or type(err).__name__}

        workers = {"target": self.target, "draft": self.draft if self.draft_alive else None}
        answers = dict(await asyncio.gather(*(ask(n, w) for n, w in workers.items() if w is not None)))
        self._gauges()
        return answers

    async def health(self) -> str | None:
        """Why the target cannot admit work (None when it can): it does not answer, the scheduler stopped, or no
        KV slot is free while no request runs (slots leaked)."""
        target = (await self.refresh_slots())["target"]
        if "error" in target:
            return target["error"]
        if not self.running:
            return "the scheduler stopped"
        if target["free_slots"] == 0 and not any(g.requests for g in self.groups):
            return "no free KV slot on the target while no request runs"
        return None

    def stats(self) -> dict:
        """Totals since start (the benchmark and the rollout diff two snapshots)."""
        running = sum(len(g.requests) for g in self.groups)
        slots = {
            name: {"free": free, "used": self.cfg.max_batch - free, "total": self.cfg.max_batch}
            for name, free in self.free_slots.items()
            if name == "target" or self.draft is not None
        }
        totals, acceptance = self.meter.totals, self.meter.acceptance
        return {
            **totals,
            "acceptance": acceptance.to_dict(),
            "acceptance_length": acceptance.acceptance_length,
            "acceptance_measured": self.meter.measured.to_dict(),  # measurement rounds' whole trees (a canary's)
            "draft_alive": self.draft_alive,
            "calibration": self.policy.calibration,
            "cost": self.policy.cost.coefficients(),
            "running": running,
            "waiting": len(self.waiting),
            "kv_slots": slots,
            "modes": [g.modes.state() for g in self.groups],  # what each micro-batch's mode chooser measured
            "transfer_bytes_per_round": {  # mean over target rounds (prefills' pairs included)
                d: totals[f"{d}_bytes"] / max(1, totals["rounds"]) for d in ("target_to_draft", "draft_to_target")
            },
        }
