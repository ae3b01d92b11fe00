"""Verifier tables: hand-built trees and target distributions with exact expected outcomes."""

from __future__ import annotations

import pytest
import torch

from orchestrator.spec.sampling import SamplingParams
from orchestrator.spec.tree import DraftTree
from orchestrator.spec.verify import Verifier, probabilities, seeded_choice

V = 8


def _argmax_rows(*tokens: int) -> torch.Tensor:
    """Target logits [n+1, V] whose argmax at row i is tokens[i]."""
    logits = torch.zeros(len(tokens), V)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


GREEDY = Verifier()
TREE = DraftTree(torch.tensor([3, 4, 5, 6, 2]), torch.tensor([-1, -1, 1, 1, 3]))  # root─{0:3, 1:4─{2:5, 3:6─4:2}}


@pytest.mark.parametrize(
    ("tree", "argmax", "accepted", "next_token"),
    [
        (DraftTree.chain([3, 4, 5]), (3, 4, 5, 6), [0, 1, 2], 6),  # all accepted + bonus
        (DraftTree.chain([3, 4, 5]), (1, 4, 5, 6), [], 1),  # first token rejected: the target's own token
        (DraftTree.chain([3, 4, 5]), (3, 4, 7, 6), [0, 1], 7),  # rejected at depth 3
        (TREE, (4, 0, 6, 0, 2, 1), [1, 3, 4], 1),  # second branch, deep: 4 -> 6 -> 2, bonus 1
        (TREE, (4, 0, 7, 0, 2, 1), [1], 7),  # second branch, neither grandchild matches
        (DraftTree.empty(), (5,), [], 5),  # nothing drafted: plain decoding
    ],
    ids=["all-accepted", "first-rejected", "third-rejected", "deep-second-branch", "branch-then-miss", "empty"],
)
def test_greedy_table(tree, argmax, accepted, next_token):
    verdict = GREEDY.verify(tree, _argmax_rows(*argmax), SamplingParams(), None, 0)
    assert (verdict.accepted, verdict.next_token) == (accepted, next_token)


def test_sampling_accepts_certain_drafts_and_samples_the_bonus():
    """p puts all mass on the drafted tokens: every draft is accepted, the bonus comes from the last row."""
    tree = DraftTree.chain([3, 4], {-1: torch.full((V,), 1 / V), 0: torch.full((V,), 1 / V)})
    logits = torch.full((3, V), -1e9)
    logits[0, 3] = logits[1, 4] = logits[2, 6] = 0.0
    verdict = GREEDY.verify(tree, logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0), 0)
    assert (verdict.accepted, verdict.next_token) == ([0, 1], 6)


def test_sampling_rejects_impossible_drafts_and_uses_the_residual():
    """p(3) = 0: the draft is always rejected; the residual max(p - q, 0) is all on token 5."""
    q = torch.zeros(V)
    q[3], q[5] = 0.5, 0.5
    p_logits = torch.full((2, V), -1e9)
    p_logits[0, 5] = 0.0
    tree = DraftTree.chain([3], {-1: q})
    for seed in range(20):
        verdict = GREEDY.verify(tree, p_logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(seed), 0)
        assert (verdict.accepted, verdict.next_token) == ([], 5)


def test_sampling_point_mass_siblings_are_tried_in_order():
    """Deterministic siblings [3, 4] under p = one-hot(4): 3 is rejected (p(3) = 0), 4 accepted (p(4) = 1)."""
    tree = DraftTree(torch.tensor([3, 4]), torch.tensor([-1, -1]))
    logits = torch.full((3, V), -1e9)
    logits[0, 4] = 0.0
    logits[2, 1] = 0.0
    verdict = GREEDY.verify(tree, logits, SamplingParams(temperature=0.7), torch.Generator().manual_seed(1), 0)
    assert (verdict.accepted, verdict.next_token) == ([1], 1)


def test_top_k_restricts_the_target_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, -1.0, -2.0, -3.0, -4.0]])
    tree = DraftTree.empty()
    seen = {
        GREEDY.verify(
            tree, logits, SamplingParams(temperature=1.0, top_k=2), torch.Generator().manual_seed(s), 0
        ).next_token
        for s in range(200)
    }
    assert seen == {2, 3}


P_FIVE = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])


def _seeded_counts(noise_seed) -> torch.Tensor:
    """How often each token is chosen at output position 3 over 4000 request seeds."""
    counts = torch.zeros(5)
    for seed in range(4000):
        counts[int(seeded_choice(P_FIVE[None], noise_seed(seed), torch.tensor([3]))[0])] += 1
    return counts


def test_seeded_sampling_is_exact_and_a_shared_seed_is_not():
    """Gumbel-max with (seed, position) noise samples p exactly (chi-square); noise that ignores the request's
    seed (a broken implementation) picks one token for everyone and fails the same test."""
    from scipy.stats import chisquare

    assert chisquare(_seeded_counts(lambda s: s), 4000 * P_FIVE).pvalue > 1e-3
    assert chisquare(_seeded_counts(lambda s: 0), 4000 * P_FIVE).pvalue < 1e-6


def test_seeded_verification_emits_the_same_tokens_for_any_tree():
    """A seeded request's tokens depend only on (seed, position): drafting a tree or not changes nothing."""
    torch.manual_seed(0)
    logits = torch.randn(4, V)  # the target at [root, a, b, c]
    params = SamplingParams(temperature=1.0, seed=11)
    plain = Verifier().verify(DraftTree.empty(), logits[:1], params, None, position=5)
    assert plain.accepted == []
    choice = seeded_choice(probabilities(logits, params), 11, torch.tensor([5, 6, 7, 8]))
    assert plain.next_token == int(choice[0])
    chain = DraftTree.chain([int(choice[0]), int(choice[1]), (int(choice[2]) + 1) % V])
    verdict = Verifier().verify(chain, logits, params, None, position=5)
    assert verdict.accepted == [0, 1] and verdict.next_token == int(choice[2])


def test_nan_logits_are_the_requests_error():
    logits = torch.zeros(1, V)
    logits[0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        Verifier().verify(DraftTree.empty(), logits, SamplingParams(), None, 0)
    masked = torch.zeros(1, V)
    masked[0, 1:] = float("-inf")  # -inf is a mask, not an error
    assert Verifier().verify(DraftTree.empty(), masked, SamplingParams(temperature=1.0), None, 0).next_token == 0


def test_the_batchs_max_gives_argmaxs_choice_and_catches_what_the_request_holds():
    """The target worker takes `logits.max(-1)` once per call (`best`): its index is argmax's, ties included (the
    first maximal value, which bf16 logits hit), and a row's NaN or +inf reaches its max."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(8, V)).to(torch.bfloat16)
    logits[:, 5] = logits.max(dim=-1).values  # ties with an earlier or later maximum
    values, indices = logits.max(dim=-1)
    assert torch.equal(indices, logits.argmax(dim=-1))
    tree = DraftTree.chain([int(indices[0]), int(indices[1]), 0])
    got = Verifier().verify(tree, logits[:4], SamplingParams(), None, 0, (values[:4], indices[:4]))
    assert got == Verifier().greedy(tree, logits[:4].argmax(dim=-1))
    for bad in (float("nan"), float("inf")):
        poisoned = logits.clone()
        poisoned[6, 2] = bad
        values, indices = poisoned.max(dim=-1)
        with pytest.raises(ValueError, match="NaN or"):
            Verifier().verify(DraftTree.empty(), poisoned[6:7], SamplingParams(), None, 0, (values[6:7], indices[6:7]))
