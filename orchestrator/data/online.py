"""Hidden states streamed to training (`train.data: online`): nothing written to storage.

Each Ray Train worker reads its shards through `OnlineShards`, a storage that ShardReader reads like a
directory, but whose shard bytes come from capture actors (the collection's own `CaptureWorker`, which returns
the bytes instead of writing them) through Ray's object store:

    ShardReader(rank r) --order of its shards--> OnlineShards --shard(plan)--> capture actors (target model)
                        <----- bytes, one shard at a time <-- object store <--

The reader announces the order it will read its shards in; at most `prefetch` of them are being captured or
waiting ahead of the one it reads (the backpressure: capture runs only as far ahead as training allows, and the
memory held is about `prefetch` + 1 shards per trainer). A shard's bytes are the bytes the offline collection
writes for the same config, so the batches are the same. Validation shards read once are kept (evaluation
rereads them); training shards are dropped once read, and a resumed or later epoch captures them again.
"""

from __future__ import annotations

import json
from collections import deque

from orchestrator.data.shards import ShardPlan
from orchestrator.errors import AerieError

MANIFEST = "manifest.json"


class OnlineShards:
    """A read-only Storage over shards captured on demand (see the module docstring)."""

    def __init__(self, manifest: dict, plans: list[ShardPlan], workers: list, prefetch: int = 2, keep=("validation",)):
        self.manifest, self.workers, self.prefetch, self.keep = manifest, workers, max(1, prefetch), set(keep)
        self.plans = {p.name: p for p in plans}
        self.order: deque[str] = deque()
        self.in_flight: dict[str, object] = {}  # name -> ObjectRef of its bytes
        self.kept: dict[str, bytes] = {}
        self.next_worker = 0
        self.captured = 0  # shards captured for this reader (tests and the report read it)
        self.most_ahead = 0  # the most shards ever captured or waiting ahead of the reader

    def uri(self) -> str:
        return "online"

    def exists(self, name: str) -> bool:
        return name == MANIFEST or name in self.plans

    def will_read(self, names: list[str]) -> None:
        """The reader's order; captures start for the first `prefetch` (those not already under way)."""
        self.order = deque(n for n in names if n not in self.kept)
        self._fill()

    def read_bytes(self, name: str) -> bytes:
        import ray

        if name == MANIFEST:
            return json.dumps(self.manifest).encode()
        if name in self.kept:
            return self.kept[name]
        if name not in self.plans:
            raise AerieError(f"online data has no shard {name}")
        ref = self.in_flight.pop(name, None)
        if ref is None:  # read out of the announced order
            if name in self.order:
                self.order.remove(name)
            ref = self._submit(name)
        self._fill()
        data = ray.get(ref)
        if self.plans[name].split in self.keep:
            self.kept[name] = data
        return data

    def _submit(self, name: str):
        worker = self.workers[self.next_worker % len(self.workers)]
        self.next_worker += 1
        self.captured += 1
        return worker.shard.remote(self.plans[name])

    def _fill(self) -> None:
        while self.order and len(self.in_flight) < self.prefetch:
            name = self.order.popleft()
            if name not in self.in_flight:
                self.in_flight[name] = self._submit(name)
        self.most_ahead = max(self.most_ahead, len(self.in_flight))
