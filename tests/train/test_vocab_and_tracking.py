"""Draft vocabulary selection, the learning-rate schedule and batching."""

from __future__ import annotations

import pytest
import torch

from orchestrator.errors import AerieError
from orchestrator.models.drafter import Drafter, DrafterConfig
from orchestrator.train.vocab import coverage, draft_vocab, size_for_coverage
from tests.helpers import TINY_LLAMA


def test_draft_vocab_takes_the_most_frequent_ids_ascending_and_maps_like_vllm():
    counts = torch.tensor([0, 5, 9, 1, 9, 0, 7])
    vocab = draft_vocab(counts, 3)
    assert vocab.tolist() == [2, 4, 6]  # 9, 9, 7; ties by lower id
    assert coverage(counts, vocab) == pytest.approx(25 / 31)
    config = DrafterConfig.for_target(TINY_LLAMA, (1, 4, 5), draft_vocab_size=3)
    drafter = Drafter(config)
    drafter.d2t.copy_(vocab - torch.arange(3))  # as init.new_drafter sets it
    assert drafter.to_target_ids(torch.arange(3)).tolist() == [2, 4, 6]
    with pytest.raises(AerieError, match="draft_vocab_size 8 must be in 1..7"):
        draft_vocab(counts, 8)


def test_vocabulary_sized_by_coverage_is_the_fewest_tokens_reaching_it():
    counts = torch.tensor([1, 6, 0, 3])  # sorted: 6, 3, 1, 0 of 10
    assert [size_for_coverage(counts, s, multiple=1) for s in (0.6, 0.61, 0.9, 0.95, 1.0)] == [1, 2, 2, 3, 3]
    assert coverage(counts, draft_vocab(counts, size_for_coverage(counts, 0.9, multiple=1))) >= 0.9
    assert coverage(torch.zeros(4, dtype=torch.long), torch.tensor([0])) == 0.0  # no loss-masked token: no error
    assert size_for_coverage(counts, 0.5) == 4  # rounded up to 64, capped at the target's vocabulary
    assert size_for_coverage(torch.ones(1000, dtype=torch.long), 0.1) == 128  # 100 -> 128
    from orchestrator.train.config import TrainConfig

    base = {"name": "x", "model": "m", "data": "d", "output": "o", "max_steps": 1}
    with pytest.raises(ValueError, match="drop draft_vocab_coverage"):
        warm = {"variant": "eagle3", "init_from": "d", "draft_vocab_coverage": 0.9}
        TrainConfig.model_validate(base | {"drafter": warm})
    with pytest.raises(ValueError, match="less than or equal to 1"):
        TrainConfig.model_validate(base | {"drafter": {"variant": "eagle3", "draft_vocab_coverage": 1.5}})


def test_learning_rate_warms_up_then_decays_over_the_budget():
    from orchestrator.train.config import TrainConfig
    from orchestrator.train.loop import lr_factor

    base = {"name": "x", "model": "m", "data": "d", "output": "o", "drafter": {"variant": "eagle3"}}
    by_steps = TrainConfig.model_validate(base | {"max_steps": 110, "optim": {"warmup_steps": 10}})
    assert [round(lr_factor(by_steps, s, 0.0), 3) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert lr_factor(by_steps, 10, 0.0) == 1.0
    assert lr_factor(by_steps, 60, 0.0) == pytest.approx(0.55)  # halfway: (1 + 0.1) / 2
    assert lr_factor(by_steps, 110, 0.0) == pytest.approx(0.1)
    by_time = TrainConfig.model_validate(base | {"max_time_minutes": 10, "optim": {"warmup_steps": 0}})
    assert lr_factor(by_time, 1000, 300.0) == pytest.approx(0.55)
    with pytest.raises(ValueError, match="set max_steps or max_time_minutes"):
        TrainConfig.model_validate(base)


def test_batches_pack_pad_budget_cut_long_sequences_and_flush_the_rest():
    from orchestrator.data.reader import HiddenStateSequence
    from orchestrator.train.loop import batches
    from orchestrator.train.state import DataPosition

    def seq(n: int) -> HiddenStateSequence:
        return HiddenStateSequence(
            f"c{n}", torch.arange(n), torch.ones(n, dtype=torch.bool), torch.zeros(n, 2), torch.zeros(n, 1)
        )

    stream = ((seq(n), DataPosition(0, k + 1)) for k, n in enumerate([3, 4, 2, 9, 5]))
    out = list(batches(stream, batch_tokens=8))
    # [3, 4] -> 2 x 4 = 8 fits; +2 would be 3 x 4 = 12; [2] then 9 (cut to 8) would be 2 x 8; [8] alone; [5]
    assert [[s.input_ids.numel() for s in group] for group, _ in out] == [[3, 4], [2], [8], [5]]
    assert [pos.consumed for _, pos in out] == [2, 3, 4, 5]  # where a resumed stream continues
