"""The canary's statistical decision (orchestrator/serving/canary.py) on simulated counter streams: the moments
the counters give are exact, a drafter that accepts (almost) nothing is never promoted, a better one is, and a
candidate worse than the tolerance is promoted no more often than alpha, however many looks a window takes."""

from __future__ import annotations

import random

import pytest

from orchestrator.serving.canary import CanaryTest, accepted_moments
from orchestrator.spec.acceptance import Acceptance


def _draft(rng: random.Random, p: float, k: int = 5) -> int:
    """Accepted tokens of one chain of k draft tokens, each accepted with probability p while the path holds."""
    accepted = 0
    while accepted < k and rng.random() < p:
        accepted += 1
    return accepted


def _decide(
    rng: random.Random, p_stable: float, p_canary: float, tolerance: float = 0.1, per_poll: int = 8, polls: int = 120
) -> tuple[str, dict]:
    """One rollout's watch: both sides draft `per_poll` times between reads; the last read is final."""
    stable, canary, test = Acceptance(), Acceptance(), CanaryTest(tolerance, min_drafts=50)
    for poll in range(polls):
        for _ in range(per_poll):
            stable.record(5, _draft(rng, p_stable))
            canary.record(5, _draft(rng, p_canary))
        verdict = test.look(stable, canary, final=poll == polls - 1)
        if verdict is not None:
            return verdict.decision, verdict.to_dict()
    raise AssertionError("the final look must decide")


def test_the_counters_give_the_exact_mean_and_variance_of_accepted_tokens_per_draft():
    rng = random.Random(1)
    for _ in range(50):
        a, draws = Acceptance(), [_draft(rng, rng.random()) for _ in range(rng.randint(1, 200))]
        for x in draws:
            a.record(5, x)
        mean, var = accepted_moments(a)
        true_mean = sum(draws) / len(draws)
        assert mean == pytest.approx(true_mean)
        assert var == pytest.approx(sum((x - true_mean) ** 2 for x in draws) / len(draws), abs=1e-9)
    # without a per-position split: the largest variance the mean allows (A in [0, 5], mean 2: 2 * 3)
    assert accepted_moments(Acceptance(10, 50, 20)) == (2.0, 6.0)


def test_a_random_drafter_is_never_promoted_over_a_trained_one_and_a_better_one_mostly_is():
    rng = random.Random(2)
    random_vs_trained = [_decide(rng, 0.6, rng.choice([0.0, 0.01, 0.03]))[0] for _ in range(200)]
    assert random_vs_trained.count("promoted") == 0
    assert random_vs_trained.count("rolled back") == 200
    better = [_decide(rng, 0.5, 0.7)[0] for _ in range(100)]
    assert better.count("promoted") >= 90 and better.count("rolled back") == 0


def test_a_candidate_worse_by_the_tolerance_is_promoted_at_most_alpha_of_the_time_over_sequential_looks():
    """The canary's p is set so that its acceptance is exactly `tolerance` (0.1) below the stable one's (5-token
    chains, stable p = 0.6): the boundary, where promoting is the wrong decision the test bounds. Each decision
    takes up to 60 looks' worth of counters (20 drafts a side between reads); promotions stay within alpha = 5%
    (measured: 1.8% of 1000; deciding on the point estimate alone would promote about half)."""

    def mean(p: float) -> float:
        return sum(p**k for k in range(1, 6))

    lo, hi = 0.3, 0.6
    for _ in range(50):  # bisect: mean(p) = mean(0.6) - 0.1
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean(mid) < mean(0.6) - 0.1 else (lo, mid)
    rng = random.Random(3)
    decisions = [_decide(rng, 0.6, lo, per_poll=20, polls=60)[0] for _ in range(600)]
    assert decisions.count("promoted") <= 0.05 * 600


def test_undecided_by_the_end_is_inconclusive_and_so_is_a_window_without_enough_drafts():
    test = CanaryTest(tolerance=0.0, min_drafts=50)
    few = Acceptance()
    for _ in range(10):
        few.record(5, 2)
    assert test.look(few, few) is None
    verdict = test.look(few, few, final=True)
    assert verdict.decision == "inconclusive" and "too few drafts" in verdict.reason
    rng = random.Random(4)
    decision, record = _decide(rng, 0.6, 0.6, tolerance=0.0)
    assert decision == "inconclusive" and record["low"] < 0 < record["high"] and record["look"] >= 3


def test_a_recorded_counter_stream_is_decided_again_as_the_rollout_decided_it(tmp_path):
    """record.json keeps every poll's window totals; `replay` reaches the rollout's decision on them, and another
    one under other settings (a tolerance that tolerates the difference)."""
    from orchestrator.serving.canary import replay

    rng = random.Random(5)
    stable, canary, stream = Acceptance(), Acceptance(), []
    for poll in range(40):
        for _ in range(8):
            stable.record(5, _draft(rng, 0.6))
            canary.record(5, _draft(rng, 0.45))
        stream.append({"t": float(poll), "s": stable.to_dict(), "c": canary.to_dict()})
    verdict = replay(stream, "s", "c", CanaryTest(0.1, 50), window_s=5, max_window_s=39)
    assert verdict.decision == "rolled back" and verdict.high < -0.1
    lenient = replay(stream, "s", "c", CanaryTest(2.0, 50), window_s=5, max_window_s=39)
    assert lenient.decision == "promoted" and lenient.low >= -2.0
    assert replay(stream[:3], "s", "c", CanaryTest(0.1, 50), window_s=5, max_window_s=39).decision == "inconclusive"


def _record(rng: random.Random, p_stable: float, p_canary: float, polls: int = 120, per_poll: int = 3) -> dict:
    """A rollout's record.json as jobs.deploy writes it: the two routes and every poll's window totals."""
    stable, canary, stream = Acceptance(), Acceptance(), []
    for poll in range(polls):
        for _ in range(per_poll):
            stable.record(5, _draft(rng, p_stable))
            canary.record(5, _draft(rng, p_canary))
        stream.append({"t": float(poll), "aerie-1": stable.to_dict(), "aerie-2": canary.to_dict()})
    return {"stable": {"app": "aerie-1"}, "canary": {"app": "aerie-2"}, "counters": stream}


def test_replays_on_resampled_counter_streams_never_promote_a_drafter_that_accepts_little(tmp_path, capsys):
    """`aerie canary-replay`: 200 decisions on block-resampled copies of one recorded stream. A candidate that
    accepts little (0.05 per token against 0.6) is never promoted; an equal or better one nearly always is; each
    decision keeps its interval and sample sizes. Resampling keeps a stream's totals in expectation."""
    import json

    from orchestrator.cli import main
    from orchestrator.serving.canary import replays, resampled

    rng = random.Random(7)
    weak, better = _record(rng, 0.6, 0.05), _record(rng, 0.5, 0.65)
    test = {"tolerance": 0.1, "min_drafts": 50, "window_s": 10}
    refused = replays(weak, 200, test, seed=1)
    assert refused["decisions"]["promoted"] == 0 and refused["decisions"]["rolled back"] == 200
    promoted = replays(better, 200, test, seed=1)
    assert promoted["decisions"]["promoted"] >= 190
    v = promoted["verdicts"][0]
    assert v["low"] <= v["difference"] <= v["high"] and min(v["canary_drafts"], v["stable_drafts"]) >= 50
    copies = [resampled(better["counters"], ("aerie-1", "aerie-2"), random.Random(s)) for s in range(40)]
    drafts = [c[-1]["aerie-2"]["drafts"] for c in copies]
    assert all(len(c) == 120 and c[-1]["t"] == 119.0 for c in copies) and set(drafts) == {360}
    accepted = sum(c[-1]["aerie-2"]["accepted"] for c in copies) / 40
    assert accepted == pytest.approx(better["counters"][-1]["aerie-2"]["accepted"], rel=0.1)

    path = tmp_path / "record.json"
    path.write_text(json.dumps(weak))
    assert (
        main(["canary-replay", str(path), "--replays", "20", "--window-s", "10", "--out", str(tmp_path / "r.json")])
        == 0
    )
    assert '"promoted": 0' in capsys.readouterr().out and json.loads((tmp_path / "r.json").read_text())["replays"] == 20
    path.write_text(json.dumps({"decision": "initial"}))  # the first deployment's record: nothing to replay
    assert main(["canary-replay", str(path)]) == 2  # a user error: one line, no traceback
    assert "not a canary's record" in capsys.readouterr().err
