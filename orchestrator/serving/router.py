"""The traffic router in front of a served model: what makes drafter rollouts possible without a failed request.

    HTTP /v1/... ──> Router (app "aerie", route /) ──weights──> backend app "aerie-v1" (/_backends/v1)
                                                          └───> backend app "aerie-v2" (/_backends/v2)  (canary)

Each backend is a whole Serve application (the disaggregated app or the vLLM app, one drafter version). The
router forwards every request, streaming or not, to one backend drawn by weight, through Serve's HTTP proxy on
this node. Weights live in a route table (a detached named actor) that every router replica polls
(`REPORT_PERIOD_S`), so changing them (`jobs.deploy`) restarts nothing: requests in flight finish where they
started, new ones follow the new weights.

The routes survive the table's death: every change is written to Ray's GCS key-value store before it takes
effect, and a table that starts (again) reads them back. Whoever finds the table dead (a router replica, a
rollout, `/router/status`) starts a new one; meanwhile routers keep routing by the routes they have.

Every route but `/health` needs the API key (`serving/guard.py`); the router forwards the client's
`Authorization` header, and each backend checks it again (its routes are reachable without the router).

`GET /router/status` reports the routes and, per backend, requests forwarded, in flight and failed (HTTP 5xx
or a broken connection), summed over the router's replicas: what a rollout watches before it removes a
backend.
"""

from __future__ import annotations

import json
import logging
import random
import time

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field
from ray import serve

from orchestrator.cluster import HEAD_NODE
from orchestrator.config import StrictModel
from orchestrator.serving.guard import Guard, api_keys
from orchestrator.serving.protocol import RequestError, error_body, sse

log = logging.getLogger(__name__)

BACKEND_PREFIX = "/_backends"


class Route(StrictModel):
    app: str = Field(description="the backend's Serve application name")
    weight: float = Field(ge=0, description="share of new requests (relative to the other routes)")
    version: str = Field("", description="what is served there, e.g. the drafter's models:/ URI")

    @property
    def prefix(self) -> str:
        return f"{BACKEND_PREFIX}/{self.app}"


class RouterConfig(StrictModel):
    name: str = Field(description="the router application's name (names its route table)")
    routes: list[Route] = Field(min_length=1, description="where requests go until the route table says otherwise")
    upstream: str = Field("http://127.0.0.1:8000", description="Serve's HTTP proxy, as seen from the router")
    max_body_bytes: int = Field(4 << 20, ge=1024, description="larger request bodies get 413")
    num_replicas: int = Field(2, ge=1, description="router replicas (one dying leaves the other routing)")


ROUTES_NAMESPACE = "aerie"
REPORT_PERIOD_S = 0.25


def _kv_key(name: str) -> bytes:
    return f"routes/{name}".encode()


def stored_routes(name: str) -> dict | None:
    """{"version", "routes"} of router `name` as last written to the GCS key-value store (None: never)."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(_kv_key(name), namespace=ROUTES_NAMESPACE)
    return json.loads(raw) if raw else None


def forget_routes(name: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(_kv_key(name), namespace=ROUTES_NAMESPACE)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class RouteTable:
    """The routes of one router application and the counters its replicas report (a detached named actor:
    changing routes never restarts a router replica). Routes are kept in the GCS key-value store: a table that
    (re)starts continues from them, not from `routes` (only the first table's)."""

    def __init__(self, name: str, routes: list[dict]) -> None:
        self.name = name
        stored = stored_routes(name)
        self.version, self.routes = (stored["version"], stored["routes"]) if stored else (1, routes)
        if stored is None:
            self._store()
        self.replicas: dict[str, dict] = {}  # replica -> {"version", "counts", "at"}

    def _store(self) -> None:
        from ray.experimental import internal_kv

        value = json.dumps({"version": self.version, "routes": self.routes})
        internal_kv._internal_kv_put(_kv_key(self.name), value, overwrite=True, namespace=ROUTES_NAMESPACE)

    def set_routes(self, routes: list[dict]) -> int:
        previous = self.version, self.routes
        self.version, self.routes = self.version + 1, routes
        try:
            self._store()  # stored first: a table that dies now restarts with these routes
        except Exception:
            self.version, self.routes = previous
            raise
        return self.version

    def get(self) -> tuple[int, list[dict]]:
        return self.version, self.routes

    def report(self, replica: str, version: int, counts: dict) -> tuple[int, list[dict]]:
        self.replicas[replica] = {"version": version, "counts": counts, "at": time.monotonic()}
        return self.version, self.routes

    def status(self) -> dict:
        """Routes, and per backend the counters summed over the replicas heard from in the last 5 s."""
        now = time.monotonic()
        live = {r: v for r, v in self.replicas.items() if now - v["at"] < 5}
        backends: dict[str, dict[str, int]] = {}
        for replica, rep in self.replicas.items():  # gone replicas' requests and failures still count
            for app, counts in rep["counts"].items():
                total = backends.setdefault(app, {"requests": 0, "in_flight": 0, "failed": 0})
                for key, value in counts.items():
                    if key != "in_flight" or replica in live:  # a dead replica's requests are no longer in flight
                        total[key] += value
        return {
            "version": self.version,
            "routes": self.routes,
            "backends": backends,
            "replicas_current": bool(live) and all(v["version"] == self.version for v in live.values()),
        }


def route_table(name: str, routes: list[Route] | None = None):
    """The route table of router application `name`: the live one, else a new one (with the stored routes, or
    `routes` the first time)."""
    return RouteTable.options(
        name=f"routes-{name}",
        namespace=ROUTES_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        resources=HEAD_NODE,
    ).remote(name, [r.model_dump() for r in routes or []])


_HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


def _unavailable(message: str) -> JSONResponse:
    error = RequestError.of("unavailable", message)
    return JSONResponse(error.body(), status_code=error.status)


router_api = FastAPI(title="aerie-router")


# on the head node (HEAD_NODE), with the route table: no worker node's loss takes a router replica
@serve.deployment(ray_actor_options={"num_cpus": 0, "resources": HEAD_NODE}, max_ongoing_requests=512)
@serve.ingress(router_api)
class Router:
    """Weighted forwarding to backend applications, routes from the route table."""

    def __init__(self, config: dict) -> None:
        import asyncio
        import uuid

        import httpx

        self.config = RouterConfig.model_validate(config)
        api_keys()  # no key configured: the replica does not start (the error says how to set one)
        if not any(m.cls is Guard for m in router_api.user_middleware):
            router_api.add_middleware(Guard, max_body_bytes=self.config.max_body_bytes)
        self.client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=512))
        self.table = route_table(self.config.name, self.config.routes)
        self.version, self.routes = 0, list(self.config.routes)
        self.counts: dict[str, dict[str, int]] = {}
        self.replica = uuid.uuid4().hex[:8]
        self._sync_task = asyncio.get_event_loop().create_task(self._sync())

    async def _sync(self) -> None:
        """Report counters and pick up the current routes, every REPORT_PERIOD_S."""
        import asyncio

        while True:
            try:
                version, routes = await self.table.report.remote(self.replica, self.version, self.counts)
                if version != self.version:
                    self.routes = [Route.model_validate(r) for r in routes]
                    self.version = version
                    log.info("routes v%d: %s", version, [(r.app, r.weight) for r in self.routes])
            except Exception as err:  # noqa: BLE001 (a dead table must not stop routing: the routes we have stay)
                log.warning("route table unreachable (%s): starting a new one from the stored routes", err)
                self.table = route_table(self.config.name, self.config.routes)
            await asyncio.sleep(REPORT_PERIOD_S)

    @router_api.get("/router/status")
    async def status(self) -> dict:
        """The routes and, per backend, requests forwarded, in flight and failed, over the router's replicas."""
        try:
            return await self.table.status.remote()
        except ray.exceptions.RayActorError:
            self.table = route_table(self.config.name, self.config.routes)
            return await self.table.status.remote()

    @router_api.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(self, path: str, request: Request):
        """Any other path, streamed to one backend drawn by weight (`/_backends/APP/PATH`); 503 when none takes it."""
        import httpx

        live = [r for r in self.routes if r.weight > 0]
        if not live:
            return _unavailable("no backend takes traffic")
        route = random.choices(live, weights=[r.weight for r in live])[0]
        counts = self.counts.setdefault(route.app, {"requests": 0, "in_flight": 0, "failed": 0})
        counts["requests"] += 1
        counts["in_flight"] += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        url = f"{self.config.upstream}{route.prefix}/{path}"
        try:
            upstream = await self.client.send(
                self.client.build_request(
                    request.method, url, params=request.query_params, headers=headers, content=await request.body()
                ),
                stream=True,
            )
        except httpx.HTTPError as err:
            counts["in_flight"] -= 1
            counts["failed"] += 1
            log.warning("backend %s unreachable: %s", route.app, err)
            return _unavailable(f"backend unreachable: {err}")
        if upstream.status_code >= 500:
            counts["failed"] += 1

        streaming = upstream.headers.get("content-type", "").startswith("text/event-stream")

        async def body():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as err:
                counts["failed"] += 1
                log.warning("backend %s broke a response: %s", route.app, err)
                if streaming:  # the client learns it, as from the server's own failures (a cut JSON body shows)
                    message = "the backend serving this request was lost mid-response; send it again"
                    yield (
                        "\n\n" + sse(error_body(message, "server_error", code="backend_lost") | {"status": 503})
                    ).encode()
            finally:
                counts["in_flight"] -= 1
                await upstream.aclose()

        keep = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
        return StreamingResponse(body(), status_code=upstream.status_code, headers=keep)


def build_router(args: dict) -> serve.Application:
    """Application builder: `import_path: orchestrator.serving.router:build_router`, args = a RouterConfig."""
    cfg = RouterConfig.model_validate(args)
    return Router.options(num_replicas=cfg.num_replicas).bind(cfg.model_dump())
