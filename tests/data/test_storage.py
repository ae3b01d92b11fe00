"""Storage: object keys and manifest names never become paths outside their directory (moto's S3 on loopback)."""

from __future__ import annotations

import pytest

from orchestrator.data.storage import LocalStorage, download_prefix, safe_path, upload_dir
from orchestrator.errors import AerieError


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("model.safetensors", True),
        ("sub/dir/x.json", True),
        ("./x", True),
        ("a..b/c..", True),  # dots inside a name are no segment
        ("", False),
        (".", False),
        ("/etc/passwd", False),
        ("../x", False),
        ("sub/../../x", False),
        ("sub/..", False),
    ],
)
def test_safe_path_keeps_names_inside_the_root(tmp_path, name, ok):
    if ok:
        assert safe_path(tmp_path, name).resolve().is_relative_to(tmp_path.resolve())
    else:
        with pytest.raises(AerieError, match="refusing object key"):
            safe_path(tmp_path, name)


def test_a_symlink_out_of_the_root_is_refused(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path / "outside")
    with pytest.raises(AerieError, match="'link/x'"):
        safe_path(tmp_path / "root", "link/x")


def test_local_storage_refuses_names_from_a_manifest_that_leave_it(tmp_path):
    (tmp_path / "secret").write_bytes(b"s")
    storage = LocalStorage(tmp_path / "run")
    for call in (storage.exists, storage.read_bytes, lambda n: storage.write_bytes(n, b"x")):
        with pytest.raises(AerieError, match=r"refusing object key '\.\./secret'"):
            call("../secret")
    assert (tmp_path / "secret").read_bytes() == b"s"
    storage.write_bytes("sub/shard.json", b"{}")  # nested names are written beside their target and renamed
    assert storage.names() == ["sub/shard.json"]


def _put(client, keys: list[str]) -> None:
    for key in keys:
        client.put_object(Bucket="aerie-test", Key=key, Body=b"payload")


def test_download_prefix_refuses_an_absolute_key_before_writing(s3, tmp_path):
    outside = tmp_path / "outside" / "x"
    bad = f"trav-abs/v1/{outside}"  # "trav-abs/v1//tmp/.../x": the double slash makes the name absolute
    _put(s3, ["trav-abs/v1/config.json", bad])
    dest = tmp_path / "cache" / "dest"
    with pytest.raises(AerieError, match=f"refusing object key 's3://aerie-test/{bad}'"):
        download_prefix("s3://aerie-test/trav-abs/v1", dest)
    assert not outside.exists()
    assert not dest.exists(), "nothing is written once a key is refused"


def test_download_prefix_refuses_dot_dot_keys_before_writing(s3, tmp_path):
    _put(s3, ["trav-dots/v1/a.json", "trav-dots/v1/sub/../../../evil"])
    dest = tmp_path / "cache" / "dest"
    with pytest.raises(AerieError, match=r"'s3://aerie-test/trav-dots/v1/sub/\.\./\.\./\.\./evil'"):
        download_prefix("s3://aerie-test/trav-dots/v1", dest)
    assert not (tmp_path / "evil").exists()
    assert not dest.exists(), "a.json sorts first and is still not written"

    _put(s3, ["trav-dots2/v1/../../evil"])
    with pytest.raises(AerieError, match=r"'s3://aerie-test/trav-dots2/v1/\.\./\.\./evil'"):
        download_prefix("s3://aerie-test/trav-dots2/v1", dest)
    assert not (tmp_path / "cache" / "evil").exists() and not (tmp_path / "evil").exists()


def test_download_prefix_copies_nested_objects_and_skips_folder_markers(s3, tmp_path):
    _put(s3, ["clean/v1/config.json", "clean/v1/sub/", "clean/v1/sub/w.bin", "clean/v1x/other.json"])
    dest = download_prefix("s3://aerie-test/clean/v1", tmp_path / "dest")
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == ["config.json", "sub/w.bin"]
    upload_dir(dest, str(tmp_path / "copy"))  # local to local keeps the layout
    assert (tmp_path / "copy" / "sub" / "w.bin").read_bytes() == b"payload"


def test_local_storage_writes_what_only_its_writer_may_read(tmp_path):
    """Shards may hold users' prompts and answers (the traffic tap): 0600, whole, nothing left beside them."""
    import stat

    store = LocalStorage(tmp_path / "traffic")
    store.write_bytes("w1/shard-0.safetensors", b"x" * 10)
    path = tmp_path / "traffic" / "w1" / "shard-0.safetensors"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert store.read_bytes("w1/shard-0.safetensors") == b"x" * 10
    assert [p.name for p in path.parent.iterdir()] == ["shard-0.safetensors"]
