"""Bytes between the workers: every message's size by one rule (`payload_nbytes`), and the scheduler counts
exactly what one worker hands the other (Pairs to the drafter, trees to the target), in its totals, its /stats
means and the Prometheus counter (fake workers, no Ray)."""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch

from orchestrator.runtime.messages import DraftOutput, NewSequence, Pairs, RoundOutput, SeqUpdate, payload_nbytes
from orchestrator.spec.sampling import SamplingParams
from orchestrator.spec.tree import DraftTree
from tests.runtime.harness import build, read, run

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def test_payload_bytes_table():
    """Tensor data plus 8 per number, 1 per bool, UTF-8 per string, through every container."""
    pairs = Pairs(["r1"], [2], torch.zeros(2, dtype=torch.long), torch.zeros(2, 1728))
    assert pairs.nbytes == 2 + 8 + 2 * 8 + 2 * 1728 * 4  # the docstring's example: 13850
    assert Pairs(["r1"], [2], torch.zeros(2, dtype=torch.long), torch.zeros(2, 1728, dtype=torch.bfloat16)).nbytes == (
        2 + 8 + 16 + 2 * 1728 * 2
    )
    params = SamplingParams(max_tokens=5, stop=("ab",))  # 4 numbers, seed None, one stop string, one bool
    assert NewSequence("r1", [1, 2, 3], params).nbytes == 2 + 3 * 8 + (4 * 8 + 0 + 2 + 1) + 1  # + capture
    assert SeqUpdate("é", [7]).nbytes == 2 + 8 + 0 + 8 + 8 + 0 + 8 + 1  # "é" is 2 bytes of UTF-8
    tree = DraftTree(torch.tensor([5, 6]), torch.tensor([-1, 0]), {-1: torch.zeros(96)}, torch.zeros(2))
    assert payload_nbytes({"r1": tree}) == 2 + (16 + 16 + (8 + 96 * 4) + 8)
    assert payload_nbytes({"r1": DraftTree.empty()}) == 2
    out = RoundOutput([SeqUpdate("r1", [7])], 3, 0.5, 1.0, 13850, 4)
    assert out.nbytes == SeqUpdate("r1", [7]).nbytes + 5 * 8
    with pytest.raises(TypeError, match="no size rule for Generator"):
        payload_nbytes(torch.Generator())


def test_a_message_is_about_as_big_when_pickled():
    """What Ray sends (pickle 5) is the counted payload plus framing, not a multiple of it."""
    pairs = Pairs(["r1", "r2"], [3, 1], torch.arange(4), torch.randn(4, 3 * 576))
    assert pairs.nbytes <= len(pickle.dumps(pairs, protocol=5)) <= pairs.nbytes + 2048


def test_the_scheduler_counts_every_byte_one_worker_hands_the_other():
    h = build(max_batch=4, micro_batches=2)
    sent = {"target_to_draft": 0, "draft_to_target": 0}
    target, draft = h.target.worker, h.draft.worker
    propose, verify = draft.propose, target.verify

    def counting_propose(requests, reset=(), *pairs):
        sent["target_to_draft"] += sum(payload_nbytes(p) for p in pairs)
        out, trees = propose(requests, reset, *pairs)
        assert isinstance(out, DraftOutput) and out.trees_bytes == payload_nbytes(trees)
        return out, trees

    def counting_verify(keep, trees):
        sent["draft_to_target"] += payload_nbytes(trees) if trees is not None else 0
        return verify(keep, trees)

    draft.propose, target.verify = counting_propose, counting_verify
    metered: dict[str, int] = {}

    class Counter:
        def inc(self, value, tags):
            metered[tags["direction"]] = metered.get(tags["direction"], 0) + value

    class Metrics:  # the scheduler's metrics, only the transfer counter of interest; the rest ignored
        transfer_bytes = Counter()

        def __getattr__(self, name):
            return _Ignore()

    h.scheduler.meter.export = Metrics()
    prompts = [[(3 * i + k) % 20 for k in range(1 + i % 5)] for i in range(8)]

    async def body(h):
        await asyncio.gather(*[read(h, h.scheduler.submit(p, GREEDY)) for p in prompts])

    run(h, body)
    stats = h.scheduler.stats()
    assert sent["target_to_draft"] > 0 and sent["draft_to_target"] > 0
    for direction, n in sent.items():
        assert stats[f"{direction}_bytes"] == n == metered[direction]
        assert stats["transfer_bytes_per_round"][direction] == pytest.approx(n / stats["rounds"])


class _Ignore:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def __call__(self, *args, **kwargs):
        return None
