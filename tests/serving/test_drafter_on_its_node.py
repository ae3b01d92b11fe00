"""Across nodes: the server reads only its drafter's config.json and pins it; the draft worker fetches that
exact drafter itself, on its own node, into its own cache (moto's S3 on loopback). A drafter the worker
cannot load is one line at `ready()`, never a hang."""

from __future__ import annotations

import functools
import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from orchestrator.data import storage
from orchestrator.data.storage import upload_dir
from orchestrator.errors import AerieError
from orchestrator.models.checkpoint import drafter_config_from_hf, save_drafter
from orchestrator.runtime.messages import Pairs
from orchestrator.runtime.workers import DraftWorker
from orchestrator.spec.proposer import load_eagle_proposer
from orchestrator.spec.sampling import SamplingParams
from orchestrator.tracking.store import DrafterRef, read_drafter_ref
from tests.helpers import random_drafter, wait_for

GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def drafter_dir(tiny_dir, tmp_path_factory) -> Path:
    hf = json.loads((tiny_dir / "config.json").read_text())
    return save_drafter(random_drafter(hf), tmp_path_factory.mktemp("drafter") / "d")


def _factory(ref: DrafterRef, target_dir: Path, cache_dir: str = "runs/drafter-cache"):
    """What the replica hands the draft actor (pickled, as Ray ships it)."""
    aux = drafter_config_from_hf(ref.config).aux_layer_ids
    factory = functools.partial(
        load_eagle_proposer, ref, str(target_dir), 2, 1, 2, cache_dir=cache_dir, aux_layer_ids=aux
    )
    return pickle.loads(pickle.dumps(factory))


def _draft(worker: DraftWorker, width: int) -> list[int]:
    aux = torch.randn(3, width, generator=torch.Generator().manual_seed(0))
    _, trees = worker.propose([("r", GREEDY, 2)], (), Pairs(["r"], [3], torch.tensor([5, 6, 7]), aux))
    return trees["r"].tokens.tolist()


def test_the_draft_worker_fetches_the_s3_drafter_on_its_own_node(s3, tiny_dir, drafter_dir, tmp_path, monkeypatch):
    upload_dir(drafter_dir, "s3://aerie-test/nodes/d")
    replica, node = tmp_path / "replica", tmp_path / "draft-node"
    replica.mkdir()
    node.mkdir()
    reads, real = [], storage.S3Storage.read_bytes
    monkeypatch.setattr(storage.S3Storage, "read_bytes", lambda self, name: reads.append(name) or real(self, name))

    monkeypatch.chdir(replica)
    ref = read_drafter_ref("s3://aerie-test/nodes/d")
    assert reads == ["config.json"], "the replica reads the config only"
    factory = _factory(ref, tiny_dir)

    monkeypatch.chdir(node)  # another node: another working directory, its own (empty) cache
    worker = DraftWorker(factory, 2)
    assert worker.ready()["max_context"] > 0
    assert sorted(reads[1:]) == ["config.json", "model.safetensors"]
    cached = list((node / "runs" / "drafter-cache" / "s3").glob("*/model.safetensors"))
    assert len(cached) == 1 and cached[0].read_bytes() == (drafter_dir / "model.safetensors").read_bytes()
    assert list(replica.iterdir()) == [], "nothing was downloaded on the replica's node"

    local = DraftWorker(load_eagle_proposer(drafter_dir, tiny_dir, 2, 1, 2), 2)
    width = 3 * json.loads((tiny_dir / "config.json").read_text())["hidden_size"]
    assert _draft(worker, width) == _draft(local, width), "the same drafter as the directory's"


@pytest.mark.parametrize("fault", ["missing", "corrupt", "changed", "other-layers"])
def test_a_drafter_the_worker_cannot_load_is_one_line_at_ready(fault, s3, tiny_dir, drafter_dir, tmp_path):
    prefix = f"nodes-{fault}/d"
    upload_dir(drafter_dir, f"s3://aerie-test/{prefix}")
    if fault == "corrupt":
        s3.put_object(Bucket="aerie-test", Key=f"{prefix}/model.safetensors", Body=b"\x00" * 64)
    ref = read_drafter_ref(f"s3://aerie-test/{prefix}")
    if fault == "missing":  # deleted after the server pinned it
        for key in ("config.json", "model.safetensors"):
            s3.delete_object(Bucket="aerie-test", Key=f"{prefix}/{key}")
    elif fault == "changed":  # replaced after the server pinned it: the target may capture other layers
        s3.put_object(Bucket="aerie-test", Key=f"{prefix}/model.safetensors", Body=b"another drafter")
    elif fault == "other-layers":  # the target was configured for other aux layers than the drafter reads
        layers = {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
        config = ref.config | layers | {"eagle_config": ref.config["eagle_config"] | layers}
        ref = DrafterRef(ref.source, config, digest=ref.digest)
    expected = {
        "missing": "holds no files",
        "corrupt": "Error",
        "changed": "changed since the server read its config.json",
        "other-layers": "the target captures [0, 1, 2]",
    }[fault]

    worker = DraftWorker(_factory(ref, tiny_dir, str(tmp_path / "cache")), 2)
    with pytest.raises(AerieError) as err:
        worker.ready()
    message = str(err.value)
    # node "local" alone; a Ray node's id when an earlier test of the session started Ray in this process
    assert re.match(r"the draft worker \(node [^)]+\) has no proposer: ", message) and "\n" not in message
    assert expected in message, message
    with pytest.raises(AerieError, match="has no proposer"):
        worker.propose([("r", GREEDY, 2)])
    assert list((tmp_path / "cache").rglob(".*")) == [], "no half-written download left"


@pytest.mark.ray
def test_through_ray_the_replica_gets_the_workers_error_in_one_line(serve_session):
    """The actor stays up (no restart loop) and the replica's `ready` wait ends with the worker's own line."""
    import ray

    from orchestrator.serving.app import _ready

    factory = functools.partial(
        load_eagle_proposer, DrafterRef("/nonexistent/drafter", {}), "/nonexistent/target", 2, 1, 2
    )
    actor = ray.remote(DraftWorker).options(num_cpus=0, max_restarts=-1, max_task_retries=0).remote(factory, 2)
    try:
        with pytest.raises(AerieError) as err:
            _ready("draft", actor)
    finally:
        ray.kill(actor)
    message = str(err.value)
    assert "\n" not in message and message.startswith("draft worker: the draft worker (node "), message
    assert "drafter '/nonexistent/drafter' is not a directory with a config.json" in message, message


def _lost(ref) -> bool:
    import ray

    try:
        ray.get(ref, timeout=10)
    except ray.exceptions.ObjectLostError:
        return True
    return False


def _dead(actor) -> bool:
    import ray

    try:
        ray.get(actor.alive.remote(), timeout=60)
    except ray.exceptions.RayActorError:
        return True
    return False


@pytest.mark.ray
def test_through_ray_pairs_lost_before_a_draft_call_fail_that_call_not_the_worker(serve_session, tiny_dir, drafter_dir):
    """The scheduler hands the drafter each `Pairs` as a top-level Ray argument. One lost before the call (here its
    owner died; served, the target's node) fails that call (`WorkerFailed`: the round goes target-only and the
    drafter is sent whole histories), never `WorkerLost`, which would take a live drafter out of service."""
    import asyncio

    import ray

    from orchestrator.runtime.clients import RemoteWorker, WorkerFailed

    width = 3 * json.loads((tiny_dir / "config.json").read_text())["hidden_size"]
    factory = functools.partial(load_eagle_proposer, drafter_dir, str(tiny_dir), 2, 1, 2)
    actor = ray.remote(DraftWorker).options(num_cpus=0, max_restarts=0, max_task_retries=0).remote(factory, 2)

    @ray.remote(num_cpus=0)
    class Owner:
        def pairs(self, n: int) -> list:  # in a list: the ref stays the owner's, in the object store (> 100 KB)
            return [ray.put(Pairs(["r"], [n], torch.full((n,), 5), torch.randn(n, width)))]

        def alive(self) -> bool:
            return True

    try:
        worker = RemoteWorker(actor, timeout_s=120)
        owner = Owner.remote()
        [lost] = ray.get(owner.pairs.remote(4096))
        ray.kill(owner)
        # ray.kill is asynchronous (a call sent right after it may still be served); the dead owner's objects are
        # known lost about a second after its death
        wait_for(lambda: _dead(owner), 60, "the owner dead after ray.kill", period_s=0.2)
        wait_for(lambda: _lost(lost), 60, "the dead owner's object known lost")
        with pytest.raises(WorkerFailed, match="could not be computed"):
            asyncio.run(worker.call("propose", [("r", GREEDY, 2)], (), lost, returns=2))
        aux = torch.randn(3, width, generator=torch.Generator().manual_seed(0))
        pairs = ray.put(Pairs(["r"], [3], torch.tensor([5, 6, 7]), aux))
        out, trees = asyncio.run(worker.call("propose", [("r", GREEDY, 2)], ["r"], pairs, returns=2))
        assert list(out.sketches) == ["r"] and ray.get(trees)["r"].size > 0, "the same worker drafts on"
    finally:
        ray.kill(actor)
