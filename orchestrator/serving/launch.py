"""`aerie serve --config FILE [key=value ...]`: start an application from a Ray Serve config file.

The file is an ordinary Serve config (what `serve run FILE` and `serve deploy FILE` read); the overrides are
applied to the first application's `args`, which are validated before anything starts.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from orchestrator.config import describe_validation_error
from orchestrator.errors import AerieError

log = logging.getLogger(__name__)


def read_serve_config(path: str | Path, overrides: list[str] | None = None) -> tuple[dict, dict]:
    """(the Serve config, its first application with the overrides applied to `args`)."""
    from pydantic import ValidationError

    from orchestrator.serving.app import SpecServeConfig

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
        if app["import_path"].startswith("orchestrator.serving.app:"):
            _check_drafter(SpecServeConfig.model_validate(app["args"]))
    except ValidationError as err:
        raise AerieError(f"{path}: {describe_validation_error(err)}") from err
    except Exception as err:  # OmegaConf's errors for malformed overrides
        if "omegaconf" not in type(err).__module__:
            raise
        raise AerieError(f"bad override: {err}") from err
    return config, app


def _check_drafter(cfg) -> None:
    """A local drafter directory must exist before anything starts (s3:// and models:/ are fetched later)."""
    local = cfg.speculation and cfg.proposer_factory is None and cfg.drafter is not None
    if (
        local
        and not cfg.drafter.startswith(("s3://", "models:/"))
        and not (Path(cfg.drafter) / "config.json").is_file()
    ):
        raise AerieError(
            f"drafter {cfg.drafter!r} is not a drafter directory: train one (`make drafters`), "
            "or set drafter=DIR|s3://...|models:/NAME@ALIAS, or speculation=false"
        )


def serve_app(
    path: str | Path,
    overrides: list[str] | None = None,
    address: str | None = None,
    host: str | None = None,
    port: int | None = None,
    blocking: bool = True,
) -> str:
    """Deploy the config's first application on Ray (local, or the cluster at `address`); returns its URL."""
    from ray import serve

    from orchestrator.jobrunner import init_ray
    from orchestrator.serving.app import _import

    config, app = read_serve_config(path, overrides)
    http = dict(config.get("http_options") or {})
    http["host"] = host or http.get("host", "127.0.0.1")
    http["port"] = port or http.get("port", 8000)
    init_ray(address)
    serve.start(http_options={"host": http["host"], "port": http["port"]})
    builder = _import(app["import_path"])
    name, prefix = app.get("name", "default"), app.get("route_prefix", "/")
    url = f"http://{http['host']}:{http['port']}{prefix.rstrip('/')}"
    log.info("deploying %s at %s", name, url)
    serve.run(builder(app["args"]), name=name, route_prefix=prefix, blocking=False)
    print(f"serving {name} at {url}", flush=True)
    if blocking:
        import time

        while True:
            time.sleep(3600)
    return url
