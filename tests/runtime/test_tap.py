"""The traffic tap in the target worker: a finished request it may keep is written with exactly the states the
target computed for it (the fake target's rows say which token at which position they saw), through tree
verification, accepted paths, EOS and max_tokens cuts; requests it may not keep, aborted ones and unsampled ones
are not written; nothing of the scheduler's output changes."""

from __future__ import annotations

import asyncio

import torch

from orchestrator.data.shards import read_shard
from orchestrator.data.storage import LocalStorage
from orchestrator.data.traffic import TapConfig, traffic_shards
from orchestrator.spec.sampling import SamplingParams
from tests.runtime.fakes import reference
from tests.runtime.harness import build, read, run, tokens_of

EOS = 5


def _captured(out) -> list[dict]:
    storage = LocalStorage(out)
    seqs = []
    for record in traffic_shards(storage):
        shard = read_shard(storage.read_bytes(record["name"]))
        start = 0
        for n in shard["seq_lens"].tolist():
            rows = slice(start, start + n)
            seqs.append({k: shard[k][rows] for k in ("input_ids", "loss_mask", "aux_hidden", "final_hidden")})
            start += n
    return seqs


def test_a_kept_request_is_written_with_the_exact_states_of_its_tokens(tmp_path):
    tap = TapConfig(enabled=True, output=str(tmp_path / "traffic"), shard_tokens=1, dtype="float32")
    h = build(max_batch=4, eos=(EOS,), tap=tap, depth=3, width=2)
    cases = [  # (prompt, params, capture)
        ([1, 2, 3], SamplingParams(max_tokens=20), True),
        ([4, 6], SamplingParams(max_tokens=7, ignore_eos=True), True),
        ([7, 8, 9, 10], SamplingParams(max_tokens=30, temperature=1.0, seed=3), True),
        ([11, 12], SamplingParams(max_tokens=9), False),  # the client opted out
        ([13], SamplingParams(max_tokens=1), True),  # one answer token: nothing to learn from, not written
    ]

    async def body(h):
        rs = [h.scheduler.submit(p, params, capture=c) for p, params, c in cases]
        return rs, await asyncio.gather(*(read(h, r) for r in rs))

    rs, events = run(h, body)
    h.target.worker.tap.close()
    answers = [tokens_of(e) for e in events]
    for (prompt, params, _), got in zip(cases, answers, strict=True):
        assert got == reference(prompt, params, frozenset({EOS}))  # the tap changes nothing of the output
    captured = {tuple(s["input_ids"].tolist()): s for s in _captured(tmp_path / "traffic")}
    expected = {
        tuple(prompt + answer[:-1]): len(prompt)
        for (prompt, _, capture), answer in zip(cases, answers, strict=True)
        if capture and len(answer) >= 2
    }
    assert set(captured) == set(expected) and len(expected) == 3
    for ids, prompt_len in expected.items():
        s = captured[ids]
        positions = torch.arange(len(ids), dtype=torch.float32)
        assert torch.equal(s["loss_mask"], positions >= prompt_len)
        assert torch.equal(s["aux_hidden"][:, 0], torch.tensor(ids, dtype=torch.float32))  # the token it saw
        assert torch.equal(s["aux_hidden"][:, 1], positions) and torch.equal(s["final_hidden"][:, 0], positions)
        previous = torch.tensor([-1, *ids[:-1]], dtype=torch.float32)
        assert torch.equal(s["final_hidden"][:, 1], previous)  # the token before it, through every tree
    assert h.target.worker.tap.stats.dropped == 0 and h.target.worker.tap.stats.write_errors == 0


def test_nothing_is_kept_when_the_tap_samples_none_or_the_request_is_aborted(tmp_path):
    tap = TapConfig(enabled=True, output=str(tmp_path / "none"), shard_tokens=1, sample=0.0)
    h = build(max_batch=2, tap=tap)

    async def body(h):
        r = h.scheduler.submit([1, 2], SamplingParams(max_tokens=12, ignore_eos=True), capture=True)
        return await read(h, r)

    run(h, body)
    h.target.worker.tap.close()
    assert _captured(tmp_path / "none") == []
    tap = TapConfig(enabled=True, output=str(tmp_path / "aborted"), shard_tokens=1)
    h = build(max_batch=2, tap=tap)

    async def aborted(h):
        r = h.scheduler.submit([1, 2], SamplingParams(max_tokens=40, ignore_eos=True), capture=True)
        return await read(h, r, abort_after=3)

    run(h, aborted)
    h.target.worker.tap.close()
    assert _captured(tmp_path / "aborted") == []  # the client left: its request never finished


def test_a_tap_whose_storage_cannot_be_opened_serves_on_and_counts_what_it_lost(tmp_path):
    """The tap's output under a regular file: the target worker starts, every request is answered exactly, and
    the tap counts the requests it could not write."""
    (tmp_path / "file").write_text("not a directory")
    tap = TapConfig(enabled=True, output=str(tmp_path / "file" / "traffic"), shard_tokens=1)
    h = build(max_batch=2, tap=tap)
    params = SamplingParams(max_tokens=10, ignore_eos=True)

    async def body(h):
        rs = [h.scheduler.submit(p, params, capture=True) for p in ([1, 2], [3, 4, 5])]
        return rs, await asyncio.gather(*(read(h, r) for r in rs))

    rs, events = run(h, body)
    worker_tap = h.target.worker.tap
    worker_tap.close()
    assert [tokens_of(e) for e in events] == [reference([1, 2], params), reference([3, 4, 5], params)]
    assert all(e[-1].finish_reason == "length" for e in events)
    assert worker_tap.stats.write_errors >= 1 and worker_tap.stats.lost_requests == 2
