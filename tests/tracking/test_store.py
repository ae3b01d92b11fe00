"""The drafter cache: one directory per exact version, written beside its name and renamed into place, reused
and never deleted while another replica may read it (moto's S3 on loopback, a SQLite MLflow registry)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orchestrator.data import storage
from orchestrator.errors import AerieError
from orchestrator.models.checkpoint import ARCHITECTURE
from orchestrator.tracking import fetch_drafter, register_drafter


def _drafter(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": [ARCHITECTURE]}))
    (path / "model.safetensors").write_bytes(weights)
    return path


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _mark(path: Path) -> tuple[int, int]:
    """Stamp `path` with mtime 1 ns; (inode, mtime) changes if anything deletes, replaces or rewrites it."""
    os.utime(path, ns=(1, 1))
    return _identity(path)


def _identity(path: Path) -> tuple[int, int]:
    return os.stat(path).st_ino, os.stat(path).st_mtime_ns


def _leftovers(cache: Path) -> list[Path]:
    return list(cache.rglob(".*"))  # orchestrator.files builds beside the destination under a dot name


def _upload(client, prefix: str, weights: bytes) -> None:
    client.put_object(
        Bucket="aerie-test", Key=f"{prefix}/config.json", Body=json.dumps({"architectures": [ARCHITECTURE]})
    )
    client.put_object(Bucket="aerie-test", Key=f"{prefix}/model.safetensors", Body=weights)


def test_an_s3_drafter_is_cached_per_content_and_never_replaced(s3, tmp_path):
    _upload(s3, "cache-a/d", b"v1")
    cache = tmp_path / "cache"
    first = fetch_drafter("s3://aerie-test/cache-a/d", cache)
    assert first.parent == cache / "s3" and first.name.startswith("aerie-test_cache-a_d-")
    with (first / "model.safetensors").open("rb") as reader:  # a replica reading the cached drafter
        stamp = _mark(first / "model.safetensors")
        assert fetch_drafter("s3://aerie-test/cache-a/d", cache) == first
        assert _identity(first / "model.safetensors") == stamp, "reused, not rewritten"
        assert reader.read() == b"v1"

    _upload(s3, "cache-a/d", b"v2")  # new content under the same prefix: a new directory
    second = fetch_drafter("s3://aerie-test/cache-a/d", cache)
    assert second != first and (second / "model.safetensors").read_bytes() == b"v2"
    assert (first / "model.safetensors").read_bytes() == b"v1"
    assert _leftovers(cache) == []


def test_a_replica_that_loses_the_rename_race_keeps_the_winners_copy(s3, tmp_path, monkeypatch):
    _upload(s3, "cache-race/d", b"w")
    cache, source = tmp_path / "cache", "s3://aerie-test/cache-race/d"
    real, seen = storage.download_prefix, {}

    def slow_replica(location, dest):
        if not seen:  # while this replica downloads, another one fetches the same drafter and finishes first
            seen["started"] = True
            seen["winner"] = fetch_drafter(source, cache)
            seen["stamp"] = _mark(seen["winner"] / "model.safetensors")
        return real(location, dest)

    monkeypatch.setattr(storage, "download_prefix", slow_replica)
    assert fetch_drafter(source, cache) == seen["winner"]
    assert _identity(seen["winner"] / "model.safetensors") == seen["stamp"], "the winner's files stay as they are"
    assert _files(seen["winner"])["model.safetensors"] == b"w"
    assert _leftovers(cache) == []


def test_a_failed_download_leaves_no_cached_directory(s3, tmp_path, monkeypatch):
    _upload(s3, "cache-fail/d", b"x")
    cache, source = tmp_path / "cache", "s3://aerie-test/cache-fail/d"
    real, reads = storage.S3Storage.read_bytes, []

    def fail_after_one(self, name):
        if reads:
            raise ConnectionError("connection reset")
        reads.append(name)
        return real(self, name)

    monkeypatch.setattr(storage.S3Storage, "read_bytes", fail_after_one)
    with pytest.raises(ConnectionError):
        fetch_drafter(source, cache)
    assert list(cache.rglob("*")) == [cache / "s3"], "no final and no temporary directory"
    monkeypatch.setattr(storage.S3Storage, "read_bytes", real)
    assert (fetch_drafter(source, cache) / "model.safetensors").read_bytes() == b"x"


def test_an_s3_prefix_without_a_config_is_no_drafter(s3, tmp_path):
    s3.put_object(Bucket="aerie-test", Key="cache-none/d/weights.bin", Body=b"x")
    with pytest.raises(AerieError, match="s3://aerie-test/cache-none/d holds no config.json"):
        fetch_drafter("s3://aerie-test/cache-none/d", tmp_path / "cache")
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []


@pytest.fixture
def registry(tmp_path) -> tuple[str, object]:
    """A SQLite registry with drafter `d`: version 1 (@prod) and version 2; (tracking URI, client)."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("drafters", artifact_location=(tmp_path / "artifacts").as_uri())
    for version, weights in ((1, b"one"), (2, b"two")):
        run = client.create_run(exp).info.run_id
        client.log_artifacts(run, str(_drafter(tmp_path / f"src{version}", weights)), "drafter")
        register_drafter(client, "d", run, "drafter", {}, ["prod"] if version == 1 else [])
    return uri, client


def test_a_registry_alias_is_cached_under_its_version(registry, tmp_path, monkeypatch):
    import mlflow.artifacts

    uri, client = registry
    cache = tmp_path / "cache"
    one = fetch_drafter("models:/d@prod", cache, uri)
    assert one.relative_to(cache).parts[0] == "models" and one.parts[-2:] == ("d", "1")
    assert _files(one)["model.safetensors"] == b"one"
    stamp = _mark(one / "model.safetensors")

    downloads = []
    monkeypatch.setattr(mlflow.artifacts, "download_artifacts", lambda **kw: downloads.append(kw))
    assert fetch_drafter("models:/d/1", cache, uri) == one and downloads == [], "the same version: no download"
    monkeypatch.undo()

    client.set_registered_model_alias("d", "prod", "2")
    two = fetch_drafter("models:/d@prod", cache, uri)
    assert two.parts[-2:] == ("d", "2") and _files(two)["model.safetensors"] == b"two"
    assert _identity(one / "model.safetensors") == stamp and _files(one)["model.safetensors"] == b"one"
    assert _leftovers(cache) == []


def test_a_failed_registry_download_leaves_no_cached_directory(registry, tmp_path, monkeypatch):
    import mlflow.artifacts

    uri, _ = registry

    def half(artifact_uri, dst_path, **kw):
        (Path(dst_path) / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(mlflow.artifacts, "download_artifacts", half)
    with pytest.raises(OSError, match="disk full"):
        fetch_drafter("models:/d@prod", tmp_path / "cache", uri)
    assert [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []


def test_a_pinned_registry_drafter_stays_at_its_version_when_the_alias_moves(registry, tmp_path, monkeypatch):
    """The server pins models:/d@prod to version 1 reading only config.json; a draft worker fetching later (or
    restarting) gets version 1 even after the alias moved."""
    import mlflow.artifacts

    from orchestrator.tracking import read_drafter_ref

    uri, client = registry
    real, asked = mlflow.artifacts.download_artifacts, []

    def record(**kw):
        asked.append(kw["artifact_uri"])
        return real(**kw)

    monkeypatch.setattr(mlflow.artifacts, "download_artifacts", record)
    ref = read_drafter_ref("models:/d@prod", uri)
    assert (ref.source, ref.tracking, ref.config) == ("models:/d/1", uri, {"architectures": [ARCHITECTURE]})
    assert asked == ["models:/d/1/config.json"], "only the config is read"
    client.set_registered_model_alias("d", "prod", "2")
    assert _files(ref.fetch(tmp_path / "node-cache"))["model.safetensors"] == b"one"


def test_a_pinned_s3_drafter_in_the_node_cache_needs_no_s3(s3, tmp_path, monkeypatch):
    """A restarted draft worker finds its pinned version in its node's cache without asking S3."""
    from orchestrator.tracking import read_drafter_ref

    _upload(s3, "pinned/d", b"p")
    ref = read_drafter_ref("s3://aerie-test/pinned/d")
    first = ref.fetch(tmp_path / "cache")

    def unreachable(self, url):
        raise AssertionError("S3 was asked")

    monkeypatch.setattr(storage.S3Storage, "__init__", unreachable)
    assert ref.fetch(tmp_path / "cache") == first and (first / "model.safetensors").read_bytes() == b"p"


def test_a_cache_folder_that_holds_no_drafter_is_refused_untouched(tmp_path):
    from orchestrator.tracking.store import _cached

    dest = tmp_path / "cache" / "v1"
    dest.mkdir(parents=True)
    (dest / "notes.txt").write_text("keep me")
    downloads = []
    with pytest.raises(AerieError, match="exists but holds no config.json"):
        _cached("s3://b/d", dest, lambda tmp: downloads.append(tmp) or tmp)
    assert downloads == [], "nothing downloaded for a folder it will not use"
    assert _files(dest) == {"notes.txt": b"keep me"} and _leftovers(tmp_path / "cache") == []
