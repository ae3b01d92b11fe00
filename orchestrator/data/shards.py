"""Hidden-state shards: whole sequences packed back to back in one safetensors file each.

    input_ids    [T] int32        loss_mask  [T] bool (assistant tokens)
    aux_hidden   [T, k*H] dtype   final_hidden [T, H] dtype (after the target's final norm)
    seq_lens     [S] int32        metadata: conversation ids and template variant of each sequence

A shard's content is fixed before capture (`plan_shards`), and each is captured in the same batches on
every run, so a rerun, a resume or another destination produces the same bytes. Beside each shard a small
`NAME.json` records its sha256; a resume skips a shard only when the bytes still match it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import load as load_safetensors

from orchestrator.data.storage import Storage
from orchestrator.models.target import TargetModel


@dataclass
class Sequence:
    conversation_id: str
    template: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool


@dataclass
class ShardPlan:
    name: str
    split: str
    sequences: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.input_ids.numel() for s in self.sequences)


def plan_shards(sequences: list[Sequence], split: str, shard_tokens: int) -> list[ShardPlan]:
    """Cut sequences, in order, into shards of about `shard_tokens` tokens (a sequence is never split)."""
    shards: list[ShardPlan] = []
    current: list[Sequence] = []
    count = 0
    for seq in sequences:
        current.append(seq)
        count += seq.input_ids.numel()
        if count >= shard_tokens:
            shards.append(ShardPlan(f"{split}-{len(shards):05d}.safetensors", split, current))
            current, count = [], 0
    if current:
        shards.append(ShardPlan(f"{split}-{len(shards):05d}.safetensors", split, current))
    return shards


def _batches(sequences: list[Sequence], batch_tokens: int) -> list[list[Sequence]]:
    out, current, count = [], [], 0
    for seq in sequences:
        if current and count + seq.input_ids.numel() > batch_tokens:
            out.append(current)
            current, count = [], 0
        current.append(seq)
        count += seq.input_ids.numel()
    return out + ([current] if current else [])


def target_states(target: TargetModel, plan: ShardPlan, batch_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """aux [T, k*H] and final-norm [T, H] states of a shard's sequences from the project's target model."""
    aux, final = [], []
    for batch in _batches(plan.sequences, batch_tokens):
        lengths = torch.tensor([s.input_ids.numel() for s in batch])
        cache = target.new_cache(len(batch), int(lengths.max()))
        out = target(torch.cat([s.input_ids for s in batch]), cache, torch.arange(len(batch)), lengths, logits="none")
        aux.append(out.aux_hidden.cpu())  # a shard is written from host memory
        final.append(out.final_hidden.cpu())
    return torch.cat(aux), torch.cat(final)


def shard_bytes(plan: ShardPlan, aux: torch.Tensor, final: torch.Tensor, dtype: torch.dtype) -> bytes:
    """Serialise a captured shard (canonical safetensors bytes)."""
    tensors = {  # ids and mask joined by numpy: the traffic tap's writer thread must not enter ATen's OpenMP team
        "input_ids": torch.from_numpy(np.concatenate([s.input_ids.numpy() for s in plan.sequences]).astype(np.int32)),
        "loss_mask": torch.from_numpy(np.concatenate([s.loss_mask.numpy() for s in plan.sequences])),
        "aux_hidden": aux.to(dtype).contiguous(),
        "final_hidden": final.to(dtype).contiguous(),
        "seq_lens": torch.tensor([s.input_ids.numel() for s in plan.sequences], dtype=torch.int32),
    }
    metadata = {
        "conversation_ids": json.dumps([s.conversation_id for s in plan.sequences]),
        "templates": json.dumps([s.template for s in plan.sequences]),
        "split": plan.split,
    }
    return save_safetensors(tensors, metadata)


_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
    torch.uint8: "U8",
}


def save_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """safetensors bytes with a canonical header (sorted keys; tensors by element size, then name).

    `safetensors.torch.save` orders its JSON header differently from call to call, so equal tensors gave
    different bytes (and checksums); this writer makes equal content byte-identical."""
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    blobs, offset = [], 0
    for name in sorted(tensors, key=lambda n: (-tensors[n].element_size(), n)):  # wider dtypes first: aligned
        t = tensors[name].contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    encoded = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return len(encoded).to_bytes(8, "little") + encoded + b"".join(blobs)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def plan_record(plan: ShardPlan) -> dict:
    """What a shard's record says before it is captured: name, split and counts."""
    return {
        "name": plan.name,
        "split": plan.split,
        "num_tokens": plan.num_tokens,
        "num_sequences": len(plan.sequences),
        "num_loss_tokens": sum(int(np.count_nonzero(s.loss_mask.numpy())) for s in plan.sequences),
    }


def split_totals(records: list[dict]) -> dict[str, dict]:
    """A manifest's `splits`: per split, shards and the sequences, tokens and loss tokens of their records."""
    splits: dict[str, dict] = {}
    for r in records:
        s = splits.setdefault(r["split"], {"num_shards": 0, "num_sequences": 0, "num_tokens": 0, "num_loss_tokens": 0})
        s["num_shards"] += 1
        for key in ("num_sequences", "num_tokens", "num_loss_tokens"):
            s[key] += r[key]
    return splits


def write_shard(storage: Storage, plan: ShardPlan, data: bytes) -> dict:
    """Write a shard, then its checksum record; returns the record."""
    record = {**plan_record(plan), "bytes": len(data), "sha256": sha256(data)}
    storage.write_bytes(plan.name, data)
    storage.write_bytes(plan.name + ".json", json.dumps(record, indent=2).encode())
    return record


def finished_record(storage: Storage, plan: ShardPlan) -> dict | None:
    """The shard's record if it exists complete and its bytes match the checksum, else None (rewrite it)."""
    if not (storage.exists(plan.name) and storage.exists(plan.name + ".json")):
        return None
    record = json.loads(storage.read_bytes(plan.name + ".json"))
    if sha256(storage.read_bytes(plan.name)) != record.get("sha256"):
        return None
    return record


def read_shard(data: bytes) -> dict[str, torch.Tensor]:
    return load_safetensors(data)
