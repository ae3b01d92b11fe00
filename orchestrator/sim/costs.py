"""What simulated workers charge for their calls, and how often drafts are accepted.

A forward over `tokens` new tokens of `seqs` sequences that attend to `context` cached tokens in all takes

    fixed_s + tree_s [a tree mask]  +  weights_s + per_context_s * context   (reading: weights, KV cache,
                                       + expert_s * E (1 - (1 - k/E)^tokens)    and the MoE experts touched)
                                    +  per_token_s * tokens                     (compute)

with the reading and the compute summed (a CPU: `roofline: false`) or overlapped, the larger one counting
(a GPU's roofline: a decode step reads the weights, a long prefill is compute-bound). `fit_step_cost` fits the
summed form to measured steps; `configs/*/plan.yaml` give roofline constants with their sources.

Acceptance (`AcceptanceProfile`): the drafter's top-ranked child at depth d is accepted, given its parent was,
with probability `chain[d-1]`; a lower-ranked sibling, tried after the ones before it were rejected, with
`sibling x chain[d-1]`. Measured per-position rates (share of drafts reaching depth d) give `chain` as their
successive ratios (`from_rates`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from pydantic import Field, model_validator

from orchestrator.config import StrictModel


class StepCost(StrictModel):
    """Seconds one forward of a worker takes (see the module docstring)."""

    fixed_s: float = Field(0.0, ge=0, description="per forward: launches, framework, the per-layer floor")
    tree_s: float = Field(0.0, ge=0, description="extra per forward that verifies draft tokens (a tree mask)")
    weights_s: float = Field(0.0, ge=0, description="reading the weights once per forward")
    per_token_s: float = Field(0.0, ge=0, description="compute per new token")
    per_context_s: float = Field(0.0, ge=0, description="reading one cached token (KV) of one sequence")
    experts: int = Field(0, ge=0, description="MoE: routed experts per layer (0: a dense model)")
    experts_per_token: int = Field(0, ge=0, description="MoE: experts each token is routed to")
    expert_s: float = Field(0.0, ge=0, description="MoE: reading one routed expert of every layer")
    roofline: bool = Field(False, description="reading and compute overlap (a GPU): the larger counts")

    def experts_read(self, tokens: int) -> float:
        """Expected distinct experts `tokens` tokens touch per layer: E (1 - (1 - k/E)^tokens)."""
        if not self.experts or tokens <= 0:
            return 0.0
        return self.experts * (1 - (1 - self.experts_per_token / self.experts) ** tokens)

    def seconds(self, tokens: int, context: int = 0, tree: bool = False) -> float:
        memory = self.weights_s + self.per_context_s * context + self.expert_s * self.experts_read(tokens)
        compute = self.per_token_s * tokens
        body = max(memory, compute) if self.roofline else memory + compute
        return self.fixed_s + (self.tree_s if tree else 0.0) + body


class Link(StrictModel):
    """The network between the two workers (or the same device: bandwidth inf, latency 0)."""

    bandwidth_bytes_s: float = Field(math.inf, gt=0, description="bytes per second one way")
    latency_s: float = Field(0.0, ge=0, description="one transfer's fixed cost")

    def seconds(self, nbytes: int) -> float:
        return 0.0 if nbytes <= 0 else self.latency_s + nbytes / self.bandwidth_bytes_s


class CostModel(StrictModel):
    """Both workers' costs and what travels between them."""

    target: StepCost = Field(description="a verify or decode step of the target")
    prefill: StepCost | None = Field(None, description="a prefill step of the target (default: `target`'s)")
    draft: StepCost = Field(description="one drafter forward (the catch-up of new states, or one tree level)")
    link: Link = Field(default_factory=Link)
    call_s: float = Field(0.0, ge=0, description="per worker call: RPC and scheduling, beside the compute")
    round_s: float = Field(
        0.0, ge=0, description="per target call: the server's own work (scheduling, streaming, HTTP), beside the calls"
    )
    colocated: bool = Field(
        False, description="drafter and target share one device: their calls queue on it (vLLM's EAGLE)"
    )
    aux_bytes_per_token: int = Field(
        ge=0, description="target -> draft per committed token: k aux hidden states (+ the token id)"
    )
    tree_bytes_per_node: int = Field(24, ge=0, description="draft -> target per draft node (token, parent, score)")


class AcceptanceProfile(StrictModel):
    """How often the target accepts draft tokens (see the module docstring)."""

    chain: list[float] = Field(min_length=1, description="per depth: P(top child accepted | parent accepted)")
    sibling: float = Field(0.35, ge=0, le=1, description="a lower-ranked sibling's chance, relative to chain[d]")
    calibration: float = Field(1.0, gt=0, description="the drafter's scores claim this x the true probability")

    @model_validator(mode="after")
    def _probabilities(self) -> AcceptanceProfile:
        if any(not 0 <= p <= 1 for p in self.chain):
            raise ValueError(f"chain acceptance rates must lie in [0, 1], got {self.chain}")
        return self

    @classmethod
    def from_rates(cls, rates: list[float], **kw) -> AcceptanceProfile:
        """From per-position rates (share of drafts whose accepted path reached depth d, `Acceptance.
        per_position_rates`): chain[d] = rates[d] / rates[d-1]."""
        chain, before = [], 1.0
        for r in rates:
            chain.append(min(1.0, r / before) if before > 0 else 0.0)
            before = r
        return cls(chain=chain or [0.0], **kw)

    def p(self, depth: int, rank: int) -> float:
        """P(accepted | parent accepted, earlier siblings rejected) of the child ranked `rank` at `depth` (1-based)."""
        a = self.chain[min(depth, len(self.chain)) - 1]
        return a if rank == 0 else self.sibling * a

    def chain_length(self, k: int) -> float:
        """Expected tokens per round of a chain of k drafts: 1 + sum over d of prod of chain[:d]."""
        total, reach = 1.0, 1.0
        for d in range(1, k + 1):
            reach *= self.p(d, 0)
            total += reach
        return total


@dataclass
class Step:
    """One measured call: `forwards` forwards over `tokens` new tokens in all (a drafter's call runs one per tree
    level), attending to `context` cached tokens, with a tree mask or not, in `seconds`."""

    tokens: int
    seconds: float
    context: int = 0
    tree: bool = False
    forwards: int = 1


def fit_step_cost(steps: list[Step]) -> StepCost:
    """Least squares of the summed form over measured calls: fixed (per forward), tree, per token and per context
    token, each at least 0 (a column that never varies is left out). Returns the CPU (summed) form."""
    if len(steps) < 4:
        raise ValueError(f"fit_step_cost needs at least 4 measured steps, got {len(steps)}")
    x = torch.tensor([[float(s.forwards), float(s.tree), float(s.tokens), float(s.context)] for s in steps])
    y = torch.tensor([s.seconds for s in steps], dtype=torch.float32)
    free = [j for j in range(4) if j == 0 or x[:, j].std() > 0]
    while True:  # non-negative least squares by dropping columns with negative coefficients (4 at most)
        solution = torch.linalg.lstsq(x[:, free], y[:, None]).solution[:, 0]
        negative = [j for j, c in zip(free, solution.tolist(), strict=True) if c < 0 and j != 0]
        if not negative:
            break
        free = [j for j in free if j not in negative]
    coef = torch.zeros(4)
    coef[free] = solution.clamp_min(0)
    fixed, tree, per_token, per_context = coef.tolist()
    return StepCost(fixed_s=fixed, tree_s=tree, per_token_s=per_token, per_context_s=per_context)
