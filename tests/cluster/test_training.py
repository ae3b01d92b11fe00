"""Jobs across nodes on the cluster of network namespaces: a collection whose two capture workers run on two
nodes writes the same shards as on one; a training whose two Ray Train workers run on two nodes (gloo over the
link) logs the same loss curve as two workers on one node; a training worker's node killed mid-run, the run
goes on from its last checkpoint on a replacement node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import RESOURCES
from tests.helpers import committed_checkpoint, tiny_training, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
TRAIN = ["max_steps=24", "checkpoint.every_steps=4", "log_every_steps=1", "eval_every_steps=100", "worker.num_cpus=1"]


@pytest.fixture(scope="module")
def root(tmp_path_factory, smollm2_dir) -> Path:
    """tiny_training's model and configs, its conversations collected on this machine's own Ray (root/data)."""
    root = tmp_path_factory.mktemp("cluster-jobs")
    tiny_training(root, smollm2_dir)
    ok(job("collect_hidden_states", root / "collect.yaml", "num_workers=2"))
    return root


def job(module: str, config: Path, *overrides: str, cluster=None, timeout: float = 900) -> subprocess.CompletedProcess:
    """A job as a driver on the cluster's head (RAY_ADDRESS), or without a cluster on this machine's own Ray."""
    cmd = [sys.executable, "-m", f"jobs.{module}", "--config", str(config), *overrides]
    if cluster is None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    env = cluster.env | {"RAY_ADDRESS": cluster.address}
    return cluster.run("head", cmd, env=env, timeout=timeout, cwd=REPO)


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


def shard_digests(data: Path) -> dict:
    manifest = json.loads((data / "manifest.json").read_text())
    return {s["name"]: s["sha256"] for s in manifest["shards"]}


def history(root: Path, name: str, key: str = "loss") -> dict[int, float]:
    """The metric `key` by step of the newest training run named `name` (MLflow)."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    runs = client.search_runs(
        [client.get_experiment_by_name("aerie-drafters").experiment_id],
        f"tags.mlflow.runName LIKE '{name}%'",
        order_by=["attributes.start_time DESC"],
    )
    return {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, key)}


def test_collection_on_two_nodes(netcluster, root):
    two = root / "data-2nodes"
    ok(job("collect_hidden_states", root / "collect.yaml", "num_workers=2", f"output={two}", cluster=netcluster))
    captured_on = {node for cls, node in netcluster.actors(alive=False) if cls.endswith("CaptureWorker")}
    print("capture workers on", sorted(captured_on), "| actors:", netcluster.actors(alive=False))
    assert captured_on == {"target", "draft"}
    assert shard_digests(two) == shard_digests(root / "data")


def test_training_on_two_nodes_matches_one(netcluster, root):
    ok(job("train_drafter", root / "train.yaml", *TRAIN, "name=one-node", f"output={root / 'd1'}"))
    ok(job("train_drafter", root / "train.yaml", *TRAIN, "name=two-nodes", f"output={root / 'd2'}", cluster=netcluster))
    trained_on = [node for cls, node in netcluster.actors(alive=False) if cls.endswith("RayTrainWorker")]
    one, two = history(root, "one-node"), history(root, "two-nodes")
    print("train workers on", sorted(trained_on), "| loss by step, one node:", one, "two nodes:", two)
    assert {"target", "draft"} <= set(trained_on)
    assert one.keys() == two.keys() and len(one) >= 20
    assert all(abs(one[s] - two[s]) <= 1e-4 * max(1.0, abs(one[s])) for s in one), (one, two)


def test_a_training_node_killed_and_the_run_resumed(netcluster, root):
    """The draft node (one of the two training workers) killed once the run has a checkpoint; a replacement
    joins; Ray Train restarts the worker group (max_failures=1) from that checkpoint and the run completes."""
    storage = root / "ckpt-kill"
    cmd = [sys.executable, "-m", "jobs.train_drafter", "--config", str(root / "train.yaml"), *TRAIN]
    cmd += ["max_steps=120", "checkpoint.every_steps=20", "max_failures=1", "name=killed"]
    cmd += [f"checkpoint.storage_path={storage}", f"output={root / 'd3'}"]
    log = root / "killed.log"
    proc = netcluster.popen(
        "head",
        cmd,
        env=netcluster.env | {"RAY_ADDRESS": netcluster.address},
        cwd=REPO,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )

    def checkpointed() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        return committed_checkpoint(storage)

    wait_for(checkpointed, 600, "a committed checkpoint")
    netcluster.kill("draft")
    netcluster.add_node("draft", RESOURCES["draft"])
    assert proc.wait(timeout=900) == 0, log.read_text()[-4000:]
    curve, resumed = history(root, "killed"), history(root, "killed", "resumed_from_step")
    print(
        f"the draft node killed; resumed from step(s) {sorted(resumed.values())};"
        f" loss logged for steps {min(curve)}..{max(curve)}"
    )
    assert resumed and min(resumed.values()) >= 20  # from a checkpoint, not from the start
    assert max(curve) >= 119
