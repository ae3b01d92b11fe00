"""The traffic tap without a server: what it writes is what it was given, in the collection's shard format; it
never blocks or raises where the serving side calls it (a full queue drops and counts, a failing storage
counts and loses only that shard); retention keeps each writer within its byte budget and maximum age, across
restarts and beside `delete_traffic`."""

from __future__ import annotations

import threading
import time

import torch

from orchestrator.data.shards import read_shard
from orchestrator.data.storage import LocalStorage
from orchestrator.data.traffic import TapConfig, TrafficTap, delete_traffic, traffic_shards
from tests.helpers import captured_request, wait_for, wait_written, write_traffic

META = {"name": "tiny", "hidden_size": 4, "aux_layer_ids": [0, 1, 2]}


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _tap(tmp_path, storage=None, clock=None, **kw) -> TrafficTap:
    cfg = TapConfig(enabled=True, output=str(tmp_path / "traffic"), **({"shard_tokens": 12, "dtype": "float32"} | kw))
    return TrafficTap(cfg, META, "replica-a", storage=storage, clock=clock or Clock())


def test_shards_hold_exactly_what_was_offered_in_the_collection_format(tmp_path):
    tap = _tap(tmp_path)
    offered = [captured_request(i) for i in range(5)]
    assert all(tap.offer(c) for c in offered)
    tap.close()
    storage = LocalStorage(tmp_path / "traffic")
    records = traffic_shards(storage)
    assert [r["num_sequences"] for r in records] == [2, 2, 1]  # 12 tokens a shard; the rest written on close
    assert tap.stats.written_requests == 5 and tap.stats.written_tokens == 30 and tap.stats.dropped == 0
    got = [read_shard(storage.read_bytes(r["name"])) for r in records]
    ids = torch.cat([g["input_ids"] for g in got]).long()
    assert torch.equal(ids, torch.cat([c.input_ids for c in offered]))
    assert torch.equal(torch.cat([g["loss_mask"] for g in got]), torch.cat([c.loss_mask for c in offered]))
    assert torch.equal(torch.cat([g["aux_hidden"] for g in got]), torch.cat([c.aux_hidden for c in offered]))
    assert torch.equal(torch.cat([g["final_hidden"] for g in got]), torch.cat([c.final_hidden for c in offered]))
    assert all(r["sha256"] and r["writer"] == "replica-a" for r in records)


class BlockingStorage(LocalStorage):
    """Writes wait until released (a slow store); `entered` is set once the writer is inside one."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.entered, self.release = threading.Event(), threading.Event()

    def write_bytes(self, name, data) -> None:
        self.entered.set()
        assert self.release.wait(30)
        super().write_bytes(name, data)


def test_a_slow_storage_never_blocks_an_offer_a_full_queue_drops_and_counts(tmp_path):
    storage = BlockingStorage(tmp_path / "traffic")
    tap = _tap(tmp_path, storage, shard_tokens=1, queue_requests=4)
    assert tap.offer(captured_request(0))
    assert storage.entered.wait(30)  # the writer is stuck in its first write
    results = [tap.offer(captured_request(i)) for i in range(1, 10)]  # returns at once: 4 queued, 5 dropped
    assert results == [True] * 4 + [False] * 5 and tap.stats.dropped == 5
    storage.release.set()
    tap.close()
    assert tap.stats.written_requests == 5 and tap.stats.write_errors == 0


class FlakyStorage(LocalStorage):
    def __init__(self, root) -> None:
        super().__init__(root)
        self.failing = True

    def write_bytes(self, name, data) -> None:
        if self.failing and name.endswith(".safetensors"):
            raise OSError("disk full")
        super().write_bytes(name, data)


def test_a_partial_shard_is_written_after_flush_s_without_waiting_for_more_traffic(tmp_path):
    tap = _tap(tmp_path, shard_tokens=10**6, flush_s=0.2)
    tap.offer(captured_request(0))
    wait_written(tap, 1)  # without more traffic and without close: a crash loses at most flush_s of it
    assert tap.stats.shards == 1
    tap.offer(captured_request(1))
    tap.offer(captured_request(2))  # within flush_s of the first: the same shard
    wait_written(tap, 2)
    assert tap.stats.shards == 2 and tap.stats.written_requests == 3
    tap.close()


def test_a_failing_storage_loses_only_its_shard_and_raises_nothing(tmp_path):
    storage = FlakyStorage(tmp_path / "traffic")
    tap = _tap(tmp_path, storage)
    for i in range(2):
        assert tap.offer(captured_request(i))
    tap.close()
    assert tap.stats.write_errors == 1 and tap.stats.lost_requests == 2 and tap.stats.shards == 0
    storage.failing = False
    tap = _tap(tmp_path, storage)  # a new replica writes again
    tap.offer(captured_request(3))
    tap.close()
    assert [r["num_sequences"] for r in traffic_shards(storage)] == [1]


def test_retention_keeps_the_byte_budget_and_the_maximum_age_across_restarts(tmp_path):
    clock = Clock()
    storage = LocalStorage(tmp_path / "traffic")
    probe = TrafficTap(TapConfig(shard_tokens=6, dtype="float32"), META, "probe", storage=storage, clock=clock)
    probe.offer(captured_request(0))
    probe.close()
    size = traffic_shards(storage)[0]["bytes"]  # every shard of one 6-token request has this size
    delete_traffic(storage)
    for restart in range(3):  # a restarted replica knows its shards: the budget holds over all of them
        tap = _tap(tmp_path, storage, clock=clock, shard_tokens=6, max_bytes=3 * size, max_age_hours=1)
        for i in range(4):
            clock.t += 60
            tap.offer(captured_request(10 * restart + i))
            wait_written(tap, i + 1)
        tap.close()
        records = traffic_shards(storage)
        assert sum(r["bytes"] for r in records) <= 3 * size and len(records) == 3
        assert records[-1]["written_at"] == clock.t  # the newest stays
    files = [n for n in storage.names() if n.endswith(".safetensors")]
    assert len(files) == 3  # deleted from storage, not only from the manifest
    clock.t += 2 * 3600  # everything is older than max_age_hours: the next write deletes it
    tap = _tap(tmp_path, storage, clock=clock, shard_tokens=6, max_bytes=3 * size, max_age_hours=1)
    tap.offer(captured_request(99))
    tap.close()
    assert [r["written_at"] for r in traffic_shards(storage)] == [clock.t]


def test_a_gone_writers_folder_is_deleted_once_all_of_it_is_past_the_maximum_age(tmp_path):
    clock = Clock()
    storage = LocalStorage(tmp_path / "traffic")
    for writer in ("replaced", "idle-but-fresh"):  # two other replicas' folders, written at 1 h and 3 h
        other = TrafficTap(_tap(tmp_path).cfg.model_copy(update={"shard_tokens": 6}), META, writer, storage, clock)
        other.offer(captured_request(0))
        other.close()
        clock.t += 2 * 3600
    live = _tap(tmp_path, storage, clock=clock, shard_tokens=6, max_age_hours=3)  # "replaced" is 4 h old now
    live.offer(captured_request(1))
    live.close()
    writers = sorted({r["writer"] for r in traffic_shards(storage)})
    assert writers == ["idle-but-fresh", "replica-a"]
    assert not any(n.startswith("replaced/") for n in storage.names())  # shards, records and manifest
    assert live.stats.deleted_shards == 1


def test_delete_traffic_by_age_or_all_and_a_live_tap_does_not_bring_deleted_shards_back(tmp_path):
    clock = Clock()
    storage = LocalStorage(tmp_path / "traffic")
    tap = _tap(tmp_path, storage, clock=clock, shard_tokens=6)
    write_traffic(tap, clock, 3, every_s=3600)
    assert delete_traffic(storage, older_than_hours=0.5, now=clock.t) == 2  # written 2 h and 1 h ago
    assert len(traffic_shards(storage)) == 1
    tap.offer(captured_request(7))  # the tap's next shard: the manifest does not list the deleted ones again
    tap.close()
    assert len(traffic_shards(storage)) == 2
    assert delete_traffic(storage) == 2
    assert storage.names() == []


def test_the_cli_lists_and_deletes_captured_traffic_and_names_keys_without_showing_them(tmp_path, capsys, monkeypatch):
    import io

    from orchestrator.cli import main
    from orchestrator.serving.guard import key_id

    tap = _tap(tmp_path, shard_tokens=6)
    for i in range(2):
        tap.offer(captured_request(i))
    tap.close()
    out = str(tmp_path / "traffic")
    assert main(["traffic", "list", "--output", out]) == 0
    assert capsys.readouterr().out.startswith("2 shards, 2 requests, 12 tokens")
    assert main(["traffic", "delete", "--output", out]) == 2  # neither an age nor --all: refused
    assert "--older-than-hours H, or --all" in capsys.readouterr().err
    assert main(["traffic", "delete", "--output", out, "--all"]) == 0
    assert capsys.readouterr().out.startswith("deleted 2 shards") and LocalStorage(out).names() == []
    monkeypatch.setattr("sys.stdin", io.StringIO("a-secret-key-of-32-characters-xx\n"))
    assert main(["key-id"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == key_id("a-secret-key-of-32-characters-xx") and "secret" not in printed and len(printed) == 16


def test_a_request_is_kept_only_with_the_tap_on_no_opt_out_and_a_key_not_excluded():
    from orchestrator.serving.app import may_capture
    from orchestrator.serving.guard import key_id

    on = TapConfig(enabled=True, no_capture_key_ids=[key_id("excluded-key-0123456789")])
    auth = {"authorization": "Bearer allowed-key-0123456789"}
    assert may_capture(on, auth)
    assert not may_capture(TapConfig(), auth)  # off by default
    for value in ("off", "OFF", "0", "false", "no"):
        assert not may_capture(on, auth | {"x-aerie-capture": value})
    assert may_capture(on, auth | {"x-aerie-capture": "on"})
    assert not may_capture(on, {"authorization": "Bearer excluded-key-0123456789"})


def test_adaptation_data_holds_out_the_newest_traffic_and_replays_the_corpus(tmp_path):
    import json

    import pytest

    from orchestrator.data.reader import ShardReader
    from orchestrator.data.shards import Sequence, ShardPlan, shard_bytes, write_shard
    from orchestrator.data.traffic import adaptation_data
    from orchestrator.errors import AerieError

    clock = Clock()
    storage = LocalStorage(tmp_path / "traffic")
    tap = _tap(tmp_path, storage, clock=clock, shard_tokens=6)
    write_traffic(tap, clock, 6, every_s=60)
    tap.close()
    cutoff = traffic_shards(storage)[0]["written_at"]  # the first shard was adapted on before
    corpus = LocalStorage(tmp_path / "corpus")  # the drafter's own collection: 4 shards of 6 tokens
    records = []
    for k in range(4):
        c = captured_request(100 + k)
        plan = ShardPlan(f"train-{k:05d}.safetensors", "train", [Sequence(f"c{k}", "chatml", c.input_ids, c.loss_mask)])
        records.append(write_shard(corpus, plan, shard_bytes(plan, c.aux_hidden, c.final_hidden, torch.float32)))
    corpus.write_bytes("manifest.json", json.dumps({"aux_layer_ids": [0, 1, 2], "shards": records}).encode())

    manifest = adaptation_data(storage, tmp_path / "adapt", since=cutoff, holdout_fraction=0.25,
                               replay=str(tmp_path / "corpus"), replay_share=0.5)  # fmt: skip
    traffic = manifest["datasets"]["traffic"]
    assert len(traffic["shards_sha256"]) == 5 and traffic["since"] == cutoff  # the first shard is not taken again
    newest = traffic_shards(storage)[-1]["name"]
    assert traffic["held_out"] == [newest]
    assert manifest["splits"]["validation"]["num_shards"] == 1 and manifest["splits"]["train"]["num_shards"] == 4 + 2
    assert manifest["datasets"]["replay"]["shards"] == ["train-00000.safetensors", "train-00001.safetensors"]
    train = list(ShardReader(str(tmp_path / "adapt"), "train"))  # checksums verified through the links
    held = list(ShardReader(str(tmp_path / "adapt"), "validation"))
    assert len(train) == 6 and len(held) == 1
    last = captured_request(5)
    assert torch.equal(held[0].input_ids, last.input_ids) and torch.equal(held[0].aux_hidden, last.aux_hidden)
    with pytest.raises(AerieError, match="at least 2 are needed"):
        adaptation_data(storage, tmp_path / "again", since=traffic_shards(storage)[-2]["written_at"])


def test_a_writer_with_no_traffic_still_deletes_what_aged_out_even_after_a_restart(tmp_path):
    clock = Clock()
    storage = LocalStorage(tmp_path / "traffic")
    tap = _tap(tmp_path, storage, clock=clock, shard_tokens=6, max_age_hours=1)
    tap.offer(captured_request(0))
    tap.close()
    assert len(traffic_shards(storage)) == 1
    # the replica restarts and nobody sends a request: retention runs on its own every retain_every_s
    tap = _tap(tmp_path, storage, clock=clock, shard_tokens=6, max_age_hours=1, retain_every_s=0.02)
    time.sleep(0.2)
    assert len(traffic_shards(storage)) == 1  # still fresh: nothing deleted, nothing rewritten wrongly
    clock.t += 2 * 3600
    wait_for(lambda: not traffic_shards(storage), 10, "the expired shard deleted", 0.02)
    tap.close()
    assert traffic_shards(storage) == []
    assert not [n for n in storage.names() if n.endswith(".safetensors")]
    assert tap.stats.deleted_shards == 1


def test_the_writer_thread_never_starts_an_openmp_team_of_its_own(tmp_path):
    """A large cat or dtype cast on the writer thread would give it OpenMP threads beside the serving thread's:
    on a small machine the two teams then contend for the cores (the tap deployment served 12-20% slower)."""
    import os

    import pytest

    from orchestrator.data.traffic import Captured

    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: no team to start")
    torch.ones(1 << 20).add_(1)  # this thread's team exists before counting
    tap = _tap(tmp_path, shard_tokens=40_000, dtype="bfloat16")
    threads = len(os.listdir("/proc/self/task"))
    n, width = 40_000, 96  # 3.8M elements a tensor: far above ATen's grain size
    aux = torch.randn(n, 3 * width).to(torch.bfloat16)
    big = Captured(torch.arange(n) % 100, torch.arange(n) >= 10, aux, torch.randn(n, width).to(torch.bfloat16))
    tap.offer(big)
    wait_written(tap, 1)
    assert len(os.listdir("/proc/self/task")) == threads  # no new thread: the writer stayed serial
    tap.close()
    got = read_shard(
        LocalStorage(tmp_path / "traffic").read_bytes(traffic_shards(LocalStorage(tmp_path / "traffic"))[0]["name"])
    )
    assert torch.equal(got["aux_hidden"], aux) and torch.equal(got["input_ids"].long(), big.input_ids)
