"""A served model on Ray Serve, as a rollout changes it: the router application `name` in front of backend
applications `name-1`, `name-2`, ..., its route table, and the backends' acceptance counters. `Rollout` (the
canary's state machine, rollout.py) drives these operations and nothing else touches Serve for it; tests give it
fakes with the same methods."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable

from orchestrator.console import say
from orchestrator.errors import AerieError
from orchestrator.serving.backends import backend_of, build_application
from orchestrator.serving.counters import backend_activity, backend_counters, running_import_path
from orchestrator.serving.launch import app_resources
from orchestrator.serving.placement import PlacementWatch, check_placeable, fmt_resources, wait_running
from orchestrator.serving.router import BACKEND_PREFIX, Route, RouterConfig, forget_routes
from orchestrator.spec.acceptance import Acceptance


class EventLog:
    """What a rollout did, when (seconds since it began): said on the console as it happens (also during a
    pipeline stage), kept for its record."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock, self.t0 = clock, clock()
        self.events: list[dict] = []

    def now(self) -> float:
        return round(self.clock() - self.t0, 2)

    def __call__(self, what: str, **details) -> None:
        entry = {"t": self.now(), "event": what, **details}
        self.events.append(entry)
        say(f"[deploy {entry['t']:7.1f}s] {what} {json.dumps(details, default=str)}")


class ServeDeployments:
    """Served model `name` on the Ray Serve this process is connected to (see the module docstring)."""

    def __init__(
        self,
        name: str,
        route_prefix: str,
        proxy: str,
        event: EventLog,
        startup_timeout_s: float,
        placement_timeout_s: float,
    ) -> None:
        self.name, self.route_prefix, self.proxy, self.event = name, route_prefix, proxy, event
        self.startup_timeout_s, self.placement_timeout_s = startup_timeout_s, placement_timeout_s

    # -- the router --------------------------------------------------------------------------------------------

    def _table(self, method: str, *args, routes: list[Route] | None = None):
        """Call the route table; a table found dead is replaced (from the stored routes) and called again."""
        import ray

        from orchestrator.serving.router import route_table

        for attempt in range(3):
            try:
                return ray.get(getattr(route_table(self.name, routes), method).remote(*args), timeout=60)
            except ray.exceptions.RayActorError as err:
                self.event("route table lost; a new one starts from the stored routes", error=str(err)[:200])
                if attempt == 2:
                    raise

    def router_status(self) -> dict | None:
        """The route table's status (`routes`, per backend `requests`, `failed`, `in_flight`); None when this
        router application is not running."""
        from ray import serve

        if self.name not in serve.status().applications:
            return None
        return self._table("status")

    def set_routes(self, routes: list[Route]) -> None:
        """Point the router at `routes` (deploying the router first if needed); returns once every router replica
        routes by them."""
        from ray import serve

        from orchestrator.serving.router import build_router

        self._table("set_routes", [r.model_dump() for r in routes], routes=routes)
        if self.name not in serve.status().applications:
            port = int(self.proxy.rsplit(":", 1)[1])
            cfg = RouterConfig(name=self.name, routes=routes, upstream=f"http://127.0.0.1:{port}")
            serve.run(build_router(cfg.model_dump()), name=self.name, route_prefix=self.route_prefix, blocking=False)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._table("status")["replicas_current"]:
                self.event("routes", routes={r.app: r.weight for r in routes})
                return
            time.sleep(0.1)
        raise AerieError(f"the router did not take routes {[(r.app, r.weight) for r in routes]}")

    # -- backends ----------------------------------------------------------------------------------------------

    def next_app(self) -> str:
        from ray import serve

        taken = [
            int(m.group(1))
            for name in serve.status().applications
            if (m := re.fullmatch(rf"{re.escape(self.name)}-(\d+)", name))
        ]
        return f"{self.name}-{max(taken, default=0) + 1}"

    def start(self, app: str, config_app: dict, tick: Callable[[], object] = lambda: None) -> None:
        """Start backend `app` and wait until it runs (`tick()` every second meanwhile). One that the cluster
        cannot hold at all fails before it starts; one whose workers still wait for resources nobody has free
        after `placement_timeout_s` fails then, naming what it lacks."""
        from ray.serve import api as serve_api

        needs = app_resources(config_app)
        if not check_placeable(app, needs):
            import ray

            free = fmt_resources(ray.available_resources())
            self.event("waiting for resources", app=app, needs=fmt_resources(needs), free=free)
        builder = build_application(config_app)
        self.event("starting backend", app=app, drafter=config_app["args"].get("drafter"), needs=fmt_resources(needs))
        watch, last_note = PlacementWatch(app, needs, self.placement_timeout_s), [0.0]

        def each_second(elapsed: float) -> None:
            tick()
            if elapsed - last_note[0] >= 15:
                last_note[0] = elapsed
                self.event("backend starting", app=app, seconds=round(elapsed), not_created=len(watch.not_created()))
            watch.check(elapsed)

        # serve.run would wait for RUNNING itself, however long placement takes: start it, and watch here
        serve_api._run(builder, name=app, route_prefix=f"{BACKEND_PREFIX}/{app}", _blocking=False)
        wait_running(app, self.startup_timeout_s, tick=each_second)
        self.event("backend running", app=app)

    def delete(self, app: str) -> None:
        from ray import serve

        serve.delete(app)

    def import_path_of(self, app: str) -> str:
        """The import path of running backend `app`'s kind."""
        return running_import_path(app)

    def measure(self, app: str, import_path: str, share: float, seconds: float, again: bool = False) -> None:
        """Ask a disaggregated backend to make `share` of its rounds measurement rounds (whole trees) for `seconds`
        (vLLM drafts and verifies its whole chain every step anyway). Best effort: a backend that does not answer
        is named in an event, the watch goes on. One replica hears each request: `again` (said at every poll,
        so that every replica hears it, a restarted one too) logs only a failure."""
        if backend_of(import_path) != "disaggregated":
            return
        import urllib.request

        from orchestrator.serving.guard import auth_headers

        body = json.dumps({"share": share, "seconds": seconds}).encode()
        url = f"{self.proxy}{BACKEND_PREFIX}/{app}/measure"
        headers = {"content-type": "application/json", **auth_headers()}
        try:
            urllib.request.urlopen(urllib.request.Request(url, body, headers, method="POST"), timeout=10).close()
            if not again:
                self.event("measuring", app=app, share=share, seconds=seconds)
        except OSError as err:
            self.event("measuring not set", app=app, error=repr(err)[:200])

    def activity(self, app: str, import_path: str) -> dict:
        """What `app`'s scheduler did so far (`backend_activity`); {"error": ...} when it does not answer."""
        try:
            return backend_activity(app, import_path, self.proxy)
        except (OSError, ValueError) as err:  # unreachable, an HTTP error, a body that is not JSON
            return {"error": repr(err)[:200]}

    def counters(self, app: str, import_path: str) -> dict[str, Acceptance]:
        """`app`'s cumulative acceptance counters by replica (what `CounterWindow` takes)."""
        return backend_counters(app, import_path, self.proxy)


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
