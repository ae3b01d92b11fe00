"""Rolling drafter deployments behind the router, gated by live acceptance.

A served model is a router application (`name`, route /) in front of backend applications `name-1`,
`name-2`, ... (each one drafter version, either backend). `deploy`:

    no router yet      -> start backend name-1 and the router (100% to it): an initial deployment
    otherwise          -> start backend name-N with the new drafter beside the stable one
                          canary: the router sends it `canary_weight` of new requests
                          watch:  acceptance length of both, from their engines' counters, over the same window
                          decide: promote if canary >= stable - tolerance, else roll back
                          switch: the loser gets weight 0, its requests in flight finish (drain), it is deleted

No request fails on the way: requests are only ever sent to running backends, a backend is deleted only once
nothing is in flight there, and Serve's own graceful shutdown covers the rest. Every step is logged, and the
decision is recorded: `record.json` (+ a timeline plot) under `output_dir`, and, for a `models:/` drafter,
tags on its registry version and the `production` alias moved on promotion.

Acceptance length is vLLM's: 1 + accepted draft tokens / drafted request-steps. The disaggregated backend
reports them on its `/stats`; the vLLM backend's engines export `vllm:spec_decode_num_drafts` and
`vllm:spec_decode_num_accepted_tokens` to Ray's Prometheus endpoints, per replica.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
import urllib.request
from pathlib import Path

from pydantic import Field

from orchestrator.config import StrictModel
from orchestrator.errors import AerieError
from orchestrator.serving.guard import API_KEY_ENV, API_KEY_FILE_ENV, api_keys, default_key_file, ensure_local_key
from orchestrator.serving.launch import BACKENDS, app_resources, backend_of, read_serve_config
from orchestrator.serving.router import BACKEND_PREFIX, Route, RouterConfig, forget_routes
from orchestrator.spec.acceptance import Acceptance

log = logging.getLogger(__name__)


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
    max_window_s: float = Field(600, gt=0, description="longest canary watch waiting for min_drafts")
    min_drafts: int = Field(50, ge=1, description="drafted request-steps each side needs before a decision")
    tolerance: float = Field(0.1, ge=0, description="promote if canary acceptance >= stable's minus this")
    startup_timeout_s: float = Field(900, gt=0, description="longest a new backend may take to come up")
    placement_timeout_s: float = Field(
        120, gt=0, description="longest a new backend's workers may wait for resources before it fails"
    )
    drain_timeout_s: float = Field(600, gt=0, description="longest to wait for in-flight requests")
    poll_s: float = Field(1.0, gt=0, description="timeline / counter sampling period")
    production_alias: str = Field("production", description="registry alias moved on promotion")
    tracking_uri: str | None = Field(None, description="MLflow (default: MLFLOW_TRACKING_URI or runs/mlflow.db)")
    output_dir: str = Field("runs/deploy", description="where record.json and the timeline go")


# -- acceptance counters ---------------------------------------------------------------------------------------


def _get_json(url: str, timeout: float = 10) -> dict:
    from orchestrator.serving.guard import auth_headers

    with urllib.request.urlopen(urllib.request.Request(url, headers=auth_headers()), timeout=timeout) as r:
        return json.loads(r.read())


def stats_counters(base: str) -> dict[str, Acceptance]:
    """A disaggregated backend's acceptance counters from its /stats: {replica id: counters} of the one replica
    that answered (Serve picks one per request; `CounterWindow` keeps each replica's series)."""
    stats = _get_json(f"{base}/stats")
    return {stats.get("replica", ""): Acceptance.from_dict(stats["acceptance"])}


_VLLM = {
    "drafts": "spec_decode_num_drafts",
    "draft_tokens": "spec_decode_num_draft_tokens",
    "accepted": "spec_decode_num_accepted_tokens",
}
_SAMPLE = re.compile(r"^(?P<name>[^{\s]+)\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)")


def vllm_counters(app: str) -> Acceptance:
    """vLLM's acceptance counters summed over the engines of Serve application `app`."""
    return sum(vllm_counters_by_replica(app).values(), Acceptance())


def vllm_counters_by_replica(app: str) -> dict[str, Acceptance]:
    """vLLM's acceptance counters of every engine of Serve application `app` by replica id, from the Prometheus
    endpoint of every Ray node (samples carry the engine's `ReplicaId`)."""
    import ray

    replicas = {name.rsplit("#", 1)[-1] for name in _replica_actors(app)}
    totals: dict[str, dict[str, float]] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        for line in text.splitlines():
            m = _SAMPLE.match(line)
            if not m:
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
            replica = labels.get("ReplicaId")
            if replica not in replicas:
                continue
            for key, metric in _VLLM.items():
                if m["name"] == f"ray_vllm_{metric}_total":
                    counts = totals.setdefault(replica, dict.fromkeys(_VLLM, 0.0))
                    counts[key] += float(m["value"])
    return {r: Acceptance(int(c["drafts"]), int(c["draft_tokens"]), int(c["accepted"])) for r, c in totals.items()}


class CounterWindow:
    """Acceptance over a window, from cumulative counters read per series (a backend replica), as Prometheus'
    increase(): a series counts from the read it is first seen in; one whose counters went down restarted and
    counts on from zero (what it counted before stays; a restart that climbs past its last read before the next
    one goes unseen and is undercounted, as in Prometheus); one no longer read keeps what it counted."""

    def __init__(self) -> None:
        self.first: dict[str, Acceptance] = {}
        self.last: dict[str, Acceptance] = {}
        self.banked = Acceptance()

    def update(self, reads: dict[str, Acceptance]) -> None:
        for series, value in reads.items():
            last = self.last.get(series)
            if last is None:
                self.first[series] = value
            elif value.drafts < last.drafts or value.draft_tokens < last.draft_tokens or value.accepted < last.accepted:
                self.banked = self.banked + (last - self.first[series])
                self.first[series] = Acceptance()
            self.last[series] = value

    def total(self) -> Acceptance:
        return sum((self.last[s] - self.first[s] for s in self.last), self.banked)


# -- Serve plumbing ----------------------------------------------------------------------------------------------


def _wait_running(app: str, timeout_s: float, tick=None) -> None:
    """Until Serve reports `app` RUNNING (`tick(elapsed_s)` every second meanwhile); a failed deploy raises."""
    from ray import serve

    began = time.monotonic()
    while True:
        status = serve.status().applications.get(app)
        state = str(status.status) if status else "MISSING"
        if state.endswith("RUNNING"):
            return
        if state.endswith(("DEPLOY_FAILED", "UNHEALTHY")) or time.monotonic() - began > timeout_s:
            message = status.message if status else "not found"
            raise AerieError(f"backend {app} did not come up ({state}): {message[-500:]}")
        if tick is not None:
            tick(time.monotonic() - began)
        time.sleep(1)


def _pending() -> dict[str, str]:
    """The actors and placement groups not created yet: {id: what it is}. An actor whose constructor runs in a
    worker process of its own (a Pid) is left out: a vLLM replica importing its engine takes minutes on a busy
    node."""
    import ray

    actors = ray._private.state.state.actor_table(None)
    groups = ray.util.placement_group_table()
    return {
        a: (v.get("ActorClassName") or "actor").rsplit(".", 1)[-1]
        for a, v in actors.items()
        if v.get("State") == "PENDING_CREATION" and not v.get("Pid")
    } | {g: "placement group" for g, v in groups.items() if v.get("state") == "PENDING"}


def _demand_beyond_free() -> list[dict[str, float]]:
    """The resource shapes the cluster is asked for (actors, tasks, placement-group bundles) that what is free
    now cannot give. An actor waiting for a worker process (Ray starts a few at a time: Ray Serve LLM's
    TelemetryAgent waited 3 min behind vLLM's on 2 cores) holds its resources already: it is not here."""
    import ray
    from ray.autoscaler.v2.sdk import get_cluster_resource_state

    state = get_cluster_resource_state(ray._private.worker.global_worker.gcs_client)
    shapes = [dict(r.request.resources_bundle) for r in state.pending_resource_requests]
    shapes += [dict(b.resources_bundle) for g in state.pending_gang_resource_requests for b in g.requests]
    free = ray.available_resources()
    return [shape for shape in shapes if shortfall(shape, free)]


def _known() -> set[str]:
    import ray

    return set(ray._private.state.state.actor_table(None)) | set(ray.util.placement_group_table())


def _fmt(resources: dict[str, float]) -> str:
    shown = {k: round(v, 3) for k, v in sorted(resources.items()) if not k.startswith(("node:", "memory", "object_"))}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in shown.items()) + "}"


def shortfall(needs: dict[str, float], have: dict[str, float]) -> dict[str, float]:
    """What `have` lacks of `needs` (empty when it covers them)."""
    return {k: v - have.get(k, 0.0) for k, v in needs.items() if v - have.get(k, 0.0) > 1e-9}


class Rollout:
    """One `jobs.deploy` run."""

    def __init__(self, cfg: DeployConfig) -> None:
        self.cfg = cfg
        self.proxy = f"http://{cfg.host}:{cfg.port}"
        self.base = f"{self.proxy}{cfg.route_prefix.rstrip('/')}"
        self.events: list[dict] = []
        self.timeline: list[dict] = []
        self.t0 = time.monotonic()

    def event(self, what: str, **details) -> None:
        entry = {"t": round(time.monotonic() - self.t0, 2), "event": what, **details}
        self.events.append(entry)
        log.info("%s %s", what, json.dumps(details, default=str))
        print(f"[deploy {entry['t']:7.1f}s] {what} {json.dumps(details, default=str)}", flush=True)

    # -- router --------------------------------------------------------------------------------------------------

    def table(self, method: str, *args, routes: list[Route] | None = None):
        """Call the route table; a table found dead is replaced (from the stored routes) and called again."""
        import ray

        from orchestrator.serving.router import route_table

        for attempt in range(3):
            try:
                return ray.get(getattr(route_table(self.cfg.name, routes), method).remote(*args), timeout=60)
            except ray.exceptions.RayActorError as err:
                self.event("route table lost; a new one starts from the stored routes", error=str(err)[:200])
                if attempt == 2:
                    raise

    def router_status(self) -> dict | None:
        """The route table's status; None when this router application is not running."""
        from ray import serve

        if self.cfg.name not in serve.status().applications:
            return None
        return self.table("status")

    def set_routes(self, routes: list[Route]) -> None:
        """Point the router at `routes` (deploying the router first if needed); returns once every router
        replica routes by them."""
        from ray import serve

        from orchestrator.serving.router import build_router

        self.table("set_routes", [r.model_dump() for r in routes], routes=routes)
        if self.cfg.name not in serve.status().applications:
            cfg = RouterConfig(name=self.cfg.name, routes=routes, upstream=f"http://127.0.0.1:{self.cfg.port}")
            serve.run(
                build_router(cfg.model_dump()), name=self.cfg.name, route_prefix=self.cfg.route_prefix, blocking=False
            )
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self.table("status")["replicas_current"]:
                self.event("routes", routes={r.app: r.weight for r in routes})
                return
            time.sleep(0.1)
        raise AerieError(f"the router did not take routes {[(r.app, r.weight) for r in routes]}")

    def sample(self) -> dict:
        status = self.router_status() or {"backends": {}}
        row = {"t": round(time.monotonic() - self.t0, 2), "backends": status["backends"]}
        self.timeline.append(row)
        return row

    def drain(self, app: str) -> None:
        """Wait until the router has nothing in flight at `app` (it gets no new requests any more)."""
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while time.monotonic() < deadline:
            counts = self.sample()["backends"].get(app, {})
            if counts.get("in_flight", 0) <= 0:
                self.event("drained", app=app)
                return
            time.sleep(self.cfg.poll_s)
        self.event("drain timed out; Serve's graceful shutdown takes over", app=app)

    # -- backends ------------------------------------------------------------------------------------------------

    def start_backend(self, app: str, config_app: dict) -> None:
        """Start `app` and wait until it runs. One that the cluster cannot hold at all fails before it starts;
        one whose workers still wait for resources nobody has free after `placement_timeout_s` fails then, naming
        what it lacks; workers that hold their resources and are still starting are waited for."""
        import ray
        from ray.serve import api as serve_api

        from orchestrator.serving.app import _import

        needs = app_resources(config_app)
        total, free = ray.cluster_resources(), ray.available_resources()
        if lacking := shortfall(needs, total):
            raise AerieError(
                f"backend {app} can never be placed: its workers need {_fmt(needs)}, the whole cluster has "
                f"{_fmt(total)} (short of {_fmt(lacking)}): lower the workers' resources or add nodes"
            )
        if shortfall(needs, free):
            self.event("waiting for resources", app=app, needs=_fmt(needs), free=_fmt(free))
        builder = _import(config_app["import_path"])
        self.event("starting backend", app=app, drafter=config_app["args"].get("drafter"), needs=_fmt(needs))
        known = _known()
        last_note = [0.0]

        def tick(elapsed: float) -> None:
            self.sample()
            if elapsed - last_note[0] >= 15:
                last_note[0] = elapsed
                stuck = _pending().keys() - known
                self.event("backend starting", app=app, seconds=round(elapsed), not_created=len(stuck))
            if elapsed < self.cfg.placement_timeout_s:
                return
            unplaced = {k: v for k, v in _pending().items() if k not in known}
            if unplaced and (lacking := _demand_beyond_free()):
                free_now = ray.available_resources()
                raise AerieError(
                    f"backend {app} could not be placed within {self.cfg.placement_timeout_s:g} s: its workers need "
                    f"{_fmt(needs)} ({', '.join(sorted(set(unplaced.values())))} waiting for "
                    f"{', '.join(_fmt(x) for x in lacking)}), the cluster has "
                    f"{_fmt(free_now)} free of {_fmt(ray.cluster_resources())}: "
                    "free resources (lower target.num_cpus / draft.num_cpus, stop a backend) or add nodes, or "
                    "raise placement_timeout_s where nodes are added on demand"
                )

        # serve.run would wait for RUNNING itself, however long placement takes: start it, and watch here
        serve_api._run(builder(config_app["args"]), name=app, route_prefix=f"{BACKEND_PREFIX}/{app}", _blocking=False)
        _wait_running(app, self.cfg.startup_timeout_s, tick=tick)
        self.event("backend running", app=app)

    def counters(self, app: str, import_path: str) -> dict[str, Acceptance]:
        """`app`'s cumulative acceptance counters by replica (what `CounterWindow` takes)."""
        if backend_of(import_path) == "vllm":
            return vllm_counters_by_replica(app)
        return stats_counters(f"{self.proxy}{BACKEND_PREFIX}/{app}")

    def next_app(self) -> str:
        from ray import serve

        taken = [
            int(m.group(1))
            for name in serve.status().applications
            if (m := re.fullmatch(rf"{re.escape(self.cfg.name)}-(\d+)", name))
        ]
        return f"{self.cfg.name}-{max(taken, default=0) + 1}"


def undeploy(name: str) -> None:
    """Delete a served model: its router, every backend NAME-N and the route table."""
    import ray
    from ray import serve

    apps = [a for a in serve.status().applications if a == name or re.fullmatch(rf"{re.escape(name)}-\d+", a)]
    for app in apps:
        serve.delete(app)
    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(f"routes-{name}", namespace="aerie"))
    forget_routes(name)


def run_rollout(cfg: DeployConfig, initial_only: bool = False) -> dict:
    """Deploy `cfg.drafter` (initially, or as a gated canary); returns the record (also written to disk).
    initial_only: refuse when the application is already served (`aerie serve`)."""
    from ray import serve

    from orchestrator.jobrunner import connect_to_running_cluster, init_ray, note_local_cluster

    overrides = list(cfg.app_overrides) + ([f"drafter={cfg.drafter}"] if cfg.drafter else [])
    _, config_app = read_serve_config(cfg.app, overrides)
    import_path = config_app["import_path"]
    version = config_app["args"].get("drafter") or "(no drafter)"
    if version.startswith("models:/"):  # a wrong name or alias fails here, not after a backend start
        from orchestrator.tracking.store import check_model_uri

        check_model_uri(version, cfg.tracking_uri)
    api_keys()  # the backends and the router refuse to start without one; this job calls them with it
    if initial_only:  # `aerie serve`: its own local Ray unless given a cluster; it lives as long as the server
        if cfg.address or os.environ.get("RAY_ADDRESS"):
            init_ray(cfg.address)
        else:
            import ray

            started = not ray.is_initialized()
            init_ray()
            if started:
                note_local_cluster()
    else:
        connect_to_running_cluster(cfg.address)  # a deployment must outlive this job
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    ro = Rollout(cfg)
    status = ro.router_status()
    record: dict = {"name": cfg.name, "backend": import_path, "drafter": version}
    if status is None:
        app = ro.next_app()
        ro.start_backend(app, config_app)
        ro.set_routes([Route(app=app, weight=1.0, version=version)])
        record.update(decision="initial", app=app)
    elif initial_only:
        raise AerieError(f"{cfg.name} is already served at {ro.base}: roll a new drafter out with jobs.deploy")
    else:
        live = [r for r in status["routes"] if r["weight"] > 0]
        if len(live) != 1:
            raise AerieError(f"{cfg.name} is mid-rollout ({live}): finish or undo that one first")
        stable = Route.model_validate(live[0])
        if stable.version == version:
            raise AerieError(f"{version} already serves as {stable.app}: nothing to roll out")
        canary = Route(app=ro.next_app(), weight=cfg.canary_weight, version=version)
        record.update(stable=stable.model_dump(), canary=canary.model_dump())
        try:
            ro.start_backend(canary.app, config_app)
        except AerieError as err:
            ro.event("candidate failed to start; stable untouched", error=str(err))
            serve.delete(canary.app)
            record.update(decision="failed", reason=str(err))
            return _finish(ro, cfg, record)
        except BaseException:
            serve.delete(canary.app)
            raise
        try:
            stable_path = _import_path_of(stable)
            ro.set_routes([stable.model_copy(update={"weight": 1 - cfg.canary_weight}), canary])
            watched = _watch(ro, cfg, {stable.app: stable_path, canary.app: import_path})
        except BaseException as err:  # a failure or an interrupt (Ctrl-C, `ray job stop`) while the canary runs
            ro.event("interrupted: the stable backend takes all traffic again", error=repr(err)[:300])
            _retire(ro, stable, canary, serve)
            record.update(decision="interrupted", reason=repr(err)[:300])
            _finish(ro, cfg, record)
            raise
        stable_al, canary_al = watched[stable.app].acceptance_length, watched[canary.app].acceptance_length
        promote = canary_al >= stable_al - cfg.tolerance
        record.update(
            acceptance={app: a.summary() for app, a in watched.items()},
            decision="promoted" if promote else "rolled back",
            reason=f"canary {canary_al:.3f} vs stable {stable_al:.3f} - tolerance {cfg.tolerance}",
        )
        ro.event(record["decision"], reason=record["reason"])
        winner, loser = (canary, stable) if promote else (stable, canary)
        _retire(ro, winner, loser, serve)
        record["app"] = winner.app
    return _finish(ro, cfg, record)


def _retire(ro: Rollout, winner: Route, loser: Route, serve) -> None:
    """All traffic to `winner` first (what an interrupt must not skip), then drain and delete `loser`."""
    ro.set_routes([winner.model_copy(update={"weight": 1.0}), loser.model_copy(update={"weight": 0.0})])
    ro.drain(loser.app)
    ro.set_routes([winner.model_copy(update={"weight": 1.0})])
    serve.delete(loser.app)
    ro.event("deleted", app=loser.app)


def _replica_actors(app: str) -> list[str]:
    """Names of the Serve replica actors of application `app` ('SERVE_REPLICA::app#deployment#id')."""
    import ray

    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#")
    ]


def _import_path_of(route: Route) -> str:
    """The kind of a running backend: the vLLM app's replicas are Ray Serve LLM's `LLMServer`."""
    vllm = any("#LLMServer" in name for name in _replica_actors(route.app))
    return BACKENDS["vllm" if vllm else "disaggregated"][0]


def _watch(ro: Rollout, cfg: DeployConfig, paths: dict) -> dict[str, Acceptance]:
    """Acceptance of every app over a window of at least window_s and min_drafts on each side. The counters are
    read at every poll, the first read starting the window (`CounterWindow`: every replica answering, restarts
    counted on); a read that fails (timed out under load) is read again at the next poll: nothing is lost."""
    windows = {app: CounterWindow() for app in paths}
    start = time.monotonic()
    while True:
        ro.sample()
        elapsed = time.monotonic() - start
        try:
            reads = {app: ro.counters(app, path) for app, path in paths.items()}
        except OSError as err:
            if elapsed >= cfg.max_window_s:
                raise AerieError(
                    f"the backends' acceptance counters could not be read within max_window_s "
                    f"({cfg.max_window_s:g} s): {err!r}"
                ) from err
            ro.event("counters unreadable; read again at the next poll", error=repr(err)[:300])
        else:
            for app, read in reads.items():
                windows[app].update(read)
            if elapsed >= cfg.window_s:
                now = {app: w.total() for app, w in windows.items()}
                ro.event("watch", **{app: a.summary() for app, a in now.items()})
                if all(a.drafts >= cfg.min_drafts for a in now.values()) or elapsed >= cfg.max_window_s:
                    return now
        time.sleep(cfg.poll_s)


def _finish(ro: Rollout, cfg: DeployConfig, record: dict) -> dict:
    out = Path(cfg.output_dir) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    ro.sample()
    record.update(events=ro.events, timeline=ro.timeline)
    (out / "record.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    if len(ro.timeline) > 1:
        plot_timeline(ro.timeline, out / "timeline.png", ro.events)
    record["record_dir"] = str(out)
    _record_in_registry(cfg, record)
    return record


def plot_timeline(timeline: list[dict], path: Path, events: list[dict] | None = None, window_s: float = 5.0) -> None:
    """Requests/s per backend over a sliding `window_s` (router counters), failures as red crosses, and the
    rollout's decisions as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    apps = sorted({a for row in timeline for a in row["backends"]})
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for app in apps:
        pts = [(row["t"], row["backends"][app]) for row in timeline if app in row["backends"]]
        if pts[-1][1]["requests"] == pts[0][1]["requests"]:
            continue  # no traffic in this period
        ts, rate, j = [], [], 0
        for t, counts in pts:
            while pts[j][0] < t - window_s:
                j += 1
            if t > pts[j][0]:
                ts.append(t)
                rate.append((counts["requests"] - pts[j][1]["requests"]) / (t - pts[j][0]))
        ax.plot(ts, rate, label=f"{app} req/s")
        fails = [t for (t, a), (_, b) in zip(pts, pts[1:], strict=False) if b["failed"] > a["failed"]]
        if fails:
            ax.scatter(fails, [0] * len(fails), marker="x", color="red", label=f"{app} failures")
    for e in events or []:
        if e["event"] in ("routes", "promoted", "rolled back", "deleted"):
            ax.axvline(e["t"], color="grey", linewidth=0.6, linestyle=":")
            label = e["event"] if e["event"] != "routes" else " ".join(f"{a}:{w:g}" for a, w in e["routes"].items())
            ax.text(e["t"], ax.get_ylim()[1], label, rotation=90, va="top", ha="right", fontsize=7)
    ax.set_xlabel("seconds since the rollout started")
    ax.set_ylabel(f"requests / s ({window_s:g} s window)")
    if ax.get_legend_handles_labels()[0]:  # no traffic at all: nothing to label
        ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _record_in_registry(cfg: DeployConfig, record: dict) -> None:
    """Tag the drafter's registry version with the decision; move `production_alias` on promotion."""
    drafter = record.get("drafter", "")
    if not str(drafter).startswith("models:/"):
        return
    from orchestrator.tracking.store import client

    body = drafter[len("models:/") :]
    c = client(cfg.tracking_uri)
    name, has_alias, alias = body.partition("@")
    if has_alias:
        version = c.get_model_version_by_alias(name, alias).version
    else:
        name, _, version = body.partition("/")
    decision = record["decision"]
    c.set_model_version_tag(name, version, "aerie.rollout", decision)
    c.set_model_version_tag(name, version, "aerie.rollout.app", record.get("app") or "")
    if "reason" in record:
        c.set_model_version_tag(name, version, "aerie.rollout.reason", record["reason"])
    if decision in ("initial", "promoted"):
        c.set_registered_model_alias(name, cfg.production_alias, version)
    print(f"[deploy] {name} version {version}: {decision}", flush=True)


def serve_app(
    path: str | Path | None,
    overrides: list[str] | None = None,
    address: str | None = None,
    host: str | None = None,
    port: int | None = None,
    blocking: bool = True,
    backend: str | None = None,
) -> str:
    """`aerie serve [--backend vllm|disaggregated] [--config FILE] [key=value ...]`: deploy the config's first
    application behind the router on Ray (local, or the cluster at `address`) as backend `NAME-1`, so that
    `jobs.deploy` can later roll a new drafter out to it; returns the URL clients use."""
    if path is None:
        if backend is None:
            raise AerieError("give --config FILE or --backend vllm|disaggregated (its default config)")
        path = BACKENDS[backend][1]
    config, app = read_serve_config(path, overrides)
    if backend is not None and backend_of(app["import_path"]) != backend:
        raise AerieError(
            f"{path} is not a {backend} config (import_path {app['import_path']}); "
            f"the {backend} backend's is {BACKENDS[backend][1]}"
        )
    http = dict(config.get("http_options") or {})
    host, port = host or http.get("host", "127.0.0.1"), port or http.get("port", 8000)
    name, route = app.get("name", "aerie"), app.get("route_prefix") or "/"
    cfg = DeployConfig(
        app=str(path),
        app_overrides=list(overrides or []),
        name=name,
        route_prefix=route,
        address=address,
        host=host,
        port=port,
    )
    url = f"http://{host}:{port}{route.rstrip('/')}"
    if not (address or os.environ.get("RAY_ADDRESS")):
        written = ensure_local_key()  # a server on this machine: a random key unless one is configured
        if written is not None:
            print(f"wrote a new API key to {written}", flush=True)
    log.info("deploying %s at %s", name, url)
    run_rollout(cfg, initial_only=True)
    print(f"serving {name} at {url}", flush=True)
    if not (os.environ.get(API_KEY_ENV) or os.environ.get(API_KEY_FILE_ENV)):
        print(f"clients need its API key: export OPENAI_API_KEY=$(cat {default_key_file()})", flush=True)
    if blocking:  # until Ctrl-C or SIGTERM (`kill`, a service manager): Ray and the noted address go with it
        from orchestrator.jobrunner import interrupt_on_sigterm

        interrupt_on_sigterm()
        while True:
            time.sleep(3600)
    return url
