"""Hidden-state collection on Ray: conversations -> chat templates -> target forward -> shards + manifest.

driver: load sources, split by id, render every template variant, plan shards, skip verified ones
   └── ActorPool of CaptureWorker (TargetModel each; resources from the config)
          states (TargetModel or vLLM extract_hidden_states) -> shard bytes -> write_shard (atomic,
          with a sha256 record) -> local dir or s3://
driver: manifest.json (written last) and result.json
"""

from __future__ import annotations

import hashlib
import json
import logging
import resource
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator

from orchestrator.cluster import WorkerResources, init_ray
from orchestrator.config import StrictModel
from orchestrator.console import bar
from orchestrator.data import corpus
from orchestrator.data.conversations import (
    Conversation,
    LoadReport,
    first_turns,
    load_chitchat,
    load_messages_jsonl,
    load_mtbench_first_turns,
    load_sharegpt,
    split_of,
)
from orchestrator.data.shards import (
    Sequence,
    ShardPlan,
    finished_record,
    plan_record,
    plan_shards,
    shard_bytes,
    split_totals,
    target_states,
    write_shard,
)
from orchestrator.data.storage import open_storage
from orchestrator.data.synthetic import (
    RegenerateConfig,
    SyntheticConfig,
    answer_turns,
    normalise,
    synthesise_prompts,
)
from orchestrator.data.templates import render_conversation
from orchestrator.errors import AerieError
from orchestrator.fingerprint import fingerprint
from orchestrator.models.device import DTYPES, DtypeName, dtype_name
from orchestrator.models.target import check_target_supported, config_sha256, default_aux_layer_ids, read_hf_config

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
BASELINE_TOKENS = 16384  # the baseline's sample: a rate to compare with, not a second pass over every shard


class SourceConfig(StrictModel):
    kind: Literal["chitchat", "jsonl", "sharegpt", "mtbench", "synthetic"] = Field(
        description="dataset format, built-in set, or synthetic (Magpie-style prompts written by the target)"
    )
    path: str | None = Field(None, description="file for jsonl / sharegpt")
    weight: float = Field(1.0, gt=0, description="share of max_conversations taken from this source")
    synthetic: SyntheticConfig | None = Field(None, description="settings of a synthetic source")
    max_user_turns: int | None = Field(
        None, ge=1, description="keep each conversation's first N user turns (regenerating long ones costs most)"
    )

    @model_validator(mode="after")
    def _path(self) -> SourceConfig:
        if self.kind in ("jsonl", "sharegpt") and not self.path:
            raise ValueError(f"a {self.kind} source needs a path")
        if (self.kind == "synthetic") != (self.synthetic is not None):
            raise ValueError("a synthetic source needs synthetic settings (and only it takes them)")
        if self.kind == "synthetic" and self.max_user_turns is not None:
            raise ValueError("a synthetic source sets its turns with synthetic.user_turns, not max_user_turns")
        return self


class TemplateVariant(StrictModel):
    name: str = Field(description="variant name recorded with each sequence")
    chat_template: str | None = Field(None, description="Jinja chat template; None = the tokenizer's own")
    system_prompts: list[str] = Field(
        default_factory=list, description="system message put first, drawn per conversation; empty = none added"
    )


class CollectConfig(StrictModel):
    """`python -m jobs.collect_hidden_states` settings."""

    model: str = Field(description="target: a Hugging Face directory or a packaged model name")
    models_dir: str = Field("models", description="where packaged models are prepared")
    sources: list[SourceConfig] = Field(min_length=1, description="where the conversations come from, by weight")
    max_conversations: int | None = Field(None, ge=1, description="total over sources, split by weight")
    validation_fraction: float = Field(
        0.05, ge=0, lt=1, description="share of conversations held out as the validation split (by a hash of the id)"
    )
    templates: list[TemplateVariant] = Field(
        default_factory=lambda: [TemplateVariant(name="default")],
        min_length=1,
        description="chat template variants: every conversation is rendered under each",
    )
    max_length_tokens: int = Field(
        2048, ge=2, description="tokens per sequence: longer conversations are truncated, generated ones stop there"
    )
    aux_layer_ids: list[int] | None = Field(None, description="default: vLLM's (2, N//2, N-3)")
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="the shards' precision")
    compute_dtype: DtypeName = Field(
        "auto",
        description="the target forward's precision (auto: bf16 on CUDA, fp32 on the CPU); bfloat16 on a CPU with "
        "AVX512-BF16 or AMX captures ~1.5x faster than fp32 (SmolLM2-135M, 2 cores)",
    )
    backend: Literal["target", "vllm"] = Field(
        "target", description="target: the project's model; vllm: vLLM's extract_hidden_states (production on GPU)"
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="backend vllm: devices per capture worker (worker.num_cpus / num_gpus each)"
    )
    shard_tokens: int = Field(65536, ge=1, description="tokens per shard (whole sequences)")
    batch_tokens: int = Field(4096, ge=1, description="tokens per target forward")
    output: str = Field(description="local directory or s3://bucket/prefix")
    num_workers: int = Field(1, ge=1, description="capture workers (target replicas), at most one per pending shard")
    worker: WorkerResources = Field(
        default_factory=lambda: WorkerResources(torch_threads=2), description="what each capture worker reserves"
    )
    ray_address: str | None = Field(None, description="None: RAY_ADDRESS if set, else a local Ray")
    max_new_shards: int | None = Field(None, ge=0, description="write at most this many shards, then stop")
    capture_sample: int | None = Field(
        None,
        ge=1,
        description="capture only this many of the conversations, a sample fixed by their ids (e.g. a replay "
        "share of a large corpus, for jobs.adapt); the collection is complete over that sample",
    )
    regenerate: RegenerateConfig | None = Field(None, description="replace assistant turns by the target's own")
    measure_baseline: bool = Field(
        True, description="backend target: time a plain forward loop over the first shards (BASELINE_TOKENS)"
    )

    @model_validator(mode="after")
    def _tensor_parallel(self) -> CollectConfig:
        if self.tensor_parallel_size > 1 and self.backend != "vllm":
            raise ValueError("tensor_parallel_size > 1 needs backend: vllm (the project's target runs on one device)")
        return self


def load_conversations(cfg: CollectConfig) -> tuple[list[Conversation], dict]:
    """All sources, each cut to its weighted share of max_conversations; returns conversations + provenance."""
    total_weight = sum(s.weight for s in cfg.sources)
    conversations, provenance = [], []
    for source in cfg.sources:
        report = LoadReport()
        if source.kind == "chitchat":
            convs = load_chitchat(report)
        elif source.kind == "synthetic":
            continue  # written by the target: see add_generated
        elif source.kind == "mtbench":
            convs = load_mtbench_first_turns()
        elif source.kind == "jsonl":
            convs = load_messages_jsonl(source.path, report)
        else:
            convs = load_sharegpt(source.path, report)
        if cfg.max_conversations is not None:
            convs = convs[: round(cfg.max_conversations * source.weight / total_weight)]
        if source.max_user_turns is not None:
            convs = [first_turns(c, source.max_user_turns) for c in convs]
        conversations += convs
        provenance.append(
            {
                **source.model_dump(),
                "used": len(convs),
                "malformed": report.malformed,
                "malformed_lines": report.malformed_lines,
                "skipped_no_assistant": report.no_assistant,
            }
        )
    return conversations, {"sources": provenance}


def add_generated(
    cfg: CollectConfig, model_dir: Path, tokenizer, conversations: list[Conversation], provenance: dict
) -> list[Conversation]:
    """Synthetic sources and regeneration, written `regenerate.chunk_conversations` conversations at a time;
    each chunk is saved under regenerate.cache_dir (corpus.py's format, with its manifest; committed to git with
    regenerate.commit) and reused when the model and settings match, so a stopped run loses at most the chunk it
    was writing. Degenerate answers are cut out of what is returned (corpus.drop_degenerate)."""
    synthetic = [s for s in cfg.sources if s.kind == "synthetic"]
    if not synthetic and cfg.regenerate is None:
        return conversations
    from orchestrator.engine import SpecEngine, load_engine
    from orchestrator.engine.vllm_backend import VllmGenerator

    regen = cfg.regenerate or RegenerateConfig()
    size, cache = regen.chunk_conversations, Path(regen.cache_dir)
    settings = {**regen.cache_settings(), "max_length_tokens": cfg.max_length_tokens}  # it cuts conversations
    model_hash = config_sha256(model_dir)
    made = {"model": model_dir.name, "config_sha256": model_hash, "target_sha256": target_sha256(model_dir)}
    made["regenerate"] = settings
    decoder = None

    def load_or_make(jobs: Iterable[tuple[Path, Callable]], done: list) -> list[tuple[Path, list, dict]]:
        """The one chunk-cache loop: each (path, make) of `jobs` in turn, the chunk at `path` reused, or made by
        `make() -> (conversations, provenance)`, saved (and committed). Appends (path, conversations, provenance)
        to `done` as it goes: `jobs` is read lazily, so a chunk's `make` sees the chunks before it there."""
        for path, make in jobs:
            found = corpus.load_chunk(path)
            if found is not None:
                log.info("corpus chunk %s: reused (%d conversations)", path, len(found[0]))
            else:
                log.info("corpus chunk %s: generating", path)
                began = time.perf_counter()
                convs, prov = make()
                corpus.save_chunk(path, convs, {**made, **prov, "seconds": round(time.perf_counter() - began, 1)})
                manifest = corpus.write_manifest(cache, {k: v for k, v in made.items() if k != "regenerate"})
                if regen.commit:
                    totals = manifest["totals"]
                    corpus.git_commit(
                        [path, corpus.provenance_path(path), cache / corpus.MANIFEST],
                        f"corpus: {path.name} ({len(convs)} conversations; {totals['chunks']} chunks, "
                        f"{totals['unique_assistant_tokens']:.0f} unique assistant tokens in {cache})",
                    )
                found = corpus.load_chunk(path)
            done.append((path, *found))
        return done

    def get_decoder() -> SpecEngine | VllmGenerator:
        nonlocal decoder
        if decoder is None and regen.generator == "vllm":
            decoder = VllmGenerator(
                model_dir,
                max_model_len=cfg.max_length_tokens,
                dtype=regen.vllm_dtype,
                max_num_seqs=128,
                per_request_seeds=False,  # vLLM draws are then not reproducible; the saved dataset is reused
                all_cores=True,
            )
        elif decoder is None:
            decoder = load_engine(model_dir, tokenizer=tokenizer)
        return decoder

    for source in synthetic:
        scfg = source.synthetic
        # A chunk's key leaves the source's total out: a larger corpus reuses the chunks of a smaller one.
        what = source.model_dump(exclude={"synthetic": {"num_conversations"}})
        chunks: list[tuple[Path, list, dict]] = []

        def synthetic_jobs(scfg=scfg, what=what, source=source, chunks=chunks):
            for k in range(-(-scfg.num_conversations // size)):
                wanted = min(size, scfg.num_conversations - k * size)
                path = cache / f"synthetic-{fingerprint(model_hash, what, settings, k, size, wanted)}{corpus.SUFFIX}"

                def make(k=k, wanted=wanted):
                    seen = {normalise(first_user(c)) for _, convs, _ in chunks for c in convs}  # earlier chunks'
                    prompts, stats = synthesise_prompts(get_decoder(), tokenizer, scfg, wanted, k * size, seen)
                    convs = answer_turns(get_decoder(), tokenizer, prompts, regen, scfg, cfg.max_length_tokens)
                    return convs, {"source": source.model_dump(), "chunk": k, "stats": stats}

                yield path, make

        load_or_make(synthetic_jobs(), chunks)
        conversations += [c for _, convs, _ in chunks for c in convs]
        provenance["sources"].append(
            {
                "kind": "synthetic",
                "datasets": [str(p) for p, _, _ in chunks],
                "used": sum(len(convs) for _, convs, _ in chunks),
                **sum_stats([{**prov["stats"], "seconds": prov["seconds"]} for _, _, prov in chunks]),
            }
        )
    if cfg.regenerate is not None:
        real = [c for c in conversations if not c.source.startswith("synthetic")]

        def regenerate_jobs():
            for part in [real[i : i + size] for i in range(0, len(real), size)]:
                asked = [
                    [c.id, [(m["role"], m["content"]) for m in c.messages if m["role"] != "assistant"]] for c in part
                ]
                path = cache / f"regenerated-{fingerprint(model_hash, asked, settings)}{corpus.SUFFIX}"
                yield (
                    path,
                    lambda part=part: (
                        answer_turns(get_decoder(), tokenizer, part, regen, None, cfg.max_length_tokens),
                        {},
                    ),
                )

        chunks = load_or_make(regenerate_jobs(), [])
        totals = sum_stats(
            [
                {
                    "conversations": len(convs),
                    "generated_tokens": prov["counts"]["assistant_tokens"],
                    "seconds": prov["seconds"],
                }
                for _, convs, prov in chunks
            ]
        )
        answered = [c for _, convs, _ in chunks for c in convs]
        conversations = answered + [c for c in conversations if c.source.startswith("synthetic")]
        provenance["regenerated"] = {
            "datasets": [str(p) for p, _, _ in chunks],
            "model": model_dir.name,
            "config_sha256": model_hash,
            **totals,
            "tokens_per_s": round(totals.get("generated_tokens", 0) / max(totals.get("seconds", 0), 1e-9), 1),
        }
    if isinstance(decoder, VllmGenerator):
        decoder.close()  # its engine process would compete with the capture workers
    conversations, provenance["degenerate"] = corpus.drop_degenerate(conversations, tokenizer)
    provenance["corpus"] = {"folder": str(cache), **corpus_totals(cache)}
    return conversations


def corpus_totals(folder: Path) -> dict:
    """The corpus manifest's sha256 and totals (empty when there is none)."""
    path = folder / corpus.MANIFEST
    if not path.is_file():
        return {}
    data = path.read_bytes()
    return {"manifest_sha256": corpus.sha256_bytes(data), **json.loads(data)["totals"]}


def target_sha256(model_dir: Path) -> str:
    """The target's checksum: the packaged source file's sha256 recorded by `aerie prepare-model`, else the
    sha256 of its config and weight files."""
    from orchestrator.models.prepare import MARKER

    marker = model_dir / MARKER
    if marker.is_file():
        record = json.loads(marker.read_text())
        if record.get("source_sha256"):
            return record["source_sha256"]
    digest = hashlib.sha256()
    for f in sorted([model_dir / "config.json", *model_dir.glob("*.safetensors")]):
        with f.open("rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def first_user(conv: Conversation) -> str:
    return next(m["content"] for m in conv.messages if m["role"] == "user")


def sum_stats(parts: list[dict]) -> dict:
    """Chunk statistics added up: numbers summed, dictionaries of numbers summed key by key."""
    total: dict = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict):
                inner = total.setdefault(key, {})
                for k, v in value.items():
                    inner[k] = inner.get(k, 0) + v
            elif isinstance(value, int | float) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in total.items()}


def sample_conversations(conversations: list[Conversation], n: int) -> list[Conversation]:
    """`n` of `conversations`, the same ones on every run and in any order: those first by a hash of the id. The
    hash differs from the split's (`split_of`), so the sample holds each split in its share."""
    ranked = sorted(conversations, key=lambda c: hashlib.sha256(f"sample/{c.id}".encode()).hexdigest())
    return ranked[:n]


def render_all(cfg: CollectConfig, conversations: list[Conversation], tokenizer) -> dict[str, list[Sequence]]:
    """Every conversation under every template variant, by split."""
    out: dict[str, list[Sequence]] = {"train": [], "validation": []}
    for conv in bar(iterable=conversations, desc="render", unit="conv", leave=False):
        split = split_of(conv.id, cfg.validation_fraction)
        for variant in cfg.templates:
            messages = conv.messages
            if variant.system_prompts:
                pick = int(hashlib.sha256(f"{variant.name}/{conv.id}".encode()).hexdigest(), 16)
                system = variant.system_prompts[pick % len(variant.system_prompts)]
                messages = [{"role": "system", "content": system}] + [m for m in messages if m["role"] != "system"]
            r = render_conversation(tokenizer, messages, variant.chat_template, variant.name, cfg.max_length_tokens)
            if r.loss_mask.any():  # truncation can cut every assistant token away
                out[split].append(Sequence(conv.id, variant.name, r.input_ids, r.loss_mask))
    return out


def _capture_worker_class():
    import ray

    @ray.remote
    class CaptureWorker:
        """One target replica: captures whole shards and writes them to the destination itself."""

        def __init__(self, cfg: CollectConfig, model_dir: str, aux_layer_ids: tuple[int, ...], write: bool) -> None:
            """A replica of the target in `model_dir` as `cfg` places and runs it; write=False: it only returns
            shard bytes (`shard`), for a reader that takes them from the object store."""
            device = cfg.worker.torch_device()
            if cfg.worker.torch_threads:
                torch.set_num_threads(cfg.worker.torch_threads)
            if cfg.backend == "vllm":
                from orchestrator.data.vllm_capture import VllmCapture

                compute = dtype_name(cfg.compute_dtype, device)  # auto: the serving precision, not the shards'
                self.states = VllmCapture(
                    model_dir, aux_layer_ids, cfg.max_length_tokens + 1, compute, cfg.tensor_parallel_size
                ).capture
            else:
                from orchestrator.models.target import TargetModel

                target = TargetModel.from_pretrained(model_dir, aux_layer_ids, dtype=cfg.compute_dtype, device=device)
                self.states = lambda plan: target_states(target, plan, cfg.batch_tokens)
            self.storage = open_storage(cfg.output) if write else None
            self.dtype = DTYPES[cfg.dtype]

        def shard(self, plan: ShardPlan) -> bytes:
            """The shard's bytes (what `capture` writes), for a reader that takes them from the object store."""
            aux, final = self.states(plan)
            return shard_bytes(plan, aux, final, self.dtype)

        def peak_rss_mib(self) -> float:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

        def capture(self, plan: ShardPlan) -> tuple[dict, dict]:
            began = time.perf_counter()
            record = write_shard(self.storage, plan, self.shard(plan))
            peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            return record, {"seconds": time.perf_counter() - began, "peak_rss_mib": peak_mib}

    return CaptureWorker


@dataclass
class CollectionPlan:
    """Everything a collection decides before it captures: the target's config, the aux layers, the datasets'
    provenance and the shards, each a list of rendered sequences."""

    hf: dict
    aux: tuple[int, ...]
    provenance: dict
    plans: list[ShardPlan]


def plan_collection(cfg: CollectConfig, model_dir: Path) -> CollectionPlan:
    """Check the inputs, load and (re)generate the conversations, render them and cut them into shards."""
    from orchestrator.models.tokenizer import load_tokenizer

    hf = read_hf_config(model_dir)
    if cfg.backend == "target":
        check_target_supported(hf)  # before Ray starts: the error names the vLLM backend
    num_layers = hf["num_hidden_layers"]
    aux = tuple(cfg.aux_layer_ids or default_aux_layer_ids(num_layers))
    bad = [i for i in aux if not 0 <= i < num_layers]
    if bad:
        raise AerieError(f"aux layer ids {bad} are outside the {num_layers}-layer target (valid: 0..{num_layers - 1})")
    if cfg.backend == "vllm":
        from orchestrator.engine.vllm_backend import check_tensor_parallel

        check_tensor_parallel(hf, cfg.tensor_parallel_size, model_dir.name)
    conversations, provenance = load_conversations(cfg)
    tokenizer = load_tokenizer(model_dir)
    conversations = add_generated(cfg, model_dir, tokenizer, conversations, provenance)
    if not conversations:
        raise AerieError("the configured sources hold no usable conversation (each needs an assistant turn)")
    if cfg.capture_sample is not None:
        conversations = sample_conversations(conversations, cfg.capture_sample)
    by_split = render_all(cfg, conversations, tokenizer)
    plans = [p for split, seqs in by_split.items() for p in plan_shards(seqs, split, cfg.shard_tokens)]
    return CollectionPlan(hf, aux, provenance, plans)


def start_capture_workers(cfg: CollectConfig, model_dir: Path, aux: tuple[int, ...], n: int, write: bool = True):
    """`n` capture actors as the config places them (write=False: they only return shard bytes)."""
    init_ray(cfg.ray_address)
    ranks = cfg.tensor_parallel_size  # the worker's resources are per device
    worker_cls = _capture_worker_class().options(**cfg.worker.actor_options(ranks))
    return [worker_cls.remote(cfg, str(model_dir), aux, write) for _ in range(n)]


def run_collection(cfg: CollectConfig, model_dir: Path) -> dict:
    """The whole job; returns result.json's content. Every input is checked before any capture starts."""
    import ray
    from ray.util import ActorPool

    storage = open_storage(cfg.output)
    planned = plan_collection(cfg, model_dir)
    hf, aux, provenance, plans = planned.hf, planned.aux, planned.provenance, planned.plans
    records = {p.name: r for p in plans if (r := finished_record(storage, p)) is not None}
    pending = [p for p in plans if p.name not in records]
    reused = len(records)
    if cfg.max_new_shards is not None:
        pending = pending[: cfg.max_new_shards]
    log.info("%d shards planned, %d verified and reused, %d to capture", len(plans), reused, len(pending))
    began, tokens, peaks = time.perf_counter(), 0, []
    if pending:  # nothing to capture (every shard reused, or max_new_shards=0): no Ray, no workers
        workers = start_capture_workers(cfg, model_dir, aux, min(cfg.num_workers, len(pending)))
        with bar(total=sum(p.num_tokens for p in pending), desc="capture", unit="tok", unit_scale=True) as captured:
            for record, stats in ActorPool(workers).map_unordered(lambda w, p: w.capture.remote(p), pending):
                records[record["name"]] = record
                tokens += record["num_tokens"]
                peaks.append(stats["peak_rss_mib"])
                captured.update(record["num_tokens"])
        for w in workers:
            ray.kill(w)
    elapsed = time.perf_counter() - began

    complete = len(records) == len(plans)
    manifest = None
    if complete:
        manifest = build_manifest(cfg, model_dir, hf, aux, provenance, [records[p.name] for p in plans])
        storage.write_bytes(MANIFEST, json.dumps(manifest, indent=2).encode())
    total_tokens = sum(r["num_tokens"] for r in records.values())
    result = {
        "output": storage.uri(),
        "complete": complete,
        "shards_planned": len(plans),
        "shards_reused": reused,
        "shards_written": len(pending),
        "tokens_captured_this_run": tokens,
        "total_tokens": total_tokens,
        "capture_seconds": round(elapsed, 2),
        "capture_tokens_per_s": round(tokens / elapsed, 1) if tokens else None,
        "bytes_per_token": round(sum(r["bytes"] for r in records.values()) / max(total_tokens, 1), 1),
        "worker_peak_rss_mib": round(max(peaks), 1) if peaks else None,
        "datasets": provenance,
    }
    if cfg.measure_baseline and pending and cfg.backend == "target":
        result["baseline_forward_tokens_per_s"] = baseline_tokens_per_s(cfg, model_dir, aux, pending)
        result["capture_vs_baseline"] = round(
            result["capture_tokens_per_s"] / result["baseline_forward_tokens_per_s"], 3
        )
    return result


def baseline_tokens_per_s(cfg: CollectConfig, model_dir: Path, aux: tuple[int, ...], plans: list[ShardPlan]) -> float:
    """The same forwards in the driver, in the same batches: no Ray, no casting, serialising or storage; over the
    first shards holding BASELINE_TOKENS tokens (at least one shard)."""
    from orchestrator.models.target import TargetModel

    sample = []
    for plan in plans:
        sample.append(plan)
        if sum(p.num_tokens for p in sample) >= BASELINE_TOKENS:
            break
    if cfg.worker.torch_threads:
        torch.set_num_threads(cfg.worker.torch_threads)
    target = TargetModel.from_pretrained(model_dir, aux, dtype=cfg.compute_dtype)
    began = time.perf_counter()
    for plan in sample:
        target_states(target, plan, cfg.batch_tokens)
    return round(sum(p.num_tokens for p in sample) / (time.perf_counter() - began), 1)


def online_manifest(cfg: CollectConfig, model_dir: Path, planned: CollectionPlan) -> dict:
    """The manifest of a collection streamed to training (`train.data: online`): the shards' records without
    sizes or checksums (their bytes exist only in Ray's object store, for as long as a trainer reads them)."""
    manifest = build_manifest(
        cfg, model_dir, planned.hf, planned.aux, planned.provenance, [plan_record(p) for p in planned.plans]
    )
    return {**manifest, "online": True}


def is_collect_config(location: str) -> bool:
    """Whether `location` names a collect config (*.yaml) rather than a finished collection (a directory or s3://)."""
    return location.endswith((".yaml", ".yml"))


def planned_collection(collect_config: str, overrides: list[str] = (), model_dir: Path | None = None) -> dict:
    """A collect config's plan and the manifest its capture would have, with that manifest's sha256, nothing
    captured (what online training reads). Without `model_dir`, the config's own target, resolved as training
    resolves it, so the sha256 is the one training logged."""
    from orchestrator.config import load_config
    from orchestrator.models.prepare import resolve_model

    collect = load_config(CollectConfig, collect_config, list(overrides))
    model_dir = model_dir or resolve_model(collect.model, collect.models_dir).resolve()
    collect = collect.model_copy(update={"model": str(model_dir)})
    planned = plan_collection(collect, model_dir)
    manifest = online_manifest(collect, model_dir, planned)
    return {
        "manifest": manifest,
        "manifest_sha256": hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest(),
        "plans": planned.plans,
        "collect": collect,
        "num_capture_workers": collect.num_workers,
    }


def build_manifest(cfg: CollectConfig, model_dir: Path, hf: dict, aux, provenance: dict, records: list[dict]) -> dict:
    splits = split_totals(records)
    return {
        "format": "aerie-hidden-states/1",
        "target": {
            "name": model_dir.name,
            "config_sha256": config_sha256(model_dir),
            "hidden_size": hf["hidden_size"],
            "num_hidden_layers": hf["num_hidden_layers"],
            "vocab_size": hf["vocab_size"],
        },
        "aux_layer_ids": list(aux),
        "dtype": cfg.dtype,
        "compute_dtype": cfg.compute_dtype,
        "backend": cfg.backend,
        "max_length_tokens": cfg.max_length_tokens,
        "templates": [t.model_dump() for t in cfg.templates],
        "validation_fraction": cfg.validation_fraction,
        "datasets": provenance,
        "splits": splits,
        "shards": records,
    }
