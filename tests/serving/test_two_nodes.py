"""Two Ray nodes started with `ray start` on this machine (a head for the target, a worker carrying the custom
resource `draft`), the server started with `aerie serve` against that cluster: the draft worker runs on the
draft node and greedy output stays exact. The fallback of tests/cluster/ where network namespaces cannot be
made."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from orchestrator.netcluster import NetCluster
from tests.helpers import AUTH, ray_cli_env, start_ray_head, stop_ray_cluster
from tests.serving.conftest import app_args, free_port

pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.skipif(
        NetCluster.unavailable() is None,
        reason="tests/cluster/test_serving.py serves across nodes of their own network namespaces here",
    ),
]
BIN = Path(sys.executable).parent


def _ray(*args, env, timeout=180) -> None:
    proc = subprocess.run([str(BIN / "ray"), *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_draft_worker_on_the_draft_node(tiny_chat, tiny_drafter, references, tmp_path):
    import ray
    from ray import serve

    if ray.is_initialized():  # this test needs its own cluster, its driver outside any other
        serve.shutdown()
        ray.shutdown()
    env = ray_cli_env()
    gcs, dashboard, http = free_port(), free_port(), free_port()
    server = None
    try:
        start_ray_head(env, gcs, dashboard, resources={"target": 1})
        _ray(
            "start",
            f"--address=127.0.0.1:{gcs}",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=1",
            "--resources",
            json.dumps({"draft": 1}),
            env=env,
        )
        args = app_args(
            tiny_chat, drafter=str(tiny_drafter), target={"resources": {"target": 1}}, draft={"resources": {"draft": 1}}
        )
        config = tmp_path / "serve.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "applications": [
                        {
                            "name": "two-nodes",
                            "route_prefix": "/",
                            "import_path": "orchestrator.serving.app:build_app",
                            "args": args,
                        }
                    ]
                }
            )
        )
        server = subprocess.Popen(
            [str(BIN / "aerie"), "serve", "--config", str(config), f"--address=127.0.0.1:{gcs}", f"--port={http}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        url = f"http://127.0.0.1:{http}"
        health = None
        for _ in range(300):
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                r = httpx.get(f"{url}/health", timeout=5, headers=AUTH)
                if r.status_code == 200:
                    health = r.json()
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        assert health is not None, "the server did not come up"

        probe = (  # a driver of its own: this process's Ray reads RAY_AUTH_MODE only when it is imported
            f"import json, ray; ray.init(address='127.0.0.1:{gcs}', log_to_driver=False); "
            "print(json.dumps({n['NodeID']: n['Resources'] for n in ray.nodes() if n['Alive']}))"
        )
        proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        nodes = json.loads(proc.stdout.strip().splitlines()[-1])
        workers = health["workers"]
        assert "draft" in nodes[workers["draft"]["node_id"]]
        assert "target" in nodes[workers["target"]["node_id"]]
        assert workers["draft"]["node_id"] != workers["target"]["node_id"]

        for m, want in zip(references["messages"][:2], references["texts"][:2], strict=True):
            body = {"model": "tiny", "messages": m, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120, headers=AUTH)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
        stats = httpx.get(f"{url}/stats", headers=AUTH).json()
        assert stats["acceptance"]["draft_tokens"] > 0 and stats["pairs_bytes"] > 0
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        stop_ray_cluster(gcs)
