"""The pipeline job (collect -> train on two Ray Train workers, killed and resumed -> export -> MLflow registry
-> evaluate -> gate -> report), rerun to skip what is done, and its lineage walked back from the registered
drafter to its data, on a tiny random target that speaks SmolLM2's tokenizer; evaluation from the registry;
training from and to S3; and clear errors before training."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli import main
from tests.helpers import committed_checkpoint, tiny_training, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.ray]
REPO = Path(__file__).resolve().parents[2]


def _job(module: str, config: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"jobs.{module}", "--config", str(config), *overrides],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def root(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template, and 24 chitchat conversations collected."""
    root = tmp_path_factory.mktemp("e2e")
    tiny = tiny_training(root, smollm2_dir)
    evaluate = {
        "model": str(tiny),
        "drafters": [{"name": "placeholder", "source": "set by the pipeline"}],
        "sets": {
            "mtbench_questions": 2,
            "validation_prompts": 2,
            "long_context_buckets": [256],
            "long_context_per_bucket": 1,
            "template_prompts": 1,
        },
        "methods": {"chain-3": {"method": "chain", "num_spec_tokens": 3}},
        "max_tokens": 12,
        "vllm_check": False,  # vLLM's CPU attention has no kernel for this tiny head size (16)
        "output_dir": "set by the pipeline",
    }
    (root / "eval.yaml").write_text(json.dumps(evaluate))
    pipeline = {
        "name": "tiny-pipeline",
        "model": str(tiny),
        "registered_model": "tiny-drafter",
        "collect": {"config": str(root / "collect.yaml")},
        "train": {"config": str(root / "train.yaml"), "variants": ["eagle3.1"]},
        "evaluate": {"config": str(root / "eval.yaml")},
        "gate": {"method": "chain-3", "beat": "all", "hold": []},
        "deploy": {"config": "configs/smollm2-135m/deploy.yaml", "when": "never"},
        "benchmark": {"config": "configs/smollm2-135m/benchmark_serving.yaml", "enabled": False},
        "mlflow_tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
        "output_dir": str(root / "pipeline"),
    }
    (root / "pipeline.yaml").write_text(json.dumps(pipeline))
    return root


def _ran(stdout: str, key: str) -> bool:
    """Whether the pipeline's console says it ran stage `key` (its stage line names the log), not skipped it."""
    return re.search(rf"\] {re.escape(key)}: (?!skipped).*\(log: ", stdout) is not None


def _stage(root: Path, key: str) -> dict:
    return json.loads((root / "pipeline" / "state.json").read_text())[key]


@pytest.fixture(scope="module")
def trained(root) -> dict:
    """Start the pipeline, SIGKILL the whole job once training has a checkpoint, then rerun it to the end."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobs.pipeline", "--config", str(root / "pipeline.yaml")],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )

    def checkpointed() -> bool:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        return committed_checkpoint(root / "ckpt")

    wait_for(checkpointed, 600, "a committed checkpoint", 0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _stage(root, "collect")["status"] == "done" and _stage(root, "train-eagle3.1")["status"] == "running"
    # the training run by hand, going on from that checkpoint at another learning rate: refused in one line
    (name,) = [p.name for p in (root / "ckpt").iterdir() if p.name.startswith("tiny-pipeline-eagle3.1-")]
    changed = _job("train_drafter", root / "train.yaml", f"name={name}", "optim.lr=5e-4")
    assert changed.returncode != 0 and "Traceback" not in changed.stderr, changed.stderr[-3000:]
    assert "started with other settings: optim.lr=0.001 (now 0.0005). Rerun" in changed.stderr.strip().splitlines()[-1]
    resumed = _job("pipeline", root / "pipeline.yaml")
    _ok(resumed)
    assert "collect: skipped" in resumed.stdout and _ran(resumed.stdout, "train-eagle3.1")
    return _stage(root, "train-eagle3.1")["result"]


def test_training_resumes_exports_and_registers(root, trained):
    from mlflow import MlflowClient

    from orchestrator.models.checkpoint import load_drafter

    assert trained["steps"] == 40
    assert 2 <= trained["final_metrics"]["resumed_from_step"] < 40
    assert 1.0 <= trained["final_metrics"]["val_tau_chain"] <= 1 + 3  # replayed chain of ttt_steps (3) drafts
    assert trained["registered"] == "models:/tiny-drafter/1"
    drafter = load_drafter(trained["exported"])  # the vLLM layout, read with safetensors only
    assert drafter.config.variant == "eagle3.1" and drafter.config.draft_vocab_size == 512
    # the tiny target is random, but its distribution is learnable: the drafter gets better than its start
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    run = client.get_run(trained["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    history = [m.value for m in client.get_metric_history(run.info.run_id, "loss_step_0")]
    assert history[-1] < history[0]
    assert run.data.params["drafter.variant"] == "eagle3.1" and run.data.params["num_workers"] == "2"
    assert run.data.tags["worker_allocator"] == "jemalloc"  # preloaded from Ray's package (worker.allocator)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"drafter", "plots", "train_config.json"} <= artifacts
    version = client.get_model_version("tiny-drafter", "1")
    assert version.tags["variant"] == "eagle3.1" and len(version.tags["data_manifest_sha256"]) == 64


def test_a_rerun_skips_every_finished_stage_and_reports(root, trained):
    before = json.loads((root / "pipeline" / "state.json").read_text())
    again = _job("pipeline", root / "pipeline.yaml")
    _ok(again)
    for stage in ("collect", "train-eagle3.1", "evaluate"):
        assert f"{stage}: skipped" in again.stdout, again.stdout[-2000:]
    after = json.loads((root / "pipeline" / "state.json").read_text())
    assert {k: v["fingerprint"] for k, v in after.items()} == {k: v["fingerprint"] for k, v in before.items()}
    report = json.loads((root / "pipeline" / "report.json").read_text())
    assert report["gate"]["passed"] and report["deploy"] == {"skipped": "deploy.when is 'never'"}
    assert report["stages"]["train-eagle3.1"]["status"] == "skipped"
    markdown = (root / "pipeline" / "report.md").read_text()
    assert "models:/tiny-drafter/1" in markdown and "![tau_by_set](tau_by_set.png)" in markdown
    assert (root / "pipeline" / "tau_by_set.png").is_file()
    changed = _job("pipeline", root / "pipeline.yaml", "evaluate.overrides=[max_tokens=8]")
    _ok(changed)
    assert "train-eagle3.1: skipped" in changed.stdout and _ran(changed.stdout, "evaluate")


def test_lineage_from_the_registered_drafter_back_to_its_data(root, trained):
    """A user holding models:/tiny-drafter/1 finds the data it was trained on, byte for byte, through MLflow."""
    import hashlib

    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    version = client.get_model_version("tiny-drafter", "1")
    training = client.get_run(version.run_id)  # the version was registered from its training run
    assert training.info.run_id == version.tags["aerie.training.run_id"]
    pipeline_run = training.data.tags["mlflow.parentRunId"]
    assert pipeline_run == version.tags["aerie.pipeline.run_id"]
    collection = client.get_run(version.tags["aerie.collection.run_id"])
    assert collection.data.tags["mlflow.parentRunId"] == pipeline_run  # both stages of the same pipeline run
    manifest = Path(download_artifacts(run_id=collection.info.run_id, artifact_path="manifest.json", tracking_uri=uri))
    sha = hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert sha == version.tags["data_manifest_sha256"] == version.tags["aerie.collection.manifest_sha256"]
    assert sha == training.data.params["data.manifest_sha256"]
    assert training.data.params["data"] == collection.data.params["output"] == version.tags["aerie.collection"]
    on_disk = Path(version.tags["aerie.collection"]) / "manifest.json"
    assert hashlib.sha256(on_disk.read_bytes()).hexdigest() == sha  # and the shards it lists are still there
    shards = json.loads(manifest.read_text())["shards"]
    assert shards and all((on_disk.parent / s["name"]).is_file() for s in shards)
    evaluation = client.get_run(version.tags["aerie.evaluation.run_id"])  # the latest evaluation of it
    assert client.get_run(evaluation.data.tags["mlflow.parentRunId"]).data.tags["aerie.pipeline"] == "tiny-pipeline"
    assert float(version.tags["aerie.eval.tau.chain-3.all"]) >= 1.0 and version.tags["aerie.gate"] == "passed"


def test_evaluation_reads_the_registry_and_reports_every_set(root, trained):
    cfg = {
        "model": str(root / "tiny-chat"),
        "drafters": [
            {"name": "dir", "source": trained["exported"]},
            {"name": "registry", "source": "models:/tiny-drafter/1"},
        ],
        "data": str(root / "data"),
        "sets": {
            "mtbench_questions": 2,
            "validation_prompts": 2,
            "long_context_buckets": [256, 512],
            "long_context_per_bucket": 1,
            "template_prompts": 1,
        },
        "methods": {"chain-3": {"method": "chain", "num_spec_tokens": 3}, "tree": {"method": "tree", "depth": 3}},
        "max_tokens": 12,
        "vllm_check": False,  # vLLM's CPU attention has no kernel for this tiny head size (16)
        "output_dir": str(root / "eval"),
        "mlflow_tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
    }
    (root / "eval-two.yaml").write_text(json.dumps(cfg))
    _ok(_job("evaluate_drafter", root / "eval-two.yaml"))
    result = json.loads((root / "eval" / "result.json").read_text())
    assert result["prompts"] == {"mtbench": 4, "validation": 2, "long_context": 2, "templates": 6}
    by_dir, by_registry = result["drafters"]["dir"]["engine"], result["drafters"]["registry"]["engine"]
    assert by_dir == by_registry  # the same drafter, fetched two ways
    for method in ("chain-3", "tree"):
        assert set(by_dir[method]["sets"]) == {"mtbench", "validation", "long_context", "templates"}
        assert 1.0 <= by_dir[method]["overall"]["acceptance_length"] <= 4.0
    assert {Path(p).name for p in result["plots"]} == {
        "tau_by_context.png",
        "per_depth_acceptance.png",
        "tau_by_template.png",
    }


def test_the_pipeline_trains_online_without_a_collect_stage(root):
    """`train.data=online`: no collect stage; the capture actors feed the trainer through Ray's object store
    (validation shards too) and no shard is written anywhere; the drafter is registered with the online
    manifest's hash and the report says why the collection was skipped."""
    from mlflow import MlflowClient

    data = root / "data"
    before = sorted(p.name for p in data.iterdir()) if data.exists() else None
    out = root / "pipeline-online"
    proc = _job(
        "pipeline",
        root / "pipeline.yaml",
        "name=tiny-online-pipeline",
        "train.data=online",
        "train.overrides=[max_steps=4,num_workers=1,eval_every_steps=2]",
        "collect.overrides=[output=" + str(root / "online-never-written") + "]",
        f"output_dir={out}",
    )
    _ok(proc)
    assert "collect: skipped: train.data is online" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    trained = report["trained"]["eagle3.1"]
    assert trained["steps"] == 4 and trained["tokens"] > 0 and report["gate"]["passed"]
    metrics = trained["final_metrics"]
    assert metrics["capture_peak_rss_mib"] > 0 and metrics["peak_rss_mib"] > 0 and "val_loss_step_0" in metrics
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    name, _, version = trained["registered"][len("models:/") :].partition("/")
    tags = client.get_model_version(name, version).tags
    assert tags["aerie.collection"] == f"online:{root / 'collect.yaml'}"
    assert (
        tags["aerie.collection.manifest_sha256"] == tags["data_manifest_sha256"]
        and len(tags["data_manifest_sha256"]) == 64
    )
    params = client.get_run(trained["mlflow_run_id"]).data.params
    assert params["data"] == "online" and len(params["data.manifest_sha256"]) == 64
    # what `make drafters` records of an online training: the collect config's planned manifest, the same sha256
    bf16 = root / "online-bf16"
    assert main(["convert-drafter", trained["exported"], "--out", str(bf16), "--data", str(root / "collect.yaml")]) == 0
    recorded = json.loads((bf16 / "provenance.json").read_text())["data"]
    assert recorded["manifest_sha256"] == tags["data_manifest_sha256"] and recorded["datasets"]["sources"]
    assert not (root / "online-never-written").exists()
    assert before is None or sorted(p.name for p in data.iterdir()) == before


def test_s3_data_checkpoints_and_export(root, trained, s3_env, monkeypatch):
    """Shards read from S3, Ray Train checkpoints and the exported drafter written to S3 (moto on loopback)."""
    from orchestrator.data.storage import download_prefix, upload_dir
    from orchestrator.models.checkpoint import load_drafter
    from orchestrator.train.vocab import count_tokens, size_for_coverage

    env, client = s3_env
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    upload_dir(root / "data", "s3://aerie-test/e2e-data")
    proc = _job(
        "train_drafter",
        root / "train.yaml",
        "name=tiny-s3",
        "data=s3://aerie-test/e2e-data",
        "output=s3://aerie-test/e2e-drafter",
        "checkpoint.storage_path=s3://aerie-test/e2e-ckpt",
        "num_workers=1",
        "max_steps=4",
        "mlflow.registered_model=null",
        "drafter.draft_vocab_coverage=0.9",
        env=env,
    )
    _ok(proc)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="aerie-test", Prefix="e2e-ckpt/tiny-s3/")["Contents"]]
    assert any(k.endswith("/drafter/model.safetensors") for k in keys), keys
    assert any(k.endswith("/optimizer.safetensors") for k in keys), keys
    drafter = load_drafter(download_prefix("s3://aerie-test/e2e-drafter", root / "from-s3"))
    counts = count_tokens(str(root / "data"), drafter.config.vocab_size)
    assert drafter.config.draft_vocab_size == size_for_coverage(counts, 0.9) != 512


def test_a_committed_drafter_trains_on_where_it_stopped(root, trained):
    """`make drafters` across sessions: the exported drafter converted to bf16 with its provenance (what a
    session commits), then trained on from there on a machine without the first run's checkpoints."""
    exported, committed = root / "exported", root / "committed"
    shutil.copytree(trained["exported"], exported)
    (exported / "result.json").write_text(json.dumps(trained))  # what jobs.train_drafter writes beside its export
    assert main(["convert-drafter", str(exported), "--out", str(committed), "--data", str(root / "data")]) == 0
    before = json.loads((committed / "provenance.json").read_text())["training"]
    proc = _job(
        "train_drafter",
        root / "train.yaml",
        f"drafter.continue_from={committed}",
        f"output={root / 'continued'}",
        f"checkpoint.storage_path={root / 'ckpt-continued'}",  # the first run's checkpoints are not there
        "max_steps=2",
        "mlflow.registered_model=null",
    )
    _ok(proc)
    after = json.loads((root / "continued" / "result.json").read_text())
    assert after["name"].startswith("tiny-from-") and after["steps"] == 2
    assert after["tokens_cumulative"] == before["tokens"] + after["tokens"]
    assert after["runs"] == [before["mlflow_run_id"], after["mlflow_run_id"]]
    assert after["draft_vocab_size"] == before["draft_vocab_size"]
    assert after["data_plan_sha256"] == before["data_plan_sha256"]
    for old, new in zip(before["data_positions"], after["data_positions"], strict=True):  # the stream went on
        assert new["epoch"] > old["epoch"] or (new["epoch"], new["first_shard"]) == (old["epoch"], old["shards_read"])


@pytest.mark.parametrize(
    ("edit", "overrides", "message"),
    [
        ({"target.hidden_size": 32}, [], "the data's target has hidden_size=32"),
        ({"aux_layer_ids": [1, 2, 40]}, [], "aux_layer_ids [1, 2, 40] do not fit"),
        ({"splits.train.num_loss_tokens": 0}, [], "empty train split"),
        ({}, ["drafter.variant=eagle4"], "drafter.variant: Input should be 'eagle3' or 'eagle3.1'"),
        ({}, ["drafter.init_from=models:/no-such-drafter@prod"], "models:/no-such-drafter@prod is not in the model"),
        ({}, ["num_workers=9"], "9 workers need at least as many train shards"),
    ],
    ids=["hidden-size", "layer-ids", "empty", "variant", "registry", "workers"],
)
def test_bad_input_fails_before_training(root, tmp_path, edit, overrides, message):
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    manifest = json.loads((data / "manifest.json").read_text())
    for dotted, value in edit.items():
        *path, last = dotted.split(".")
        node = manifest
        for key in path:
            node = node[key]
        node[last] = value
    (data / "manifest.json").write_text(json.dumps(manifest))
    proc = _job(
        "train_drafter", root / "train.yaml", f"data={data}", f"checkpoint.storage_path={tmp_path}/c", *overrides
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert message in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "c").exists()
