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

import logging
import math
from collections import deque
from dataclasses import dataclass, field

import torch

from orchestrator.spec.tree import BestFirst

log = logging.getLogger(__name__)


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
    _probes: int = 0

    def __post_init__(self) -> None:
        self.cost = self.cost or LinearCost()

    def allocate(
        self,
        sketches: list[tuple[torch.Tensor, torch.Tensor]],
        overhead_s: float = 0.0,
        whole: bool = False,
        caps: list[int] | None = None,
    ) -> tuple[list[list[int]], float]:
        """sketches: (parents [n], scores [n]) per request. Returns the nodes to verify per request (ascending)
        and the expected number of accepted draft tokens. `whole` (or adaptive off): every node of every tree,
        up to its cap, whatever the budget and the cost model say. caps: most nodes per request (default
        max_nodes_per_request)."""
        n = len(sketches)
        caps = [min(c, self.max_nodes_per_request) for c in caps] if caps else [self.max_nodes_per_request] * n
        trim = self.adaptive and not whole
        room = max(0, self.budget_tokens - n) if trim else sum(caps)
        if trim and self.cost.coefficients() is None:
            room = self._probe_room(min(room, sum(min(len(p), c) for (p, _), c in zip(sketches, caps, strict=True))))
        order = BestFirst([(parents.tolist(), scores.tolist()) for parents, scores in sketches])
        chosen: list[list[int]] = [[] for _ in sketches]
        expected, taken = 0.0, 0
        best_rate = self._rate(n, 0.0, 0, overhead_s)
        while taken < room and (best := order.pop()) is not None:
            r, node = best
            if len(chosen[r]) >= caps[r]:
                continue  # this request is full: its other nodes stay out
            p = min(1.0, self.calibration * math.exp(order.scores[r][node]))
            rate = self._rate(n, expected + p, taken + 1, overhead_s)
            if trim and taken and best_rate is not None and rate is not None and rate <= best_rate:
                break  # the next node no longer pays for its verification (the first always goes: module docstring)
            best_rate = rate
            order.take(r, node)
            chosen[r].append(node)
            expected += p
            taken += 1
        return [sorted(c) for c in chosen], expected

    def _probe_room(self, room: int) -> int:
        """Until the cost line is fitted (it needs rounds of different sizes), rounds verify an eighth, a quarter,
        half and all of what they could, in turn. Verifying everything while the budget was full gave every round
        the same size, and the line waited for the batch to change: Llama-3.1-8B on a simulated GB200 at 64 users
        verified all 1024 tokens in 70 of 347 drafted rounds, and lost 10% to a fixed chain of 5."""
        shift = 3 - self._probes % 4
        self._probes += 1
        return max(1, room >> shift)

    def _rate(self, n: int, expected: float, k: int, overhead_s: float) -> float | None:
        t = self.cost(n + k) if self.adaptive else None
        return None if t is None else (n + expected) / (t + overhead_s)

    def observe(self, requests: int, verified_tokens: int, verify_s: float, predicted: float, accepted: int) -> None:
        """Feed back one round of `requests` requests: its cost (when it verified draft nodes: see the module's
        docstring), and how many draft tokens were predicted vs accepted."""
        if verified_tokens > requests:
            self.cost.observe(verified_tokens, verify_s)
        if predicted > 0:
            # A ratio of (decayed) sums, not a mean of per-round ratios: a round that accepts nothing (half of
            # them with a useful drafter) must not pull it down more than a good round pushes it up.
            d = self.calibration_decay
            self._accepted = d * self._accepted + accepted
            self._predicted = d * self._predicted + predicted / self.calibration  # the drafter's own claim
            self.calibration = min(4.0, max(0.05, self._accepted / self._predicted))


@dataclass
class Measured:
    """One mode at one batch-size bucket, as `ModeChooser` measured it."""

    tokens: float  # per request and round: long memory (yield_smoothing)
    seconds: float  # per round: moving average (smoothing), restarted when stale
    rounds: int = 0  # rounds measured, in all
    streak: int = 0  # ... since it was last stale
    last: int = 0  # the choice it was last measured at


def _sizes(bucket: int) -> str:
    """The batch sizes of a bucket (n.bit_length()): "1", "2-3", "4-7", ..."""
    lo, hi = 1 << (bucket - 1), (1 << bucket) - 1
    return f"{lo}-{hi}" if hi > lo else str(lo)


@dataclass
class Probe:
    """Rounds of the mode `ModeChooser` is not choosing, at `bucket`; judged once `left` reaches 0."""

    mode: bool
    bucket: int
    left: int


@dataclass
class ModeChooser:
    """Drafted or target-only rounds, whichever has measured more tokens per second at this batch size (log2 buckets
    of the number of requests in the round); switching to drafting only where it wins by more than `margin`. The
    losing mode is re-measured for `probe_rounds` rounds (fewer at larger batches, whose rounds average over more
    requests: probe_rounds // bucket, at least 2) every `probe_every` rounds, twice as rarely after each probe that
    confirms the choice (up to `max_backoff` times), so a drafter that starts to pay (or stops) is noticed while
    probing a mode that keeps losing costs little. What it measures is the round as the scheduler lives it (draft
    call, verify call, waiting for the other micro-batch), so it holds on any hardware: a compute-bound target, a
    drafter sharing its cores, network hops.

    A mode's rate is (average tokens per request and round) / (average seconds per round): a drafted round
    yields 1 to depth+1 tokens, and averaging per-round rates let one unlucky round flip the choice. The two
    averages have different memories. A round's cost varies little, so seconds are a moving average with
    `smoothing`, and a mode not measured for `probe_every` rounds starts a fresh one (a probe replaces a stale
    cost instead of nudging it). Tokens per drafted round vary a lot (acceptance differs per request and per
    stretch of text), so they are averaged over the last ~1/`yield_smoothing` drafted rounds, probes included,
    and never restarted: with a short memory, a dip of acceptance switches drafting off and the next short probe,
    landing on a hard stretch as often as not, keeps it off (tests/runtime/test_policies.py). A drafted round
    that follows target-only ones is not measured (`catch_up`): the drafter first commits every state it
    skipped, a cost of the stretch before it, not of drafting; except at a batch size whose drafted rounds are
    all catch-ups (`_measure_catch_up`). A bucket serving target-only switches to drafting
    only on a fresh measurement of it that spans `confirm_rounds` drafted rounds in a row (`_best`,
    `_unconfirmed`): two rounds of a probe are too few to judge by.

    Probing is paid for from a budget. Each probe round adds the time it lost against the better mode to a debt:
    its seconds minus what its tokens would have taken at the better mode's rate, a catch-up round included.
    Every other round pays back `probe_overhead` of its seconds, and a probe starts only without debt. So a
    losing mode costs about `probe_overhead` of the time however badly it loses, and a mode that loses by
    little is probed as often as the backoff allows. Without the budget, a drafter that does not pay cost 5-11%
    on this CPU: a probe and its catch-up each cost about two rounds, at rounds 16, 32, 64 and so on."""

    probe_every: int = 16
    probe_rounds: int = 6
    smoothing: float = 0.1
    yield_smoothing: float = 1 / 64
    max_backoff: int = 16
    probe_overhead: float = 0.02
    confirm_rounds: int = 8
    margin: float = 0.03  # a bucket serving target-only drafts only where drafting measured this much faster
    debt: float = 0.0  # seconds probes lost that later rounds have not yet paid back (see the docstring)
    measured: dict[tuple[bool, int], Measured] = field(default_factory=dict)  # (drafted, bucket) -> its rounds
    backoff: dict[int, int] = field(default_factory=dict)  # bucket -> probe interval in units of probe_every
    probe: Probe | None = None  # the current probe, or the last one until it is judged
    why: str = "best"  # the last choice: "start" (a bucket's first measurements), "probe" or "best"
    chosen: dict[int, bool] = field(default_factory=dict)  # bucket -> the mode it last chose (to log a switch)
    rounds: int = 0  # choices made
    switches: deque = field(default_factory=lambda: deque(maxlen=16))  # the last switches, as /stats shows them
    confirmed: dict[int, int] = field(default_factory=dict)  # bucket -> the round its last confirmation began
    start_catch_ups: dict[int, int] = field(default_factory=dict)  # bucket -> catch-ups among its first rounds

    def choose(self, n: int) -> bool:
        """True: draft this round."""
        bucket = n.bit_length()
        self.rounds += 1
        self.why = "best"
        rounds = self._start_rounds(bucket)
        if self._count(True, bucket) < rounds or self._count(False, bucket) < rounds:
            self.why = "start"
            return self._count(True, bucket) < rounds  # measure drafted rounds first, then target-only ones
        if self.probe is None or self.probe.left == 0:
            if self.probe is not None:  # the last probe is over: did it change the choice in its bucket?
                b, mode = self.probe.bucket, self.probe.mode
                won = self._drafting_pays(b) == mode
                self.backoff[b] = 1 if won else min(self.max_backoff, 2 * self.backoff.get(b, 1))
                self.probe = None
            best = self._best(bucket)
            if self.chosen.setdefault(bucket, best) != best:
                self.chosen[bucket] = best
                self._log_switch(bucket, best)
            if not best and (more := self._unconfirmed(bucket)):
                self.probe = Probe(mode=True, bucket=bucket, left=more)
                self.confirmed[bucket] = self.rounds
            elif self.rounds % (self.probe_every * self.backoff.get(bucket, 1)) or self.debt > 0:
                return best
            else:
                self.probe = Probe(mode=not best, bucket=bucket, left=rounds)
        self.probe.left -= 1
        self.why = "probe"
        return self.probe.mode

    def state(self) -> dict:
        """What it has measured, per batch size (`/stats` shows it): each mode's tokens per request and round, its
        milliseconds per round and rounds measured, and the mode it chooses there; and the probing debt."""
        buckets = sorted({b for _, b in self.measured})
        out: dict = {"debt_s": self.debt, "switches": list(self.switches)}
        for b in buckets:
            modes = {
                name: {"tokens": m.tokens, "ms": 1e3 * m.seconds, "rounds": m.rounds}
                for name, drafted in (("drafted", True), ("target_only", False))
                if (m := self.measured.get((drafted, b))) is not None
            }
            if len(modes) == 2:
                choice = self.chosen.get(b, self._drafting_pays(b))
                modes["choice"] = "drafted" if choice else "target_only"
            out[_sizes(b)] = modes
        return out

    def _log_switch(self, bucket: int, drafting: bool) -> None:
        """A switch of mode at a batch size, with what decided it (rare: at most once per probe)."""
        d, p = self.measured[(True, bucket)], self.measured[(False, bucket)]
        self.switches.append(
            {
                "round": self.rounds,
                "batches": _sizes(bucket),
                "to": "drafted" if drafting else "target_only",
                **{
                    name: {"tokens": m.tokens, "ms": 1e3 * m.seconds, "rounds": m.rounds, "streak": m.streak}
                    for name, m in (("drafted", d), ("target_only", p))
                },
            }
        )
        log.info(
            "batches of %s requests now %s: drafted %.2f tokens per request in %.1f ms, target-only %.2f in %.1f ms",
            _sizes(bucket),
            "draft" if drafting else "go target-only",
            d.tokens,
            1e3 * d.seconds,
            p.tokens,
            1e3 * p.seconds,
        )

    def _account(self, bucket: int, per_request: float, seconds: float) -> None:
        """The probing budget: a probe round's loss against the better mode goes into the debt, any other round
        pays back `probe_overhead` of its time."""
        if self.why != "probe":
            self.debt = max(0.0, self.debt - self.probe_overhead * seconds)
            return
        if (True, bucket) not in self.measured or (False, bucket) not in self.measured:
            return  # the bucket's first measurements: charged once both modes have theirs (`_charge_start`)
        best = max(self.rate(True, bucket), self.rate(False, bucket))  # tokens per request and second
        self.debt += max(0.0, seconds - per_request / best)

    def _charge_start(self, bucket: int) -> None:
        """Both modes of a bucket are measured for the first time: the rounds spent on the losing one go into the
        debt like a probe's (so the first probe waits until they are paid back). Not where the drafted ones were
        catch-ups (`_measure_catch_up`): their cost is the stretch before them, and one after a lost drafter
        carries whole histories (seconds), which charged as start rounds held every probe back for minutes."""
        if self.start_catch_ups.get(bucket, 0) > self._start_rounds(bucket):
            return
        drafted, plain = self.measured[(True, bucket)], self.measured[(False, bucket)]
        best = max(self.rate(True, bucket), self.rate(False, bucket))
        loser = drafted if self.rate(True, bucket) < best else plain
        self.debt += loser.rounds * max(0.0, loser.seconds - loser.tokens / best)

    def _best(self, bucket: int) -> bool:
        """The mode with the higher measured rate (to switch to drafting: by more than `margin`), except that a bucket
        serving target-only starts drafting only on a fresh measurement of drafting. A drafted cost not measured for
        `probe_every` rounds was taken under another load: when users arrive, every round grows slower, target-only ones
        included, and a stale drafted cost measured at a lighter load then looks cheap. Switching on it drafted dozens
        of rounds at 16 users that each cost twice a target-only one (docs/benchmarks.md); the next probe refreshes it.
        And the fresh measurement must span `confirm_rounds` drafted rounds in a row (`_unconfirmed` drafts the rest at
        once). Going target-only needs no such proof: it is the baseline, and a wrong switch costs only the drafter's
        gain until the next probe."""
        best = self._drafting_pays(bucket)
        drafted = self.measured[(True, bucket)]
        if best and not self.chosen.get(bucket, True):
            return self._recent(drafted.last) and drafted.streak >= self.confirm_rounds
        return best

    def _recent(self, round_: int) -> bool:
        """Whether `round_` lies within the last `probe_every` choices (a measurement from then is fresh)."""
        return self.rounds - round_ <= self.probe_every

    def _unconfirmed(self, bucket: int) -> int:
        """Drafted rounds to measure before a bucket serving target-only may switch to drafting: drafting measured
        faster there, freshly, but on fewer than `confirm_rounds` rounds in a row (0: none; at most one such
        probe per bucket every `probe_every` rounds). A probe at batches of 4 or more is 2 rounds, a drafted
        round's time varies by ~20% on this CPU, and target-only rounds at a batch size that users pass through
        (a request ended, the next one not yet admitted) are slowed by the churn around them: where drafting
        lost by 10-20%, one or two lucky drafted rounds switched to it, and it drafted by choice until its own
        rounds pulled the mean back (41 rounds in one 4-user A/A level; docs/benchmarks.md)."""
        drafted = self.measured[(True, bucket)]
        if not self._drafting_pays(bucket) or not self._recent(drafted.last):
            return 0
        if bucket in self.confirmed and self._recent(self.confirmed[bucket]):
            return 0
        return max(0, self.confirm_rounds - drafted.streak)

    def excess(self, n: int, tokens: int, seconds: float) -> float | None:
        """Seconds a drafted round of `n` requests that yielded `tokens` took beyond what target-only rounds
        would have taken for them, at the target-only cost measured at its batch size (negative: drafting saved
        time); None where target-only has not been measured yet. What drafting costs, or gains, by accounting:
        unlike a comparison of two deployments, it does not see how their processes happened to share cores."""
        plain = self.measured.get((False, n.bit_length()))
        if plain is None:
            return None
        return seconds - tokens / max(1, n) * plain.seconds / max(plain.tokens, 1e-6)

    def _measure_catch_up(self, bucket: int) -> bool:
        """Whether a catch-up round is measured after all. A probe's is not: the probe gets a round more, and the
        round after it, in step with the drafter, is measured instead. A bucket's first drafted rounds ("start")
        are drafted only at its own batch size, and where that size is one users pass through (a request ended,
        the next not yet admitted), the round before was target-only at another size, so each of them is a
        catch-up: not measured, the bucket never had its first measurements and drafted a catch-up at every
        visit, for as long as the server ran (3 per 20 s at 4 users across nodes, each a stall on a thin link;
        docs/operating/nodes.md). So once a bucket's start has skipped as many catch-ups as it has start rounds,
        they are measured as they are: drafting at that batch size comes with a catch-up."""
        if self.why == "probe":
            self.probe.left += 1
            return False
        if self.why != "start":
            return False
        skipped = self.start_catch_ups.get(bucket, 0)
        self.start_catch_ups[bucket] = skipped + 1
        return skipped >= self._start_rounds(bucket)

    def _start_rounds(self, bucket: int) -> int:
        """Rounds of each mode a bucket measures first, and a probe's length there (larger batches average more)."""
        return max(2, self.probe_rounds // bucket)

    def _drafting_pays(self, bucket: int) -> bool:
        """Whether drafted rounds measured faster than target-only ones at a batch-size bucket: by more than `margin`
        where the bucket serves target-only, by anything where it drafts. Without the band, where the two measured
        about even every switch to drafting began with a catch-up, and at 16 users here the chooser switched 16
        times in 200 rounds on rates 1-3% apart (drafted 1.4 tokens per request in 140-168 ms against one in
        100-129): speculation on ran 2% behind off (0.98x [0.96, 0.99]) while its own accounting said drafting
        saved 6.5%."""
        threshold = 1.0 if self.chosen.get(bucket, True) else 1.0 + self.margin
        return self.rate(True, bucket) > threshold * self.rate(False, bucket)

    def rate(self, drafted: bool, bucket: int) -> float:
        """Measured tokens per second per request of a mode at a batch-size bucket (n.bit_length())."""
        m = self.measured[(drafted, bucket)]
        return m.tokens / max(m.seconds, 1e-6)

    def _count(self, drafted: bool, bucket: int) -> int:
        m = self.measured.get((drafted, bucket))
        return m.rounds if m is not None else 0

    def observe(self, drafted: bool, n: int, tokens: int, seconds: float, catch_up: bool = False) -> None:
        per_request = tokens / max(1, n)  # comparable across the batch sizes of one bucket
        self._account(n.bit_length(), per_request, seconds)
        if catch_up and not self._measure_catch_up(n.bit_length()):
            return
        m = self.measured.setdefault((drafted, n.bit_length()), Measured(per_request, seconds))
        if not self._recent(m.last):
            m.streak = 0  # stale: start afresh
        a = max(self.smoothing, 1.0 / (m.streak + 1))  # a fresh streak: its running mean
        y = max(self.yield_smoothing, 1.0 / (m.rounds + 1))  # the running mean of every round, then a long EMA
        m.tokens = (1 - y) * m.tokens + y * per_request
        m.seconds = (1 - a) * m.seconds + a * seconds
        m.rounds, m.streak, m.last = m.rounds + 1, m.streak + 1, self.rounds
        other = self.measured.get((not drafted, m_bucket := n.bit_length()))
        if m.rounds == 1 and other is not None:
            self._charge_start(m_bucket)
