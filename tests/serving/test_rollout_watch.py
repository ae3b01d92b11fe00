"""The canary watch reads cumulative acceptance counters; a read that fails (a /stats request timed out on a busy
machine) is read again at the next poll instead of ending the rollout, up to max_window_s."""

from __future__ import annotations

import pytest

from orchestrator.errors import AerieError
from orchestrator.serving.rollout import DeployConfig, _watch
from orchestrator.spec.acceptance import Acceptance


class FakeRollout:
    """Counters that grow by 10 drafts (2 accepted each) per read; the reads listed in `fail` time out."""

    def __init__(self, fail: set[int]) -> None:
        self.fail, self.reads, self.events = fail, 0, []

    def sample(self) -> dict:
        return {}

    def event(self, what: str, **fields) -> None:
        self.events.append(what)

    def counters(self, app: str, path: str) -> Acceptance:
        self.reads += 1
        if self.reads in self.fail or "all" in self.fail:
            raise TimeoutError("timed out")
        return Acceptance(10 * self.reads, 30 * self.reads, 20 * self.reads)


def _cfg(**kw) -> DeployConfig:
    return DeployConfig(app="unused.yaml", name="m", poll_s=0.01, window_s=0.01, min_drafts=5, **kw)


def test_a_counter_read_that_times_out_is_read_again():
    ro = FakeRollout(fail={1})
    got = _watch(ro, _cfg(), {"a": Acceptance(), "b": Acceptance()}, {"a": "x", "b": "x"})
    assert ro.events == ["counters unreadable; read again at the next poll", "watch"]
    assert got["a"].drafts >= 5 and got["b"].acceptance_length == 3.0


def test_counters_unreadable_for_the_longest_window_end_the_watch_with_the_reason():
    ro = FakeRollout(fail={"all"})
    with pytest.raises(AerieError, match=r"could not be read within max_window_s \(0.05 s\): TimeoutError"):
        _watch(ro, _cfg(max_window_s=0.05), {"a": Acceptance()}, {"a": "x"})
    assert set(ro.events) == {"counters unreadable; read again at the next poll"}
