"""The canary's decision, as a statistical test on the drafts both backends verified over the same window.

What is compared is accepted draft tokens per draft (acceptance length - 1), whose mean and variance the
counters give exactly: the accepted path is a prefix, so `accepted_per_pos[d]` counts the drafts that accepted
more than d tokens, and E[A^2] = sum_d (2d + 1) accepted_per_pos[d] / drafts. The candidate is

    promoted       when the interval of (canary - stable) lies above -tolerance (it is no worse, with confidence);
    rolled back    when it lies below -tolerance, or the canary accepted nothing in min_drafts drafts;
    inconclusive   when the longest window ends first: the stable backend keeps serving.

Looks are sequential with alpha spending: look k (k = 0, 1, ...) happens once the smaller side has
min_drafts * 2^k drafts and uses level alpha / 2^(k+1), so however many looks a window takes, the chance of a
wrong decision stays within alpha; the last look, when the window runs out, spends the next level. Drafts of one
request are correlated (acceptance depends on the prompt), so the interval is narrower than it should be when a
window holds few requests: min_drafts (default 50) bounds that.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist

from orchestrator.spec.acceptance import Acceptance


def accepted_moments(a: Acceptance) -> tuple[float, float]:
    """Mean and variance of accepted draft tokens per draft. Counters without a consistent per-position split
    (older exporters) get the largest variance their mean allows (Bhatia-Davis: A in [0, draft tokens/draft])."""
    if not a.drafts:
        return 0.0, 0.0
    mean = a.accepted / a.drafts
    if sum(a.accepted_per_pos) == a.accepted:
        second = sum((2 * d + 1) * n for d, n in enumerate(a.accepted_per_pos)) / a.drafts
        return mean, max(0.0, second - mean * mean)
    most = max(a.draft_tokens / a.drafts, mean)
    return mean, mean * (most - mean)


def acceptance_difference(base: Acceptance, other: Acceptance, level: float) -> tuple[float, float, float]:
    """other's acceptance length - base's, with its normal interval at confidence `level` (drafts as independent
    units: see the module docstring). Both sides need drafts."""
    z = NormalDist().inv_cdf(1 - (1 - level) / 2)
    (mb, vb), (mo, vo) = accepted_moments(base), accepted_moments(other)
    diff = mo - mb
    half = z * math.sqrt(vb / base.drafts + vo / other.drafts)
    return diff, diff - half, diff + half


def acceptance_interval(a: Acceptance, level: float = 0.95) -> list[float]:
    """The interval of one side's acceptance length at confidence `level` (drafts as independent units)."""
    z = NormalDist().inv_cdf(1 - (1 - level) / 2)
    mean, var = accepted_moments(a)
    half = z * math.sqrt(var / a.drafts) if a.drafts else math.inf
    return [1 + mean - half, 1 + mean + half]


@dataclass(frozen=True)
class Verdict:
    decision: str  # "promoted", "rolled back" or "inconclusive"
    reason: str
    difference: float  # canary - stable acceptance length
    low: float  # its interval at this look's level
    high: float
    level: float  # the interval's confidence (1 - alpha spent at this look)
    look: int
    stable_drafts: int
    canary_drafts: int

    def to_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def replay(
    stream: list[dict], stable: str, canary: str, test: CanaryTest, window_s: float, max_window_s: float
) -> Verdict:
    """The decision a rollout would reach on a recorded counter stream (record.json's `counters`: per poll the
    seconds since the watch began and each app's window totals), with `test`'s settings: what lets recorded
    windows be decided again under other tolerances, levels or windows."""
    rows = [r for r in stream if r["t"] >= window_s]
    for i, row in enumerate(rows):
        final = row["t"] >= max_window_s or i == len(rows) - 1
        verdict = test.look(Acceptance.from_dict(row[stable]), Acceptance.from_dict(row[canary]), final)
        if verdict is not None:
            return verdict
    return test.look(Acceptance(), Acceptance(), final=True)  # nothing recorded after window_s


def resampled(stream: list[dict], apps: tuple[str, str], rng, block: int = 5) -> list[dict]:
    """Another counter stream as the server could have produced it: the recorded poll-to-poll increments of both
    apps (taken together, so a poll's load stays shared) drawn again with replacement in runs of `block`
    consecutive polls (a moving-block bootstrap: drafts of one request span polls) and summed up again, at the
    recorded poll times."""
    steps, last = [], {app: Acceptance() for app in apps}
    for row in stream:
        now = {app: Acceptance.from_dict(row[app]) for app in apps}
        steps.append({app: now[app] - last[app] for app in apps})
        last = now
    total, out = {app: Acceptance() for app in apps}, []
    starts = range(max(1, len(steps) - block + 1))
    while len(out) < len(stream):
        start = rng.choice(starts)
        for step in steps[start : start + block]:
            if len(out) == len(stream):
                break
            total = {app: total[app] + step[app] for app in apps}
            out.append({"t": stream[len(out)]["t"], **{app: a.to_dict() for app, a in total.items()}})
    return out


def replays(record: dict, n: int, test: dict, seed: int = 0, block: int = 5) -> dict:
    """`n` decisions on streams resampled (`resampled`) from a rollout's record.json, each reached as the rollout
    would (`replay`) under `test`'s settings (tolerance 0.1, min_drafts 50, alpha 0.05, window_s 60 and
    max_window_s the stream's end where not given): how often each decision comes, and every decision's interval
    and sample sizes."""
    import random

    stream = record.get("counters") or []
    if "stable" not in record or "canary" not in record or not stream:
        raise ValueError("not a canary's record: it needs stable, canary and counters (jobs.deploy's record.json)")
    apps = (record["stable"]["app"], record["canary"]["app"])
    rng = random.Random(seed)
    window_s, max_window_s = test.get("window_s", 60.0), test.get("max_window_s", stream[-1]["t"])
    verdicts = []
    for _ in range(n):
        canary_test = CanaryTest(test.get("tolerance", 0.1), test.get("min_drafts", 50), test.get("alpha", 0.05))
        verdicts.append(replay(resampled(stream, apps, rng, block), *apps, canary_test, window_s, max_window_s))
    counts = {d: sum(v.decision == d for v in verdicts) for d in ("promoted", "rolled back", "inconclusive")}
    shown = [v.to_dict() for v in verdicts]
    return {"replays": n, "block": block, "test": test, "decisions": counts, "verdicts": shown}


class CanaryTest:
    """Sequential non-inferiority test of the canary's acceptance against the stable backend's (module docstring)."""

    def __init__(self, tolerance: float, min_drafts: int, alpha: float = 0.05) -> None:
        self.tolerance, self.min_drafts, self.alpha = tolerance, min_drafts, alpha
        self.looks = 0

    def look(self, stable: Acceptance, canary: Acceptance, final: bool = False) -> Verdict | None:
        """The decision, if the counters so far (or, `final`, the window's end) allow one; None: watch on."""
        n = min(stable.drafts, canary.drafts)
        due = n >= self.min_drafts * 2**self.looks
        if not (due or final):
            return None
        if canary.drafts >= self.min_drafts and canary.accepted == 0:
            why = f"the canary accepted none of its {canary.drafts} drafts"
            return self._verdict("rolled back", why, stable, canary, 0.0, 0.0)
        if n < self.min_drafts:
            why = (
                f"too few drafts by the window's end (stable {stable.drafts}, canary {canary.drafts}; "
                f"{self.min_drafts} each needed)"
            )
            return self._verdict("inconclusive", why, stable, canary, -math.inf, math.inf)
        level = self.alpha / 2 ** (self.looks + 1)
        self.looks += 1
        diff, low, high = acceptance_difference(stable, canary, 1 - level)
        shown = (
            f"canary {canary.acceptance_length:.3f} vs stable {stable.acceptance_length:.3f}: difference "
            f"{diff:+.3f} [{low:+.3f}, {high:+.3f}] ({100 * (1 - level):.2f}% interval, {canary.drafts} and "
            f"{stable.drafts} drafts), tolerance {self.tolerance}"
        )
        if low >= -self.tolerance:
            return self._verdict("promoted", shown, stable, canary, low, high, level)
        if high < -self.tolerance:
            return self._verdict("rolled back", shown, stable, canary, low, high, level)
        if final:
            shown += ": the window ended undecided"
            return self._verdict("inconclusive", shown, stable, canary, low, high, level)
        return None

    def _verdict(self, decision, reason, stable, canary, low, high, level: float = 0.0) -> Verdict:
        return Verdict(
            decision,
            reason,
            canary.acceptance_length - stable.acceptance_length,
            low,
            high,
            1 - level if level else 0.0,
            self.looks,
            stable.drafts,
            canary.drafts,
        )
