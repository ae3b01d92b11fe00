"""Simulated target and draft workers: the calls and messages of `runtime.workers` (what the scheduler sees is
the same: `RoundOutput`, `SeqUpdate`, `DraftOutput`, `TreeSketch`, pairs to stash and hand over), with time
charged from a `CostModel` on the virtual clock and acceptance drawn from an `AcceptanceProfile`. Token ids
are placeholders; counts, slots, histories and bytes are kept as the real workers keep them.

Each worker is one device: its calls run one at a time (`colocated`: the drafter and the target share one).
A call costs `call_s` (RPC, scheduling), the transfer of what it reads from the other worker over the link,
and its forwards.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field

import torch

from orchestrator.runtime.clients import Client, WorkerFailed
from orchestrator.runtime.messages import DraftOutput, NewSequence, RoundOutput, SeqUpdate, TreeSketch
from orchestrator.sim.costs import AcceptanceProfile, CostModel
from orchestrator.sim.virtual import VirtualClock

TOKEN = 7  # every simulated token


@dataclass
class SimPairs:
    """What a target call hands the drafter: pairs per request, and their size on the wire."""

    counts: dict[str, int]
    nbytes: int


@dataclass
class SimTree:
    """A draft tree: per node its parent (-1: the root), depth (1-based) and rank among its siblings."""

    parents: list[int]
    depths: list[int]
    ranks: list[int]

    @property
    def size(self) -> int:
        return len(self.parents)


def tree_template(depth: int, topk: int, budget: int, profile: AcceptanceProfile) -> tuple[SimTree, list[float]]:
    """The tree an EAGLE-2 proposer grows (the `topk` best nodes of a level each get `topk` children, `depth`
    levels, the `budget` best nodes kept), with each node's score: the log of the drafter's claim that its path
    is accepted. Nodes are best first, so every prefix is a closed tree (a parent before its children)."""
    nodes: list[tuple[int, int, int, float]] = []  # parent, depth, rank, marginal P(path accepted)
    level = [(-1, 1.0)]  # (node index, marginal) of the nodes expanded
    for d in range(1, depth + 1):
        children = []
        for parent, marginal in level:
            rejected = 1.0  # earlier siblings all rejected
            for rank in range(topk):
                p = profile.p(d, rank)
                nodes.append((parent, d, rank, marginal * rejected * p))
                children.append((len(nodes) - 1, marginal * rejected * p))
                rejected *= 1 - p
        level = sorted(children, key=lambda c: -c[1])[:topk]
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i][3], nodes[i][1], i))[:budget]
    order.sort(key=lambda i: (nodes[i][1], -nodes[i][3], i))  # parents first (a closed tree whatever the ties)
    index = {node: pos for pos, node in enumerate(order)}
    tree = SimTree(
        [index[nodes[i][0]] if nodes[i][0] >= 0 else -1 for i in order],
        [nodes[i][1] for i in order],
        [nodes[i][2] for i in order],
    )
    claim = [min(1.0, profile.calibration * nodes[i][3]) for i in order]
    return tree, [math.log(max(c, 1e-30)) for c in claim]


def accepted_path(tree: SimTree, keep: list[int], profile: AcceptanceProfile, rng: random.Random) -> int:
    """Draft tokens the target accepts among the `keep` nodes: from the root, the children are tried in rank
    order, each accepted with its probability; the walk ends where none is."""
    children: dict[int, list[int]] = {}
    for node in sorted(keep, key=lambda n: tree.ranks[n]):
        children.setdefault(tree.parents[node], []).append(node)
    node, accepted = -1, 0
    while True:
        for child in children.get(node, []):
            if rng.random() < profile.p(tree.depths[child], tree.ranks[child]):
                node, accepted = child, accepted + 1
                break
        else:
            return accepted


@dataclass
class _Seq:
    context: int  # tokens in the KV cache
    answer: int  # tokens it will emit (EOS after them) unless max_tokens comes first
    max_tokens: int
    history: int  # committed pairs (the drafter's input)
    emitted: int = 0


@dataclass
class Device:
    """One accelerator: its calls take turns."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    busy_s: float = 0.0


class SimRef:
    """A later result of a simulated call in flight, to hand to another worker's call (as a Ray ref): that call
    starts once the result exists (a chained draft call)."""

    def __init__(self, task: asyncio.Task, index: int) -> None:
        self.task, self.index = task, index

    async def get(self):
        return (await self.task)[self.index]


class SimCall:
    """A simulated call in flight (it started when submitted): `refs`, its later results."""

    def __init__(self, task: asyncio.Task, returns: int) -> None:
        self.task, self.returns = task, returns
        self.refs = tuple(SimRef(task, i) for i in range(1, returns))

    async def result(self, timeout_s: float | None = None):
        out = await self.task
        return out[0] if self.returns > 1 else out


class SimWorker(Client):
    """The `runtime.clients` interface (`submit`, `cast`) over a simulated worker."""

    def __init__(self, clock: VirtualClock, costs: CostModel, device: Device) -> None:
        self.clock, self.costs, self.device = clock, costs, device
        self.calls = 0

    def submit(self, method: str, *args, returns: int = 1) -> SimCall:
        self.calls += 1
        return SimCall(asyncio.ensure_future(self._run(method, args)), returns)

    async def _run(self, method: str, args: tuple):
        try:
            work = getattr(self, method)
        except AttributeError as err:
            raise WorkerFailed(f"{method}: no such call") from err
        args = tuple([await a.get() if isinstance(a, SimRef) else a for a in args])
        return await work(*args)

    def cast(self, method: str, *args) -> None:
        getattr(self, f"_{method}")(*args)

    async def _spend(self, transfer_s: float, compute_s: float) -> float:
        """The call's overhead and the transfer of its inputs (off the device: the next call's arguments move
        while the device computes), then the compute once the device is free. Returns when the compute started."""
        await asyncio.sleep(self.costs.call_s + transfer_s)
        async with self.device.lock:
            started = self.clock.now
            await asyncio.sleep(compute_s)
            self.device.busy_s += compute_s
            return started


class SimTarget(SimWorker):
    def __init__(
        self,
        clock: VirtualClock,
        costs: CostModel,
        device: Device,
        profile: AcceptanceProfile,
        max_batch: int,
        seed: int = 0,
    ) -> None:
        super().__init__(clock, costs, device)
        self.profile, self.max_batch = profile, max_batch
        self.rng = random.Random(seed)
        self.seqs: dict[str, _Seq] = {}
        self.answers: dict[str, int] = {}  # request id -> answer length (the workload sets it at submit)

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self.seqs)

    async def ready(self) -> dict:
        return {"free_slots": self.free_slots, "max_batch": self.max_batch}

    def _pairs(self, counts: dict[str, int]) -> SimPairs:
        return SimPairs(counts, sum(counts.values()) * self.costs.aux_bytes_per_token)

    async def prefill(self, new: list[NewSequence]):
        updates, admitted = [], []
        for s in new:
            if not self.free_slots:
                updates.append(SeqUpdate(s.request_id, error="no free KV slot on the target", status=503, retry=True))
                continue
            n = len(s.prompt_ids)
            self.seqs[s.request_id] = _Seq(
                n, self.answers.pop(s.request_id, s.params.max_tokens), s.params.max_tokens, n
            )
            admitted.append(s)
        tokens = sum(len(s.prompt_ids) for s in admitted)
        cost = (self.costs.prefill or self.costs.target).seconds(tokens, tokens) if admitted else 0.0
        started = await self._spend(self.costs.round_s, cost)
        counts = {}
        for s in admitted:
            if s.request_id in self.seqs:  # not released meanwhile
                updates.append(self._emit(s.request_id, 1))
                counts[s.request_id] = len(s.prompt_ids)
        return self._output(updates, tokens, cost, started, counts)

    async def verify(self, keep: dict[str, list[int]], trees: dict[str, SimTree] | None):
        ids = [r for r in keep if r in self.seqs]
        updates = [
            SeqUpdate(r, error="the target no longer holds this request", status=503) for r in keep if r not in ids
        ]
        nodes = {r: (keep[r] if trees and r in trees else []) for r in ids}
        verified = sum(1 + len(n) for n in nodes.values())
        tree_bytes = sum(len(n) for n in nodes.values()) * self.costs.tree_bytes_per_node
        context = sum(self.seqs[r].context for r in ids)
        cost = self.costs.target.seconds(verified, context, tree=verified > len(ids)) if ids else 0.0
        started = await self._spend(self.costs.round_s + self._link(tree_bytes), cost)
        counts = {}
        for r in ids:
            if r not in self.seqs:  # released while the call waited
                continue
            accepted = accepted_path(trees[r], nodes[r], self.profile, self.rng) if nodes[r] else 0
            update = self._emit(r, accepted + 1)
            update.drafted, update.accepted = len(nodes[r]), accepted
            updates.append(update)
            if update.finish_reason is None:
                counts[r] = len(update.tokens)
        return self._output(updates, verified, cost, started, counts)

    async def history(self, request_ids: list[str], since: dict[str, int] | None = None):
        counts = {r: self.seqs[r].history - (since or {}).get(r, 0) for r in request_ids if r in self.seqs}
        pairs = self._pairs({r: n for r, n in counts.items() if n > 0})
        await self._spend(0.0, 0.0)
        return pairs.nbytes, pairs

    def _release(self, request_ids: list[str]) -> None:
        for r in request_ids:
            self.seqs.pop(r, None)
            self.answers.pop(r, None)

    def _link(self, nbytes: int) -> float:
        return 0.0 if self.costs.colocated else self.costs.link.seconds(nbytes)

    def _emit(self, rid: str, n: int) -> SeqUpdate:
        q = self.seqs[rid]
        n = min(n, q.answer - q.emitted, q.max_tokens - q.emitted)
        q.emitted += n
        q.context += n
        reason = "stop" if q.emitted >= q.answer else "length" if q.emitted >= q.max_tokens else None
        if reason is None:
            q.history += n
        else:
            self._release([rid])
        return SeqUpdate(rid, [TOKEN] * n, reason)

    def _output(self, updates, tokens: int, cost: float, started: float, counts: dict[str, int]):
        pairs = self._pairs(counts)
        out = RoundOutput(updates, tokens, cost, started, pairs.nbytes, self.free_slots)
        return out, pairs


class SimDraft(SimWorker):
    def __init__(
        self,
        clock: VirtualClock,
        costs: CostModel,
        device: Device,
        profile: AcceptanceProfile,
        shape: tuple[int, int, int],
        max_requests: int,
    ) -> None:
        super().__init__(clock, costs, device)
        self.depth, self.topk, budget = shape
        self.template, self.scores = tree_template(self.depth, self.topk, budget, profile)
        self._sketches = [  # the sketch of the template's first n nodes, for every n
            TreeSketch(torch.tensor(self.template.parents[:n]), torch.tensor(self.scores[:n]))
            for n in range(self.template.size + 1)
        ]
        self.max_requests = max_requests
        self.seen: dict[str, int] = {}

    @property
    def free_slots(self) -> int:
        return self.max_requests - len(self.seen)

    async def ready(self) -> dict:
        return {"free_slots": self.free_slots, "max_requests": self.max_requests, "incarnation": "sim"}

    async def propose(self, requests: list[tuple], reset: list[str] = (), *pairs: SimPairs):
        self._release(list(reset))
        new: dict[str, int] = {}
        for p in pairs:
            for rid, n in p.counts.items():
                new[rid] = new.get(rid, 0) + n
        drafted, ingest = {}, 0
        for rid, _params, cap in requests:
            if not new.get(rid) or (rid not in self.seen and not self.free_slots):
                continue
            self.seen[rid] = self.seen.get(rid, 0) + new[rid]
            ingest += new[rid]
            drafted[rid] = min(cap, self.template.size)
        context = sum(self.seen[r] for r in drafted)
        width = sum(1 for n in drafted.values() if n) * self.topk  # (no nodes: the states are only committed)
        cost = 0.0
        if drafted:  # the new states, then a forward per further level over the expanded nodes
            cost = self.costs.draft.seconds(ingest, context)
        if width:
            cost += (self.depth - 1) * self.costs.draft.seconds(width, context + width)
        pairs_bytes = sum(p.nbytes for p in pairs)
        link = 0.0 if self.costs.colocated else self.costs.link.seconds(pairs_bytes)
        started = await self._spend(link, cost)
        trees, sketches = {}, {}
        for rid, n in drafted.items():
            if rid not in self.seen:  # released while the call waited
                continue
            t = self.template
            trees[rid] = SimTree(t.parents[:n], t.depths[:n], t.ranks[:n])
            sketches[rid] = self._sketches[n]
        out = DraftOutput(
            sketches=sketches,
            compute_s=cost,
            started=started,
            pairs_bytes=pairs_bytes,
            incarnation="sim",
            seen={rid: self.seen[rid] for rid in trees},
            retired=[],
            free_slots=self.free_slots,
            trees_bytes=sum(t.size for t in trees.values()) * self.costs.tree_bytes_per_node,
            ingested=ingest,
        )
        return out, trees

    def _release(self, request_ids: list[str]) -> None:
        for r in request_ids:
            self.seen.pop(r, None)
