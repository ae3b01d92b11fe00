"""MLflow: where runs go, what may be logged, and drafters in the Model Registry.

Drafters are registered as plain artifact directories (the vLLM-format checkpoint), so any MLflow client can
fetch one with `mlflow.artifacts.download_artifacts("models:/NAME@ALIAS")` and vLLM can load the result.

A server pins its drafter first (`read_drafter_ref`: an alias to its version, an S3 prefix to its listing) and
reads only its config.json; each draft worker then fetches that exact version on its own node (`DrafterRef.fetch`),
so workers on other nodes, restarted ones included, load the drafter the target was configured for.

The drafter cache holds one directory per exact version, each written beside its final name and renamed into
place, so replicas on one node share it and never delete what another is reading:

    runs/drafter-cache/models/<registry>/<NAME>/<VERSION>/config.json   (an alias resolved to its version)
    runs/drafter-cache/s3/<bucket_prefix>-<listing digest>/config.json  (keys, ETags and sizes)
    runs/drafter-cache/models/<registry>/<NAME>/.<VERSION>.new-XXXX/     (a download in progress)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orchestrator.console import say
from orchestrator.errors import AerieError
from orchestrator.files import publish_dir
from orchestrator.redaction import redact_text

DEFAULT_STORE = "runs/mlflow.db"
TRAIN_NAME_TAG = "aerie.train_name"


def tracking_uri(configured: str | None = None) -> str:
    """The configured URI, else MLFLOW_TRACKING_URI, else a SQLite file under runs/ (absolute, so Ray
    workers started elsewhere write to the same store)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    path = Path(DEFAULT_STORE).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def client(uri: str | None = None):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri(uri))


def resume_or_start_run(
    mlflow_client, experiment: str, name: str, tag: str = TRAIN_NAME_TAG, resume: bool = True
) -> tuple[str, bool]:
    """The unfinished run tagged `tag` = `name` (a training's or a pipeline's, running or failed: a rerun resumes
    it; never a finished or a killed one), else a new run: (run_id, resumed).

    resume: False where the work starts over (a training with no checkpoint to go on from): an unfinished run of
    that name is ended as KILLED and a new one started, so that a run's params and metric history are those of
    one piece of work (a restart that reused it mixed two loss curves under the first one's learning rate)."""
    exp = mlflow_client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else mlflow_client.create_experiment(experiment)
    runs = mlflow_client.search_runs(
        [exp_id],
        filter_string=f"tags.`{tag}` = '{name}' and attributes.status != 'FINISHED' and attributes.status != 'KILLED'",
    )
    if runs and resume:
        mlflow_client.update_run(runs[0].info.run_id, status="RUNNING")
        return runs[0].info.run_id, True
    for stale in runs:
        mlflow_client.set_terminated(stale.info.run_id, status="KILLED")
    run = mlflow_client.create_run(exp_id, run_name=name, tags={tag: name})
    return run.info.run_id, False


def register_drafter(
    mlflow_client, name: str, run_id: str, artifact_path: str, tags: dict[str, str], aliases: list[str]
) -> str:
    """Register the run's logged drafter directory as a new version of `name`; returns the version."""
    from mlflow.exceptions import MlflowException

    try:
        mlflow_client.get_registered_model(name)
    except MlflowException:
        mlflow_client.create_registered_model(name, description="EAGLE-3 / 3.1 drafters (vLLM format)")
    source = f"{mlflow_client.get_run(run_id).info.artifact_uri}/{artifact_path}"
    version = mlflow_client.create_model_version(name, source, run_id=run_id, tags=tags).version
    for alias in aliases:
        mlflow_client.set_registered_model_alias(name, alias, version)
    return str(version)


MODELS = "models:/"


def is_model_uri(source: object) -> bool:
    """Whether `source` names a registered model version (models:/NAME/VERSION or models:/NAME@ALIAS)."""
    return str(source).startswith(MODELS)


@dataclass(frozen=True)
class ModelUri:
    """A `models:/NAME/VERSION` or `models:/NAME@ALIAS` URI, parsed: the one place that reads their syntax."""

    name: str
    version: str | None = None
    alias: str | None = None

    @classmethod
    def parse(cls, uri: str) -> ModelUri:
        body = uri[len(MODELS) :] if is_model_uri(uri) else ""
        name, at, alias = body.partition("@")
        if not at:
            name, _, version = body.partition("/")
        if not name or not (alias if at else version):
            raise AerieError(f"{uri!r} is not a model URI: use models:/NAME/VERSION or models:/NAME@ALIAS")
        return cls(name, alias=alias) if at else cls(name, version=version)

    def __str__(self) -> str:
        return f"{MODELS}{self.name}@{self.alias}" if self.alias else f"{MODELS}{self.name}/{self.version}"

    def resolve(self, mlflow_client) -> str:
        """The version number it names (an alias looked up); MlflowException when there is none."""
        if self.alias:
            return str(mlflow_client.get_model_version_by_alias(self.name, self.alias).version)
        return str(mlflow_client.get_model_version(self.name, self.version).version)


def check_model_uri(uri: str, tracking: str | None = None) -> tuple[str, str]:
    """Fail early, with a clear message, when a models:/ URI names no registered version; returns
    (name, version), an alias resolved to its version number."""
    from mlflow.exceptions import MlflowException

    parsed = ModelUri.parse(uri)
    c = client(tracking)
    try:
        return parsed.name, parsed.resolve(c)
    except MlflowException as err:
        known = [m.name for m in c.search_registered_models(max_results=20)]
        registry = redact_text(tracking_uri(tracking))
        raise AerieError(
            f"{uri} is not in the model registry at {registry} ({err.error_code}); registered: {known}"
        ) from err


def tag_rollout(record: dict, tracking: str | None = None, production_alias: str = "production") -> None:
    """A rollout's decision on its drafter's registry version (when it is a models:/ one) as tags; promotion
    (or a first deployment) moves `production_alias` to it."""
    if not is_model_uri(record.get("drafter", "")):
        return
    uri = ModelUri.parse(record["drafter"])
    c = client(tracking)
    version = uri.resolve(c)
    decision = record["decision"]
    c.set_model_version_tag(uri.name, version, "aerie.rollout", decision)
    c.set_model_version_tag(uri.name, version, "aerie.rollout.app", record.get("app") or "")
    if "reason" in record:
        c.set_model_version_tag(uri.name, version, "aerie.rollout.reason", record["reason"])
    if decision in ("initial", "promoted"):
        c.set_registered_model_alias(uri.name, production_alias, version)
    say(f"[deploy] {uri.name} version {version}: {decision}")


@dataclass(frozen=True)
class DrafterRef:
    """A drafter pinned to one exact version, and its config.json (see the module docstring)."""

    source: str  # a directory (on a volume every node sees), s3://bucket/prefix or models:/NAME/VERSION
    config: dict  # its config.json
    tracking: str | None = None  # models:/: the registry it was resolved in
    digest: str | None = None  # s3://: sha256 of the listing its config was read from (`S3Storage.digest`)

    def fetch(self, cache_dir: str | Path) -> Path:
        """This version's directory on this node (downloaded into `cache_dir` unless it is a directory)."""
        return fetch_drafter(self.source, cache_dir, self.tracking, self.digest)


def read_drafter_ref(source: str, tracking: str | None = None) -> DrafterRef:
    """Pin a directory, s3:// prefix or models:/ URI to its exact version and read just its config.json."""
    if is_model_uri(source):
        import mlflow
        from mlflow.exceptions import MlflowException

        name, version = check_model_uri(source, tracking)
        uri = tracking_uri(tracking)
        mlflow.set_tracking_uri(uri)  # models:/ downloads read the global registry URI
        pinned = f"models:/{name}/{version}"
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = mlflow.artifacts.download_artifacts(artifact_uri=f"{pinned}/config.json", dst_path=tmp)
            except (MlflowException, OSError) as err:
                raise AerieError(f"drafter {source} ({pinned}) holds no config.json ({type(err).__name__})") from err
            return DrafterRef(pinned, _config(Path(path).read_bytes(), source), tracking=uri)
    if source.startswith("s3://"):
        from orchestrator.data.storage import S3Storage

        storage = S3Storage(source)
        digest = storage.digest()
        if not storage.exists("config.json"):
            raise AerieError(f"drafter {redact_text(source)} holds no config.json")
        return DrafterRef(source, _config(storage.read_bytes("config.json"), source), digest=digest)
    return DrafterRef(source, _config(fetch_drafter(source).joinpath("config.json").read_bytes(), source))


def _config(raw: bytes, source: str) -> dict:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AerieError(f"drafter {redact_text(source)}: config.json is not valid JSON ({err})") from err


def fetch_drafter(
    source: str, cache_dir: str | Path = "runs/drafter-cache", tracking: str | None = None, digest: str | None = None
) -> Path:
    """A drafter directory for a local path, an s3:// prefix or a models:/ URI (downloaded once per exact
    version into `cache_dir`, see the module docstring; an existing download is reused, never replaced).
    digest: for s3://, the listing the content must have (`DrafterRef`): a prefix that changed since fails."""
    from orchestrator.data.storage import safe_path

    cache = Path(cache_dir)
    if is_model_uri(source):
        import mlflow

        name, version = check_model_uri(source, tracking)
        uri = tracking_uri(tracking)
        mlflow.set_tracking_uri(uri)  # models:/ downloads read the global registry URI
        registry = hashlib.sha256(redact_text(uri).encode()).hexdigest()[:12]  # one cache per registry
        dest = safe_path(cache, f"models/{registry}/{_slug(name)}/{version}", source)
        pinned = f"models:/{name}/{version}"
        return _cached(
            source, dest, lambda tmp: Path(mlflow.artifacts.download_artifacts(artifact_uri=pinned, dst_path=str(tmp)))
        )
    if source.startswith("s3://"):
        from orchestrator.data.storage import S3Storage, download_prefix

        pinned = digest is not None
        digest = digest or S3Storage(source).digest()  # pinned and cached: no S3 request at all
        dest = safe_path(cache, f"s3/{_slug(source[len('s3://') :])}-{digest[:16]}", source)

        def download(tmp: Path) -> Path:
            download_prefix(source, tmp)
            if S3Storage(source).digest() != digest:
                if pinned:
                    raise AerieError(
                        f"{redact_text(source)} changed since the server read its config.json (its listing differs); "
                        "deploy the drafter again"
                    )
                raise AerieError(f"{redact_text(source)} changed while it was downloaded; fetch it again")
            return tmp

        return _cached(source, dest, download)
    path = Path(source)
    if not (path / "config.json").is_file():
        raise AerieError(
            f"drafter {redact_text(source)!r} is not a directory with a config.json (nor s3:// or models:/)"
        )
    return path


def _slug(text: str) -> str:
    """One path segment: `org/drafter v1` -> `org_drafter_v1` (a leading dot too, so never `.` or `..`)."""
    return re.sub(r"^\.|[^A-Za-z0-9._-]+", "_", text)


def _cached(source: str, dest: Path, download: Callable[[Path], Path]) -> Path:
    """`dest` when it holds a drafter; else `download(tmp)` into a fresh directory beside `dest` (it returns the
    drafter directory: `tmp` or one inside it), renamed to `dest`. When another process renamed first, its copy
    is kept and ours discarded; nothing but our own temporary directory is ever deleted."""

    def build(tmp: Path) -> Path:
        got = download(tmp)
        if not (got / "config.json").is_file():
            raise AerieError(f"drafter {redact_text(source)} holds no config.json")
        return got

    if not dest.exists():
        publish_dir(dest, build, replace=False)
    if not (dest / "config.json").is_file():  # there before, or put there meanwhile by another process
        raise AerieError(f"{dest} exists but holds no config.json (not a cached drafter): remove it")
    return dest
