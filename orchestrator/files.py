"""Files and directories published whole: a reader (another process, a server, a run that resumes after a crash)
finds the previous version or the new one, never a part of either.

Both build beside the destination (a temporary name in the same directory, so the last step is one rename on one
file system) and publish readable by other users: a server or a training job may run as another user than the
one that wrote, and `mkstemp`/`mkdtemp` create 0600/0700.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

FILE_MODE, DIR_MODE = 0o644, 0o755


def write_atomic(path: str | Path, data: bytes | str, mode: int = FILE_MODE) -> Path:
    """Write `data` (str: UTF-8) to `path`, creating its directory: a temporary file beside it, renamed over it.
    mode: 0600 for what only its writer may read (users' traffic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def publish_dir(out: str | Path, build: Callable[[Path], Path | None], *, replace: bool = True) -> Path:
    """Build a directory with `build(tmp)` (an empty directory beside `out`; it returns the directory to publish:
    `tmp`, the default, or one inside it) and rename it to `out`. On any failure `out` stays as it was and
    nothing is left beside it.

    replace: an existing `out` is swapped out (renamed aside, then removed) and, when the last rename fails, put
    back:

        out/ (previous)   .out.new-X/ (built)   ->   .out.old-Y/ (previous)   out/ (new)   ->   out/ (new)

    False: the first copy wins (a cache several processes fill): an `out` that exists when the build is done
    is kept and this build discarded."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-", dir=out.parent))
    old: Path | None = None
    try:
        built = build(tmp) or tmp
        _readable(built)
        if out.exists() and not replace:
            return out
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old)  # onto the empty placeholder
        try:
            os.rename(built, out)
        except OSError:
            if old is not None:
                os.rename(old, out)  # the previous version back in place
                old = None
            elif not replace and out.exists():
                return out  # another process published first
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
        if old is not None and out.exists():  # kept if it could not be put back
            shutil.rmtree(old)
    return out


def _readable(root: Path) -> None:
    root.chmod(DIR_MODE)
    for path in root.rglob("*"):
        if not path.is_symlink():
            path.chmod(DIR_MODE if path.is_dir() else FILE_MODE)
