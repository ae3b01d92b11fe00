"""The pipeline's bookkeeping without running a job: a stage runs once per fingerprint and is skipped after,
reruns when its inputs or its output change, and a failing stage names itself; bad configs and a deploy
without a running cluster fail in one line before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.errors import AerieError
from orchestrator.pipeline import Collection, Pipeline, PipelineConfig

REPO = Path(__file__).resolve().parents[1]


def _job(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(
        [sys.executable, "-m", f"jobs.{module}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**base, **(env or {})},
    )


@pytest.fixture
def pipeline(tmp_path) -> Pipeline:
    cfg = PipelineConfig.model_validate(
        {
            "name": "p",
            "model": "m",
            "registered_model": "r",
            "collect": {"config": "c.yaml"},
            "train": {"config": "t.yaml"},
            "evaluate": {"config": "e.yaml"},
            "deploy": {"config": "d.yaml"},
            "benchmark": {"config": "b.yaml"},
            "mlflow_tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "output_dir": str(tmp_path / "out"),
        }
    )
    return Pipeline(cfg)


def test_a_stage_runs_once_per_fingerprint(pipeline, capsys):
    calls = []

    def body():
        calls.append(1)
        return {"n": len(calls)}

    assert pipeline.stage("s", "fp1", body, doing="counting") == {"n": 1}
    log = Path(pipeline.cfg.output_dir) / "logs" / "s.log"
    assert pipeline.report["stages"]["s"]["log"] == str(log) and log.is_file()
    assert pipeline.stage("s", "fp1", body) == {"n": 1} and len(calls) == 1  # skipped
    said = capsys.readouterr().out
    assert f"s: counting (log: {log})" in said and "s: skipped" in said
    assert pipeline.stage("s", "fp2", body) == {"n": 2}  # inputs changed
    assert pipeline.stage("s", "fp2", body, check=lambda r: False) == {"n": 3}  # its output is gone
    again = Pipeline(pipeline.cfg)  # a new process reads state.json
    assert again.stage("s", "fp2", body) == {"n": 3} and len(calls) == 3


def test_a_failing_stage_names_itself_and_its_log_and_is_not_done(pipeline, capsys):
    def broken():
        os.write(1, b"the engine's last words\n")  # as a subprocess writes, past Python's sys.stdout
        raise ValueError("disk full")

    with pytest.raises(AerieError, match=r"pipeline stage train-eagle3 failed: ValueError: disk full \(traceback: "):
        pipeline.stage("train-eagle3", "fp", broken)
    log = Path(pipeline.cfg.output_dir) / "logs" / "train-eagle3.log"
    assert f"train-eagle3: failed after 0 s (log: {log})" in capsys.readouterr().out  # the pointer
    assert "the engine's last words" in log.read_text() and "ValueError: disk full" in log.read_text()
    assert pipeline.state.stages["train-eagle3"]["status"] == "failed"
    assert "ValueError" in (Path(pipeline.cfg.output_dir) / "train-eagle3.error.txt").read_text()
    assert pipeline.stage("train-eagle3", "fp", lambda: {"ok": True}) == {"ok": True}  # a rerun runs it


def test_the_gate_reads_the_configured_method_and_set(pipeline):
    evaluation = {
        "drafters": {
            "eagle3.1": {
                "engine": {
                    "chain-5": {"overall": {"acceptance_length": 1.8}, "sets": {"mtbench": {"acceptance_length": 1.6}}},
                    "draft_vocab_coverage": {},
                }
            }
        }
    }
    assert pipeline.tau(evaluation, "eagle3.1", "mtbench") == 1.6
    assert pipeline.tau(evaluation, "eagle3.1", "all") == 1.8
    with pytest.raises(AerieError, match=r"gate set 'validation' was not evaluated: \['mtbench'\]"):
        pipeline.tau(evaluation, "eagle3.1", "validation")
    pipeline.cfg.gate.method = "tree"
    with pytest.raises(AerieError, match=r"gate.method 'tree' is not an evaluation method: \['chain-5'\]"):
        pipeline.tau(evaluation, "eagle3.1", "mtbench")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.config=nope.yaml", "pipeline stage train: config file 'nope.yaml' does not exist"),
        ("deploy.overrides=[window_s=-1]", "pipeline stage deploy: configs/smollm2-135m/deploy.yaml: window_s: Input"),
        ("train.variants=[eagle4]", "train.variants.0: Input should be 'eagle3.1' or 'eagle3'"),
    ],
)
def test_bad_stage_configs_fail_in_one_line_before_any_stage(tmp_path, override, message):
    proc = _job("pipeline", "--config", "configs/smollm2-135m/pipeline.yaml", override, f"output_dir={tmp_path}/out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert message in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_deploy_refuses_without_a_running_cluster(tmp_path):
    """No RAY_ADDRESS and no `aerie serve` on this machine: a deployment would die with the job, so it refuses."""
    proc = _job(
        "deploy",
        "--config",
        "configs/smollm2-135m/deploy.yaml",
        "drafter=null",
        "app_overrides=[speculation=false]",
        f"output_dir={tmp_path}/deploy",
        env={"XDG_CONFIG_HOME": str(tmp_path / "cfg"), "AERIE_API_KEY": "k" * 32},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: no running cluster to deploy to: start the server first (`aerie serve")
    assert not (tmp_path / "deploy").exists()


def _config_class(stem: str):
    """The job (or Serve application) a config file of configs/smollm2-135m/ belongs to, by its name."""
    from jobs.adapt import AdaptConfig
    from orchestrator.benchmarks.generate import BenchmarkGenerateConfig
    from orchestrator.benchmarks.serving import BenchmarkServingConfig
    from orchestrator.benchmarks.training_data import BenchmarkTrainingDataConfig
    from orchestrator.data.collect import CollectConfig
    from orchestrator.evaluation import EvalConfig
    from orchestrator.evaluation.diagnose import DiagnoseConfig
    from orchestrator.evaluation.extrapolation import ExtrapolationConfig
    from orchestrator.serving.rollout import DeployConfig
    from orchestrator.sim.plan import PlanConfig
    from orchestrator.train.config import TrainConfig

    prefixes = {
        "collect": CollectConfig,
        "train": TrainConfig,
        "evaluate": EvalConfig,
        "diagnose": DiagnoseConfig,
        "extrapolation": ExtrapolationConfig,
        "recipes": ExtrapolationConfig,
        "deploy": DeployConfig,
        "pipeline": PipelineConfig,
        "adapt": AdaptConfig,
        "benchmark_generate": BenchmarkGenerateConfig,
        "benchmark_serving": BenchmarkServingConfig,
        "benchmark_training_data": BenchmarkTrainingDataConfig,
        "plan": PlanConfig,
    }
    return next(cls for prefix, cls in prefixes.items() if stem.startswith(prefix))


@pytest.mark.parametrize("path", sorted(p.name for p in (REPO / "configs/smollm2-135m").glob("*.yaml")))
def test_every_embedded_default_config_validates(path, monkeypatch):
    from orchestrator.config import load_config
    from orchestrator.serving.launch import read_serve_config

    monkeypatch.chdir(REPO)
    file = f"configs/smollm2-135m/{path}"
    if path.startswith("serve"):
        read_serve_config(file, [])  # its drafter is committed: a fresh clone serves with speculation
        return
    cfg = load_config(_config_class(Path(path).stem), file)
    if isinstance(cfg, PipelineConfig):  # and every stage's file with its overrides
        Pipeline(cfg.model_copy(update={"output_dir": "/nonexistent"})).preflight()


LABELS = [["validation", f"v{i}"] for i in range(20)] + [["mtbench", f"m{i}"] for i in range(20)]
HARDNESS = [0.1 * (i % 5 - 2) for i in range(20)]  # prompts differ (the same for every drafter: paired)


def _evaluated(tau: float, validation: float | list[float] | None = None) -> dict:
    """An evaluation entry of one drafter: tau per prompt (20 validation, 20 MT-Bench prompts, 100 drafts each)."""
    if not isinstance(validation, list):
        validation = [(validation or tau) + h for h in HARDNESS]
    taus = [*validation, *(tau + h for h in HARDNESS)]
    rows = [[100, round(100 * (t - 1))] for t in taus]

    def length(rs):
        return 1 + sum(a for _, a in rs) / sum(d for d, _ in rs)

    sets = {"validation": {"acceptance_length": length(rows[:20])}, "mtbench": {"acceptance_length": length(rows[20:])}}
    method = {"overall": {"acceptance_length": length(rows)}, "sets": sets, "per_prompt": rows}
    return {"engine": {"chain-5": method, "draft_vocab_coverage": {}}}


def test_the_gate_compares_the_candidate_with_the_version_in_production(pipeline):
    """Production is whatever the alias points at, one of this pipeline's versions included; the verdict is
    tagged on the versions, and a candidate already in production is not deployed again."""
    registry = pipeline.mlflow
    registry.create_registered_model("r")
    for _ in range(2):
        registry.create_model_version("r", "file:///nonexistent")
    registry.set_registered_model_alias("r", "production", "1")
    pipeline.start_parent()
    trained = {
        "eagle3.1": {"registered": "models:/r/2", "mlflow_run_id": "train-2"},
        "eagle3": {"registered": "models:/r/1", "mlflow_run_id": "train-1"},
    }
    evaluation = {
        "mlflow_run_id": "eval",
        "prompt_labels": LABELS,
        "drafters": {
            "eagle3.1": {"source": "models:/r/2", **_evaluated(1.5)},
            "eagle3": {"source": "models:/r/1", **_evaluated(1.6)},
        },
    }
    collection = Collection(False, "sha", "data", "sha", "collect")
    gate = pipeline.gate(trained, evaluation, collection)
    assert gate["production"] == "models:/r/1" and gate["production_tau"]["mtbench"] == 1.6 and not gate["passed"]
    assert registry.get_model_version("r", "2").tags["aerie.gate"] == "failed"
    assert registry.get_model_version("r", "1").tags["aerie.collection.manifest_sha256"] == "sha"
    assert pipeline.deploy(trained, gate) == {"skipped": f"the gate failed: {gate['reason']}"}
    registry.set_registered_model_alias("r", "production", "2")
    pipeline.cfg.gate.beat = "all"  # against itself: a candidate never beats itself on the beat set
    gate = pipeline.gate(trained, evaluation, collection)
    assert not gate["passed"] and "failed on all" in gate["reason"]


@pytest.mark.parametrize(
    ("validation", "mtbench", "passed", "failed_on"),
    [
        (1.9, 1.5, True, None),  # beats it on the new data, holds on MT-Bench
        (1.7, 1.5, False, "validation"),  # equal on the new data is not better
        (1.9, 1.49, False, "mtbench"),  # better on the new data, worse on MT-Bench
        # better on average (1.75 vs 1.7), by chance: much better on some prompts, worse on the others
        ([1.7 + (0.6 if i % 2 else -0.5) + h for i, h in enumerate(HARDNESS)], 1.5, False, "validation"),
    ],
)
def test_a_fine_tuned_candidate_must_beat_its_base_on_new_data_and_hold_on_mtbench(
    pipeline, validation, mtbench, passed, failed_on
):
    """Nothing registered in production: the committed drafter the candidate was fine-tuned from stands for it."""
    pipeline.cfg.train.init_from = {"eagle3.1": "drafters/base"}
    pipeline.mlflow.create_registered_model("r")
    pipeline.mlflow.create_model_version("r", "file:///nonexistent")
    pipeline.start_parent()
    trained = {"eagle3.1": {"registered": "models:/r/1", "mlflow_run_id": "train-1"}}
    evaluation = {
        "mlflow_run_id": "eval",
        "prompt_labels": LABELS,
        "drafters": {
            "production": {"source": "drafters/base", **_evaluated(1.5, validation=1.7)},
            "eagle3.1": {"source": "models:/r/1", **_evaluated(mtbench, validation=validation)},
        },
    }
    gate = pipeline.gate(trained, evaluation, Collection(False, "sha", "data", "sha", "c"))
    assert gate["production"] == "drafters/base" and gate["passed"] == passed
    assert gate["production_tau"] == pytest.approx({"validation": 1.7, "mtbench": 1.5})
    ratio = gate["beat_ratio"]
    assert ratio["prompts"] == 20 and ratio["ratio_interval"][0] <= ratio["ratio"] <= ratio["ratio_interval"][1]
    assert (ratio["ratio_interval"][0] > 1) == (failed_on != "validation") and "interval above 1" in gate["reason"]
    assert (f"failed on {failed_on}" in gate["reason"]) if failed_on else ("failed" not in gate["reason"])


def test_the_candidate_is_fine_tuned_from_its_base_and_the_baseline_starts_fresh(tmp_path, monkeypatch):
    """configs/smollm2-135m/pipeline.yaml's train stage: EAGLE-3.1 from the committed drafter (its vocabulary: no
    coverage sizing), EAGLE-3 from scratch."""
    from orchestrator.config import load_config

    monkeypatch.chdir(REPO)
    cfg = load_config(PipelineConfig, "configs/smollm2-135m/pipeline.yaml", [f"output_dir={tmp_path}"])
    assert (REPO / cfg.train.init_from["eagle3.1"] / "model.safetensors").is_file()
    seen = {}

    def fake_training(train_cfg):
        seen[train_cfg.drafter.variant] = train_cfg.drafter
        return {"registered": None, "mlflow_run_id": None, "exported": str(tmp_path)}

    monkeypatch.setattr("orchestrator.train.run.run_training", fake_training)
    pipeline = Pipeline(cfg)
    monkeypatch.setattr(pipeline, "adopt", lambda run_id: None)
    collection = Collection(False, "sha", str(tmp_path / "collection"), "sha")
    for variant in ("eagle3.1", "eagle3"):
        pipeline.train(tmp_path / "model", collection, variant)
    assert seen["eagle3.1"].init_from == cfg.train.init_from["eagle3.1"]
    assert seen["eagle3.1"].draft_vocab_coverage is None
    assert seen["eagle3"].init_from is None


def _traffic(tmp_path: Path, requests: int):
    """What a serving tap captured: one shard per request, a minute apart; its storage."""
    from types import SimpleNamespace

    from orchestrator.data.storage import LocalStorage
    from orchestrator.data.traffic import TapConfig, TrafficTap
    from tests.helpers import write_traffic

    storage, clock = LocalStorage(tmp_path / "traffic"), SimpleNamespace(t=1000.0)
    tap = TrafficTap(TapConfig(shard_tokens=6, dtype="float32"), {"aux_layer_ids": [1]}, "w", storage, lambda: clock.t)
    write_traffic(tap, clock, requests, every_s=60)
    tap.close()
    return storage


def test_an_adaptation_reads_the_traffic_since_production_and_records_where_the_next_one_starts(tmp_path):
    """jobs.adapt's data: all captured traffic before any adaptation; after one, only what came since the
    production version's `aerie.traffic.until`; the candidate is tuned from production, and its version is
    tagged with the traffic's end, its base and the replay share (the next round starts there)."""

    from orchestrator.data.traffic import traffic_shards

    storage = _traffic(tmp_path, 5)
    base = {
        "name": "p",
        "model": "m",
        "registered_model": "r",
        "traffic": {"output": str(tmp_path / "traffic"), "holdout_fraction": 0.2},
        "train": {"config": "t.yaml", "variants": ["eagle3.1"], "init_from": {"eagle3.1": "drafters/base"}},
        "evaluate": {"config": "e.yaml"},
        "deploy": {"config": "d.yaml"},
        "benchmark": {"config": "b.yaml", "enabled": False},
        "mlflow_tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "output_dir": str(tmp_path / "out"),
    }
    with pytest.raises(ValueError, match="exactly one data source"):
        PipelineConfig.model_validate({**base, "collect": {"config": "c.yaml"}})
    pipeline = Pipeline(PipelineConfig.model_validate(base))
    pipeline.start_parent()
    first = pipeline.traffic_data()
    assert first.summary["traffic_shards"] == 5 and first.summary["since"] is None
    assert pipeline.traffic["base"] is None  # nothing in production yet: tuned from init_from
    registry = pipeline.mlflow
    registry.create_registered_model("r")
    registry.create_model_version("r", "file:///nonexistent")
    until = traffic_shards(storage)[2]["written_at"]
    registry.set_model_version_tag("r", "1", "aerie.traffic.until", repr(until))
    registry.set_registered_model_alias("r", "production", "1")
    second = Pipeline(PipelineConfig.model_validate(base))
    second.start_parent()
    collection = second.traffic_data()
    assert collection.summary["since"] == until and collection.summary["traffic_shards"] == 2
    assert collection.manifest_sha256 != first.manifest_sha256 and collection.data_key == collection.manifest_sha256
    assert second.traffic["base"] == "models:/r/1"
    tags = second._traffic_tags()
    assert tags["aerie.traffic.until"] == repr(traffic_shards(storage)[-1]["written_at"])
    assert tags["aerie.traffic.base"] == "models:/r/1" and tags["aerie.traffic.replay_share"] == "0.5"


def test_the_mlflow_walk_from_an_adapted_version_back_to_its_traffic(tmp_path):
    """From a registered version: its tags name the traffic run, whose manifest.json artifact has the tagged
    sha256 and lists the traffic source and every shard's sha256, the ones on storage."""
    import hashlib
    import json

    import mlflow

    from orchestrator.data.traffic import traffic_shards

    storage = _traffic(tmp_path, 3)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = PipelineConfig.model_validate(
        {
            "name": "p",
            "model": "m",
            "registered_model": "r",
            "traffic": {"output": str(tmp_path / "traffic")},
            "train": {"config": "t.yaml", "variants": ["eagle3.1"]},
            "evaluate": {"config": "e.yaml"},
            "deploy": {"config": "d.yaml"},
            "benchmark": {"config": "b.yaml", "enabled": False},
            "mlflow_tracking_uri": uri,
            "output_dir": str(tmp_path / "out"),
        }
    )
    pipeline = Pipeline(cfg)
    pipeline.start_parent()
    collection = pipeline.traffic_data()
    registry = pipeline.mlflow
    registry.create_registered_model("r")
    registry.create_model_version("r", "file:///nonexistent")
    trained = {"eagle3.1": {"registered": "models:/r/1", "mlflow_run_id": pipeline.parent}}
    evaluation = {"mlflow_run_id": "eval", "drafters": {"eagle3.1": {"source": "models:/r/1", **_evaluated(1.5)}}}
    gate = {"candidate": "models:/r/1", "passed": True, "reason": "r"}
    pipeline._tag_versions(trained, evaluation, gate, collection)

    tags = registry.get_model_version("r", "1").tags  # the walk starts at the version
    run = registry.get_run(tags["aerie.collection.run_id"])
    path = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="manifest.json", tracking_uri=uri)
    raw = Path(path).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == tags["aerie.collection.manifest_sha256"]
    traffic = json.loads(raw)["datasets"]["traffic"]
    assert traffic["source"] == storage.uri() and tags["aerie.traffic.until"] == repr(traffic["until"])
    assert traffic["shards_sha256"] == {r["name"]: r["sha256"] for r in traffic_shards(storage)}
