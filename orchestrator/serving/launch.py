"""`aerie serve [--backend vllm|disaggregated] [--config FILE] [key=value ...]`: start a served model.

The file is an ordinary Serve config (what `serve run FILE` and `serve deploy FILE` read); the overrides are
applied to the first application's `args`, which are validated before anything starts. `aerie serve` puts the
application behind the router (`orchestrator.serving.router`) as backend `NAME-1`, so that `jobs.deploy` can
later roll a new drafter out to it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from orchestrator.config import describe_validation_error
from orchestrator.errors import AerieError

log = logging.getLogger(__name__)

BACKENDS = {
    "disaggregated": ("orchestrator.serving.app:build_app", "configs/smollm2-135m/serve.yaml"),
    "vllm": ("orchestrator.serving.vllm_app:build_app", "configs/smollm2-135m/serve-vllm.yaml"),
}


def backend_of(import_path: str) -> str | None:
    return next((name for name, (path, _) in BACKENDS.items() if path == import_path), None)


def read_serve_config(path: str | Path, overrides: list[str] | None = None) -> tuple[dict, dict]:
    """(the Serve config, its first application with the overrides applied to `args`)."""
    from pydantic import ValidationError

    from orchestrator.serving.app import SpecServeConfig
    from orchestrator.serving.vllm_app import VllmServeConfig

    if not Path(path).is_file():
        raise AerieError(f"serve config {str(path)!r} does not exist")
    config = yaml.safe_load(Path(path).read_text()) or {}
    apps = config.get("applications") or []
    if not apps or "import_path" not in apps[0]:
        raise AerieError(f"{path}: no `applications:` entry with an `import_path`")
    app = dict(apps[0])
    try:
        merged = OmegaConf.merge(OmegaConf.create(app.get("args") or {}), OmegaConf.from_dotlist(overrides or []))
        app["args"] = OmegaConf.to_container(merged, resolve=True)
        backend = backend_of(app["import_path"])
        if backend == "disaggregated":
            cfg = SpecServeConfig.model_validate(app["args"])
            _check_drafter(cfg.drafter if cfg.speculation and cfg.proposer_factory is None else None)
        elif backend == "vllm":
            cfg = VllmServeConfig.model_validate(app["args"])
            _check_drafter(cfg.drafter if cfg.speculation else None)
    except ValidationError as err:
        raise AerieError(f"{path}: {describe_validation_error(err)}") from err
    except Exception as err:  # OmegaConf's errors for malformed overrides
        if "omegaconf" not in type(err).__module__:
            raise
        raise AerieError(f"bad override: {err}") from err
    return config, app


def _check_drafter(drafter: str | None) -> None:
    """A local drafter directory must exist before anything starts (s3:// and models:/ are fetched later)."""
    if (
        drafter is not None
        and not drafter.startswith(("s3://", "models:/"))
        and not (Path(drafter) / "config.json").is_file()
    ):
        raise AerieError(
            f"drafter {drafter!r} is not a drafter directory: train one (`make drafters`), "
            "or set drafter=DIR|s3://...|models:/NAME@ALIAS, or speculation=false"
        )


def serve_app(
    path: str | Path | None,
    overrides: list[str] | None = None,
    address: str | None = None,
    host: str | None = None,
    port: int | None = None,
    blocking: bool = True,
    backend: str | None = None,
) -> str:
    """Deploy the config's first application behind the router on Ray (local, or the cluster at `address`);
    returns the URL clients use."""
    from orchestrator.serving.rollout import DeployConfig, run_rollout

    if path is None:
        if backend is None:
            raise AerieError("give --config FILE or --backend vllm|disaggregated (its default config)")
        path = BACKENDS[backend][1]
    config, app = read_serve_config(path, overrides)
    if backend is not None and backend_of(app["import_path"]) != backend:
        raise AerieError(
            f"{path} is not a {backend} config (import_path {app['import_path']}); "
            f"the {backend} backend's is {BACKENDS[backend][1]}"
        )
    http = dict(config.get("http_options") or {})
    host, port = host or http.get("host", "127.0.0.1"), port or http.get("port", 8000)
    name = app.get("name", "aerie")
    cfg = DeployConfig(
        app=str(path), app_overrides=list(overrides or []), name=name, address=address, host=host, port=port
    )
    url = f"http://{host}:{port}"
    log.info("deploying %s at %s", name, url)
    run_rollout(cfg, initial_only=True)
    print(f"serving {name} at {url}", flush=True)
    if blocking:
        import time

        while True:
            time.sleep(3600)
    return url
