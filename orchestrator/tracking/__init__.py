"""Experiment tracking and the drafter registry (MLflow)."""

from orchestrator.tracking.store import (
    DrafterRef,
    check_model_uri,
    client,
    fetch_drafter,
    read_drafter_ref,
    register_drafter,
    resume_or_start_run,
    tracking_uri,
)

__all__ = [
    "DrafterRef",
    "check_model_uri",
    "client",
    "fetch_drafter",
    "read_drafter_ref",
    "register_drafter",
    "resume_or_start_run",
    "tracking_uri",
]
