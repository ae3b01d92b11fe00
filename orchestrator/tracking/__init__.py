"""Experiment tracking and the drafter registry (MLflow)."""

from orchestrator.tracking.store import (
    DrafterRef,
    ModelUri,
    check_model_uri,
    client,
    fetch_drafter,
    is_model_uri,
    read_drafter_ref,
    register_drafter,
    resume_or_start_run,
    tag_rollout,
    tracking_uri,
)

__all__ = [
    "DrafterRef",
    "ModelUri",
    "check_model_uri",
    "client",
    "fetch_drafter",
    "is_model_uri",
    "read_drafter_ref",
    "register_drafter",
    "resume_or_start_run",
    "tag_rollout",
    "tracking_uri",
]
