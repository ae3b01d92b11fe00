"""Speculative sampling reproduces the target's distribution exactly (chi-square over 8k samples), for chains
and for trees with several children per node, with and without top-k / top-p, both ways a request samples:
recursive rejection sampling (no seed) and seeded Gumbel-max choices. A verifier that accepts every draft must
fail the same test (the negative control; its p-value underflows to 0 at this size)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from orchestrator.engine import SpecEngine
from orchestrator.models import TargetModel
from orchestrator.runtime import DraftWorker, TargetWorker
from orchestrator.spec import EagleProposer, SamplingParams, Verdict, Verifier, probabilities
from tests.helpers import random_drafter, write_tiny_llama

pytestmark = pytest.mark.slow
VOCAB, SAMPLES, PROMPT = 12, 8_000, [3, 7, 5, 1]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Llama with a 12-token vocabulary and peaked next-token distributions."""
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny12"), seed=7, vocab_size=VOCAB, initializer_range=0.3)
    return TargetModel.from_pretrained(path, packed=False)


@pytest.fixture(scope="module")
def drafter(target):
    """A deliberately mismatched drafter: random weights, unrelated to the target."""
    d = random_drafter(target.hf_config, "eagle3.1", seed=11)
    with torch.no_grad():
        d.lm_head.weight.mul_(60.0)  # peaked but wrong: accepts some drafts, rejects many
    d.share_embedding(target.embed_tokens)
    return d


def _exact_pair_distribution(target: TargetModel, params: SamplingParams) -> torch.Tensor:
    """P(x2, x3) [V, V] of the 2nd and 3rd generated tokens, marginalised over the 1st, from the target."""

    def dist(prefixes: list[list[int]]) -> torch.Tensor:
        cache = target.new_cache(len(prefixes), 16)
        num = torch.tensor([len(p) for p in prefixes])
        logits = target(
            torch.tensor([t for p in prefixes for t in p]), cache, torch.arange(len(prefixes)), num, logits="last"
        ).logits
        return probabilities(logits.double(), params)

    p1 = dist([PROMPT])[0]  # [V]
    p2 = dist([PROMPT + [a] for a in range(VOCAB)])  # [V(x1), V(x2)]
    p3 = dist([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


def _sampled_pairs(target, drafter, params, depth, topk, budget, seeded: bool, verifier=None) -> torch.Tensor:
    """The 2nd and 3rd tokens of SAMPLES requests: seeds 0.. (seeded), or unseeded requests whose random
    streams come from torch's global generator (seeded here: the test is deterministic)."""
    target_side = TargetWorker(target, [], 500, verifier=verifier)
    engine = SpecEngine(target_side, DraftWorker(EagleProposer(drafter, depth, topk, max_requests=500), 500), budget)
    base = params.model_copy(update={"max_tokens": 4, "ignore_eos": True})
    torch.manual_seed(0)
    out = engine.generate(
        [PROMPT] * SAMPLES, [base.model_copy(update={"seed": s if seeded else None}) for s in range(SAMPLES)]
    )
    counts = torch.zeros(VOCAB, VOCAB)
    for g in out:
        counts[g.token_ids[1], g.token_ids[2]] += 1
    return counts


def _p_value(counts: torch.Tensor, exact: torch.Tensor) -> float:
    expected = exact.flatten().double() * counts.sum().item()
    observed = counts.flatten().double()
    if observed[expected == 0].sum() > 0:
        return 0.0  # tokens the target can never produce (top-k / top-p) were sampled
    big = expected >= 5  # pool the rare cells so the chi-square approximation holds
    f_obs, f_exp = observed[big], expected[big]
    if expected[~big].sum() > 0:
        f_obs = torch.cat([f_obs, observed[~big].sum()[None]])
        f_exp = torch.cat([f_exp, expected[~big].sum()[None]])
    f_exp = f_exp / f_exp.sum() * f_obs.sum()
    return float(chisquare(f_obs.numpy(), f_exp.numpy()).pvalue)


CASES = {
    "chain": (SamplingParams(temperature=1.0), 2, 1, 2),
    "chain-topk-topp": (SamplingParams(temperature=0.9, top_k=6, top_p=0.9), 2, 1, 2),
    "tree": (SamplingParams(temperature=1.0), 2, 3, 6),
    "tree-topk-topp": (SamplingParams(temperature=1.2, top_k=5, top_p=0.85), 2, 3, 6),
}


@pytest.mark.parametrize("case", CASES)
def test_speculative_sampling_matches_the_target(target, drafter, case):
    params, depth, topk, budget = CASES[case]
    counts = _sampled_pairs(target, drafter, params, depth, topk, budget, seeded=False)
    assert _p_value(counts, _exact_pair_distribution(target, params)) > 1e-3


@pytest.mark.parametrize("case", ["chain", "tree-topk-topp"])
def test_seeded_speculative_sampling_matches_the_target(target, drafter, case):
    params, depth, topk, budget = CASES[case]
    counts = _sampled_pairs(target, drafter, params, depth, topk, budget, seeded=True)
    assert _p_value(counts, _exact_pair_distribution(target, params)) > 1e-3


class AcceptEverything(Verifier):
    """A broken verifier: takes the first child at every level, then the target's token after it."""

    @staticmethod
    def _first_children(tree) -> tuple[list[int], int]:
        node, accepted = -1, []
        while children := [i for i, p in enumerate(tree.parents.tolist()) if p == node]:
            node = children[0]
            accepted.append(node)
        return accepted, node

    def greedy(self, tree, choice):
        accepted, node = self._first_children(tree)
        return Verdict(accepted, int(choice[node + 1]))

    def sample(self, tree, probs, generator):
        accepted, node = self._first_children(tree)
        return Verdict(accepted, int(torch.multinomial(probs[node + 1], 1, generator=generator)))


@pytest.mark.parametrize(("case", "seeded"), [("chain", False), ("tree", False), ("tree", True)])
def test_broken_verifier_fails_the_same_test(target, drafter, case, seeded):
    params, depth, topk, budget = CASES[case]
    counts = _sampled_pairs(target, drafter, params, depth, topk, budget, seeded, verifier=AcceptEverything())
    assert _p_value(counts, _exact_pair_distribution(target, params)) < 1e-6
