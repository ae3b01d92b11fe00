"""Lossless verification of a draft tree against the target's distributions.

Greedy (temperature 0): walk down from the root, following the child whose token is the target's argmax;
the argmax where the walk stops is the bonus (or correcting) token. Output = exactly greedy target decoding.

Sampling: recursive rejection sampling (SpecInfer; Sequoia/EAGLE). At a node with target distribution p,
try its children in drawing order. A child x drawn from q is accepted with probability min(1, p(x) / q(x));
on rejection p <- norm(max(p - q, 0)) and, since siblings are drawn without replacement, q <- norm(q with x
zeroed). A child chosen deterministically is a point mass (accepted with probability p(x); on rejection p(x)
<- 0). When every child is rejected (or at a leaf), the token is sampled from the residual p. Each stage is
an ordinary rejection-sampling step, so the emitted token has exactly the target's distribution.

    p = [.5 .3 .2], one child x ~ q = [.2 .6 .2]: x is accepted and equals y w.p. min(p(y), q(y)) = [.2 .3 .2];
    rejected w.p. .3, then drawn from norm(max(p - q, 0)) = [1 0 0]: P = [.2 + .3, .3, .2] = p exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orchestrator.engine.sampling import SamplingParams, probabilities, seeded_choice
from orchestrator.spec.tree import DraftTree


@dataclass
class Verdict:
    """The accepted path (node indices, root excluded) and the token the target adds after it."""

    accepted: list[int]
    next_token: int


class Verifier:
    """Greedy or sampling verification, chosen by the request's sampling parameters."""

    def verify(
        self,
        tree: DraftTree,
        logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        position: int | None = None,
    ) -> Verdict:
        """logits: [n+1, vocab], target logits at `[root, nodes...]` (row i+1 scores node i's children).

        position: the output index of the token sampled at the root. Given it, a seeded request samples each
        position by Gumbel-max with noise fixed by (seed, position) (`seeded_choice`) and accepts a draft iff it
        equals that sample: exact, and reproducible under any batching or tree.
        """
        if params.greedy:
            return self.greedy(tree, logits.argmax(dim=-1))
        if params.seed is not None and position is not None:
            positions = position + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths()])
            return self.greedy(tree, seeded_choice(probabilities(logits, params), params.seed, positions))
        return self.sample(tree, probabilities(logits, params), generator)

    @staticmethod
    def _children(tree: DraftTree) -> dict[int, list[int]]:
        children: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parents.tolist()):
            children.setdefault(p, []).append(i)
        return children

    def greedy(self, tree: DraftTree, argmax: torch.Tensor) -> Verdict:
        """argmax: [n+1] the target's token at `[root, nodes...]` (greedy, or a seeded request's sample)."""
        children, tokens = self._children(tree), tree.tokens.tolist()
        node, accepted = -1, []
        while True:
            want = int(argmax[node + 1])
            match = next((c for c in children.get(node, ()) if tokens[c] == want), None)
            if match is None:
                return Verdict(accepted, want)
            accepted.append(match)
            node = match

    def sample(self, tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
        """probs: [n+1, vocab] the target's sampling distributions at `[root, nodes...]`."""
        children, tokens = self._children(tree), tree.tokens.tolist()
        node, accepted = -1, []
        while True:
            p = probs[node + 1].double()
            q = tree.draft_probs.get(node)
            q = None if q is None else q.double().clone()
            for child in children.get(node, ()):
                x = tokens[child]
                u = torch.rand((), generator=generator, dtype=torch.float64)
                if q is None:  # a deterministic choice: a point-mass proposal
                    if u < p[x]:
                        break
                    p = p.clone()
                    p[x] = 0.0
                else:
                    if u < torch.clamp(p[x] / q[x], max=1.0):
                        break
                    p = torch.clamp(p - q, min=0.0)
                    q[x] = 0.0
                    q = q / q.sum() if q.sum() > 0 else q
                total = p.sum()
                assert total > 0, "residual distribution vanished: p == q, yet a draft was rejected"
                p = p / total
            else:
                token = int(torch.multinomial(p, 1, generator=generator))
                return Verdict(accepted, token)
            accepted.append(child)
            node = child
