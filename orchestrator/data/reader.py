"""Streaming reader of hidden-state shards (local or S3) for training.

Worker `rank` of `world_size` reads shards rank, rank + world_size, ... of a split (whole shards, so no two
workers read the same sequence); sequences pass through a shuffle buffer of `buffer_sequences`, so memory
stays bounded by about one shard plus the buffer, whatever the dataset size.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from orchestrator.data.shards import read_shard, sha256
from orchestrator.data.storage import open_storage
from orchestrator.errors import AerieError


@dataclass
class HiddenStateSequence:
    conversation_id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    aux_hidden: torch.Tensor  # [T, k * H]
    final_hidden: torch.Tensor  # [T, H]


def shard_order(shards: list, seed: int) -> tuple[list, random.Random]:
    """The order a reader seeded `seed` reads a split's `shards` in (any list of that length: manifest records or
    shard plans), and the generator it then shuffles sequences with."""
    rng = random.Random(seed)
    order = list(shards)
    rng.shuffle(order)
    return order, rng


class ShardReader:
    def __init__(
        self,
        location,
        split: str = "train",
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        buffer_sequences: int = 256,
        verify: bool = True,
        start_shard: int = 0,
    ) -> None:
        """location: a collection's directory or s3:// prefix, or a Storage (data/online.py's OnlineShards).
        start_shard: skip the first shards of the shuffled order (never read, so never captured online);
        `shards_read` counts, from the start of that order, the shards read whole so far."""
        assert 0 <= rank < world_size
        self.storage = open_storage(location) if isinstance(location, str) else location
        if not self.storage.exists("manifest.json"):
            raise AerieError(f"{self.storage.uri()} has no manifest.json: not a finished collection")
        self.manifest = json.loads(self.storage.read_bytes("manifest.json"))
        self.shards = [s for s in self.manifest["shards"] if s["split"] == split][rank::world_size]
        online = self.manifest.get("online", False)  # no checksums: the bytes never touched storage
        self.seed, self.buffer, self.verify = seed, buffer_sequences, verify and not online
        self.start_shard = self.shards_read = start_shard

    def __iter__(self) -> Iterator[HiddenStateSequence]:
        order, rng = shard_order(self.shards, self.seed)
        order = order[self.start_shard :]
        if hasattr(self.storage, "will_read"):  # online shards: capture starts ahead, in this order
            self.storage.will_read([r["name"] for r in order])
        buffer: list[HiddenStateSequence] = []
        for record in order:
            for seq in self._sequences(record):
                buffer.append(seq)
                if len(buffer) >= self.buffer:
                    yield buffer.pop(rng.randrange(len(buffer)))
            self.shards_read += 1
        rng.shuffle(buffer)
        yield from buffer

    def _sequences(self, record: dict) -> Iterator[HiddenStateSequence]:
        data = self.storage.read_bytes(record["name"])
        if self.verify and sha256(data) != record["sha256"]:
            raise AerieError(f"shard {record['name']} does not match its manifest checksum: re-run the collection")
        tensors = read_shard(data)
        ids = json.loads(_metadata(data)["conversation_ids"])
        offset = 0
        for conv_id, n in zip(ids, tensors["seq_lens"].tolist(), strict=True):
            rows = slice(offset, offset + n)
            yield HiddenStateSequence(
                conv_id,
                tensors["input_ids"][rows].long(),
                tensors["loss_mask"][rows],
                tensors["aux_hidden"][rows],
                tensors["final_hidden"][rows],
            )
            offset += n


def _metadata(data: bytes) -> dict:
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]).get("__metadata__", {})
