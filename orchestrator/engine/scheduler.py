"""SpecScheduler: continuous batching of many users' requests over a TargetWorker and a DraftWorker.

    ingress ──submit() / events()──> SpecScheduler ──> TargetWorker (Ray actor, a target node)
                                           └─────────> DraftWorker  (Ray actor, a draft node)

Live requests are split into micro-batches (two by default) that take turns, each running

    admit waiting requests (prefill) -> draft -> BudgetPolicy picks the nodes to verify -> verify -> stream

so while the target verifies group A's trees the drafter drafts group B's, and neither side idles (one
request: plain draft -> verify -> draft). Each round the global verification budget (tokens the target
verifies per round) is split among the group's requests by expected acceptance (`spec/budget.py`), and
`ModeChooser` runs rounds target-only while they measure faster than drafted ones at the current batch size
(the drafter catches up on the skipped states in its next round).

Faults: a draft call that fails (the actor died) turns the rounds target-only (greedy output is unchanged;
sampling stays exact); once the restarted actor answers, it gets every live request's history from the
target and speculation resumes. A target call that fails ends the affected requests with an error (HTTP
503); the restarted actor serves new ones. Every request ends by `request_timeout_s`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pydantic import Field

from orchestrator.config import StrictModel
from orchestrator.engine.sampling import SamplingParams
from orchestrator.engine.workers import NewSequence, RoundOutput
from orchestrator.spec.budget import BudgetPolicy, ModeChooser

log = logging.getLogger(__name__)


class SchedulerConfig(StrictModel):
    """How the scheduler batches and speculates."""

    max_batch: int = Field(16, ge=1, description="requests decoded at once (the target's KV slots)")
    budget_tokens: int = Field(64, ge=1, description="global verification budget: tokens per target round")
    max_nodes_per_request: int = Field(16, ge=0, description="most draft tokens one request gets per round")
    micro_batches: int = Field(2, ge=1, le=2, description="groups that take turns (2: pipelined)")
    adaptive: bool = Field(True, description="trim trees with the measured verify cost (False: fixed budgets)")
    request_timeout_s: float = Field(300.0, gt=0, description="every request ends by then")
    worker_timeout_s: float = Field(120.0, gt=0, description="a worker call that takes longer counts as failed")


class WorkerLost(Exception):
    """A worker call failed (the actor died or did not answer in time)."""


@dataclass
class Event:
    """What a request's stream receives: new tokens, then a finish reason or an error."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    status: int = 200


@dataclass(eq=False)
class _Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    deadline: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    group: int = -1
    emitted: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    last_token: float | None = None
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0


class SpecScheduler:
    """Owns the request queue and drives the workers (Ray actor handles) from one asyncio loop."""

    def __init__(self, target, draft, cfg: SchedulerConfig, metrics=None, trace_size: int = 4000) -> None:
        self.target, self.draft, self.cfg, self.metrics = target, draft, cfg, metrics
        self.policy = BudgetPolicy(cfg.budget_tokens, cfg.max_nodes_per_request, adaptive=cfg.adaptive)
        self.waiting: deque[_Request] = deque()
        self.requests: dict[str, _Request] = {}
        self.groups: list[list[str]] = [[] for _ in range(cfg.micro_batches)]
        self.backlog: list[list] = [[] for _ in range(cfg.micro_batches)]  # pairs refs not yet drafted from
        self.resync = [False] * cfg.micro_batches
        self.drafted_last = [False] * cfg.micro_batches  # a drafted round after target-only ones catches up
        self.draft_alive = draft is not None
        self.draft_incarnation: str | None = None  # changes when the draft actor restarts
        self.trace: deque[dict] = deque(maxlen=trace_size)
        self.totals: dict[str, float] = dict.fromkeys(_TOTALS, 0.0)
        self.per_depth: list[int] = []
        self._ids = itertools.count()
        self._cond: asyncio.Condition | None = None
        self._tasks: list[asyncio.Task] = []
        self._draft_ema = 0.0
        self.modes = ModeChooser()

    # -- client side -----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._cond = asyncio.Condition()
        loops = [self._group_loop(g) for g in range(self.cfg.micro_batches)]
        self._tasks = [asyncio.create_task(c) for c in [*loops, self._watchdog()]]

    async def submit(self, prompt_ids: list[int], params: SamplingParams) -> _Request:
        r = _Request(f"r{next(self._ids)}", list(prompt_ids), params, time.perf_counter() + self.cfg.request_timeout_s)
        self.requests[r.id] = r
        self.waiting.append(r)
        self._gauges()
        async with self._cond:
            self._cond.notify_all()
        return r

    async def events(self, r: _Request):
        """The request's events until it finishes or fails."""
        while True:
            event = await r.queue.get()
            yield event
            if event.finish_reason or event.error:
                return

    def abort(self, request_id: str) -> None:
        """The client left (or a stop string matched): forget the request, free its slots."""
        r = self.requests.get(request_id)
        if r is not None:
            self._end(r, Event(finish_reason="abort"))

    # -- the loops -------------------------------------------------------------------------------------------

    async def _group_loop(self, g: int) -> None:
        while True:
            async with self._cond:
                await self._cond.wait_for(lambda: self.waiting or self.groups[g])
            try:
                await self._admit(g)
                if self.groups[g]:
                    await self._round(g)
            except WorkerLost as err:
                self._target_lost(str(err))
                await self._await_worker(self.target, "target")
            except Exception as err:  # a bug must not take the other requests down: fail this group's
                log.exception("scheduler round failed")
                for rid in list(self.groups[g]):
                    self._fail(self.requests[rid], f"internal error: {err}", 500, "internal")

    async def _admit(self, g: int) -> None:
        live = sum(map(len, self.groups))
        share = -(-(live + len(self.waiting)) // len(self.groups))  # ceil: balance the groups
        take = min(self.cfg.max_batch - live, max(0, share - len(self.groups[g])), len(self.waiting))
        new = [self.waiting.popleft() for _ in range(take)]
        if not new:
            return
        for r in new:
            r.group = g
            self.groups[g].append(r.id)
        self._gauges()
        out_ref, pairs_ref = self.target.prefill.options(num_returns=2).remote(
            [NewSequence(r.id, r.prompt_ids, r.params) for r in new]
        )
        try:
            out = await self._call(out_ref, "target")
        except WorkerLost as err:  # nothing of these requests reached a client: queue them again
            for r in new:
                self.groups[g].remove(r.id)
                r.group = -1
            self._target_lost(str(err))
            self.waiting.extendleft(reversed(new))
            await self._await_worker(self.target, "target")
            return
        self._span("prefill", "target", g, out.started, out.compute_s, len(new), out.verified_tokens)
        self.backlog[g].append(pairs_ref)
        self._deliver(out)

    async def _round(self, g: int) -> None:
        ids = list(self.groups[g])
        keep, trees_ref, predicted = {rid: [] for rid in ids}, None, 0.0
        round_began = time.perf_counter()
        speculate = self.draft_alive and (not self.cfg.adaptive or self.modes.choose(len(ids)))
        if speculate:
            drafted = await self._draft(g, ids)
            if drafted is not None:
                sketches, trees_ref = drafted
                overhead = 0.0 if len(self.groups) > 1 else self._draft_ema  # pipelined: drafting is hidden
                have = [rid for rid in ids if rid in sketches]
                chosen, predicted = self.policy.allocate([sketches[rid] for rid in have], overhead)
                keep.update(zip(have, chosen, strict=True))
        began = time.perf_counter()
        out_ref, pairs_ref = self.target.verify.options(num_returns=2).remote(keep, trees_ref)
        out = await self._call(out_ref, "target")
        latency = time.perf_counter() - began
        self._span("verify", "target", g, out.started, out.compute_s, len(ids), out.verified_tokens)
        self.backlog[g].append(pairs_ref)
        accepted = sum(u.accepted for u in out.updates)
        self.policy.observe(out.verified_tokens, out.compute_s, predicted, accepted)
        emitted = sum(len(u.tokens) for u in out.updates)
        with_draft = trees_ref is not None
        catch_up = with_draft and not self.drafted_last[g]
        self.modes.observe(with_draft, len(ids), emitted, time.perf_counter() - round_began, catch_up=catch_up)
        self.drafted_last[g] = with_draft
        self._account(out, latency)
        self._deliver(out)

    async def _draft(self, g: int, ids: list[str]):
        """Draft trees for the group; None when the draft worker is gone or failed (the round goes
        target-only: drafts are an optimisation, never needed for a correct answer)."""
        import ray

        resync = self.resync[g]
        if resync:
            self.backlog[g] = [self.target.history.remote(ids)]
        requests = [(rid, self.requests[rid].params, self._node_cap(self.requests[rid])) for rid in ids]
        began = time.perf_counter()
        out_ref, trees_ref = self.draft.propose.options(num_returns=2).remote(requests, self.backlog[g], resync)
        try:
            out = await self._call(out_ref, "draft")
        except WorkerLost as err:
            self._draft_lost(str(err))
            return None
        except ray.exceptions.RayTaskError as err:  # the drafter raised: draft nothing this round, start over
            log.error("draft round failed, running it target-only: %s", err)
            self.totals["draft_errors"] = self.totals.get("draft_errors", 0) + 1
            self.release_draft(ids)
            self.resync[g], self.backlog[g] = True, []
            return None
        latency = time.perf_counter() - began
        self.backlog[g], self.resync[g] = [], False
        if self.draft_incarnation not in (None, out.incarnation):  # restarted between calls: its drafts are
            self._draft_restarted()  # still valid (verification is exact) but its caches miss history
        self.draft_incarnation = out.incarnation
        self._draft_ema = 0.8 * self._draft_ema + 0.2 * latency if self._draft_ema else latency
        self.totals["draft_calls"] += 1
        self.totals["draft_call_s"] += latency
        self.totals["draft_compute_s"] += out.compute_s
        self.totals["pairs_bytes"] += out.pairs_bytes
        self._span("draft", "draft", g, out.started, out.compute_s, len(ids), 0)
        if self.metrics:
            self.metrics.draft_latency.observe(latency)
        return {rid: (s.parents, s.scores) for rid, s in out.sketches.items()}, trees_ref

    def _node_cap(self, r: _Request) -> int:
        """Never draft past max_tokens: a round emits at most (nodes on the path) + 1 tokens."""
        return max(0, min(self.cfg.max_nodes_per_request, r.params.max_tokens - r.emitted - 1))

    async def _call(self, ref, worker: str):
        import ray

        try:
            return await asyncio.wait_for(ref, timeout=self.cfg.worker_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
            raise WorkerLost(f"{worker} worker died: {type(err).__name__}") from err
        except TimeoutError as err:
            raise WorkerLost(f"{worker} worker did not answer within {self.cfg.worker_timeout_s} s") from err

    # -- results ---------------------------------------------------------------------------------------------

    def _deliver(self, out: RoundOutput) -> None:
        now = time.perf_counter()
        for u in out.updates:
            r = self.requests.get(u.request_id)
            if r is None:  # aborted while the round ran
                if u.finish_reason is None:
                    self.target.release.remote([u.request_id])
                continue
            if r.last_token is None and self.metrics:
                self.metrics.ttft.observe(now - r.submitted)
            elif self.metrics:
                for _ in u.tokens:
                    self.metrics.itl.observe((now - r.last_token) / len(u.tokens))
            r.last_token = now
            r.emitted += len(u.tokens)
            r.drafted += u.drafted
            r.accepted += u.accepted
            r.queue.put_nowait(Event(list(u.tokens)))
            if u.finish_reason is not None:
                self._end(r, Event(finish_reason=u.finish_reason), released=True)

    def _account(self, out: RoundOutput, latency: float) -> None:
        drafted = [u.drafted for u in out.updates]
        accepted = [u.accepted for u in out.updates]
        n = len(out.updates)
        t = self.totals
        t["rounds"] += 1
        t["spec_rounds"] += 1 if sum(drafted) else 0
        t["batch"] += n
        t["verified_tokens"] += out.verified_tokens
        t["budget_tokens"] += self.cfg.budget_tokens
        t["drafted"] += sum(drafted)
        t["drafted_requests"] += sum(1 for d in drafted if d)
        t["accepted"] += sum(accepted)
        t["verify_calls"] += 1
        t["verify_call_s"] += latency
        t["verify_compute_s"] += out.compute_s
        t["pairs_bytes"] += out.pairs_bytes
        for a in accepted:
            while len(self.per_depth) < a:
                self.per_depth.append(0)
            for d in range(a):
                self.per_depth[d] += 1
        if self.metrics:
            self.metrics.round(n, out.verified_tokens, self.cfg.budget_tokens, drafted, accepted)
            self.metrics.verify_latency.observe(latency)

    def _end(self, r: _Request, event: Event, released: bool = False) -> None:
        """Finish a request: last event, leave its group, free its state in the workers."""
        self.requests.pop(r.id, None)
        if r in self.waiting:
            self.waiting.remove(r)
        elif r.group >= 0 and r.id in self.groups[r.group]:
            self.groups[r.group].remove(r.id)
            if not released:
                self.target.release.remote([r.id])
            self.release_draft([r.id])
        r.queue.put_nowait(event)
        self._gauges()

    def _fail(self, r: _Request, message: str, status: int, kind: str) -> None:
        if self.metrics:
            self.metrics.errors.inc(1, {"kind": kind})
        self.totals[f"errors_{kind}"] = self.totals.get(f"errors_{kind}", 0) + 1
        self._end(r, Event(error=message, status=status))

    def _target_lost(self, reason: str) -> None:
        """Every running request fails cleanly; waiting ones are served by the restarted target."""
        log.error("%s: failing %d running requests", reason, sum(map(len, self.groups)))
        self.totals["target_failures"] += 1
        for g, ids in enumerate(self.groups):
            for rid in list(ids):
                self._fail(self.requests[rid], f"{reason}; the request was lost, retry it", 503, "target_died")
            self.resync[g] = True  # the drafter's state of those requests is gone with them
            self.backlog[g] = []

    def _draft_lost(self, reason: str) -> None:
        if not self.draft_alive:
            return
        log.warning("%s: target-only rounds until it is back", reason)
        self.totals["draft_failures"] += 1
        if self.metrics:
            self.metrics.errors.inc(1, {"kind": "draft_died"})
        self.draft_alive = False
        self._draft_restarted()
        self._tasks.append(asyncio.create_task(self._await_draft()))

    def _draft_restarted(self) -> None:
        """The draft worker lost its caches: send every live request's full history with its next draft."""
        self.resync = [True] * len(self.groups)
        self.backlog = [[] for _ in self.groups]

    async def _await_draft(self) -> None:
        """Speculation resumes (after a history resync) once the restarted draft worker answers."""
        await self._await_worker(self.draft, "draft")
        self.draft_alive = True

    async def _await_worker(self, handle, name: str) -> None:
        """Poll a restarting worker until it answers (requests waiting meanwhile keep their deadlines)."""
        while True:
            try:
                await asyncio.wait_for(handle.ready.remote(), timeout=self.cfg.worker_timeout_s)
                break
            except Exception:  # noqa: BLE001 (still restarting)
                await asyncio.sleep(0.5)
        log.warning("%s worker is answering", name)

    def release_draft(self, ids: list[str]) -> None:
        if self.draft is not None:
            self.draft.release.remote(ids)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.perf_counter()
            for r in [r for r in self.requests.values() if r.deadline < now]:
                self._fail(r, f"request timed out after {self.cfg.request_timeout_s:g} s", 504, "timeout")

    # -- observability ---------------------------------------------------------------------------------------

    def _span(self, name: str, worker: str, g: int, started: float, dur: float, batch: int, tokens: int) -> None:
        self.trace.append(
            {"name": name, "worker": worker, "group": g, "ts": started, "dur": dur, "batch": batch, "tokens": tokens}
        )

    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.queue_depth.set(len(self.waiting))
            self.metrics.running.set(sum(map(len, self.groups)))

    def stats(self) -> dict:
        """Totals since start (the benchmark diffs two snapshots)."""
        return {
            **self.totals,
            "accepted_per_depth": list(self.per_depth),
            "draft_alive": self.draft_alive,
            "calibration": self.policy.calibration,
            "cost": self.policy.cost.coefficients(),
            "running": sum(map(len, self.groups)),
            "waiting": len(self.waiting),
        }


_TOTALS = (
    "rounds",
    "spec_rounds",
    "batch",
    "verified_tokens",
    "budget_tokens",
    "drafted",
    "drafted_requests",  # request-steps verified with a draft (acceptance length = 1 + accepted / this)
    "accepted",
    "draft_calls",
    "draft_call_s",
    "draft_compute_s",
    "verify_calls",
    "verify_call_s",
    "verify_compute_s",
    "pairs_bytes",
    "target_failures",
    "draft_failures",
)
