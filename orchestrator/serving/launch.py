"""Serve config files of either backend: an ordinary Serve config (what `serve run FILE` and `serve deploy
FILE` read) whose first application's `args` take `key=value` overrides and are validated before anything
starts. `aerie serve`, `jobs.deploy` and the serving benchmark read and build them here.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf import OmegaConf

from orchestrator.config import describe_validation_error
from orchestrator.errors import AerieError
from orchestrator.serving.backends import backend_of


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
            _check_target(cfg.model)
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


def app_bundles(app: dict) -> list[dict[str, float]]:
    """The Ray resource bundles a backend application's workers reserve, every replica's (its Serve replicas
    themselves take none): the target and draft workers', or the vLLM engine's, one per TP rank."""
    from orchestrator.serving.app import SpecServeConfig
    from orchestrator.serving.vllm_app import VllmServeConfig, placement

    if backend_of(app["import_path"]) == "vllm":
        cfg = VllmServeConfig.model_validate(app["args"])
        return placement(cfg)[0] * cfg.num_replicas
    cfg = SpecServeConfig.model_validate(app["args"])
    return ([cfg.target.bundle()] + ([cfg.draft.bundle()] if cfg.speculation else [])) * cfg.num_replicas


def app_resources(app: dict) -> dict[str, float]:
    """`app_bundles` summed: what the application takes from the cluster."""
    total: dict[str, float] = {}
    for bundle in app_bundles(app):
        for key, value in bundle.items():
            if value:
                total[key] = total.get(key, 0.0) + value
    return total


def _check_target(model: str) -> None:
    """The disaggregated backend runs the project's own target, which knows a few architectures: a target
    directory present here is checked before anything starts (its error names the vLLM backend)."""
    from orchestrator.models.target import check_target_supported, read_hf_config

    if (Path(model) / "config.json").is_file():
        check_target_supported(read_hf_config(model))


def _check_drafter(drafter: str | None) -> None:
    """A local drafter directory must exist before anything starts (s3:// and models:/ are fetched later)."""
    if (
        drafter is not None
        and not drafter.startswith(("s3://", "models:/"))
        and not (Path(drafter) / "config.json").is_file()
    ):
        raise AerieError(
            f"drafter {drafter!r} is not a drafter directory: train one (`make drafters`), "
            "or set drafter=DIR (or models:/NAME@ALIAS, or s3://BUCKET/PREFIX), or speculation=false"
        )
