"""The canary watch reads cumulative acceptance counters at every poll, one series per backend replica (Serve's
/stats answers from one replica per request): replicas are summed, a replica that restarts counts on from zero
instead of subtracting, and a read that fails (a /stats request timed out on a busy machine), the first one
included, is read again at the next poll instead of ending the rollout, up to max_window_s. No Ray."""

from __future__ import annotations

import random

import pytest

from orchestrator.errors import AerieError
from orchestrator.serving.rollout import CounterWindow, DeployConfig, _watch
from orchestrator.spec.acceptance import Acceptance


def _acc(drafts: int, accepted_each: int = 2) -> Acceptance:
    return Acceptance(drafts, 3 * drafts, accepted_each * drafts)


class FakeRollout:
    """Per app, a replica that drafts 10 more request-steps (2 accepted each) between reads; reads listed in
    `fail` (1-based, over all apps) time out."""

    def __init__(self, fail: set) -> None:
        self.fail, self.reads, self.events, self.drafts = fail, 0, [], {}

    def sample(self) -> dict:
        return {}

    def event(self, what: str, **fields) -> None:
        self.events.append(what)

    def counters(self, app: str, path: str) -> dict[str, Acceptance]:
        self.reads += 1
        if self.reads in self.fail or "all" in self.fail:
            raise TimeoutError("timed out")
        self.drafts[app] = self.drafts.get(app, 0) + 10
        return {"r1": _acc(self.drafts[app])}


def _cfg(**kw) -> DeployConfig:
    return DeployConfig(app="unused.yaml", name="m", poll_s=0.01, window_s=0.01, min_drafts=5, **kw)


def test_a_counter_read_that_times_out_the_first_one_included_is_read_again():
    ro = FakeRollout(fail={1, 4})
    got = _watch(ro, _cfg(), {"a": "x", "b": "x"})
    assert ro.events[0] == "counters unreadable; read again at the next poll"
    assert ro.events.count("counters unreadable; read again at the next poll") == 2 and ro.events[-1] == "watch"
    assert got["a"].drafts >= 5 and got["b"].acceptance_length == 3.0


def test_counters_unreadable_for_the_longest_window_end_the_watch_with_the_reason():
    ro = FakeRollout(fail={"all"})
    with pytest.raises(AerieError, match=r"could not be read within max_window_s \(0.05 s\): TimeoutError"):
        _watch(ro, _cfg(max_window_s=0.05), {"a": "x"})
    assert set(ro.events) == {"counters unreadable; read again at the next poll"}


def test_replicas_are_summed_and_a_restarted_one_counts_on_from_zero():
    w = CounterWindow()
    w.update({"r1": _acc(100)})  # the window starts: r1's 100 earlier drafts are not counted
    w.update({"r2": _acc(40, 1)})  # r2 first seen: counts from here
    w.update({"r1": _acc(130)})  # +30
    w.update({"r2": _acc(50, 1)})  # +10
    w.update({"r1": _acc(5)})  # r1 restarted (same id, counters reset): +5, its +30 before stays
    w.update({"r3": _acc(0)})  # a new replica, nothing yet; r2 no longer answers: its +10 stays
    w.update({"r3": _acc(7)})  # +7
    total = w.total()
    assert total.drafts == 30 + 10 + 5 + 7
    assert total.accepted == 2 * 30 + 1 * 10 + 2 * 5 + 2 * 7 and total.draft_tokens == 3 * total.drafts


def test_random_schedules_of_replicas_answering_count_every_draft_after_each_first_sighting():
    """Invariant over random schedules (traffic per replica, which replica answers each read): once every
    replica is read again, the window holds exactly the drafts each made after the read it was first seen in;
    before that, no more than that and never less than zero."""
    rng = random.Random(0)
    for _ in range(300):
        drafts = {f"r{i}": rng.randrange(0, 50) for i in range(rng.randint(1, 4))}  # cumulative, per replica
        w, since = CounterWindow(), {}  # since: drafts after the first sighting
        for _ in range(rng.randint(1, 40)):
            for r in drafts:
                step = rng.randrange(0, 6)
                drafts[r] += step
                if r in since:
                    since[r] += step
            r = rng.choice(sorted(drafts))
            since.setdefault(r, 0)
            w.update({r: _acc(drafts[r])})
            assert 0 <= w.total().drafts <= sum(since.values())
        w.update({r: _acc(drafts[r]) for r in since})
        assert w.total().drafts == sum(since.values())
