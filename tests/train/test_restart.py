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


def test_a_resume_with_other_training_settings_is_named_and_a_new_budget_is_not(mlflow_client):
    from mlflow.entities import Param

    from orchestrator.errors import AerieError
    from orchestrator.models.drafter import DrafterConfig
    from orchestrator.train.config import TrainConfig
    from orchestrator.train.run import changed_on_resume, refuse_changed_resume, run_params

    hf = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
    hf |= {"vocab_size": 512, "num_hidden_layers": 4, "rms_norm_eps": 1e-5, "rope_theta": 1e4}
    hf |= {"max_position_embeddings": 256}
    drafter = DrafterConfig.for_target(hf, (1, 2, 3), 128, "eagle3.1")
    base = {"name": "t", "model": "m", "data": "d", "output": "o", "drafter": {"variant": "eagle3.1"}}
    first = TrainConfig.model_validate(base | {"max_time_minutes": 55, "optim": {"lr": 5e-4}})
    run_id, _ = resume_or_start_run(mlflow_client, "drafters", "t")
    params = run_params(first, drafter, "abc", 0.98)
    mlflow_client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])
    logged = mlflow_client.get_run(run_id).data.params  # as MLflow gives them back

    assert changed_on_resume(logged, run_params(first, drafter, "abc", 0.98)) == []
    longer = first.model_copy(update={"max_time_minutes": 75.0, "log_every_steps": 5})
    assert changed_on_resume(logged, run_params(longer, drafter, "abc", 0.98)) == [], "a budget may change"
    lr = TrainConfig.model_validate(base | {"max_time_minutes": 55, "optim": {"lr": 3e-4}})
    assert changed_on_resume(logged, run_params(lr, drafter, "abc", 0.98)) == ["optim.lr=0.0005 (now 0.0003)"]
    assert changed_on_resume(logged, run_params(first, drafter, "other", 0.98)) == [
        "data.manifest_sha256=abc (now other)"
    ]
    older = {k: v for k, v in logged.items() if k != "optim.lr"}  # a run logged before a setting existed
    assert changed_on_resume(older, run_params(lr, drafter, "abc", 0.98)) == []

    refuse_changed_resume(mlflow_client, run_id, run_params(longer, drafter, "abc", 0.98), "runs/train/t")
    with pytest.raises(AerieError, match=r"^training runs/train/t goes on .* optim.lr=0.0005 \(now 0.0003\)\. Rerun"):
        refuse_changed_resume(mlflow_client, run_id, run_params(lr, drafter, "abc", 0.98), "runs/train/t")
    assert mlflow_client.get_run(run_id).info.status == "FAILED"
    assert resume_or_start_run(mlflow_client, "drafters", "t", resume=True) == (run_id, True), "still resumable"
