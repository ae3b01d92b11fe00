"""The two serving backends by name, what their application `args` share, and loading an application from its
import path. Imports neither backend: both import this."""

from __future__ import annotations

import importlib

from pydantic import Field

from orchestrator.config import StrictModel

BACKENDS = {
    "disaggregated": ("orchestrator.serving.app:build_app", "configs/smollm2-135m/serve.yaml"),
    "vllm": ("orchestrator.serving.vllm_app:build_app", "configs/smollm2-135m/serve-vllm.yaml"),
}


class ServedModel(StrictModel):
    """What either backend's application `args` start with: the model served, under which name, and the drafter."""

    model: str = Field(description="target: a Hugging Face directory or a packaged model name")
    served_model_name: str | None = Field(None, description="the `model` clients send (default: the model's name)")
    models_dir: str = Field("models", description="where packaged models are prepared")
    drafter: str | None = Field(None, description="drafter: a directory, s3://... or models:/NAME@ALIAS")
    mlflow_tracking_uri: str | None = Field(
        None,
        description="the registry a models:/ drafter is read from (default: MLFLOW_TRACKING_URI or runs/mlflow.db); "
        "jobs.deploy sets its own tracking_uri here, so that a candidate comes from the registry that holds it",
    )
    speculation: bool = Field(True, description="False: the baseline without speculation, same deployment code")


def backend_of(import_path: str) -> str | None:
    return next((name for name, (path, _) in BACKENDS.items() if path == import_path), None)


def import_object(path: str):
    """`module:name` (a Serve config's `import_path`, a proposer factory) -> that object."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def build_application(app: dict, **args):
    """A Serve application from a config's application entry (`read_serve_config`), `args` overriding its own."""
    return import_object(app["import_path"])(app["args"] | args)
