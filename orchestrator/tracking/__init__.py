"""Experiment tracking and the drafter registry (MLflow)."""

from orchestrator.tracking.store import (
    check_model_uri,
    client,
    fetch_drafter,
    register_drafter,
    resume_or_start_run,
    tracking_uri,
)

__all__ = [
    "check_model_uri",
    "client",
    "fetch_drafter",
    "register_drafter",
    "resume_or_start_run",
    "tracking_uri",
]
