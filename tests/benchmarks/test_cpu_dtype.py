"""The CPU dtype step benchmark on the tiny target: a line per (dtype, tokens), the verify steps' cost over decoding,
for one sequence or a batch of them."""

from __future__ import annotations

import pytest
import torch

from orchestrator.benchmarks.cpu_dtype import main, step_ms
from orchestrator.models.target import TargetModel


@pytest.mark.parametrize("sequences", [1, 3])
def test_every_dtype_and_step_size_is_timed(tiny_dir, capsys, sequences):
    args = ["--model", str(tiny_dir), "--context", "12", "--tokens", "1", "3", "--repeats", "2", "--threads", "1"]
    main([*args, "--sequences", str(sequences)])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["bfloat16", "1"],
        ["bfloat16", "3"],
        ["float32", "1"],
        ["float32", "3"],
    ]
    assert all(" ms [" in line for line in lines) and "over 1" in lines[1] and "over 1" in lines[3]


def test_a_step_of_a_batch_appends_to_every_sequence_and_leaves_the_caches_as_they_were(tiny_dir):
    model = TargetModel.from_pretrained(tiny_dir, dtype="float32", device="cpu")
    cache = model.new_cache(2, 32)
    slots = [cache.allocate(), cache.allocate()]
    for slot, n in zip(slots, (5, 9), strict=True):  # sequences of different lengths
        model(torch.arange(n), cache, torch.tensor([slot]), torch.tensor([n]), logits="last")
    seen = []

    def forward(tokens, cache_, slots_, num, positions=None, block_mask=None):
        seen.append((tokens.shape[0], num.tolist(), positions.tolist(), block_mask.shape))
        return model(tokens, cache_, slots_, num, positions=positions, block_mask=block_mask)

    forward.vocab_size = model.vocab_size
    assert step_ms(forward, cache, slots, 3) > 0
    assert seen == [(6, [3, 3], [5, 6, 7, 9, 10, 11], (2, 3, 3))]  # each sequence's block after its own prefix
    assert [int(cache.lengths[s]) for s in slots] == [5, 9]
