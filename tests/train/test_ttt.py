"""Train/serve parity: the TTT unroll computes, row by row, what the serving drafter computes when it drafts a
chain over the same tokens; and the objective's bookkeeping on hand-made cases."""

from __future__ import annotations

import pytest
import torch

from orchestrator.models.target import TargetModel
from orchestrator.train.objective import Batch, chain_hits, chain_rounds, ttt_loss
from orchestrator.train.ttt import unroll
from tests.helpers import random_drafter

VARIANTS = {
    "eagle3": {"variant": "eagle3"},
    "eagle3.1": {"variant": "eagle3.1"},
    "norm_before_fc": {"variant": "eagle3", "norm_before_fc": True},
    "two_layers": {"variant": "eagle3.1", "num_hidden_layers": 2},
}


@pytest.fixture(scope="module")
def target(tiny_dir):
    return TargetModel.from_pretrained(tiny_dir)


def _serving_chain(drafter, tokens: torch.Tensor, aux: torch.Tensor, row: int, steps: int) -> list[torch.Tensor]:
    """The engine's way: commit pairs (aux[t], x[t+1]) for t <= row, then draft a chain on true tokens."""
    cache, slot = drafter.new_cache(1, 64), torch.tensor([0])
    out = drafter(tokens[1 : row + 2], drafter.combine_aux(aux[: row + 1]), cache, slot, torch.tensor([row + 1]))
    logits, hidden = [out.logits[-1]], out.next_hidden[-1:]
    for j in range(1, steps):
        out = drafter(tokens[row + j + 1 : row + j + 2], hidden, cache, slot, torch.tensor([1]))
        logits.append(out.logits[-1])
        hidden = out.next_hidden
    return logits


def test_a_drafting_step_for_some_rows_is_the_full_steps_rows(target):
    """Drafting commits every new pair but reads each sequence's last row only (`rows`): the same values."""
    drafter = random_drafter(target.hf_config, draft_vocab_size=64, seed=5, variant="eagle3.1")
    drafter.share_embedding(target.embed_tokens)
    width = len(drafter.config.aux_layer_ids) * target.hf_config["hidden_size"]
    tokens, aux = torch.randint(0, 96, (9,)), torch.randn(9, width)
    outs = []
    for rows in (None, torch.tensor([4, 8])):
        cache = drafter.new_cache(2, 32)
        slots = torch.tensor([cache.allocate(), cache.allocate()])
        outs.append(drafter(tokens, drafter.combine_aux(aux), cache, slots, torch.tensor([5, 4]), rows=rows))
    full, some = outs
    torch.testing.assert_close(some.logits, full.logits[[4, 8]])
    torch.testing.assert_close(some.next_hidden, full.next_hidden[[4, 8]])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_unroll_equals_serving_chain(target, name):
    drafter = random_drafter(target.hf_config, draft_vocab_size=64, seed=3, **VARIANTS[name])
    drafter.share_embedding(target.embed_tokens)
    gen = torch.Generator().manual_seed(0)
    t, steps = 14, 4
    tokens = torch.randint(0, 96, (t,), generator=gen)
    aux = torch.randn(t, drafter.fc.in_features, generator=gen)
    with torch.no_grad():
        trained = unroll(drafter, tokens[None], aux[None], steps)  # steps x [1, T, dv]
        for row in (0, 3, t - steps - 1):
            served = _serving_chain(drafter, tokens, aux, row, steps)
            for j in range(steps):
                torch.testing.assert_close(trained[j][0, row], served[j], rtol=1e-5, atol=1e-5)


def test_unroll_rows_do_not_see_padding_or_later_rows(target):
    """A row's logits depend only on its prefix: padding a batch or changing later tokens changes nothing."""
    drafter = random_drafter(target.hf_config, draft_vocab_size=64, seed=1)
    drafter.share_embedding(target.embed_tokens)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 96, (2, 12), generator=gen)
    aux = torch.randn(2, 12, drafter.fc.in_features, generator=gen)
    changed, changed_aux = tokens.clone(), aux.clone()
    changed[1, 9:] = 5
    changed_aux[1, 9:] = 0.0
    with torch.no_grad():
        a = unroll(drafter, tokens, aux, 3)
        b = unroll(drafter, changed, changed_aux, 3)
    for j in range(3):  # step j row i reads tokens up to i+j+1 and aux up to i
        last = 9 - j - 2
        torch.testing.assert_close(a[j][1, : last + 1], b[j][1, : last + 1])
        torch.testing.assert_close(a[j][0], b[j][0])


def test_loss_counts_only_loss_masked_rows_inside_the_sequence():
    t, dv = 6, 4
    target = torch.zeros(1, t, dv)
    target[0, :, 2] = 30.0  # the target is sure of draft id 2 everywhere
    good = torch.full((1, t, dv), -10.0)
    good[..., 2] = 10.0
    batch = Batch(
        input_ids=torch.zeros(1, t, dtype=torch.long),
        loss_mask=torch.tensor([[False, False, False, True, True, False]]),
        lengths=torch.tensor([5]),
        aux_hidden=torch.zeros(1, t, 1),
        final_hidden=torch.zeros(1, t, 1),
    )
    bad = good.clone()
    bad[0, 2] = -good[0, 2]  # wrong only at step-0 row 2, which predicts x[4] (masked in, inside length 5)
    loss, stats = ttt_loss([bad, good], target, batch, step_weight=0.8)
    # step 0 counts rows 1, 2 (predicting x[3], x[4]); step 1 rows 0, 1 (x[3], x[4]); x[5] is past the length
    assert stats.count.tolist() == [2.0, 2.0]
    assert stats.correct.tolist() == [1.0, 2.0]
    assert loss.item() > 5.0
    clean, _ = ttt_loss([good, good], target, batch, step_weight=0.8)
    assert clean.item() < 1e-3


def _answer_batch(t: int, answers: list[tuple[int, int]]) -> Batch:
    """A one-row batch of length t whose loss mask covers the given [a, end) runs."""
    mask = torch.zeros(1, t, dtype=torch.bool)
    for a, end in answers:
        mask[0, a:end] = True
    return Batch(
        torch.zeros(1, t, dtype=torch.long), mask, torch.tensor([t]), torch.zeros(1, t, 1), torch.zeros(1, t, 1)
    )


def test_chain_rounds_replays_greedy_chain_decoding():
    batch = _answer_batch(12, [(2, 9), (10, 12)])  # only the first answer (x[2..8]) is replayed
    every = torch.ones(2, 1, 12, dtype=torch.bool)
    # prefill emits x[2]; round at row 1 accepts x[3], x[4] (+ x[5] from the target); row 4: x[6], x[7] (+ x[8])
    assert chain_rounds(every, batch, answer_tokens=96) == (2, 4)
    assert chain_rounds(~every, batch, answer_tokens=96) == (6, 0)  # one token per round: x[3..8]
    assert chain_rounds(every, batch, answer_tokens=3) == (1, 2)  # x[2..4]: prefill, then both drafts
    first_only = every.clone()
    first_only[1] = False
    assert chain_rounds(first_only, batch, answer_tokens=96) == (3, 3)  # rows 1, 3, 5, then row 7 ends at x[8]
    first_only[1, 0, 2] = True  # a second-depth hit where no round starts changes nothing
    assert chain_rounds(first_only, batch, answer_tokens=96) == (3, 3)
    assert chain_rounds(every, _answer_batch(12, []), answer_tokens=96) == (0, 0)


def test_chain_hits_compare_drafts_with_the_recorded_tokens():
    batch = _answer_batch(5, [(0, 5)])
    batch.input_ids[0] = torch.tensor([7, 8, 9, 10, 11])
    logits = torch.zeros(1, 5, 4)
    logits[0, :, 1] = 1.0  # draft id 1 everywhere, target id 1 + 8 = 9
    hits = chain_hits([logits, logits], lambda d: d + 8, batch)
    assert hits.shape == (2, 1, 5)
    assert hits[0, 0].tolist() == [True, False, False, False, False]  # step 0 row i predicts x[i+2]
    assert hits[1, 0].tolist() == [False, False, False, False, False]  # step 1 row 0 predicts x[3] = 10
