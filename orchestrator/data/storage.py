"""Where shards go: a local directory or `s3://bucket/prefix` (boto3; endpoint, region and credentials from the
standard AWS environment and config files, so MinIO, Ceph or moto work as well as AWS).

Writes are atomic: a local file is written beside its target and renamed; an S3 object appears whole. A name
from elsewhere (an S3 listing, a manifest) becomes a local path only through `safe_path`, which refuses one that
would land outside its directory.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Protocol

from orchestrator.errors import AerieError
from orchestrator.files import write_atomic
from orchestrator.redaction import redact_text


class Storage(Protocol):
    def exists(self, name: str) -> bool: ...

    def read_bytes(self, name: str) -> bytes: ...

    def write_bytes(self, name: str, data: bytes) -> None: ...

    def uri(self, name: str = "") -> str: ...

    def names(self) -> list[str]: ...

    def delete(self, name: str) -> None: ...


def safe_path(root: Path, name: str, key: str | None = None) -> Path:
    """`root / name` for a name read from elsewhere; an AerieError naming `key` (default: `name`) when the path
    would land outside `root`: an absolute name (`prefix//tmp/x` lists as `/tmp/x`), a `..` segment, or a
    symlink inside `root` that points out of it.

        safe_path(Path("d"), "sub/model.safetensors") -> d/sub/model.safetensors
        safe_path(Path("d"), "../../evil")            -> AerieError
    """
    parts = PurePosixPath(name).parts
    target = root / name
    if not parts or PurePosixPath(name).is_absolute() or ".." in parts or not _inside(target, root):
        raise AerieError(
            f"refusing object key {key or name!r}: it would be written outside {root} "
            "(an absolute path, a '..' segment or a symlink out); rename the object"
        )
    return target


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


class LocalStorage:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def exists(self, name: str) -> bool:
        return safe_path(self.root, name).is_file()

    def read_bytes(self, name: str) -> bytes:
        return safe_path(self.root, name).read_bytes()

    def write_bytes(self, name: str, data: bytes) -> None:
        write_atomic(safe_path(self.root, name), data, mode=0o600)  # shards may hold users' traffic: the writer's only

    def uri(self, name: str = "") -> str:
        return str(self.root / name)

    def names(self) -> list[str]:
        """Every file below the root, as relative names."""
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())

    def delete(self, name: str) -> None:
        """Remove `name` (nothing when it is not there)."""
        safe_path(self.root, name).unlink(missing_ok=True)


class S3Storage:
    def __init__(self, url: str) -> None:
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, _, prefix = url[len("s3://") :].partition("/")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.client = boto3.client("s3")
        try:
            self.client.head_bucket(Bucket=bucket)
        except (BotoCoreError, ClientError) as err:
            raise AerieError(
                redact_text(f"cannot reach S3 bucket {bucket!r} ({err}); check AWS_ENDPOINT_URL and credentials")
            ) from err

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def exists(self, name: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(name))
            return True
        except ClientError as err:
            if err.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def read_bytes(self, name: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()

    def write_bytes(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data)

    def uri(self, name: str = "") -> str:
        return f"s3://{self.bucket}/{self._key(name)}"

    def objects(self) -> dict[str, tuple[str, int]]:
        """Every object under the prefix: relative name -> (ETag, size in bytes)."""
        start = f"{self.prefix}/" if self.prefix else ""
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
            out |= {obj["Key"][len(start) :]: (obj["ETag"], obj["Size"]) for obj in page.get("Contents", [])}
        return out

    def names(self) -> list[str]:
        return sorted(self.objects())

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(name))

    def digest(self) -> str:
        """sha256 of the listing (names, ETags, sizes): changes whenever any object under the prefix does."""
        return hashlib.sha256(json.dumps(sorted(self.objects().items())).encode()).hexdigest()


def open_storage(location: str) -> Storage:
    """`s3://bucket/prefix` or a local directory."""
    if location.startswith("s3://"):
        return S3Storage(location)
    return LocalStorage(location)


def upload_dir(local_dir: str | Path, location: str) -> str:
    """Copy every file of `local_dir` to `location` (local or s3://); returns the location's URI."""
    storage = open_storage(location)
    local_dir = Path(local_dir)
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        storage.write_bytes(str(path.relative_to(local_dir)), path.read_bytes())
    return storage.uri()


def download_prefix(location: str, dest: str | Path) -> Path:
    """Copy every object under `location` into `dest` (a fresh local directory); returns `dest`. Every key is
    checked before anything is written: one that would land outside `dest` is an error naming it."""
    storage, dest = open_storage(location), Path(dest)
    names = [n for n in storage.names() if n and not n.endswith("/")]  # "dir/" keys are folder markers
    if not names:
        raise AerieError(f"{redact_text(location)} holds no files")
    targets = {name: safe_path(dest, name, storage.uri(name)) for name in names}
    for name, target in targets.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(storage.read_bytes(name))
    return dest
