"""Files and directories published whole (orchestrator.files): the previous version or the new one, never a part,
nothing left beside them, readable by other users."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from orchestrator.files import publish_dir, write_atomic


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _build(files: dict[str, bytes]):
    def build(tmp: Path) -> None:
        for name, data in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)
            (tmp / name).chmod(0o600)  # as safetensors and mkstemp write them

    return build


def test_a_file_is_written_whole_readable_and_alone(tmp_path):
    path = write_atomic(tmp_path / "sub" / "manifest.json", "{}\n")
    assert path.read_text() == "{}\n" and _mode(path) == 0o644
    write_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in path.parent.iterdir()) == ["manifest.json"]


def test_a_file_that_cannot_be_renamed_into_place_leaves_the_old_one(tmp_path, monkeypatch):
    path = write_atomic(tmp_path / "state.json", "old")

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"], "no temporary file left"


def test_a_directory_replaces_the_previous_one_whole_and_readable(tmp_path):
    out = publish_dir(tmp_path / "d", _build({"a.bin": b"old", "stale.bin": b"s"}))
    publish_dir(out, _build({"a.bin": b"new", "sub/b.json": b"{}"}))
    assert _tree(out) == {"a.bin": b"new", "sub/b.json": b"{}"}
    assert _mode(out) == _mode(out / "sub") == 0o755
    assert _mode(out / "a.bin") == _mode(out / "sub" / "b.json") == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["d"], "no temporary or previous copy left beside it"


def test_a_build_that_fails_leaves_the_previous_directory(tmp_path):
    out = publish_dir(tmp_path / "d", _build({"a.bin": b"old"}))

    def half(tmp: Path) -> None:
        (tmp / "a.bin").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        publish_dir(out, half)
    assert _tree(out) == {"a.bin": b"old"}
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_a_last_rename_that_fails_puts_the_previous_directory_back(tmp_path, monkeypatch):
    out = publish_dir(tmp_path / "d", _build({"a.bin": b"old"}))
    real_rename = os.rename

    def refuse_the_new(src, dst):
        if ".new-" in Path(src).name:
            raise OSError(16, "Device or resource busy")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", refuse_the_new)
    with pytest.raises(OSError, match="busy"):
        publish_dir(out, _build({"a.bin": b"new"}))
    assert _tree(out) == {"a.bin": b"old"}
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_without_replace_the_first_copy_wins(tmp_path):
    out = publish_dir(tmp_path / "cache" / "v1", _build({"config.json": b"first"}), replace=False)
    assert _tree(publish_dir(out, _build({"config.json": b"second"}), replace=False)) == {"config.json": b"first"}

    def another_process_publishes_meanwhile(tmp: Path) -> Path:
        publish_dir(tmp_path / "cache" / "v2", _build({"config.json": b"theirs"}))
        (tmp / "inner").mkdir()
        (tmp / "inner" / "config.json").write_bytes(b"ours")
        return tmp / "inner"  # a download that unpacks into a folder of its own

    got = publish_dir(tmp_path / "cache" / "v2", another_process_publishes_meanwhile, replace=False)
    assert _tree(got) == {"config.json": b"theirs"}
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["v1", "v2"]


def test_a_build_may_publish_a_folder_inside_its_directory(tmp_path):
    def unpack(tmp: Path) -> Path:
        (tmp / "archive" / "drafter").mkdir(parents=True)
        (tmp / "archive" / "drafter" / "config.json").write_bytes(b"{}")
        (tmp / "archive" / "README").write_bytes(b"not published")
        return tmp / "archive" / "drafter"

    out = publish_dir(tmp_path / "d", unpack)
    assert _tree(out) == {"config.json": b"{}"}
    assert [p.name for p in tmp_path.iterdir()] == ["d"]
