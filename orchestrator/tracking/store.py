"""MLflow: where runs go, what may be logged, and drafters in the Model Registry.

Drafters are registered as plain artifact directories (the vLLM-format checkpoint), so any MLflow client can
fetch one with `mlflow.artifacts.download_artifacts("models:/NAME@ALIAS")` and vLLM can load the result.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from orchestrator.errors import AerieError

DEFAULT_STORE = "runs/mlflow.db"
TRAIN_NAME_TAG = "aerie.train_name"
_SECRET_KEY = re.compile(r"(secret|password|passwd|token|credential|api_?key|access_?key|private)", re.IGNORECASE)
_URL_AUTH = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.IGNORECASE)


def tracking_uri(configured: str | None = None) -> str:
    """The configured URI, else MLFLOW_TRACKING_URI, else a SQLite file under runs/ (absolute, so Ray
    workers started elsewhere write to the same store)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    path = Path(DEFAULT_STORE).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def redact(params: dict, prefix: str = "") -> dict[str, str]:
    """Flatten a nested config to dotted keys; values of secret-looking keys and credentials inside URLs are
    replaced, so nothing secret reaches MLflow params."""
    out: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(redact(value, f"{name}."))
        elif _SECRET_KEY.search(str(key)) and value not in (None, ""):
            out[name] = "***"
        else:
            out[name] = _URL_AUTH.sub(r"\g<scheme>***@", str(value))[:6000]
    return out


def client(uri: str | None = None):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri(uri))


def resume_or_start_run(mlflow_client, experiment: str, name: str) -> tuple[str, bool]:
    """The unfinished run of this training name (a rerun resumes it), else a new run: (run_id, resumed)."""
    exp = mlflow_client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else mlflow_client.create_experiment(experiment)
    runs = mlflow_client.search_runs(
        [exp_id], filter_string=f"tags.`{TRAIN_NAME_TAG}` = '{name}' and attributes.status != 'FINISHED'"
    )
    if runs:
        mlflow_client.update_run(runs[0].info.run_id, status="RUNNING")
        return runs[0].info.run_id, True
    run = mlflow_client.create_run(exp_id, run_name=name, tags={TRAIN_NAME_TAG: name})
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


def check_model_uri(uri: str, tracking: str | None = None) -> None:
    """Fail early, with a clear message, when a models:/ URI names no registered version."""
    from mlflow.exceptions import MlflowException

    body = uri[len("models:/") :]
    name, sep_alias, alias = body.partition("@")
    if not sep_alias:
        name, _, version = body.partition("/")
    c = client(tracking)
    try:
        if sep_alias:
            c.get_model_version_by_alias(name, alias)
        else:
            c.get_model_version(name, version)
    except MlflowException as err:
        known = [m.name for m in c.search_registered_models(max_results=20)]
        raise AerieError(
            f"{uri} is not in the model registry at {tracking_uri(tracking)} ({err.error_code}); registered: {known}"
        ) from err


def fetch_drafter(source: str, cache_dir: str | Path = "runs/drafter-cache", tracking: str | None = None) -> Path:
    """A drafter directory for a local path, an s3:// prefix or a models:/ URI (downloaded to `cache_dir`)."""
    if source.startswith("models:/"):
        import mlflow

        check_model_uri(source, tracking)
        mlflow.set_tracking_uri(tracking_uri(tracking))
        dest = Path(cache_dir) / re.sub(r"[^A-Za-z0-9._-]+", "_", source)
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(dest)))
    if source.startswith("s3://"):
        from orchestrator.data.storage import download_prefix

        return download_prefix(source, Path(cache_dir) / re.sub(r"[^A-Za-z0-9._-]+", "_", source))
    path = Path(source)
    if not (path / "config.json").is_file():
        raise AerieError(f"drafter {source!r} is not a directory with a config.json (nor s3:// or models:/)")
    return path
