"""The scheduler's policies: how to split the target's verification budget among requests by expected
acceptance (`BudgetPolicy`), and whether a round drafts at all (`ModeChooser`).

Each draft node carries the drafter's probability of the path to it, exp(score): the chance that the target
accepts it, when the drafter is calibrated (`calibration` rescales it: accepted / predicted draft tokens over
recent rounds).
A round over n requests emits n tokens for sure (each request's bonus or correcting token) plus, in
expectation, the sum of those probabilities over the verified nodes. `BudgetPolicy.allocate` takes nodes
best first across all requests (`spec.tree.BestFirst`: a node only after its parent and its earlier-drawn
siblings, which keeps verification lossless) while

    (n + sum of p over the k chosen nodes) / (t_verify(n + k) + overhead)     expected tokens per second

still grows and n + k stays within the global budget. `t_verify` is a line fitted online to the measured
times of rounds that verified draft nodes, so on a compute-bound target (a CPU, a large batch) the trees shrink
to what pays for itself, while at concurrency 1 on a memory-bound target a request gets its whole tree.
Target-only rounds stay out of the fit: a plain decode step takes another path (no tree mask; on a CPU one
token is a matrix-vector product), and on SmolLM2 here it costs 75 ms against ~95 ms for 2 to 9 tokens. A line
through both read that step as a cost per node (3.3 ms in a probe at concurrency 1, where a node costs ~0.5 ms)
and cut trees. Whether to draft at all is the `ModeChooser`'s call, from measured rounds.

A drafted round verifies at least its best node, whatever the cost model says. Otherwise a drafter whose
calibration sank (a bad stretch, a random drafter) was never verified again: its calibration, fed only by
verified nodes, could not recover, the ModeChooser's probes drafted and verified nothing, and a rollout's
acceptance gate saw no drafts on that backend and waited out its whole window (10 min, measured).

    budget 5, cost flat: a = [.9, .5 (child of .9)], b = [.3]  ->  roots a, b + a:.9, a:.5, b:.3
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from orchestrator.spec.tree import BestFirst


@dataclass
class LinearCost:
    """t(x) = a + b * x seconds for verifying x tokens, least squares over recent rounds (older ones fade)."""

    decay: float = 0.95
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + tokens, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + tokens * tokens, d * self.sxy + tokens * seconds

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), or None until rounds of different sizes have been seen."""
        var = self.n * self.sxx - self.sx * self.sx
        if self.n < 4 or var <= 1e-9 * max(1.0, self.sxx * self.n):
            return None
        b = max(0.0, (self.n * self.sxy - self.sx * self.sy) / var)
        a = max(1e-6, (self.sy - b * self.sx) / self.n)
        return a, b

    def __call__(self, tokens: int) -> float | None:
        coef = self.coefficients()
        return None if coef is None else coef[0] + coef[1] * tokens


@dataclass
class BudgetPolicy:
    """Global verification budget (tokens per target round) and the cost model that trims it."""

    budget_tokens: int
    max_nodes_per_request: int
    adaptive: bool = True  # False: every request verifies its whole tree (fixed per-request budgets)
    calibration: float = 1.0  # accepted / predicted draft tokens over recent rounds (see `observe`)
    cost: LinearCost | None = None
    calibration_decay: float = 0.98  # per round: a memory of ~50 rounds
    _accepted: float = 0.0
    _predicted: float = 0.0

    def __post_init__(self) -> None:
        self.cost = self.cost or LinearCost()

    def allocate(
        self, sketches: list[tuple[torch.Tensor, torch.Tensor]], overhead_s: float = 0.0
    ) -> tuple[list[list[int]], float]:
        """sketches: (parents [n], scores [n]) per request. Returns the nodes to verify per request (ascending)
        and the expected number of accepted draft tokens."""
        n = len(sketches)
        room = max(0, self.budget_tokens - n) if self.adaptive else n * self.max_nodes_per_request
        order = BestFirst([(parents.tolist(), scores.tolist()) for parents, scores in sketches])
        chosen: list[list[int]] = [[] for _ in sketches]
        expected, taken = 0.0, 0
        best_rate = self._rate(n, 0.0, 0, overhead_s)
        while taken < room and (best := order.pop()) is not None:
            r, node = best
            if len(chosen[r]) >= self.max_nodes_per_request:
                continue  # this request is full: its other nodes stay out
            p = min(1.0, self.calibration * math.exp(order.scores[r][node]))
            rate = self._rate(n, expected + p, taken + 1, overhead_s)
            if taken and best_rate is not None and rate is not None and rate <= best_rate:
                break  # the next node no longer pays for its verification (the first always goes: module docstring)
            best_rate = rate
            order.take(r, node)
            chosen[r].append(node)
            expected += p
            taken += 1
        return [sorted(c) for c in chosen], expected

    def _rate(self, n: int, expected: float, k: int, overhead_s: float) -> float | None:
        t = self.cost(n + k) if self.adaptive else None
        return None if t is None else (n + expected) / (t + overhead_s)

    def observe(self, requests: int, verified_tokens: int, verify_s: float, predicted: float, accepted: int) -> None:
        """Feed back one round of `requests` requests: its cost (when it verified draft nodes: see the module's
        docstring), and how many draft tokens were predicted vs accepted."""
        if verified_tokens > requests:
            self.cost.observe(verified_tokens, verify_s)
        if predicted > 0:
            # A ratio of sums. It was a running product of per-round ratios, i.e. a geometric mean: a round that
            # accepts nothing (half of them with a useful drafter) pulled it down more than a good round pushed
            # it up: a calibrated drafter's sank to 0.45 (tests/runtime/test_policies.py), the served demo drafter's
            # to its floor (0.05, measured; now 0.86-0.94), and its trees were cut to ~3 of 8 nodes.
            d = self.calibration_decay
            self._accepted = d * self._accepted + accepted
            self._predicted = d * self._predicted + predicted / self.calibration  # the drafter's own claim
            self.calibration = min(4.0, max(0.05, self._accepted / self._predicted))


@dataclass
class ModeChooser:
    """Drafted or target-only rounds, whichever has measured more tokens per second at this batch size (log2
    buckets of the number of requests in the round). The losing mode is re-measured for `probe_rounds` rounds
    (fewer at larger batches, whose rounds average over more requests: probe_rounds // bucket, at least 2)
    every `probe_every` rounds, twice as rarely after each probe that confirms the choice (up to
    `max_backoff` times), so a drafter that starts to pay (or stops) is noticed while probing a mode that keeps
    losing costs little. What it measures is the round as the scheduler lives it (draft call, verify
    call, waiting for the other micro-batch), so it holds on any hardware: a compute-bound target, a drafter
    sharing its cores, network hops.

    A mode's rate is (average tokens per request and round) / (average seconds per round): a drafted round
    yields 1 to depth+1 tokens, and averaging per-round rates let one unlucky round flip the choice. The two
    averages have different memories. A round's cost varies little, so seconds are a moving average with
    `smoothing`, and a mode not measured for `probe_every` rounds starts a fresh one (a probe replaces a stale
    cost instead of nudging it). Tokens per drafted round vary a lot (acceptance differs per request and per
    stretch of text), so they are averaged over the last ~1/`yield_smoothing` drafted rounds, probes included,
    and never restarted. With a short memory, a dip of acceptance switched drafting off and the next short
    probe, landing on a hard stretch as often as not, kept it off for longer and longer: a simulated drafter
    accepting 55% per step at 1.5x a target-only round's cost drafted 54% of its rounds at concurrency 1 (the
    serving benchmark measured 54%), now 95% (tests/runtime/test_policies.py). A drafted round that follows
    target-only ones is not measured (`catch_up`): the drafter first commits every state it skipped, a cost of
    the stretch before it, not of drafting (measured at concurrency 1 in-domain: counting it kept drafting off
    although drafted rounds were faster)."""

    probe_every: int = 16
    probe_rounds: int = 6
    smoothing: float = 0.1
    yield_smoothing: float = 1 / 64
    sums: dict = field(default_factory=dict)  # (drafted, bucket) -> [tokens per request, seconds] per round
    seen: dict = field(default_factory=dict)  # (drafted, bucket) -> [rounds measured, in this streak, last round]
    rounds: int = 0
    max_backoff: int = 16
    backoff: dict = field(default_factory=dict)  # bucket -> probe interval in units of probe_every
    probe: tuple[bool, int] | None = None  # the mode being probed, rounds left
    probed: tuple[int, bool] | None = None  # (bucket, mode) of the last probe, until it is judged
    probing: bool = False  # the last choice was a probe

    def choose(self, n: int) -> bool:
        """True: draft this round."""
        bucket = n.bit_length()
        self.rounds += 1
        self.probing = False
        rounds = max(2, self.probe_rounds // bucket)
        if self._count(True, bucket) < rounds or self._count(False, bucket) < rounds:
            return self._count(True, bucket) < rounds  # measure drafted rounds first, then target-only ones
        if self.probe is None:
            best = self.rate(True, bucket) >= self.rate(False, bucket)
            if self.probed is not None:  # the last probe is over: did it change the choice in its bucket?
                b, mode = self.probed
                won = (self.rate(True, b) >= self.rate(False, b)) == mode
                self.backoff[b] = 1 if won else min(self.max_backoff, 2 * self.backoff.get(b, 1))
                self.probed = None
            if self.rounds % (self.probe_every * self.backoff.get(bucket, 1)):
                return best
            self.probe, self.probed = (not best, rounds), (bucket, not best)
        mode, left = self.probe
        self.probe = (mode, left - 1) if left > 1 else None
        self.probing = True
        return mode

    def rate(self, drafted: bool, bucket: int) -> float:
        """Measured tokens per second per request of a mode at a batch-size bucket (n.bit_length())."""
        tokens, seconds = self.sums[(drafted, bucket)]
        return tokens / max(seconds, 1e-6)

    def _count(self, drafted: bool, bucket: int) -> int:
        return self.seen.get((drafted, bucket), [0])[0]

    def observe(self, drafted: bool, n: int, tokens: int, seconds: float, catch_up: bool = False) -> None:
        if catch_up:  # measure the round after it instead
            if self.probing:
                self.probe = (True, (self.probe[1] if self.probe else 0) + 1)
            return
        key = (drafted, n.bit_length())
        total, streak, last = self.seen.get(key, [0, 0, 0])
        if self.rounds - last > self.probe_every:
            streak = 0  # stale: start afresh
        a = max(self.smoothing, 1.0 / (streak + 1))  # a fresh streak: its running mean
        y = max(self.yield_smoothing, 1.0 / (total + 1))  # the running mean of every round, then a long EMA
        per_request = tokens / max(1, n)  # comparable across the batch sizes of one bucket
        old_tokens, old_seconds = self.sums.get(key, (per_request, seconds))
        self.sums[key] = ((1 - y) * old_tokens + y * per_request, (1 - a) * old_seconds + a * seconds)
        self.seen[key] = [total + 1, streak + 1, self.rounds]
