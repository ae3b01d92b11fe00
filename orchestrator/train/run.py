"""The training driver: check everything a user can get wrong, then Ray Train, export, MLflow.

driver: target + manifest checks -> draft vocabulary -> MLflow run (resumed when unfinished)
   └── TorchTrainer(num_workers) running loop.train_loop_per_worker (checkpoints under storage_path/name)
driver: final checkpoint -> vLLM-format export (local or s3://) -> MLflow artifacts, plots, registry
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from orchestrator.cluster import init_ray
from orchestrator.data.collect import planned_collection, start_capture_workers
from orchestrator.data.storage import open_storage, upload_dir
from orchestrator.errors import AerieError
from orchestrator.files import publish_dir
from orchestrator.models.checkpoint import ARCHITECTURE, load_drafter
from orchestrator.models.drafter import DrafterConfig
from orchestrator.models.prepare import resolve_model
from orchestrator.models.target import read_hf_config
from orchestrator.redaction import redact
from orchestrator.tracking import client, fetch_drafter, register_drafter, resume_or_start_run, tracking_uri
from orchestrator.train.config import TrainConfig
from orchestrator.train.loop import train_loop_per_worker
from orchestrator.train.plots import plot_training
from orchestrator.train.progress import TrainingBar
from orchestrator.train.state import DataPosition
from orchestrator.train.vocab import count_sequences, count_tokens, coverage, draft_vocab, size_for_coverage

log = logging.getLogger(__name__)


def read_manifest(location: str) -> tuple[dict, str]:
    """The collection's manifest and its sha256; a clear error when there is none."""
    storage = open_storage(location)
    if not storage.exists("manifest.json"):
        raise AerieError(f"{storage.uri()} has no manifest.json: not a finished collection (run collect_hidden_states)")
    raw = storage.read_bytes("manifest.json")
    return json.loads(raw), hashlib.sha256(raw).hexdigest()


def check_data(manifest: dict, hf: dict, model_dir: Path, num_workers: int) -> None:
    """The shards must come from this target and hold enough training data for every worker."""
    target = manifest.get("target", {})
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if target.get(key) != hf[key]:
            raise AerieError(
                f"the data's target has {key}={target.get(key)} but {model_dir.name} has {hf[key]}: "
                "collect hidden states with this target"
            )
    aux = manifest.get("aux_layer_ids") or []
    if not aux or max(aux) >= hf["num_hidden_layers"] or min(aux) < 0:
        raise AerieError(f"the data's aux_layer_ids {aux} do not fit a target with {hf['num_hidden_layers']} layers")
    train = manifest.get("splits", {}).get("train", {})
    if train.get("num_loss_tokens", 0) == 0:
        raise AerieError("the data has no training tokens with a loss (empty train split): collect more data")
    if train.get("num_shards", 0) < num_workers:
        raise AerieError(
            f"{num_workers} workers need at least as many train shards, the data has {train.get('num_shards', 0)}: "
            "lower num_workers or collect with a smaller shard_tokens"
        )


def _storage_path(location: str):
    """Ray Train's storage: an absolute local path, or an S3 prefix with the same endpoint as boto3."""
    if not location.startswith("s3://"):
        return str(Path(location).resolve()), None
    import os
    from urllib.parse import urlparse

    import pyarrow.fs

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    extra = {}
    if endpoint:
        url = urlparse(endpoint)
        extra = {"endpoint_override": url.netloc or url.path, "scheme": url.scheme or "https"}
    fs = pyarrow.fs.S3FileSystem(region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"), **extra)
    return location[len("s3://") :], fs


def ray_train_checkpointed(storage_path: str, filesystem, name: str) -> bool:
    """Whether Ray Train resumes the run `name` from a checkpoint: its checkpoint manager's snapshot names one (a
    `checkpoint_*` folder alone is not enough: killed before the snapshot was written, a rerun starts over)."""
    path = f"{storage_path}/{name}/checkpoint_manager_snapshot.json"
    try:
        if filesystem is None:
            text = Path(path).read_text()
        else:
            with filesystem.open_input_stream(path) as f:
                text = f.read().decode()
        snapshot = json.loads(text)
        return isinstance(snapshot, dict) and bool(snapshot.get("latest_checkpoint_result"))
    except (OSError, ValueError):  # absent, unreadable or half-written: nothing to resume
        return False


# What a rerun that goes on from a checkpoint may change: its budget, where it reports and how its workers are placed.
RESUMABLE = (
    *("max_steps", "max_time_minutes", "ray_address", "output", "max_failures", "log_every_steps", "eval_"),
    *("checkpoint.", "mlflow.", "worker.", "online.prefetch_shards"),
)


def run_params(cfg: TrainConfig, config: DrafterConfig, manifest_sha: str, cover: float) -> dict[str, str]:
    """A training's MLflow params: its config flattened (secrets redacted) and what it resolved to, as strings."""
    params = redact(cfg.model_dump(mode="json"))
    params.update({"variant": config.variant, "data.manifest_sha256": manifest_sha, "draft_vocab.coverage": cover})
    params["draft_vocab.size"] = config.draft_vocab_size
    return {k: str(v) for k, v in params.items()}


def changed_on_resume(logged: dict[str, str], params: dict[str, str]) -> list[str]:
    """The settings that decide what is trained (learning rate, data, drafter, batch...) in which a rerun differs
    from the MLflow run it would go on in, as "key=logged (now new)". Keys one side lacks (a setting added since)
    are not compared. A resumed run trained on with the new settings under the old run's params."""
    return [
        f"{k}={logged[k]} (now {params[k]})"
        for k in sorted(logged.keys() & params.keys())
        if not k.startswith(RESUMABLE) and logged[k] != params[k]
    ]


def refuse_changed_resume(mlflow_client, run_id: str, params: dict[str, str], checkpoints: str) -> None:
    """Raise (one line) where a rerun going on in MLflow run `run_id` from `checkpoints` changed what is trained;
    the run is left unfinished (FAILED), to be resumed with its own settings."""
    if changed := changed_on_resume(mlflow_client.get_run(run_id).data.params, params):
        mlflow_client.set_terminated(run_id, status="FAILED")
        raise AerieError(
            f"training {checkpoints} goes on from its checkpoint, which was started with other settings: "
            f"{'; '.join(changed)}. Rerun with those, or remove {checkpoints} (its progress is lost) or give this "
            "run another name to start over"
        )


def plan_online(cfg: TrainConfig, model_dir: Path) -> dict:
    """`data: online`: the collection's plan (conversations rendered and cut into shards, nothing captured), its
    manifest and that manifest's sha256 (the data's identity in MLflow)."""
    return planned_collection(cfg.online.collect, cfg.online.overrides, model_dir)


def _online_loop_config(online: dict, cfg: TrainConfig) -> dict:
    return {k: online[k] for k in ("manifest", "plans", "workers")} | {"prefetch": cfg.online.prefetch_shards}


def _resolve_paths(cfg: TrainConfig) -> TrainConfig:
    """Local paths made absolute, so workers started in another directory see the same files."""
    updates = {}
    if cfg.data != "online" and not cfg.data.startswith("s3://"):
        updates["data"] = str(Path(cfg.data).resolve())
    return cfg.model_copy(update=updates)


def data_plan_sha256(manifest: dict) -> str:
    """What the data stream is made of: the shards' names, splits and counts and the aux layers, not their bytes
    (a capture on another machine, or online, plans the same shards; floating-point bytes may differ)."""
    keys = ("name", "split", "num_tokens", "num_sequences", "num_loss_tokens")
    plan = [manifest["aux_layer_ids"], [{k: r.get(k) for k in keys} for r in manifest["shards"]]]
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


def continued(cfg: TrainConfig) -> tuple[TrainConfig, dict | None]:
    """`drafter.continue_from` resolved: when that directory holds a drafter, the config warm-starts from it under
    a run name of its own (the committed weights' sha256: a stopped run on this machine resumes, the next increment
    after a commit is a new run), and the previous training's record (provenance.json) comes back; else the
    config is unchanged (trained from scratch, the vocabulary sized as configured) and None."""
    where = cfg.drafter.continue_from
    if where is None or not (Path(where) / "config.json").is_file():
        return cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update={"continue_from": None})}), None
    weights = Path(where) / "model.safetensors"
    if not weights.is_file():
        raise AerieError(f"continue_from {where} has a config.json but no model.safetensors: restore or remove it")
    prov_path = Path(where) / "provenance.json"
    previous = json.loads(prov_path.read_text()).get("training", {}) if prov_path.is_file() else {}
    sha = hashlib.sha256(weights.read_bytes()).hexdigest()[:10]
    drafter = cfg.drafter.model_copy(update={"init_from": where, "continue_from": None, "draft_vocab_coverage": None})
    return cfg.model_copy(update={"name": f"{cfg.name}-from-{sha}", "drafter": drafter}), previous


def allocator_env(allocator: str) -> dict:
    """The training workers' runtime env for `worker.allocator`: jemalloc preloaded from Ray's own package (each
    node's Ray has it at the same path in one image), or nothing (the C library's malloc). With glibc a broad run's
    worker grew from 5.5 to 16 GB over 550 steps, its heap fragmented by tensors of a new shape every step."""
    if allocator == "glibc":
        return {}
    import ray

    lib = Path(ray.__file__).parent / "core" / "libjemalloc.so"
    if not lib.is_file():
        log.warning("worker.allocator=jemalloc but this Ray has no %s: the workers use the C library's malloc", lib)
        return {}
    preload = " ".join(p for p in (str(lib), os.environ.get("LD_PRELOAD", "")) if p)
    return {"env_vars": {"LD_PRELOAD": preload}}


def run_training(cfg: TrainConfig) -> dict:
    import ray.train
    from ray.train.torch import TorchTrainer

    cfg, previous = continued(cfg)
    cfg = _resolve_paths(cfg)
    model_dir = resolve_model(cfg.model, cfg.models_dir).resolve()
    hf = read_hf_config(model_dir)
    online = plan_online(cfg, model_dir) if cfg.data == "online" else None
    manifest, manifest_sha = (online["manifest"], online["manifest_sha256"]) if online else read_manifest(cfg.data)
    check_data(manifest, hf, model_dir, cfg.num_workers)
    aux = tuple(manifest["aux_layer_ids"])
    if online:
        train = (seq for plan in online["plans"] if plan.split == "train" for seq in plan.sequences)
        counts = count_sequences(train, hf["vocab_size"], "online data: the train split")
    else:
        counts = count_tokens(cfg.data, hf["vocab_size"])
    size = cfg.drafter.draft_vocab_size
    if cfg.drafter.draft_vocab_coverage is not None:
        size = size_for_coverage(counts, cfg.drafter.draft_vocab_coverage)
    uri = tracking_uri(cfg.mlflow.tracking_uri)
    init_dir, warm_drafter = None, None
    if cfg.drafter.init_from:
        init_dir = str(fetch_drafter(cfg.drafter.init_from, tracking=uri).resolve())
        warm_drafter = load_drafter(init_dir, target_num_layers=hf["num_hidden_layers"])
        size = warm_drafter.config.draft_vocab_size  # a warm start keeps its vocabulary
    config = DrafterConfig.for_target(hf, aux, size, cfg.drafter.variant, **cfg.drafter.flags())
    if warm_drafter is not None:
        warm = warm_drafter.config
        if (warm.decoder, warm.draft_vocab_size, warm.aux_layer_ids) != (
            config.decoder,
            config.draft_vocab_size,
            config.aux_layer_ids,
        ):
            raise AerieError(f"init_from {cfg.drafter.init_from} has a different shape than the configured drafter")
        if warm.variant != config.variant:
            raise AerieError(
                f"init_from {cfg.drafter.init_from} is an {warm.variant} drafter; this run trains {config.variant}: "
                "set drafter.variant to match it"
            )

    starts = None
    if previous is not None:
        same_data = previous.get("data_plan_sha256") == data_plan_sha256(manifest)
        if same_data and previous.get("data_positions"):  # a new stream after the shards it read whole
            starts = [asdict(DataPosition(**p).continue_at()) for p in previous["data_positions"]]
        log.info(
            "continuing %s (%s tokens so far) %s",
            cfg.drafter.init_from,
            previous.get("tokens_cumulative", previous.get("tokens", "?")),
            "where its data stream stopped" if starts else "from the start of this data (another collection)",
        )
    vocab = draft_vocab(counts, config.draft_vocab_size)
    if warm_drafter is not None:
        vocab = torch.nonzero(warm_drafter.t2d).flatten()
    cover = coverage(counts, vocab)
    log.info("draft vocabulary: %d tokens cover %.1f%% of loss-masked training tokens", vocab.numel(), 100 * cover)

    mlflow = client(uri)
    storage_path, filesystem = _storage_path(cfg.checkpoint.storage_path)
    checkpointed = ray_train_checkpointed(storage_path, filesystem, cfg.name)
    run_id, resumed = resume_or_start_run(mlflow, cfg.mlflow.experiment, cfg.name, resume=checkpointed)
    params = run_params(cfg, config, manifest_sha, cover)
    if resumed:
        refuse_changed_resume(mlflow, run_id, params, f"{storage_path}/{cfg.name}")
    else:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(items), 100):
            mlflow.log_batch(run_id, params=items[start : start + 100])
        mlflow.set_tag(run_id, "target", model_dir.name)
        mlflow.set_tag(run_id, "variant", config.variant)

    init_ray(cfg.ray_address)
    if online:
        online["workers"] = start_capture_workers(
            online.pop("collect"), model_dir, aux, online.pop("num_capture_workers"), write=False
        )
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "train": cfg.model_dump(mode="json"),
            "model_dir": str(model_dir),
            "aux_layer_ids": list(aux),
            "draft_vocab": vocab.tolist(),
            "init_from_dir": init_dir,
            "start_positions": starts,
            "tracking_uri": uri,
            "run_id": run_id,
            "online": _online_loop_config(online, cfg) if online else None,
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.num_workers,
            use_gpu=cfg.worker.use_gpu,
            resources_per_worker={"CPU": cfg.worker.num_cpus, **cfg.worker.resources},
        ),
        run_config=ray.train.RunConfig(
            name=cfg.name,
            storage_path=storage_path,
            storage_filesystem=filesystem,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep),
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            worker_runtime_env=allocator_env(cfg.worker.allocator),
        ),
    )
    with TrainingBar(mlflow, run_id, cfg), _ctrl_c_restored():
        result = trainer.fit()
    if online:  # the capture actors' memory: the other half of online training's footprint
        peaks = ray.get([w.peak_rss_mib.remote() for w in online["workers"]])
        mlflow.log_metric(run_id, "capture_peak_rss_mib", max(peaks))
        for w in online["workers"]:
            ray.kill(w)
    if result.checkpoint is None:
        mlflow.set_terminated(run_id, status="FAILED")
        raise AerieError(f"training {cfg.name} ended without a checkpoint ({result.error})")
    with result.checkpoint.as_directory() as ckpt:
        out = _finish(cfg, Path(ckpt), mlflow, run_id, config, manifest_sha, cover, model_dir, result.metrics)
    out["data_plan_sha256"] = data_plan_sha256(manifest)
    before = previous or {}
    out["tokens_cumulative"] = before.get("tokens_cumulative", before.get("tokens", 0)) + out["tokens"]
    out["steps_cumulative"] = before.get("steps_cumulative", before.get("steps", 0)) + out["steps"]
    out["train_minutes_cumulative"] = round(
        before.get("train_minutes_cumulative", before.get("train_minutes", 0)) + out["train_minutes"], 2
    )
    out["runs"] = before.get("runs", [before["mlflow_run_id"]] if "mlflow_run_id" in before else []) + [run_id]
    return out


def _finish(cfg, ckpt: Path, mlflow, run_id: str, config, manifest_sha: str, cover: float, model_dir, metrics) -> dict:
    """Export the final drafter, log artifacts and plots, register it; returns the job result."""
    progress = json.loads((ckpt / "progress.json").read_text())
    positions = [json.loads(p.read_text()) for p in sorted(ckpt.glob("data-rank*.json"), key=_rank_of)]
    exported = export_drafter(ckpt / "drafter", cfg.output)
    history = {
        key: [(m.step, m.value) for m in mlflow.get_metric_history(run_id, key)]
        for key in mlflow.get_run(run_id).data.metrics
    }
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "train_config.json").write_text(json.dumps(redact(cfg.model_dump(mode="json")), indent=2))
        mlflow.log_artifact(run_id, str(Path(tmp) / "train_config.json"))
        plot = plot_training(history, cfg.ttt_steps, Path(tmp) / "training.png", title=f"{cfg.name} ({config.variant})")
        mlflow.log_artifact(run_id, str(plot), "plots")
    mlflow.log_artifacts(run_id, str(ckpt / "drafter"), "drafter")
    final = {k: v[-1][1] for k, v in history.items()}
    version = None
    if cfg.mlflow.registered_model:
        tags = {
            "target": model_dir.name,
            "variant": config.variant,
            "data_manifest_sha256": manifest_sha,
            "ttt_steps": str(cfg.ttt_steps),
            "val_tau_chain": f"{final.get('val_tau_chain', float('nan')):.3f}",
        }
        version = register_drafter(mlflow, cfg.mlflow.registered_model, run_id, "drafter", tags, cfg.mlflow.aliases)
    mlflow.set_terminated(run_id, status="FINISHED")
    return {
        "name": cfg.name,
        "variant": config.variant,
        "exported": exported,
        "mlflow_run_id": run_id,
        "registered": f"models:/{cfg.mlflow.registered_model}/{version}" if version else None,
        "steps": progress["step"],
        "train_minutes": round(progress["elapsed_s"] / 60, 2),
        "tokens": progress["tokens"],
        "draft_vocab_size": config.draft_vocab_size,
        "draft_vocab_coverage": round(cover, 4),
        "data_manifest_sha256": manifest_sha,
        "data_positions": positions,
        "final_metrics": {k: round(v, 4) for k, v in sorted(final.items())},
    }


def _rank_of(path: Path) -> int:
    return int(path.stem.removeprefix("data-rank"))


def export_drafter(drafter_dir: Path, output: str) -> str:
    """Copy the drafter to `output` (s3:// or local); returns where it went. Locally it is copied beside `output`
    and swapped in (`orchestrator.files.publish_dir`), so a failure at any point leaves the previous export whole.
    An existing `output` that is neither empty nor a drafter export (a drafter config.json) is refused."""
    if output.startswith("s3://"):
        return upload_dir(drafter_dir, output)
    out = Path(output)
    if out.exists() and not _is_export(out):
        raise AerieError(
            f"output {out} exists and is not an exported drafter (no drafter config.json): "
            "choose a new or empty directory"
        )
    publish_dir(out, lambda tmp: shutil.copytree(drafter_dir, tmp, dirs_exist_ok=True))
    return str(out.resolve())


def _is_export(path: Path) -> bool:
    """An empty directory, or one whose config.json is a drafter's (a previous export)."""
    if not path.is_dir():
        return False
    if not any(path.iterdir()):
        return True
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and ARCHITECTURE in (config.get("architectures") or [])


@contextmanager
def _ctrl_c_restored() -> Iterator[None]:
    """Ray Train's `fit()` installs a SIGINT handler (Ctrl-C aborts the run gracefully) and never removes it: in
    a pipeline, a Ctrl-C during a later stage would only log "Received SIGINT" and the job would go on. The
    handler from before `fit()` comes back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
