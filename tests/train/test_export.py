"""The exported drafter: copied beside the output and swapped in, so a failed export keeps the previous one, and
an output that is not a drafter export is never touched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from orchestrator.errors import AerieError
from orchestrator.models.checkpoint import ARCHITECTURE
from orchestrator.train.run import export_drafter


def _drafter(path: Path, weights: bytes, **extra: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": [ARCHITECTURE]}))
    (path / "model.safetensors").write_bytes(weights)
    for name, data in extra.items():
        (path / name).write_bytes(data)
    return path


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir())


def test_an_export_replaces_the_previous_one_whole(tmp_path):
    out = _drafter(tmp_path / "exports" / "d", b"old", **{"result.json": b"{}", "stale.bin": b"s"})
    new = _drafter(tmp_path / "ckpt" / "drafter", b"new")
    assert export_drafter(new, str(out)) == str(out.resolve())
    assert _files(out) == _files(new)
    assert _siblings(out) == ["d"], "no temporary or previous copy left beside it"


def test_a_failure_mid_copy_leaves_the_previous_export_intact(tmp_path, monkeypatch):
    out = _drafter(tmp_path / "exports" / "d", b"old", **{"result.json": b"{}"})
    before = _files(out)
    new = _drafter(tmp_path / "ckpt" / "drafter", b"new" * 1000, **{"extra.bin": b"e"})
    real_copytree, copied = shutil.copytree, []

    def copy_one_then_fail(src, dst, *args, **kwargs):
        def copy(s, d, **kw):
            if copied:
                raise OSError(28, "No space left on device")
            copied.append(s)
            return shutil.copy2(s, d, **kw)

        return real_copytree(src, dst, *args, **{**kwargs, "copy_function": copy})

    monkeypatch.setattr(shutil, "copytree", copy_one_then_fail)
    with pytest.raises(OSError, match="No space left"):
        export_drafter(new, str(out))
    assert copied, "the copy started before it failed"
    assert _files(out) == before
    assert _siblings(out) == ["d"]


def test_an_output_that_is_no_drafter_export_is_refused_untouched(tmp_path):
    models = tmp_path / "models"
    (models / "smollm2-135m-instruct").mkdir(parents=True)
    (models / "smollm2-135m-instruct" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (models / "notes.txt").write_text("keep me")
    before = _files(models)
    new = _drafter(tmp_path / "ckpt" / "drafter", b"new")
    for output in (models, models / "smollm2-135m-instruct", models / "notes.txt"):
        with pytest.raises(AerieError, match=f"output {output} exists and is not an exported drafter"):
            export_drafter(new, str(output))
    assert _files(models) == before
    assert _siblings(models) == ["ckpt", "models"]


def test_an_empty_or_missing_output_takes_the_export(tmp_path):
    new = _drafter(tmp_path / "ckpt" / "drafter", b"new")
    (tmp_path / "empty").mkdir()
    for output in (tmp_path / "empty", tmp_path / "a" / "b"):
        export_drafter(new, str(output))
        assert _files(output) == _files(new)
