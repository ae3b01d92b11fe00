"""A training that is rerun: its MLflow run goes on only where Ray Train goes on from a checkpoint; a training that
starts over gets a run of its own (SQLite MLflow store, no Ray)."""

from __future__ import annotations

import json

import pytest

from orchestrator.tracking.store import TRAIN_NAME_TAG, resume_or_start_run
from orchestrator.train.run import ray_train_checkpointed


def test_only_a_snapshot_that_names_a_checkpoint_is_resumed_from(tmp_path):
    run = tmp_path / "storage" / "t"
    assert not ray_train_checkpointed(str(tmp_path / "storage"), None, "t"), "no run folder"
    (run / "checkpoint_2026-12-07_09-58-58").mkdir(parents=True)
    assert not ray_train_checkpointed(str(tmp_path / "storage"), None, "t"), "a checkpoint folder, no snapshot"
    snapshot = run / "checkpoint_manager_snapshot.json"
    for text in ('{"latest_checkpoint_result": null}', '{"latest_checkpoint_res', "[]"):
        snapshot.write_text(text)
        assert not ray_train_checkpointed(str(tmp_path / "storage"), None, "t"), text
    snapshot.write_text(json.dumps({"latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_x"}}))
    assert ray_train_checkpointed(str(tmp_path / "storage"), None, "t")
    assert not ray_train_checkpointed(str(tmp_path / "storage"), None, "other")


@pytest.fixture
def mlflow_client(tmp_path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")


def test_a_training_that_starts_over_never_reuses_the_unfinished_run(mlflow_client):
    first, resumed = resume_or_start_run(mlflow_client, "drafters", "t")
    assert not resumed
    mlflow_client.log_param(first, "optim.lr", "0.001")
    mlflow_client.log_metric(first, "loss", 9.4, step=80)
    again, resumed = resume_or_start_run(mlflow_client, "drafters", "t", resume=True)
    assert (again, resumed) == (first, True), "a checkpointed training goes on in its run"
    fresh, resumed = resume_or_start_run(mlflow_client, "drafters", "t", resume=False)
    assert fresh != first and not resumed
    assert mlflow_client.get_run(first).info.status == "KILLED"
    new = mlflow_client.get_run(fresh)
    assert new.data.metrics == {} and new.data.params == {}, "nothing of the stopped run's in the new one"
    assert new.data.tags[TRAIN_NAME_TAG] == "t"
    mlflow_client.set_terminated(fresh, status="FINISHED")
    _, resumed = resume_or_start_run(mlflow_client, "drafters", "t", resume=True)
    assert not resumed, "a finished run is never resumed"
