"""The draft vocabulary: the `draft_vocab_size` target tokens seen most often where the loss applies.

vLLM maps draft ids to target ids with `target = draft + d2t[draft]` and marks the chosen target ids in `t2d`:

    counts over loss-masked tokens: {"the": 90, ",": 80, "cat": 3, ...}, size 2  ->  ids of "the" and ","
    ascending target ids [11, 30]  ->  d2t = [11 - 0, 30 - 1] = [11, 29]

Positions whose target token lies outside the draft vocabulary still train: the drafter can never propose
such a token, so its best possible behaviour there is the target's distribution restricted to the draft
vocabulary and renormalised, and that is what it learns (see `objective.ttt_loss`). How often that happens is
the vocabulary's coverage, reported with the vocabulary.
"""

from __future__ import annotations

import torch

from orchestrator.data.reader import ShardReader
from orchestrator.errors import AerieError


def count_tokens(location: str, vocab_size: int, split: str = "train") -> torch.Tensor:
    """How often each target token appears at loss-masked positions of a split: [vocab] int64."""
    reader = ShardReader(location, split, buffer_sequences=1, verify=False)
    return count_sequences(reader, vocab_size, f"{location}: the {split} split")


def count_sequences(sequences, vocab_size: int, where: str) -> torch.Tensor:
    """`count_tokens` over any sequences with `input_ids` and `loss_mask` (online data: the planned ones)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        counts += torch.bincount(seq.input_ids[seq.loss_mask], minlength=vocab_size)
    if counts.sum() == 0:
        raise AerieError(f"{where} has no loss-masked tokens (empty dataset?)")
    return counts


def draft_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent ids (ties: lower id first), ascending: [size] int64."""
    if not 0 < size <= counts.numel():
        raise AerieError(f"draft_vocab_size {size} must be in 1..{counts.numel()} (the target's vocabulary)")
    order = torch.argsort(-counts, stable=True)
    return order[:size].sort().values


def size_for_coverage(counts: torch.Tensor, share: float, multiple: int = 64) -> int:
    """The fewest most-frequent ids covering `share` of the counted tokens, rounded up to `multiple` (aligned
    lm_head rows) and capped at the target's vocabulary.

        counts {"the": 6, ",": 3, "cat": 1}, share 0.9, multiple 1  ->  2   ("the" and "," cover 9 of 10)
    """
    if not 0 < share <= 1:
        raise AerieError(f"draft_vocab_coverage {share} must be in (0, 1]")
    cumulative = torch.cumsum(torch.sort(counts, descending=True).values, 0)
    need = int(torch.searchsorted(cumulative, (share - 1e-9) * cumulative[-1].item())) + 1  # 1e-9: float error
    return min(counts.numel(), -(-need // multiple) * multiple)


def coverage(counts: torch.Tensor, vocab: torch.Tensor) -> float:
    """Share of loss-masked tokens the draft vocabulary can propose."""
    total = counts.sum().item()
    return counts[vocab].sum().item() / total if total else 0.0
