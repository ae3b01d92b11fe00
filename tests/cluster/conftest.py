"""One Ray cluster of network namespaces for this package's tests (orchestrator/netcluster.py): a head and a
target and a draft node, each with its own address and link; tests kill, cut and replace nodes and leave the
cluster as they found it (the three nodes up, links up and unlimited)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml

from orchestrator.netcluster import ClusterServer, NetCluster
from tests.helpers import AUTH, ray_cli_env

# each worker node's custom resource: room for a canary backend's worker beside the stable one's (a GB200 tray
# advertises 4)
RESOURCES = {"target": {"target": 2}, "draft": {"draft": 2}}


@pytest.fixture(scope="session")
def netcluster():
    why = NetCluster.unavailable()
    if why is not None:
        pytest.skip(f"no cluster of network namespaces here: {why}")
    with NetCluster(ray_cli_env()) as cluster:
        for name, resources in RESOURCES.items():
            cluster.add_node(name, resources)
        yield cluster


def serve(cluster: NetCluster, args: dict, tmp_path) -> ClusterServer:
    """`aerie serve` on the head with the application `args` (a Serve config written to tmp_path), healthy."""
    config = Path(tmp_path) / "serve.yaml"
    app = {"name": "aerie", "route_prefix": "/", "import_path": "orchestrator.serving.app:build_app", "args": args}
    config.write_text(yaml.safe_dump({"applications": [app]}))
    server = ClusterServer(cluster, config, [], Path(tmp_path) / "serve.log")
    server.wait_healthy(AUTH)
    server.config = config
    return server


class Load:
    """Steady streaming load in a thread of its own: `users` clients, each sending its next chat request as soon
    as its last ended, until `stop()`, which returns every request as {sent, ended, tokens | error} (seconds on
    time.monotonic; a connection torn down mid-stream is an error, as a client sees it)."""

    def __init__(self, url: str, users: int = 2, max_tokens: int = 32) -> None:
        import asyncio
        import threading

        self.url, self.users, self.max_tokens = url, users, max_tokens
        self.records: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        import asyncio

        from orchestrator.benchmarks.serving import stream_request
        from tests.helpers import QUESTIONS

        async with httpx.AsyncClient(timeout=600, headers=AUTH) as client:

            async def user(u: int) -> None:
                i = u
                while not self._stop.is_set():
                    prompt = {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}
                    sent = time.monotonic()
                    try:
                        out = await stream_request(client, self.url, "smollm2", prompt, self.max_tokens)
                    except httpx.HTTPError as err:
                        out = {"error": f"{type(err).__name__}: {err}"}
                    self.records.append({"user": u, "sent": sent, "ended": time.monotonic(), **out})
                    if "error" in out:
                        await asyncio.sleep(0.5)
                    i += self.users

            await asyncio.gather(*(user(u) for u in range(self.users)))

    def stop(self, timeout_s: float = 600) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        assert not self._thread.is_alive(), "a client is still waiting for its answer"
        return self.records


class Watch:
    """The server's /stats every `period_s` in a thread: (time, draft_alive, spec_rounds, rounds) rows."""

    def __init__(self, url: str, period_s: float = 0.5) -> None:
        import threading

        self.url, self.period_s, self.rows = url, period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                s = httpx.get(f"{self.url}/stats", headers=AUTH, timeout=5).json()
                self.rows.append((time.monotonic(), s["draft_alive"], s["spec_rounds"], s["rounds"]))
            except (httpx.HTTPError, ValueError, KeyError):
                self.rows.append((time.monotonic(), None, None, None))
            self._stop.wait(self.period_s)

    def speculating_since(self, t: float) -> float | None:
        """The first time after `t` at which drafted rounds were counted again (None: not yet)."""
        rows = [r for r in self.rows if r[0] >= t and r[2] is not None]
        for a, b in zip(rows, rows[1:], strict=False):
            if b[1] and b[2] > a[2]:
                return b[0]
        return None

    def stop(self) -> list[tuple]:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.rows
