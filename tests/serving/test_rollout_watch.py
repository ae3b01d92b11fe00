"""The rollout without Ray: its state machine driven through every transition by fake backends on a virtual
clock, and the canary watch. The watch reads cumulative acceptance counters at every poll, one series per
backend replica (Serve's /stats answers from one replica per request): replicas are summed, a replica that
restarts counts on from zero instead of subtracting, and a read that fails (a /stats request timed out on a busy
machine), the first one included, is read again at the next poll instead of ending the rollout, up to
max_window_s."""

from __future__ import annotations

import random

import pytest

from orchestrator.errors import AerieError
from orchestrator.serving.canary import CanaryTest
from orchestrator.serving.counters import CounterWindow
from orchestrator.serving.deployments import EventLog
from orchestrator.serving.rollout import TRANSITIONS, DeployConfig, Phase, Rollout
from orchestrator.spec.acceptance import Acceptance


def _acc(drafts: int, accepted_each: int = 2) -> Acceptance:
    return Acceptance(drafts, 3 * drafts, accepted_each * drafts)


class Clock:
    """Virtual time: `sleep` advances it."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class FakeDeployments:
    """What `Rollout` drives, in memory. Per app, a replica that drafts 10 more request-steps (3 tokens each)
    between reads, each draft token accepted with probability `accept[app]` (default 2/3) while the path holds;
    reads listed in `fail` (1-based, over all apps, or "all") time out. In-flight requests at a backend drain one
    per poll after it stops getting traffic."""

    def __init__(self, accept: dict | None = None, fail: set | None = None, start_fails: BaseException | None = None):
        self.accept, self.fail, self.start_fails = accept or {}, fail or set(), start_fails
        self.rng, self.counters_of = random.Random(0), {}
        self.routes: list | None = None
        self.apps: dict[str, str] = {}  # app -> import path
        self.deleted: list[str] = []
        self.in_flight: dict[str, int] = {}
        self.reads, self.drafts = 0, {}
        self.calls: list[str] = []

    def router_status(self) -> dict | None:
        if self.routes is None:
            return None
        for app in self.in_flight:  # requests finish meanwhile
            self.in_flight[app] = max(0, self.in_flight[app] - 1)
        backends = {r.app: {"requests": 1, "failed": 0, "in_flight": self.in_flight.get(r.app, 0)} for r in self.routes}
        return {"routes": [r.model_dump() for r in self.routes], "backends": backends}

    def set_routes(self, routes) -> None:
        self.calls.append("set_routes " + " ".join(f"{r.app}:{r.weight:g}" for r in routes))
        for r in routes:
            if r.weight > 0:
                self.in_flight[r.app] = 3
        self.routes = list(routes)

    def next_app(self) -> str:
        return f"m-{len(self.apps) + len(self.deleted) + 1}"

    def start(self, app: str, config_app: dict, tick=lambda: None) -> None:
        self.calls.append(f"start {app}")
        tick()
        self.apps[app] = config_app["import_path"]
        if self.start_fails is not None:
            raise self.start_fails

    def delete(self, app: str) -> None:
        self.calls.append(f"delete {app}")
        self.apps.pop(app, None)
        self.deleted.append(app)

    def import_path_of(self, app: str) -> str:
        return self.apps[app]

    def measure(self, app: str, path: str, share: float, seconds: float, again: bool = False) -> None:
        self.calls.append(f"measure {app} {share:g}" + (" again" if again else ""))

    def activity(self, app: str, path: str) -> dict:
        return {"rounds": self.reads, "draft_calls": self.reads, "draft_alive": True, "replica": "r1"}

    def counters(self, app: str, path: str) -> dict[str, Acceptance]:
        self.reads += 1
        if self.reads in self.fail or "all" in self.fail:
            raise TimeoutError("timed out")
        a = self.counters_of.setdefault(app, Acceptance())
        for _ in range(10):
            accepted = 0
            while accepted < 3 and self.rng.random() < self.accept.get(app, 2 / 3):
                accepted += 1
            a.record(3, accepted)
        return {"r1": a + Acceptance()}  # a copy: the window keeps what it read


APP = {"import_path": "orchestrator.serving.app:build_app", "args": {}}


def _cfg(tmp_path, **kw) -> DeployConfig:
    defaults = {"poll_s": 1.0, "window_s": 5, "min_drafts": 20, "output_dir": str(tmp_path)}
    return DeployConfig(app="unused.yaml", name="m", **(defaults | kw))


def _rollout(cfg: DeployConfig, d: FakeDeployments) -> tuple[Rollout, list]:
    clock = Clock()
    ro = Rollout(cfg, d, EventLog(clock), clock=clock, sleep=clock.sleep)
    taken = []
    to = ro.to

    def recording_to(phase, decision=None, **details):
        taken.append((ro.phase, phase, decision))
        to(phase, decision, **details)

    ro.to = recording_to
    return ro, taken


def test_the_rollout_state_machine_takes_every_transition_with_fake_backends(tmp_path, monkeypatch):
    monkeypatch.setattr("orchestrator.serving.timeline.plot_timeline", lambda *a, **k: None)  # no matplotlib here
    taken = []
    # first deployment: NEW -> STARTING -> DONE (initial)
    d = FakeDeployments()
    ro, t = _rollout(_cfg(tmp_path), d)
    record = ro.run(APP, "v1")
    taken += t
    assert record["decision"] == "initial" and record["app"] == "m-1" and d.calls == ["start m-1", "set_routes m-1:1"]
    assert ro.phase is Phase.DONE
    with pytest.raises(AerieError, match="already served"):  # `aerie serve` refuses a served model
        _rollout(_cfg(tmp_path), d)[0].run(APP, "v2", canary=False)
    with pytest.raises(AerieError, match="v1 already serves as m-1: nothing to roll out"):
        _rollout(_cfg(tmp_path), d)[0].run(APP, "v1")

    # promoted: STARTING -> CANARY -> RETIRING -> DONE; the loser drained, then deleted
    d.accept = {"m-1": 0.4, "m-2": 0.8}
    ro, t = _rollout(_cfg(tmp_path), d)
    record = ro.run(APP, "v2")
    taken += t
    assert record["decision"] == "promoted" and record["app"] == "m-2" and "m-1" in d.deleted
    acceptance = record["acceptance"]
    assert acceptance["m-2"]["acceptance_length"] > acceptance["m-1"]["acceptance_length"] + 1
    assert record["test"]["low"] >= -0.1 and min(record["test"]["stable_drafts"], record["test"]["canary_drafts"]) >= 20
    events = [e["event"] for e in record["events"]]
    assert events.index("drained") < events.index("deleted") and events[-2:] == ["deleted", "done"]
    assert d.calls[-3:] == ["set_routes m-2:1 m-1:0", "set_routes m-2:1", "delete m-1"]
    assert {"measure m-1 0.5", "measure m-2 0.5"} <= set(d.calls) and d.calls[-4] == "measure m-2 0"
    assert {"measure m-1 0.5 again", "measure m-2 0.5 again"} <= set(d.calls)  # at every poll, every replica hears it
    assert [r.app for r in d.routes] == ["m-2"]

    # rolled back: the candidate accepts about 1.3 tokens per draft less than the stable one
    d.accept = {"m-2": 0.8, "m-3": 0.4}
    ro, t = _rollout(_cfg(tmp_path), d)
    record = ro.run(APP, "v3")
    taken += t
    assert record["decision"] == "rolled back" and record["app"] == "m-2" and [r.app for r in d.routes] == ["m-2"]
    assert record["test"]["high"] < -0.1 and record["reason"].startswith("canary 1.")
    assert "interval" in record["reason"] and "tolerance 0.1" in record["reason"]

    # rolled back: a candidate that accepts nothing, whatever the tolerance
    d.accept = {"m-2": 0.8, "m-4": 0.0}
    record = _rollout(_cfg(tmp_path, tolerance=5.0), d)[0].run(APP, "v3b")
    assert record["decision"] == "rolled back" and record["reason"].startswith("the canary accepted none of its")

    # inconclusive: as good as the stable one, asked to be no worse by 0: undecided when the window ends
    d.accept = {"m-2": 0.6, "m-5": 0.6}
    ro, t = _rollout(_cfg(tmp_path, tolerance=0.0, max_window_s=60), d)
    record = ro.run(APP, "v3c")
    taken += t
    assert record["decision"] == "inconclusive" and "window ended undecided. Over the window m-2: " in record["reason"]
    assert "draft calls" in record["reason"] and record["activity"]["m-5"]["rounds"] > 0  # what each backend did
    assert record["app"] == "m-2" and [r.app for r in d.routes] == ["m-2"] and record["test"]["look"] >= 3

    # failed: the candidate does not start; it is deleted, the stable one keeps every route
    d.start_fails = AerieError("no room")
    ro, t = _rollout(_cfg(tmp_path), d)
    record = ro.run(APP, "v4")
    taken += t
    assert record["decision"] == "failed" and record["reason"] == "no room" and d.deleted[-1] == "m-6"
    assert [r.app for r in d.routes] == ["m-2"]

    # an interrupt while starting: the candidate is deleted, the interrupt goes on (no decision)
    d.start_fails = KeyboardInterrupt()
    ro, t = _rollout(_cfg(tmp_path), d)
    with pytest.raises(KeyboardInterrupt):
        ro.run(APP, "v5")
    taken += t
    assert ro.phase is Phase.STARTING and d.deleted[-1] == "m-7" and "decision" not in ro.record

    # interrupted while the routes were being split: STARTING -> RETIRING (interrupted) -> DONE
    d.start_fails = None
    set_routes = d.set_routes

    def split_interrupted(routes) -> None:
        if 0 < routes[-1].weight < 1:  # the canary's share
            raise KeyboardInterrupt
        set_routes(routes)

    d.set_routes = split_interrupted
    ro, t = _rollout(_cfg(tmp_path), d)
    with pytest.raises(KeyboardInterrupt):
        ro.run(APP, "v6")
    taken += t
    assert ro.record["decision"] == "interrupted" and [r.app for r in d.routes] == ["m-2"]
    d.set_routes = set_routes

    # interrupted during the canary: CANARY -> RETIRING (interrupted) -> DONE, stable takes all traffic again
    d.fail = {"all"}
    ro, t = _rollout(_cfg(tmp_path, max_window_s=3), d)
    with pytest.raises(AerieError, match="could not be read within max_window_s"):
        ro.run(APP, "v7")
    taken += t
    assert ro.record["decision"] == "interrupted" and [r.app for r in d.routes] == ["m-2"]
    assert set(d.apps) == {"m-2"}  # every candidate is gone

    decided = {(a, b, c) for a, b, c in taken}
    every = {(a, b, c) for (a, b), cs in TRANSITIONS.items() for c in cs}
    assert decided == every, every - decided


def test_a_transition_off_the_table_is_refused(tmp_path):
    ro, _ = _rollout(_cfg(tmp_path), FakeDeployments())
    with pytest.raises(RuntimeError, match="no transition new -> canary"):
        ro.to(Phase.CANARY)
    ro.to(Phase.STARTING)
    with pytest.raises(RuntimeError, match="no transition starting -> done deciding 'promoted'"):
        ro.to(Phase.DONE, "promoted")


def test_a_window_that_measured_too_few_drafts_says_what_each_backend_did(tmp_path):
    """A canary window with no measured draft (here: the stable backend's drafter stopped answering, the canary
    got no rounds) ends inconclusive, and the reason says what each scheduler did over the window."""
    from orchestrator.serving.counters import activity_change

    d = FakeDeployments()
    ro, _ = _rollout(_cfg(tmp_path), d)
    verdict = CanaryTest(0.1, 20).look(Acceptance(), Acceptance(), final=True)
    state = {"m-1": {"rounds": 10, "draft_calls": 4, "draft_failures": 0, "draft_alive": True, "replica": "a"}}
    state["m-2"] = {"rounds": 0, "draft_calls": 0, "draft_alive": True, "replica": "b"}
    before = {app: dict(a) for app, a in state.items()}
    state["m-1"] |= {"rounds": 250, "draft_failures": 1, "draft_alive": False}
    d.activity = lambda app, path: state[app]
    said = ro.explain(verdict, before, {"m-1": "x", "m-2": "x"}).reason
    assert said.startswith("too few drafts by the window's end (stable 0, canary 0; 20 each needed). Over the window")
    assert "m-1: 240 rounds, 0 draft calls, 0 measured drafts, 1 drafter losses" in said
    assert "drafter not answering at the end" in said and "m-2: 0 rounds" in said
    assert ro.record["activity"]["m-1"]["rounds"] == 240
    # another replica answered at the end: its totals are shown as they are, not diffed with the first one's
    assert activity_change({"rounds": 9, "replica": "a"}, {"rounds": 5, "replica": "b"}) == {"rounds": 5}
    assert activity_change({"rounds": 9, "replica": "a"}, {"error": "timed out"}) == {"error": "timed out"}


def _enough(now: dict, final: bool):
    return True if final or all(a.drafts >= 5 for a in now.values()) else None


def test_a_counter_read_that_times_out_the_first_one_included_is_read_again(tmp_path):
    d = FakeDeployments(accept={"a": 1.0, "b": 1.0}, fail={1, 4})
    ro, _ = _rollout(_cfg(tmp_path, window_s=1), d)
    d.routes = []
    got, answer = ro.watch({"a": "x", "b": "x"}, _enough)
    events = [e["event"] for e in ro.event.events]
    assert events[0] == "counters unreadable; read again at the next poll"
    assert events.count("counters unreadable; read again at the next poll") == 2 and events[-1] == "watch"
    assert answer is True and got["a"].drafts >= 5 and got["b"].acceptance_length == 4.0


def test_counters_unreadable_for_the_longest_window_end_the_watch_with_the_reason(tmp_path):
    d = FakeDeployments(fail={"all"})
    ro, _ = _rollout(_cfg(tmp_path, window_s=1, max_window_s=5), d)
    d.routes = []
    with pytest.raises(AerieError, match=r"could not be read within max_window_s \(5 s\): TimeoutError"):
        ro.watch({"a": "x"}, _enough)
    assert {e["event"] for e in ro.event.events} == {"counters unreadable; read again at the next poll"}


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
