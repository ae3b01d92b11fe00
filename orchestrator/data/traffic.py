"""Served traffic as training data: the tap that writes what the target worker already computed for a finished
request (token ids, the loss mask on the answer, aux and final hidden states) as shards in the collection's
format, and the retention that bounds them.

    target worker ──offer(Captured)──> bounded queue ──writer thread──> shards + records + manifest.json
                     (never blocks:                  (never raises: a     under OUTPUT/WRITER/
                      full = dropped, counted)         failed write is
                                                       counted, dropped)

What is captured is user content: token ids of prompts and answers. It goes only to the configured storage,
only for requests of operators who opted in (`TapConfig.enabled`), never to logs or MLflow (the stats here are
counts). Each shard's conversation ids are random, not request ids. Retention runs after every shard: the
oldest shards go first until the writer's shards fit `max_bytes`, and every shard older than `max_age_hours`
goes; `delete_traffic` deletes by age or entirely (`aerie traffic delete`).

A writer (one per serving replica: its target worker's actor name, kept when the actor restarts) keeps its own
folder and manifest; `traffic_shards` lists every writer's. The folder of a writer that is gone (a replaced
replica) is deleted by a live writer's retention once all its shards are past `max_age_hours`.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from orchestrator.config import StrictModel
from orchestrator.data.shards import Sequence, ShardPlan, shard_bytes, split_totals, write_shard
from orchestrator.data.storage import LocalStorage, Storage, open_storage, safe_path
from orchestrator.errors import AerieError
from orchestrator.models.device import DTYPES
from orchestrator.redaction import redact_text

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
FORMAT = "aerie-traffic/1"


class TapConfig(StrictModel):
    """The serve config's `tap:` section. Off by default: captured traffic is user content."""

    enabled: bool = Field(False, description="capture finished requests (an operator's opt-in)")
    output: str = Field("runs/traffic", description="local directory or s3://bucket/prefix")
    sample: float = Field(1.0, ge=0, le=1, description="share of finished requests captured")
    max_bytes: int = Field(2**30, ge=1, description="each writer's shards at most this many bytes (oldest go first)")
    max_age_hours: float = Field(24 * 7, gt=0, description="shards older than this are deleted")
    shard_tokens: int = Field(16384, ge=1, description="tokens per shard (whole requests)")
    flush_s: float = Field(
        60.0, gt=0, description="a partial shard is written once its first request has waited this long"
    )
    retain_every_s: float = Field(
        600.0, gt=0, description="how often a writer with no traffic applies retention, so max_age_hours holds idle"
    )
    queue_requests: int = Field(256, ge=1, description="finished requests waiting to be written; beyond, dropped")
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="the shards' precision")
    no_capture_key_ids: list[str] = Field(
        [], description="API keys never captured, by id (`aerie key-id`: sha256 prefix, never the key itself)"
    )


@dataclass
class Captured:
    """One finished request as the target worker saw it: positions 0..T-1 of prompt + answer (the answer's last
    token, never forwarded, has no states and is not here). The states come in the shards' dtype, converted by the
    serving thread: the writer thread does no tensor arithmetic (see `_rows`)."""

    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool: answer tokens
    aux_hidden: torch.Tensor  # [T, k * hidden]
    final_hidden: torch.Tensor  # [T, hidden]


@dataclass
class TapStats:
    offered: int = 0
    dropped: int = 0  # the queue was full (storage slower than traffic) or the tap closed
    written_requests: int = 0
    written_tokens: int = 0
    shards: int = 0
    bytes: int = 0
    write_errors: int = 0
    deleted_shards: int = 0
    lost_requests: int = 0  # in shards whose write failed


@dataclass
class _Pending:
    sequences: list[Sequence] = field(default_factory=list)
    aux: list[torch.Tensor] = field(default_factory=list)
    final: list[torch.Tensor] = field(default_factory=list)
    tokens: int = 0


class TrafficTap:
    """One writer's tap (see the module docstring). `meta`: the target's identity for the manifest (name,
    config_sha256, hidden_size, num_hidden_layers, vocab_size, aux_layer_ids)."""

    def __init__(
        self,
        cfg: TapConfig,
        meta: dict,
        writer: str,
        storage: Storage | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg, self.meta, self.writer, self.clock = cfg, meta, writer, clock
        self.storage = storage  # opened by the writer thread: a store that is down does not stop the server
        self.stats = TapStats()
        self._queue: queue.Queue[Captured | None] = queue.Queue(maxsize=cfg.queue_requests)
        self._lock = threading.Lock()
        self._closed = False
        self.records: list[dict] = []
        self._thread = threading.Thread(target=self._run, name=f"traffic-tap-{writer}", daemon=True)
        self._thread.start()

    # -- the serving side: never blocks, never raises -------------------------------------------------------------

    def offer(self, captured: Captured) -> bool:
        """Queue a finished request for writing; False when it was dropped (queue full, tap closed)."""
        self.stats.offered += 1
        if self._closed:
            self.stats.dropped += 1
            return False
        try:
            self._queue.put_nowait(captured)
            return True
        except queue.Full:
            self.stats.dropped += 1
            return False

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued and pending, then stop (what does not fit in `timeout_s` is lost)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)

    # -- the writer thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        pending, since = _Pending(), None  # `since`: when the pending shard's first request arrived
        while True:
            idle = since is None
            wait = self.cfg.retain_every_s if idle else max(0.0, since + self.cfg.flush_s - time.monotonic())
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                if idle:  # no traffic: shards still age out
                    self._retain_idle()
                else:  # quiet for flush_s: what is pending is written (a crash loses at most that)
                    self._write(pending)
                    pending, since = _Pending(), None
                continue
            if item is None:
                break
            pending.sequences.append(Sequence(uuid.uuid4().hex[:12], "served", item.input_ids, item.loss_mask))
            pending.aux.append(item.aux_hidden)
            pending.final.append(item.final_hidden)
            pending.tokens += item.input_ids.numel()
            since = time.monotonic() if since is None else since
            if pending.tokens >= self.cfg.shard_tokens or time.monotonic() - since >= self.cfg.flush_s:
                self._write(pending)
                pending, since = _Pending(), None
        if pending.sequences:
            self._write(pending)

    def _write(self, pending: _Pending) -> None:
        """Write one shard and the manifest, then apply retention. Failures are logged and counted, never raised."""
        now = self.clock()
        if self.storage is None:  # opened at the first write, and again after one that could not open it
            try:
                self.storage = open_storage(self.cfg.output)
            except Exception as err:  # noqa: BLE001 (a tap failure never reaches a request)
                self.stats.write_errors += 1
                self.stats.lost_requests += len(pending.sequences)
                log.warning("traffic tap %s: cannot open %s: %s", self.writer, self.cfg.output, redact_text(repr(err)))
                return
        name = f"{self.writer}/traffic-{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}-{uuid.uuid4().hex[:6]}"
        plan = ShardPlan(f"{name}.safetensors", "train", pending.sequences)
        try:
            data = shard_bytes(plan, _rows(pending.aux), _rows(pending.final), DTYPES[self.cfg.dtype])
            record = write_shard(self.storage, plan, data) | {"written_at": now, "writer": self.writer}
            with self._lock:  # the manifest on storage is the truth: `aerie traffic delete` may have run
                self.records = [*self._read_manifest(), record]
            self.stats.shards += 1
            self.stats.bytes += record["bytes"]
            self.stats.written_requests += len(pending.sequences)
            self.stats.written_tokens += pending.tokens
            self.retain(now)
        except Exception as err:  # noqa: BLE001 (a tap failure never reaches a request)
            self.stats.write_errors += 1
            self.stats.lost_requests += len(pending.sequences)
            lost = len(pending.sequences)
            why = redact_text(repr(err))
            log.warning("traffic tap %s: a shard of %d requests was not written: %s", self.writer, lost, why)

    def _retain_idle(self) -> None:
        """Retention without a new shard: on the manifest as storage has it (a restarted replica with no traffic
        still deletes what aged out). Failures are logged, never raised."""
        try:
            if self.storage is None:
                self.storage = open_storage(self.cfg.output)
            with self._lock:
                self.records = self._read_manifest()
            self.retain(self.clock(), rewrite=False)
        except Exception as err:  # noqa: BLE001 (a tap failure never reaches a request)
            log.warning("traffic tap %s: retention failed: %s", self.writer, redact_text(repr(err)))

    def retain(self, now: float | None = None, rewrite: bool = True) -> None:
        """Delete this writer's oldest shards beyond max_bytes and every one older than max_age_hours; rewrite
        its manifest (only when something went, unless `rewrite`)."""
        now = self.clock() if now is None else now
        with self._lock:
            records = sorted(self.records, key=lambda r: r["written_at"])
            keep, total = [], 0
            for r in reversed(records):  # newest first
                fresh = now - r["written_at"] <= self.cfg.max_age_hours * 3600
                if fresh and total + r["bytes"] <= self.cfg.max_bytes:
                    keep.append(r)
                    total += r["bytes"]
            gone = [r for r in records if r not in keep]
            self.records = [r for r in records if r in keep]
        for r in gone:
            self.storage.delete(r["name"])
            self.storage.delete(r["name"] + ".json")
            self.stats.deleted_shards += 1
        if rewrite or gone:
            self._write_manifest()
        self.stats.deleted_shards += _delete_expired_writers(self.storage, self.cfg.max_age_hours, now, self.writer)

    def _manifest_name(self) -> str:
        return f"{self.writer}/{MANIFEST}"

    def _read_manifest(self) -> list[dict]:
        """The shards this writer wrote before (a restarted replica keeps its budget)."""
        try:
            if self.storage.exists(self._manifest_name()):
                return list(json.loads(self.storage.read_bytes(self._manifest_name()))["shards"])
        except Exception as err:  # noqa: BLE001 (an unreadable manifest: start a new one; retention catches up)
            why = redact_text(repr(err))
            log.warning("traffic tap %s: manifest unreadable (%s); starting a new one", self.writer, why)
        return []

    def _write_manifest(self) -> None:
        with self._lock:
            shards = list(self.records)
        manifest = {
            "format": FORMAT,
            "writer": self.writer,
            "target": self.meta,
            "dtype": self.cfg.dtype,
            "shards": shards,
        }
        self.storage.write_bytes(self._manifest_name(), json.dumps(manifest, indent=2).encode())


def _rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) of [n_i, width] tensors, by joining their bytes. The writer thread must not enter ATen's
    parallel kernels (a large cat or dtype conversion does): OpenMP would give it a thread team of its own, which
    competes for the cores with the serving thread's team."""
    width, dtype = parts[0].shape[1], parts[0].dtype
    raw = b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)
    return torch.frombuffer(bytearray(raw), dtype=dtype).view(-1, width)


def traffic_shards(storage: Storage) -> list[dict]:
    """Every writer's shard records, oldest first."""
    records = []
    for name in storage.names():
        if name.endswith(f"/{MANIFEST}"):
            records += json.loads(storage.read_bytes(name))["shards"]
    return sorted(records, key=lambda r: r["written_at"])


def _delete_expired_writers(storage: Storage, max_age_hours: float, now: float, live: str) -> int:
    """Delete the folders of writers other than `live` whose every shard is older than `max_age_hours` (a replaced
    replica's: nobody else would age them out). Returns the shards deleted."""
    deleted = 0
    for name in storage.names():
        if not name.endswith(f"/{MANIFEST}") or name == f"{live}/{MANIFEST}":
            continue
        try:
            shards = json.loads(storage.read_bytes(name))["shards"]
        except Exception:  # noqa: BLE001 (being rewritten, or unreadable: left to `aerie traffic delete`)
            continue
        if all(now - r["written_at"] > max_age_hours * 3600 for r in shards):
            for r in shards:
                storage.delete(r["name"])
                storage.delete(r["name"] + ".json")
            storage.delete(name)
            deleted += len(shards)
    return deleted


def delete_traffic(storage: Storage, older_than_hours: float | None = None, now: float | None = None) -> int:
    """Delete captured traffic: every shard written more than `older_than_hours` ago, or (None) all of it,
    manifests included. Returns the shards deleted."""
    now = time.time() if now is None else now
    deleted = 0
    for name in storage.names():
        if not name.endswith(f"/{MANIFEST}"):
            continue
        manifest = json.loads(storage.read_bytes(name))
        keep = []
        for r in manifest["shards"]:
            if older_than_hours is None or now - r["written_at"] > older_than_hours * 3600:
                storage.delete(r["name"])
                storage.delete(r["name"] + ".json")
                deleted += 1
            else:
                keep.append(r)
        if older_than_hours is None:
            storage.delete(name)
        else:
            storage.write_bytes(name, json.dumps({**manifest, "shards": keep}, indent=2).encode())
    return deleted


def adaptation_data(
    traffic: Storage,
    dest: str | Path,
    since: float | None = None,
    holdout_fraction: float = 0.2,
    replay: str | None = None,
    replay_share: float = 0.0,
) -> dict:
    """A collection at `dest` (a local directory) to fine-tune a drafter on served traffic: every traffic shard
    written after `since`, the newest `holdout_fraction` of them (at least one) as the validation split, never
    trained on; plus, against forgetting, shards of `replay` (a collection: the drafter's own corpus) holding
    about `replay_share` x the traffic's training tokens. Shards are linked where the source is local, else
    copied; manifest.json is the collection's format, with the traffic's cutoff and shards in `datasets`.
    Returns the manifest."""
    dest = Path(dest)
    records = [r for r in traffic_shards(traffic) if since is None or r["written_at"] > since]
    if len(records) < 2:
        raise AerieError(
            f"{traffic.uri()} holds {len(records)} traffic shard(s) written after the last adaptation: at least 2 "
            "are needed (one to train on, one held out); let the tap capture more"
        )
    targets = {json.dumps(m["target"], sort_keys=True) for m in _manifests(traffic)}
    if len(targets) != 1:
        raise AerieError(f"{traffic.uri()} holds traffic of {len(targets)} different targets: adapt one at a time")
    meta = json.loads(targets.pop())
    held = max(1, round(holdout_fraction * len(records)))
    shards = [_link(traffic, r, dest, "traffic", "train") for r in records[:-held]]
    shards += [_link(traffic, r, dest, "traffic", "validation") for r in records[-held:]]
    replayed: list[str] = []
    if replay is not None and replay_share > 0:
        source = open_storage(replay)
        corpus = json.loads(source.read_bytes(MANIFEST))
        if corpus.get("aux_layer_ids") != meta["aux_layer_ids"]:
            raise AerieError(
                f"replay collection {replay} has aux layers {corpus.get('aux_layer_ids')}, the traffic "
                f"{meta['aux_layer_ids']}: replay a collection of the same target and drafter"
            )
        budget = replay_share * sum(r["num_tokens"] for r in records[:-held])
        for r in (r for r in corpus["shards"] if r["split"] == "train"):
            if sum(s["num_tokens"] for s in shards if s["name"].startswith("replay/")) >= budget:
                break
            shards.append(_link(source, r, dest, "replay", "train"))
            replayed.append(r["name"])
    splits = split_totals(shards)
    manifest = {
        "format": "aerie-hidden-states/1",
        "target": {k: v for k, v in meta.items() if k != "aux_layer_ids"},
        "aux_layer_ids": meta["aux_layer_ids"],
        "datasets": {
            "traffic": {
                "source": traffic.uri(),
                "since": since,
                "until": records[-1]["written_at"],
                "held_out": [r["name"] for r in records[-held:]],
                "shards_sha256": {r["name"]: r["sha256"] for r in records},
            },
            "replay": {"source": replay, "share": replay_share, "shards": replayed},
        },
        "splits": splits,
        "shards": shards,
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _manifests(storage: Storage) -> list[dict]:
    return [json.loads(storage.read_bytes(n)) for n in storage.names() if n.endswith(f"/{MANIFEST}")]


def _link(source: Storage, record: dict, dest: Path, folder: str, split: str) -> dict:
    """The shard of `record` at dest/folder/name (a hard link to a local source on the same file system, else a
    copy: storage refuses symlinks that lead out of a collection); its record there."""
    target = dest / folder / record["name"]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    try:
        if not isinstance(source, LocalStorage):
            raise OSError("not local")
        os.link(safe_path(source.root, record["name"]), target)
    except OSError:
        target.write_bytes(source.read_bytes(record["name"]))
    keys = ("num_tokens", "num_sequences", "num_loss_tokens", "bytes", "sha256")
    return {"name": f"{folder}/{record['name']}", "split": split, **{k: record[k] for k in keys}}
