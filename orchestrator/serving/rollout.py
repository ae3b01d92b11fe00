"""Rolling drafter deployments behind the router, gated by live acceptance.

A served model is a router application (`name`, route /) in front of backend applications `name-1`,
`name-2`, ... (each one drafter version, either backend). A `Rollout` is one deployment, a state machine:

    NEW -> STARTING          the new backend starts; nothing is routed to it yet
    STARTING -> DONE         no router yet: the router sends it everything ("initial"); or it failed to start
                             and was deleted, the stable backend untouched ("failed")
    STARTING -> CANARY       the router sends it `canary_weight` of new requests; both backends' acceptance
                             lengths are read from their counters over the same window
    CANARY -> RETIRING       decided by a sequential test on both sides' drafts (canary.py): "promoted" when
                             the canary's acceptance is no worse than stable's by more than `tolerance`, with
                             confidence; "rolled back" when it is worse (or accepts nothing); "inconclusive"
                             when the longest window ends first; or "interrupted" (Ctrl-C, `ray job stop`, a
                             failure). The winner (the stable backend unless promoted) takes all traffic, the
                             loser drains and is deleted
    STARTING -> RETIRING     interrupted while the routes were being split
    RETIRING -> DONE

No request fails on the way: requests are only ever sent to running backends, a backend is deleted only once
nothing is in flight there, and Serve's own graceful shutdown covers the rest. Every transition is logged and
recorded: `record.json` (+ a timeline plot) under `output_dir`, and, for a `models:/` drafter, tags on its
registry version and the `production` alias moved on promotion.

Two entry points: `deploy_initial` (`aerie serve`: its own local Ray unless given a cluster, refuses a model
already served) and `run_rollout` (`jobs.deploy`: only a running cluster; a canary when the model is served).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pydantic import Field

from orchestrator.config import StrictModel
from orchestrator.errors import AerieError
from orchestrator.redaction import redact_text
from orchestrator.serving.canary import CanaryTest, Verdict
from orchestrator.serving.counters import CounterWindow, activity_change
from orchestrator.serving.deployments import EventLog, ServeDeployments, undeploy
from orchestrator.serving.launch import read_serve_config
from orchestrator.serving.router import Route
from orchestrator.spec.acceptance import Acceptance

T = TypeVar("T")

__all__ = ["DeployConfig", "Phase", "Rollout", "deploy_initial", "run_rollout", "undeploy"]


class DeployConfig(StrictModel):
    """`python -m jobs.deploy` settings."""

    app: str = Field(description="Serve config file of the backend (serve.yaml: disaggregated, serve-vllm.yaml)")
    drafter: str | None = Field(None, description="the drafter to deploy: a directory, s3://... or models:/...")
    app_overrides: list[str] = Field([], description="more key=value overrides of the backend's args")
    name: str = Field("aerie", description="the router application; backends are NAME-1, NAME-2, ...")
    route_prefix: str = Field("/", description="the router's route: the clients' endpoint")
    address: str | None = Field(
        None, description="Ray cluster (None: RAY_ADDRESS, else the Ray `aerie serve` started on this machine)"
    )
    host: str = Field("127.0.0.1", description="Serve's HTTP proxy host, as the job reaches it")
    port: int = Field(8000, ge=1, le=65535, description="Serve's HTTP proxy port")
    canary_weight: float = Field(0.25, gt=0, lt=1, description="share of new requests the candidate takes")
    window_s: float = Field(60, gt=0, description="shortest canary watch")
    max_window_s: float = Field(600, gt=0, description="longest canary watch: undecided by then, it is inconclusive")
    min_drafts: int = Field(50, ge=1, description="drafted request-steps each side needs before the first look")
    tolerance: float = Field(
        0.1, ge=0, description="promote when canary acceptance is confidently >= stable's minus this (canary.py)"
    )
    measure_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="during the canary window this share of both disaggregated backends' rounds are measurement "
        "rounds: drafted whatever the mode chooser says, every request's whole tree verified, and only those "
        "compared (drafts of one size on both sides, at a bounded cost)",
    )
    alpha: float = Field(
        0.05, gt=0, lt=0.5, description="chance of a wrong decision the test allows, all looks together"
    )
    startup_timeout_s: float = Field(900, gt=0, description="longest a new backend may take to come up")
    placement_timeout_s: float = Field(
        120, gt=0, description="longest a new backend's workers may wait for resources before it fails"
    )
    drain_timeout_s: float = Field(600, gt=0, description="longest to wait for in-flight requests")
    poll_s: float = Field(1.0, gt=0, description="timeline / counter sampling period")
    production_alias: str = Field("production", description="registry alias moved on promotion")
    tracking_uri: str | None = Field(None, description="MLflow (default: MLFLOW_TRACKING_URI or runs/mlflow.db)")
    output_dir: str = Field("runs/deploy", description="where record.json and the timeline go")

    def proxy(self) -> str:
        return f"http://{self.host}:{self.port}"


class Phase(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    CANARY = "canary"
    RETIRING = "retiring"
    DONE = "done"


# Every transition a rollout may take, and the decisions it may record on the way (None: none).
TRANSITIONS: dict[tuple[Phase, Phase], frozenset[str | None]] = {
    (Phase.NEW, Phase.STARTING): frozenset({None}),
    (Phase.STARTING, Phase.DONE): frozenset({"initial", "failed"}),
    (Phase.STARTING, Phase.CANARY): frozenset({None}),
    (Phase.STARTING, Phase.RETIRING): frozenset({"interrupted"}),
    (Phase.CANARY, Phase.RETIRING): frozenset({"promoted", "rolled back", "inconclusive", "interrupted"}),
    (Phase.RETIRING, Phase.DONE): frozenset({None}),
}


class Rollout:
    """One deployment of `config_app` (drafter `version`) on `deployments` (`ServeDeployments`, or a fake)."""

    def __init__(
        self,
        cfg: DeployConfig,
        deployments,
        log: EventLog,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.cfg, self.d, self.event, self.clock, self.sleep = cfg, deployments, log, clock, sleep
        self.phase = Phase.NEW
        self.record: dict = {"name": cfg.name}
        self.timeline: list[dict] = []

    def to(self, phase: Phase, decision: str | None = None, **details) -> None:
        """The one way the phase changes: only along TRANSITIONS; the decision and reason go in the record."""
        allowed = TRANSITIONS.get((self.phase, phase))
        if allowed is None or decision not in allowed:
            raise RuntimeError(f"rollout: no transition {self.phase.value} -> {phase.value} deciding {decision!r}")
        self.phase = phase
        if decision is not None:
            self.record["decision"] = decision
            if "reason" in details:
                self.record["reason"] = details["reason"]
        self.event(decision or phase.value, phase=phase.value, **details)

    # -- the run -------------------------------------------------------------------------------------------------

    def run(self, config_app: dict, version: str, canary: bool = True) -> dict:
        """Deploy: the first backend when nothing is served, else (`canary`) a gated canary; returns the record
        (also written to disk). `canary=False` refuses a model already served."""
        import_path = config_app["import_path"]
        self.record.update(backend=import_path, drafter=version)
        status = self.d.router_status()
        if status is None:
            app = self.d.next_app()
            self.to(Phase.STARTING, app=app)
            self.d.start(app, config_app, tick=self.sample)
            self.d.set_routes([Route(app=app, weight=1.0, version=version)])
            self.record["app"] = app
            self.to(Phase.DONE, "initial")
            return self.finish()
        base = f"{self.cfg.proxy()}{self.cfg.route_prefix.rstrip('/')}"
        if not canary:
            raise AerieError(f"{self.cfg.name} is already served at {base}: roll a new drafter out with jobs.deploy")
        live = [r for r in status["routes"] if r["weight"] > 0]
        if len(live) != 1:
            raise AerieError(f"{self.cfg.name} is mid-rollout ({live}): finish or undo that one first")
        stable = Route.model_validate(live[0])
        if stable.version == version:
            raise AerieError(f"{version} already serves as {stable.app}: nothing to roll out")
        canary_route = Route(app=self.d.next_app(), weight=self.cfg.canary_weight, version=version)
        return self._canary(stable, canary_route, config_app)

    def _canary(self, stable: Route, canary: Route, config_app: dict) -> dict:
        self.record.update(stable=stable.model_dump(), canary=canary.model_dump())
        self.to(Phase.STARTING, app=canary.app)
        try:
            self.d.start(canary.app, config_app, tick=self.sample)
        except AerieError as err:
            self.event("candidate failed to start; stable untouched", error=str(err))
            self.d.delete(canary.app)
            self.to(Phase.DONE, "failed", reason=str(err))
            return self.finish()
        except BaseException:
            self.d.delete(canary.app)
            raise
        test = CanaryTest(self.cfg.tolerance, self.cfg.min_drafts, self.cfg.alpha)
        try:
            paths = {stable.app: self.d.import_path_of(stable.app), canary.app: config_app["import_path"]}
            self.d.set_routes([stable.model_copy(update={"weight": 1 - self.cfg.canary_weight}), canary])
            self.to(Phase.CANARY)
            for app, path in paths.items():
                self.d.measure(app, path, self.cfg.measure_share, self.cfg.max_window_s)
            before = {app: self.d.activity(app, path) for app, path in paths.items()}
            ends = self.clock() + self.cfg.max_window_s

            def say_again() -> None:  # one replica hears each request: every replica, a restarted one too, in time
                for app, path in paths.items():
                    self.d.measure(app, path, self.cfg.measure_share, max(1.0, ends - self.clock()), again=True)

            look = lambda now, final: test.look(now[stable.app], now[canary.app], final)  # noqa: E731
            watched, verdict = self.watch(paths, look, each_poll=say_again)
            verdict = self.explain(verdict, before, paths)
        except BaseException as err:  # a failure or an interrupt (Ctrl-C, `ray job stop`) while the canary runs
            self.to(Phase.RETIRING, "interrupted", reason=repr(err)[:300])
            self.retire(stable, canary)
            self.to(Phase.DONE)
            self.finish()
            raise
        self.record["acceptance"] = {app: a.summary() for app, a in watched.items()}
        self.record["test"] = verdict.to_dict()
        self.to(Phase.RETIRING, verdict.decision, reason=verdict.reason)
        winner, loser = (canary, stable) if verdict.decision == "promoted" else (stable, canary)
        self.d.measure(winner.app, paths[winner.app], 0.0, 0.0)  # the mode chooser decides again
        self.retire(winner, loser)
        self.record["app"] = winner.app
        self.to(Phase.DONE)
        return self.finish()

    # -- its steps -----------------------------------------------------------------------------------------------

    def sample(self) -> dict:
        """The router's per-backend counters now, appended to the timeline."""
        status = self.d.router_status() or {"backends": {}}
        row = {"t": self.event.now(), "backends": status["backends"]}
        self.timeline.append(row)
        return row

    def watch(
        self,
        paths: dict[str, str],
        until: Callable[[dict[str, Acceptance], bool], T | None],
        each_poll: Callable[[], object] = lambda: None,
    ):
        """Acceptance of every app from the first read on, until `until(acceptance by app, final)` answers (not
        None) once window_s has passed, or, with final=True, at max_window_s; returns (acceptance, answer). The
        counters are read at every poll (`CounterWindow`: every replica answering, restarts counted on); a read
        that fails (timed out under load) is read again at the next poll: nothing is lost. `each_poll()` runs
        after each poll's sleep."""
        cfg = self.cfg
        windows = {app: CounterWindow() for app in paths}
        start = self.clock()
        while True:
            self.sample()
            elapsed = self.clock() - start
            try:
                reads = {app: self.d.counters(app, path) for app, path in paths.items()}
            except OSError as err:
                if elapsed >= cfg.max_window_s:
                    raise AerieError(
                        f"the backends' acceptance counters could not be read within max_window_s "
                        f"({cfg.max_window_s:g} s): {err!r}"
                    ) from err
                self.event("counters unreadable; read again at the next poll", error=repr(err)[:300])
            else:
                for app, read in reads.items():
                    windows[app].update(read)
                counters = {app: w.total().to_dict() for app, w in windows.items()}
                self.record.setdefault("counters", []).append({"t": round(elapsed, 2), **counters})  # replayable
                if elapsed >= cfg.window_s:
                    now = {app: w.total() for app, w in windows.items()}
                    self.event("watch", **{app: a.summary() for app, a in now.items()})
                    answer = until(now, elapsed >= cfg.max_window_s)
                    if answer is not None:
                        return now, answer
            self.sleep(cfg.poll_s)
            each_poll()

    def explain(self, verdict: Verdict, before: dict[str, dict], paths: dict[str, str]) -> Verdict:
        """What each backend's scheduler did over the window (rounds, draft calls, measured drafts, its drafter's
        losses), in the record and the log; an inconclusive verdict's reason says it (too few drafts is then a
        drafter lost, or rounds that never drafted, or no traffic, not a mystery)."""
        change = {app: activity_change(before[app], self.d.activity(app, path)) for app, path in paths.items()}
        self.record["activity"] = change
        self.event("the window's activity", **change)
        if verdict.decision != "inconclusive" or not any(change.values()):
            return verdict
        said = "; ".join(f"{app}: {_activity_line(a)}" for app, a in change.items() if a)
        return dataclasses.replace(verdict, reason=f"{verdict.reason}. Over the window {said}")

    def drain(self, app: str) -> None:
        """Wait until the router has nothing in flight at `app` (it gets no new requests any more)."""
        deadline = self.clock() + self.cfg.drain_timeout_s
        while self.clock() < deadline:
            if self.sample()["backends"].get(app, {}).get("in_flight", 0) <= 0:
                self.event("drained", app=app)
                return
            self.sleep(self.cfg.poll_s)
        self.event("drain timed out; Serve's graceful shutdown takes over", app=app)

    def retire(self, winner: Route, loser: Route) -> None:
        """All traffic to `winner` first (what an interrupt must not skip), then drain and delete `loser`."""
        self.d.set_routes([winner.model_copy(update={"weight": 1.0}), loser.model_copy(update={"weight": 0.0})])
        self.drain(loser.app)
        self.d.set_routes([winner.model_copy(update={"weight": 1.0})])
        self.d.delete(loser.app)
        self.event("deleted", app=loser.app)

    def finish(self) -> dict:
        """Write the record (and the timeline plot) under output_dir; tag a models:/ drafter's version."""
        from orchestrator.serving.timeline import plot_timeline
        from orchestrator.tracking.store import tag_rollout

        out = Path(self.cfg.output_dir) / time.strftime("%Y%m%d-%H%M%S")
        out.mkdir(parents=True, exist_ok=True)
        self.sample()
        self.record.update(events=self.event.events, timeline=self.timeline)
        (out / "record.json").write_text(json.dumps(self.record, indent=2, default=str) + "\n")
        if len(self.timeline) > 1:
            plot_timeline(self.timeline, out / "timeline.png", self.event.events)
        self.record["record_dir"] = str(out)
        tag_rollout(self.record, self.cfg.tracking_uri, self.cfg.production_alias)
        return self.record


def _activity_line(a: dict) -> str:
    if "error" in a:
        return f"stats unreadable ({a['error']})"
    alive = "alive" if a.get("draft_alive") else "not answering"
    return (
        f"{a.get('rounds', 0)} rounds, {a.get('draft_calls', 0)} draft calls, {a.get('measured_drafts', 0)} "
        f"measured drafts, {a.get('draft_failures', 0)} drafter losses, {a.get('draft_errors', 0)} drafter errors, "
        f"drafter {alive} at the end"
    )


# -- the two entry points ----------------------------------------------------------------------------------------


def _prepare(cfg: DeployConfig) -> tuple[dict, str]:
    """The backend's application with the drafter set, and the drafter's name: every input checked before Ray."""
    from orchestrator.serving.guard import api_keys
    from orchestrator.tracking.store import check_model_uri, is_model_uri

    overrides = list(cfg.app_overrides) + ([f"drafter={cfg.drafter}"] if cfg.drafter else [])
    _, config_app = read_serve_config(cfg.app, overrides)
    version = config_app["args"].get("drafter") or "(no drafter)"
    if is_model_uri(version):  # a wrong name or alias fails here, not after a backend start
        # One registry for the whole rollout: the backend reads the drafter where this job checks and tags it.
        registry = cfg.tracking_uri or config_app["args"].get("mlflow_tracking_uri")
        if registry and redact_text(registry) != registry:  # it goes into the backend's Serve config, shown to all
            raise AerieError(
                f"tracking URI {redact_text(registry)} holds a password: give MLflow's credentials through "
                "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead"
            )
        config_app["args"]["mlflow_tracking_uri"] = cfg.tracking_uri = registry
        check_model_uri(version, registry)
    api_keys()  # the backends and the router refuse to start without one; this job calls them with it
    return config_app, version


def _rollout(cfg: DeployConfig) -> Rollout:
    from ray import serve

    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    log = EventLog()
    backends = ServeDeployments(
        cfg.name, cfg.route_prefix, cfg.proxy(), log, cfg.startup_timeout_s, cfg.placement_timeout_s
    )
    return Rollout(cfg, backends, log)


def deploy_initial(cfg: DeployConfig) -> dict:
    """`aerie serve`: the first backend and the router, on the configured cluster or else a local Ray this process
    starts (and notes for this machine's jobs; it lives as long as the server). A model already served: refused."""
    import ray

    from orchestrator.cluster import configured_address, init_ray, note_local_cluster

    config_app, version = _prepare(cfg)
    started_here = not (ray.is_initialized() or configured_address(cfg.address))
    init_ray(cfg.address)
    if started_here:
        note_local_cluster()
    return _rollout(cfg).run(config_app, version, canary=False)


def run_rollout(cfg: DeployConfig) -> dict:
    """`jobs.deploy`: `cfg.drafter` as a gated canary beside the stable backend (or the first backend when the
    model is not served yet), on a running cluster only: a deployment must outlive this job."""
    from orchestrator.cluster import connect_to_running_cluster

    config_app, version = _prepare(cfg)
    connect_to_running_cluster(cfg.address)
    return _rollout(cfg).run(config_app, version)
