"""The main job: one pipeline from data to a deployed drafter, resumable, with its lineage in MLflow.

    prepare -> collect -> train (each variant) -> evaluate -> gate -> deploy -> benchmark -> report

Each stage is one of the project's jobs, configured by that job's own config file plus `key=value` overrides;
the pipeline wires their inputs and outputs (the collection the training reads, the registered versions the
evaluation compares, the version the rollout deploys) and records each finished stage in
`output_dir/state.json` with a fingerprint of everything it depends on (its resolved config and the
fingerprints or data hashes upstream). A rerun skips every stage whose fingerprint is unchanged and whose
output is still there, so it resumes where a failure or a kill stopped it; inside a stage the jobs resume too
(collection keeps shards whose checksums hold, training continues from its latest checkpoint).

The pipeline runs on the Ray cluster it finds: `ray_address`, RAY_ADDRESS (what `ray job submit` sets) or the
local Ray that `aerie serve` started; without one it starts a private Ray for its stages, and the deploy stage
(`deploy.when: auto`) is skipped with a note, because a deployment made there would die with the job.

The console shows a line per stage that names its log (`output_dir/logs/<stage>.log`: vLLM's, Ray's, MLflow's
and transformers' own output goes there), a bar per long phase, and the project's warnings; the pipeline's own
work between the stages logs to `logs/pipeline.log` (orchestrator/console.py). The report lists the logs.

MLflow: the pipeline run is a parent run (experiment `mlflow_experiment`) with a child run per stage; the
training and evaluation runs are the stages' own runs, made its children. The registered versions are tagged
with the collection (location, manifest sha256, its run), the training run, the evaluation run and taus, the
gate's decision, the pipeline run; the rollout adds its decision (`aerie.rollout`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from orchestrator import console
from orchestrator.config import StrictModel, load_config
from orchestrator.errors import AerieError
from orchestrator.files import write_atomic
from orchestrator.fingerprint import fingerprint
from orchestrator.tracking.store import ModelUri

log = logging.getLogger(__name__)
PIPELINE_TAG = "aerie.pipeline"
PARENT_TAG = "mlflow.parentRunId"


class StageFile(StrictModel):
    config: str = Field(description="the stage's job config file (configs/...)")
    overrides: list[str] = Field([], description="key=value overrides on top of it")


class TrainStage(StageFile):
    data: Literal["offline", "online"] = Field(
        "offline", description="offline: train on the collect stage's shards; online: stream them (no collect stage)"
    )
    variants: list[Literal["eagle3.1", "eagle3"]] = Field(
        ["eagle3.1", "eagle3"],
        min_length=1,
        description="drafters trained, same data and budget; the first is the candidate",
    )
    init_from: dict[Literal["eagle3.1", "eagle3"], str] = Field(
        {},
        description="the drafter a variant fine-tunes from (a committed directory, s3:// or models:/; its vocabulary "
        "kept); it stands for production at the gate while no version has the production alias. Others start fresh",
    )


class TrafficStage(StrictModel):
    """The data of an adaptation (`jobs.adapt`): what the serving tap captured since the production drafter's own
    traffic, the newest held out, the drafter's corpus replayed against forgetting."""

    output: str = Field(description="the serving tap's output (tap.output): a directory or s3://...")
    holdout_fraction: float = Field(0.2, gt=0, lt=1, description="newest share of the shards: the gate's held-out set")
    replay: str | None = Field(None, description="the drafter's original collection (a directory or s3://...)")
    replay_share: float = Field(0.5, ge=0, description="replayed corpus tokens per traffic token")


class GateConfig(StrictModel):
    method: str = Field("chain-5", description="evaluation method whose tau decides")
    beat: str = Field(
        "validation",
        description="set where the candidate's tau must exceed production's (the new data's held-out split)",
    )
    hold: list[str] = Field(
        ["mtbench"], description="sets where the candidate's tau may not fall below production's minus tolerance"
    )
    tolerance: float = Field(0.0, ge=0, description="on the hold sets: pass if tau >= production's minus this")
    level: float = Field(
        0.95,
        gt=0,
        lt=1,
        description="the candidate beats production when the paired interval of their tau ratio on `beat` (bootstrap "
        "over prompts, at this confidence) lies above 1",
    )


class DeployStage(StageFile):
    when: Literal["auto", "always", "never"] = Field(
        "auto", description="auto: roll out when a running cluster is found, else skip; always: refuse without one"
    )


class BenchmarkStage(StageFile):
    enabled: bool = Field(True, description="run the benchmark stage (false: skipped)")


@dataclass(frozen=True)
class Collection:
    """The data the training reads: a stored collection (offline), or shards each trainer captures as it reads
    (online: nothing is stored, and the manifest is the one its training planned, in that run's params)."""

    online: bool
    data_key: str  # what a training is keyed on: the manifest's sha256, or (online) the collect config's fingerprint
    output: str | None = None  # offline: where the shards and manifest.json are
    manifest_sha256: str | None = None  # offline: manifest.json's sha256
    run_id: str | None = None  # offline: the collect stage's MLflow run
    summary: dict = field(default_factory=dict)  # offline: the collection job's result, without its datasets

    @classmethod
    def from_dict(cls, d: dict) -> Collection:
        """From state.json (a result recorded before `online` and `data_key` existed is an offline one)."""
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**{"online": False, "data_key": d.get("manifest_sha256"), **known})


class PipelineConfig(StrictModel):
    """`python -m jobs.pipeline` settings."""

    name: str = Field(description="the pipeline's name: its MLflow runs and training runs are named after it")
    model: str = Field(description="target: a Hugging Face directory or a packaged model name")
    models_dir: str = Field("models", description="where a packaged target is prepared (the evaluate stage's too)")
    registered_model: str = Field(description="MLflow registered model the drafters become versions of")
    production_alias: str = Field("production", description="the alias of the drafter in production")
    collect: StageFile | None = Field(None, description="the collection job (the pipeline's data)")
    traffic: TrafficStage | None = Field(None, description="served traffic instead of a collection (jobs.adapt)")
    train: TrainStage = Field(
        description="the training stage: a jobs.train_drafter config (model, data and registry wired), per variant"
    )
    evaluate: StageFile = Field(
        description="the evaluation stage: a jobs.evaluate_drafter config (model, data and drafters wired)"
    )
    gate: GateConfig = Field(
        default_factory=GateConfig, description="when the candidate passes: its tau against production's"
    )
    deploy: DeployStage = Field(
        description="the rollout stage: a jobs.deploy config (the candidate drafter wired) and when it runs"
    )
    benchmark: BenchmarkStage = Field(
        description="the serving benchmark stage: a jobs.benchmark_serving config, run on the candidate"
    )
    ray_address: str | None = Field(None, description="None: RAY_ADDRESS, else a running local Ray, else a private one")
    mlflow_tracking_uri: str | None = Field(
        None, description="None: MLFLOW_TRACKING_URI, else sqlite:///runs/mlflow.db"
    )
    mlflow_experiment: str = Field("aerie-pipelines", description="MLflow experiment of the pipeline's parent run")
    output_dir: str = Field(description="state.json, the stages' outputs, report.json / report.md and plots")

    @model_validator(mode="after")
    def _one_data_source(self) -> PipelineConfig:
        if (self.collect is None) == (self.traffic is None):
            raise ValueError("give exactly one data source: collect (a collection job) or traffic (served traffic)")
        if self.traffic is not None and self.train.data == "online":
            raise ValueError("train.data: online streams a collection; traffic is read as stored shards (offline)")
        return self


class State:
    """`state.json`: per stage its fingerprint, result, duration and MLflow run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stages: dict[str, dict] = json.loads(path.read_text()) if path.is_file() else {}

    def done(self, stage: str, fp: str) -> dict | None:
        entry = self.stages.get(stage)
        return entry if entry and entry.get("fingerprint") == fp and entry.get("status") == "done" else None

    def record(self, stage: str, **entry) -> None:
        self.stages[stage] = entry
        write_atomic(self.path, json.dumps(self.stages, indent=2, default=str) + "\n")


class Pipeline:
    def __init__(self, cfg: PipelineConfig) -> None:
        from orchestrator.tracking import tracking_uri

        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.state = State(self.out / "state.json")
        self.uri = tracking_uri(cfg.mlflow_tracking_uri)
        self.cluster: str | None = None  # the running cluster found, or None (a private Ray)
        self.traffic: dict | None = None  # an adaptation's lineage (traffic_data)
        self.report: dict = {"name": cfg.name, "stages": {}}
        self.parent = ""

    @functools.cached_property
    def mlflow(self):
        """The MLflow client, made on first use: a new store's set-up chatter goes to logs/pipeline.log."""
        from orchestrator.tracking import client

        return client(self.uri)

    # -- plumbing ---------------------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        console.say(f"[pipeline {time.strftime('%H:%M:%S')}] {text}")

    def log_file(self, key: str) -> Path:
        """The log of a stage (`pipeline`: the pipeline's own work between stages)."""
        return self.out / "logs" / f"{key}.log"

    def stage(
        self,
        key: str,
        fp: str,
        body: Callable[[], dict],
        check: Callable[[dict], bool] = lambda r: True,
        doing: str = "running",
        ray_workers: bool = False,
    ):
        """Run `body` unless state.json has this stage done with the same fingerprint and `check` accepts its
        result; returns the result either way. `doing` says what it does in the stage line, which names the
        stage's log (the engines' output goes there, not to the terminal); a stage with `ray_workers` names Ray's
        log folder when it ends (its workers log there). A failure names the stage, its log and what to do."""
        done = self.state.done(key, fp)
        log_file = self.log_file(key)
        if done is not None and check(done["result"]):
            self.say(f"{key}: skipped (done {done['finished']}, same inputs)")
            self.report["stages"][key] = {"status": "skipped", **{k: done[k] for k in ("seconds", "finished")}}
            if log_file.is_file():
                self.report["stages"][key]["log"] = str(log_file)
            return done["result"]
        self.say(f"{key}: {doing} (log: {log_file})")
        began = time.monotonic()
        self.state.record(key, fingerprint=fp, status="running", started=time.strftime("%Y-%m-%d %H:%M:%S"))
        try:
            with console.stage_log(log_file):
                result = body()
        except BaseException as err:
            ray_logs = self._ray_logs() if ray_workers else None
            ray_said = f"; Ray workers' logs: {ray_logs}" if ray_logs else ""
            self.say(f"{key}: failed after {time.monotonic() - began:.0f} s (log: {log_file}{ray_said})")
            self._failed(key, fp, err)
            raise
        seconds = round(time.monotonic() - began, 1)
        finished = time.strftime("%Y-%m-%d %H:%M:%S")
        self.state.record(key, fingerprint=fp, status="done", result=result, seconds=seconds, finished=finished)
        self.report["stages"][key] = {"status": "ran", "seconds": seconds, "finished": finished, "log": str(log_file)}
        ray_logs = self._ray_logs() if ray_workers else None
        self.say(f"{key}: done in {seconds:.0f} s" + (f" (Ray workers' logs: {ray_logs})" if ray_logs else ""))
        return result

    def _failed(self, key: str, fp: str, err: BaseException) -> None:
        """Record a failed stage; raise the AerieError that names it and what to do (an interrupt goes on)."""
        if isinstance(err, AerieError):
            self.state.record(key, fingerprint=fp, status="failed", error=str(err))
            raise AerieError(
                f"pipeline stage {key} failed: {err} (fix that and rerun: done stages are skipped)"
            ) from err
        if isinstance(err, Exception):
            trace = self.out / f"{key}.error.txt"
            trace.write_text("".join(traceback.format_exception(err)))
            self.state.record(key, fingerprint=fp, status="failed", error=repr(err)[:500])
            raise AerieError(
                f"pipeline stage {key} failed: {type(err).__name__}: {str(err)[:300]} (traceback: {trace}); "
                "rerun resumes from this stage"
            ) from err

    def _ray_logs(self) -> str | None:
        """The folder of the Ray this job is connected to, where its workers log (recorded for the report)."""
        from orchestrator.cluster import ray_logs_dir

        where = ray_logs_dir()
        if where is not None:
            self.report["ray_logs"] = where
        return where

    def load(self, key: str, model, stage: StageFile, wiring: list[str]):
        """A stage's job config: its file, its overrides, then the pipeline's wiring; errors name the stage."""
        try:
            return load_config(model, stage.config, [*stage.overrides, *wiring])
        except AerieError as err:
            raise AerieError(f"pipeline stage {key}: {err} (in {key}.config / {key}.overrides)") from err

    def child_run(self, stage: str, params: dict, metrics: dict | None = None, artifacts: dict | None = None) -> str:
        """A child run of the pipeline run for a stage that has no run of its own."""
        from mlflow.entities import Metric, Param

        from orchestrator.redaction import redact

        exp = self.mlflow.get_experiment_by_name(self.cfg.mlflow_experiment).experiment_id
        run = self.mlflow.create_run(
            exp, run_name=f"{self.cfg.name} {stage}", tags={PARENT_TAG: self.parent, PIPELINE_TAG: self.cfg.name}
        )
        flat = {
            k: json.dumps(v, default=str) if isinstance(v, dict | list) else str(v) for k, v in redact(params).items()
        }
        ps = [Param(k[:250], v[:6000]) for k, v in flat.items()]
        ms = [Metric(k, float(v), 0, 0) for k, v in (metrics or {}).items() if isinstance(v, int | float)]
        for start in range(0, max(len(ps), len(ms), 1), 100):
            self.mlflow.log_batch(run.info.run_id, metrics=ms[start : start + 100], params=ps[start : start + 100])
        with tempfile.TemporaryDirectory() as tmp:
            for name, content in (artifacts or {}).items():
                path = Path(tmp) / name
                path.write_bytes(content if isinstance(content, bytes) else json.dumps(content, indent=2).encode())
                self.mlflow.log_artifact(run.info.run_id, str(path))
        self.mlflow.set_terminated(run.info.run_id)
        return run.info.run_id

    def adopt(self, run_id: str) -> None:
        """Make a stage's own run (training, evaluation) a child of this pipeline run."""
        self.mlflow.set_tag(run_id, PARENT_TAG, self.parent)
        self.mlflow.set_tag(run_id, PIPELINE_TAG, self.cfg.name)

    def start_parent(self) -> None:
        from orchestrator.tracking.store import resume_or_start_run

        self.parent, resumed = resume_or_start_run(self.mlflow, self.cfg.mlflow_experiment, self.cfg.name, PIPELINE_TAG)
        self.say(f"MLflow run {self.parent} ({'resumed' if resumed else 'new'}) at {self.uri_shown()}")

    def uri_shown(self) -> str:
        from orchestrator.redaction import redact_text

        return redact_text(self.uri)

    def find_cluster(self) -> None:
        """The running cluster every stage uses, or None (stages start a private Ray; no deployment)."""
        import ray

        from orchestrator.cluster import connect_to_running_cluster

        try:
            self.cluster = connect_to_running_cluster(self.cfg.ray_address)
            self.say(f"on the running Ray cluster ({ray.get_runtime_context().gcs_address})")
        except AerieError as err:
            if self.cfg.deploy.when == "always":
                raise AerieError(f"deploy.when is 'always' but {err}") from err
            self.say("no running Ray cluster: the stages run on a private Ray; the deploy stage will be skipped")

    def check_keys(self) -> None:
        """The benchmark's and the rollout's backends start only with an API key (and their clients send it):
        on this job's private Ray one is made as `aerie serve` makes it; on a cluster it must be configured."""
        from orchestrator.serving.guard import keys_for_servers

        if not self.cfg.benchmark.enabled and (self.cfg.deploy.when == "never" or self.cluster is None):
            return
        if (written := keys_for_servers(private_ray=self.cluster is None)) is not None:
            self.say(f"wrote a new API key to {written} (the benchmark's server and clients use it)")

    # -- the stages -------------------------------------------------------------------------------------------

    def preflight(self) -> None:
        """Every stage's config read and validated before the first stage starts: a typo in the deploy
        stage fails now, not after the training."""
        from orchestrator.benchmarks.serving import BenchmarkServingConfig
        from orchestrator.data.collect import CollectConfig
        from orchestrator.evaluation import EvalConfig
        from orchestrator.serving.launch import read_serve_config
        from orchestrator.serving.rollout import DeployConfig
        from orchestrator.train.config import TrainConfig

        if self.cfg.collect is not None:
            self.load("collect", CollectConfig, self.cfg.collect, [])
        self.load("train", TrainConfig, self.cfg.train, [])
        self.load("evaluate", EvalConfig, self.cfg.evaluate, [])
        if self.cfg.deploy.when != "never":
            deploy = self.load("deploy", DeployConfig, self.cfg.deploy, [])
            read_serve_config(deploy.app, [*deploy.app_overrides, "drafter=null", "speculation=false"])
        if self.cfg.benchmark.enabled:
            bench = self.load("benchmark", BenchmarkServingConfig, self.cfg.benchmark, [])
            read_serve_config(bench.app, [*bench.app_overrides, "drafter=null", "speculation=false"])

    def run(self) -> dict:
        """Every stage in turn, then the report. Between the stages the pipeline's own work (MLflow, Ray, the
        gate, the report) logs to logs/pipeline.log; each stage logs to its own file there."""
        began = time.monotonic()
        self.preflight()
        self.out.mkdir(parents=True, exist_ok=True)
        own_log = self.log_file("pipeline")
        self.say(f"{self.cfg.name}: logs in {own_log.parent}/ (the pipeline's own: {own_log.name}; one per stage)")
        self.report["log"] = str(own_log)
        with console.stage_log(own_log):
            return self._run(began)

    def _run(self, began: float) -> dict:
        self.start_parent()
        self.find_cluster()
        self.check_keys()
        try:
            model_dir = self.prepare()
            if self.cfg.traffic is not None:
                collection = self.traffic_data()
            elif self.cfg.train.data == "offline":
                collection = self.collect(model_dir)
            else:
                collection = self.online_data()
            trained = {v: self.train(model_dir, collection, v) for v in self.cfg.train.variants}
            evaluation = self.evaluate(collection, trained)
            gate = self.gate(trained, evaluation, collection)
            deployment = self.deploy(trained, gate)
            benchmark = self.benchmark(trained)
        except BaseException:
            self.mlflow.set_terminated(self.parent, status="FAILED")
            raise
        self.report.update(
            seconds=round(time.monotonic() - began, 1),
            mlflow={"tracking_uri": self.uri_shown(), "pipeline_run": self.parent},
            collection=asdict(collection),
            trained=trained,
            evaluation=evaluation,
            gate=gate,
            deploy=deployment,
            benchmark=benchmark,
        )
        from orchestrator.pipeline_report import write_report

        files = write_report(self.report, self.out)
        for path in files:
            self.mlflow.log_artifact(self.parent, str(path), "report")
        self.mlflow.set_terminated(self.parent)
        self.say(f"report: {files[1]} ({self.report['seconds']:.0f} s)")
        return self.report

    def prepare(self) -> Path:
        from orchestrator.models.prepare import resolve_model

        self.say("prepare: the target model")
        return resolve_model(self.cfg.model, self.cfg.models_dir).resolve()

    def collect(self, model_dir: Path) -> dict:
        from orchestrator.data.collect import CollectConfig, run_collection
        from orchestrator.data.storage import open_storage

        cfg = self.load("collect", CollectConfig, self.cfg.collect, [f"model={model_dir}"])

        def body() -> dict:
            result = run_collection(cfg, model_dir)
            if not result["complete"]:
                raise AerieError(f"collection {cfg.output} is incomplete ({result['shards_planned']} planned)")
            storage = open_storage(cfg.output)
            storage.write_bytes("result.json", json.dumps(result, indent=2).encode())
            raw = storage.read_bytes("manifest.json")
            sha = hashlib.sha256(raw).hexdigest()
            summary = {k: v for k, v in result.items() if k != "datasets"}
            run_id = self.child_run(
                "collect",
                {"config": cfg.model_dump(mode="json"), "output": result["output"], "manifest_sha256": sha},
                {k: v for k, v in summary.items() if isinstance(v, int | float) and not isinstance(v, bool)},
                {"manifest.json": raw, "result.json": result},
            )
            return asdict(Collection(False, sha, result["output"], sha, run_id, summary))

        def still_there(result: dict) -> bool:
            storage = open_storage(cfg.output)
            return (
                storage.exists("manifest.json")
                and hashlib.sha256(storage.read_bytes("manifest.json")).hexdigest() == result["manifest_sha256"]
            )

        sources = "+".join(s.kind for s in cfg.sources)
        regenerated = ", answers regenerated by the target" if cfg.regenerate else ""
        doing = (
            f"hidden states of {cfg.max_conversations or 'all'} {sources} conversations{regenerated} -> {cfg.output}"
        )
        fp = fingerprint(cfg.model_dump(mode="json"))
        return Collection.from_dict(self.stage("collect", fp, body, still_there, doing, ray_workers=True))

    def traffic_data(self) -> Collection:
        """The traffic the tap captured since the production drafter's (its version's `aerie.traffic.until` tag;
        all of it when production was not adapted), as a collection (`adaptation_data`)."""
        from orchestrator.data.storage import open_storage
        from orchestrator.data.traffic import adaptation_data

        t = self.cfg.traffic
        production = self.registered_production()
        since = None
        if production is not None:
            uri = ModelUri.parse(production)
            until = self.mlflow.get_model_version(uri.name, uri.version).tags.get("aerie.traffic.until")
            since = float(until) if until else None
        dest = self.out / "adaptation-data"
        shutil.rmtree(dest, ignore_errors=True)
        manifest = adaptation_data(open_storage(t.output), dest, since, t.holdout_fraction, t.replay, t.replay_share)
        raw = (dest / "manifest.json").read_bytes()
        sha = hashlib.sha256(raw).hexdigest()
        traffic = manifest["datasets"]["traffic"]
        summary = {
            "since": since,
            "until": traffic["until"],
            "traffic_shards": len(traffic["shards_sha256"]),
            "held_out_shards": len(traffic["held_out"]),
            "replay_shards": len(manifest["datasets"]["replay"]["shards"]),
            **{f"{split}_tokens": s["num_tokens"] for split, s in manifest["splits"].items()},
        }
        self.say(f"traffic: {summary}")
        self.report["stages"]["traffic"] = {"status": "ran", **summary}
        params = {"output": t.output, "manifest_sha256": sha, **summary}
        run_id = self.child_run("traffic", params, artifacts={"manifest.json": raw})
        self.traffic = {"until": traffic["until"], "base": production, "replay_share": t.replay_share}
        return Collection(False, sha, str(dest), sha, run_id, summary)

    def online_data(self) -> Collection:
        """train.data: online: no collect stage; the training captures the collect config's shards as it reads."""
        self._skip("collect", "train.data is online: the trainers read hidden states captured for them")
        return Collection(online=True, data_key=fingerprint(self.cfg.collect.model_dump(mode="json")))

    def train(self, model_dir: Path, collection: Collection, variant: str) -> dict:
        from orchestrator.train.config import OnlineData, TrainConfig
        from orchestrator.train.run import run_training

        wiring = [*self._train_wiring(model_dir), f"data={collection.output if not collection.online else 'unused'}"]
        base = self.load("train", TrainConfig, self.cfg.train, wiring).model_dump()
        base["drafter"]["variant"] = variant
        start = self.cfg.train.init_from.get(variant)
        if self.traffic is not None and variant == self.cfg.train.variants[0]:
            start = self.traffic["base"] or start  # an adaptation tunes the drafter in production
        if start is not None:  # fine-tuned: the base drafter's weights and vocabulary
            base["drafter"].update(init_from=start, draft_vocab_coverage=None)
        if collection.online:
            base["data"] = "online"
            base["online"] = OnlineData(
                collect=self.cfg.collect.config, overrides=self.cfg.collect.overrides
            ).model_dump()
        cfg = TrainConfig.model_validate(base)
        fp = fingerprint(cfg.model_dump(mode="json", exclude={"name", "output"}), collection.data_key)
        # one training run per (config, data): a changed config trains afresh, the same one resumes its checkpoint
        cfg = cfg.model_copy(
            update={"name": f"{self.cfg.name}-{variant}-{fp[:8]}", "output": str(self.out / "drafters" / variant)}
        )

        def body() -> dict:
            result = run_training(cfg)
            self.adopt(result["mlflow_run_id"])
            return {**result, "pipeline_run_id": self.parent}  # the run it trained under (later runs skip it)

        def still_there(result: dict) -> bool:
            return (Path(result["exported"]) / "config.json").is_file() and self._version_exists(result["registered"])

        budget = [f"{cfg.max_steps} steps"] if cfg.max_steps is not None else []
        budget += [f"{cfg.max_time_minutes:g} min"] if cfg.max_time_minutes is not None else []
        doing = f"{variant} for {' or '.join(budget)}" + (f", from {start}" if start else "")
        return self.stage(f"train-{variant}", fp, body, still_there, doing, ray_workers=True)

    def _train_wiring(self, model_dir: Path) -> list[str]:
        return [
            f"model={model_dir}",
            f"mlflow.registered_model={self.cfg.registered_model}",
            "mlflow.aliases=[]",
            *([f"mlflow.tracking_uri={self.cfg.mlflow_tracking_uri}"] if self.cfg.mlflow_tracking_uri else []),
        ]

    def _version_exists(self, uri: str | None) -> bool:
        if not uri:
            return False
        try:
            ModelUri.parse(uri).resolve(self.mlflow)
        except Exception:
            return False
        return True

    def production(self) -> str | None:
        """The drafter the candidate must beat: the version in production (models:/NAME/VERSION, the alias a
        promotion moves), else the drafter the candidate was fine-tuned from (train.init_from), else None."""
        return self.registered_production() or self.cfg.train.init_from.get(self.cfg.train.variants[0])

    def registered_production(self) -> str | None:
        """models:/NAME/VERSION of the drafter in production, if any."""
        from mlflow.exceptions import MlflowException

        try:
            v = self.mlflow.get_model_version_by_alias(self.cfg.registered_model, self.cfg.production_alias)
        except MlflowException:
            return None
        return f"models:/{self.cfg.registered_model}/{v.version}"

    def evaluate(self, collection: Collection, trained: dict) -> dict:
        from orchestrator.evaluation import EvalConfig, run_evaluation

        drafters = [{"name": v, "source": r["registered"]} for v, r in trained.items()]
        production = self.production()
        if production and production not in [d["source"] for d in drafters]:
            drafters.insert(0, {"name": "production", "source": production})
        wiring = [
            f"model={self.cfg.model}",
            f"models_dir={self.cfg.models_dir}",
            f"data={collection.output if not collection.online else 'null'}",
            f"output_dir={self.out / 'evaluate'}",
            *([f"mlflow_tracking_uri={self.cfg.mlflow_tracking_uri}"] if self.cfg.mlflow_tracking_uri else []),
        ]
        cfg = self.load("evaluate", EvalConfig, self.cfg.evaluate, wiring)
        cfg = EvalConfig.model_validate({**cfg.model_dump(), "drafters": drafters})

        def body() -> dict:
            result = run_evaluation(cfg)
            self.adopt(result["mlflow_run_id"])
            return result

        return self.stage(
            "evaluate",
            fingerprint(cfg.model_dump(mode="json")),
            body,
            lambda r: (Path(cfg.output_dir) / "result.json").is_file(),
            f"drafters {', '.join(d['name'] for d in drafters)}; methods {', '.join(cfg.methods)}",
        )

    def tau(self, evaluation: dict, name: str, set_name: str) -> float:
        """A drafter's tau under gate.method on one evaluation set ('all': every set)."""
        entry = evaluation["drafters"][name]["engine"]
        method = entry.get(self.cfg.gate.method)
        if method is None:
            raise AerieError(f"gate.method {self.cfg.gate.method!r} is not an evaluation method: {list(entry)[:-1]}")
        if set_name == "all":
            return method["overall"]["acceptance_length"]
        if set_name not in method["sets"]:
            raise AerieError(f"gate set {set_name!r} was not evaluated: {list(method['sets'])}")
        return method["sets"][set_name]["acceptance_length"]

    def beat_ratio(self, evaluation: dict, candidate: str, production: str) -> dict:
        """tau(candidate) / tau(production) on gate.beat under gate.method, with its paired bootstrap interval over
        the set's prompts at gate.level (stats.tau_ratio)."""
        from orchestrator.evaluation.evaluate import per_prompt, set_rows
        from orchestrator.stats import tau_ratio

        g = self.cfg.gate
        rows = set_rows(evaluation)[g.beat]
        ours, theirs = (per_prompt(evaluation, n, g.method, rows) for n in (candidate, production))
        r = tau_ratio(ours, theirs, level=g.level)
        return {"ratio": r["ratio"], "ratio_interval": r["ratio_interval"], "level": g.level, "prompts": len(rows)}

    def gate(self, trained: dict, evaluation: dict, collection: Collection) -> dict:
        """The candidate (the first variant) against production (the registered version, else its base drafter):
        it must beat production on gate.beat (the new data's held-out split: the paired interval of their tau
        ratio above 1) and hold on gate.hold (MT-Bench: tau at least production's minus gate.tolerance)."""
        g = self.cfg.gate
        candidate = self.cfg.train.variants[0]
        in_production = self.production()  # a version (maybe one of this pipeline's), or the base drafter
        name = next((n for n, e in evaluation["drafters"].items() if e["source"] == in_production), None)
        ours = {s: self.tau(evaluation, candidate, s) for s in [g.beat, *g.hold]}
        theirs = {s: self.tau(evaluation, name, s) for s in ours} if name is not None else None
        if theirs is None:
            passed, failed = True, []
            reason = f"nothing in production; candidate tau {ours[g.beat]:.3f} on {g.beat} ({g.method})"
        else:
            ratio = self.beat_ratio(evaluation, candidate, name)
            failed = [] if ratio["ratio_interval"][0] > 1 else [g.beat]
            failed += [s for s in g.hold if ours[s] < theirs[s] - g.tolerance]
            passed = not failed
            low, high = ratio["ratio_interval"]
            said = [
                f"{g.beat} {ours[g.beat]:.3f} vs {theirs[g.beat]:.3f}, ratio {ratio['ratio']:.3f} "
                f"[{low:.3f}, {high:.3f}] (must beat: the {g.level:.0%} interval above 1)"
            ]
            said += [f"{s} {ours[s]:.3f} vs {theirs[s]:.3f} - {g.tolerance} (must hold)" for s in g.hold]
            reason = f"candidate vs production {in_production}, {g.method}: " + "; ".join(said)
            if failed:
                reason += f"; failed on {', '.join(failed)}"
        gate = {
            "candidate": trained[candidate]["registered"],
            "production": in_production,
            "candidate_tau": ours,
            "production_tau": theirs,
            "beat_ratio": ratio if theirs is not None else None,
            "passed": passed,
            "reason": reason,
        }
        self.say(f"gate: {'passed' if passed else 'FAILED'}: {reason}")
        params = {k: v for k, v in gate.items() if v is not None and not isinstance(v, dict)}
        params.update({f"candidate_tau.{s}": t for s, t in ours.items()})
        params.update({f"production_tau.{s}": t for s, t in (theirs or {}).items()})
        gate["run_id"] = self.child_run("gate", params)
        self._tag_versions(trained, evaluation, gate, collection)
        self.report["stages"]["gate"] = {"status": "ran", "passed": passed}
        return gate

    def _tag_versions(self, trained: dict, evaluation: dict, gate: dict, collection: Collection) -> None:
        """What a user walking back from a version needs: data, training, evaluation, the gate, this pipeline."""
        for variant, result in trained.items():
            registered = ModelUri.parse(result["registered"])
            name, version = registered.name, registered.version
            location, sha = collection.output, collection.manifest_sha256
            if collection.online:  # the manifest the training planned and hashed; the config it came from
                location = f"online:{self.cfg.collect.config}"
                sha = self.mlflow.get_run(result["mlflow_run_id"]).data.params["data.manifest_sha256"]
            tags = {
                **self._traffic_tags(),
                "aerie.collection": location,
                "aerie.collection.manifest_sha256": sha,
                "aerie.collection.run_id": collection.run_id or "",
                "aerie.training.run_id": result["mlflow_run_id"],
                "aerie.evaluation.run_id": evaluation["mlflow_run_id"],
                "aerie.pipeline.run_id": result.get("pipeline_run_id", self.parent),
            }
            for method, e in evaluation["drafters"][variant]["engine"].items():
                if method != "draft_vocab_coverage":
                    for key, s in {"all": e["overall"], **e["sets"]}.items():
                        tags[f"aerie.eval.tau.{method}.{key}"] = f"{s['acceptance_length']:.3f}"
            if result["registered"] == gate["candidate"]:
                tags["aerie.gate"] = "passed" if gate["passed"] else "failed"
                tags["aerie.gate.reason"] = gate["reason"]
            for key, value in tags.items():
                self.mlflow.set_model_version_tag(name, version, key, value)

    def _traffic_tags(self) -> dict[str, str]:
        """An adapted version's lineage: the traffic it saw up to (the next adaptation starts there), the version
        it was tuned from, the replay share."""
        if self.traffic is None:
            return {}
        return {
            "aerie.traffic.until": repr(self.traffic["until"]),
            "aerie.traffic.base": self.traffic["base"] or "",
            "aerie.traffic.replay_share": str(self.traffic["replay_share"]),
        }

    def deploy(self, trained: dict, gate: dict) -> dict:
        from orchestrator.serving.rollout import DeployConfig, run_rollout

        if self.cfg.deploy.when == "never":
            return self._skip("deploy", "deploy.when is 'never'")
        if not gate["passed"]:
            return self._skip("deploy", f"the gate failed: {gate['reason']}")
        if gate["candidate"] == gate["production"]:
            return self._skip("deploy", f"{gate['candidate']} is in production already")
        if self.cluster is None:
            return self._skip(
                "deploy",
                "no running Ray cluster (start `aerie serve --config configs/smollm2-135m/serve.yaml` first, or "
                "set RAY_ADDRESS): a deployment on this job's private Ray would die with it",
            )
        wiring = [f"drafter={gate['candidate']}", f"output_dir={self.out / 'deploy'}"]
        if self.cfg.mlflow_tracking_uri:
            wiring.append(f"tracking_uri={self.cfg.mlflow_tracking_uri}")
        cfg = self.load("deploy", DeployConfig, self.cfg.deploy, wiring)

        def body() -> dict:
            record = run_rollout(cfg)
            summary = {k: record.get(k) for k in ("decision", "app", "drafter", "reason", "acceptance", "record_dir")}
            summary["endpoint"] = f"http://{cfg.host}:{cfg.port}{cfg.route_prefix}"
            summary["run_id"] = self.child_run("deploy", summary, artifacts={"record.json": record})
            if record["decision"] == "failed":
                raise AerieError(f"the candidate did not start: {record.get('reason')}")
            return summary

        fp = fingerprint(cfg.model_dump(mode="json"))
        return self.stage("deploy", fp, body, doing=f"rolling out {gate['candidate']}", ray_workers=True)

    def _skip(self, key: str, reason: str) -> dict:
        self.say(f"{key}: skipped: {reason}")
        self.report["stages"][key] = {"status": "skipped", "reason": reason}
        return {"skipped": reason}

    def benchmark(self, trained: dict) -> dict:
        from orchestrator.benchmarks.serving import BenchmarkServingConfig, run_serving_benchmark

        if not self.cfg.benchmark.enabled:
            return self._skip("benchmark", "benchmark.enabled is false")
        candidate = trained[self.cfg.train.variants[0]]["registered"]
        base = self.load(
            "benchmark", BenchmarkServingConfig, self.cfg.benchmark, [f"output_dir={self.out / 'benchmark'}"]
        )
        cfg = base.model_copy(update={"app_overrides": [*base.app_overrides, f"drafter={candidate}"]})

        def body() -> dict:
            out = Path(cfg.output_dir)
            if out.exists():
                shutil.rmtree(out)
            out.mkdir(parents=True)
            result = run_serving_benchmark(cfg, out)
            from orchestrator.jobrunner import write_result

            write_result(out, {"config": cfg.model_dump(), **result})
            metrics = {f"speedup_c{c}": v["ratio"] for c, v in (result.get("speedup") or {}).items()}
            result["run_id"] = self.child_run("benchmark", {"config": cfg.model_dump(mode="json")}, metrics)
            return result

        doing = f"{candidate} with and without speculation, {cfg.concurrency} concurrent users"
        fp = fingerprint(cfg.model_dump(mode="json"))
        return self.stage("benchmark", fp, body, doing=doing, ray_workers=True)


def run_pipeline(cfg: PipelineConfig) -> dict:
    return Pipeline(cfg).run()
