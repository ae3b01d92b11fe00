"""Per-request sampling parameters and the target distribution they define.

The same `SamplingParams` shape the target's and the drafter's distributions (temperature, then top-k, then
top-p, as vLLM applies them), so speculative verification compares like with like.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """How one request samples. temperature 0 means greedy (argmax)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(128, ge=1, description="most tokens to generate")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass kept")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = all")
    seed: int | None = Field(None, description="seed of this request's random stream")
    stop: tuple[str, ...] = Field((), description="stop strings (not included in the output)")
    ignore_eos: bool = Field(False, description="keep generating past EOS")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution [..., vocab] from logits [..., vocab]: temperature, top-k, top-p.

    Example (top_k=2): logits [2., 1., 0.] at T=1 -> probs [0.731, 0.269, 0.].
    """
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        sorted_p = sorted_p.masked_fill(mass_before >= params.top_p, 0.0)  # always keeps the top token
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of logits [B, vocab] -> [B]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, params), 1, generator=generator).squeeze(-1)


def seeded_choice(probs: torch.Tensor, seed: int, positions: torch.Tensor) -> torch.Tensor:
    """Tokens [n] sampled from probs [n, vocab] by Gumbel-max with noise fixed by (seed, output position):
    argmax(log p + G) with G ~ Gumbel(0, 1) i.i.d. is an exact sample from p, and since G depends on nothing
    but the seed and the position, a seeded request gets the same tokens however it is batched, drafted or
    verified (speculation on or off, any tree, a drafter restart)."""
    out = torch.empty(probs.shape[0], dtype=torch.long)
    for i, position in enumerate(positions.tolist()):
        mixed = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) % 2**63
        u = torch.rand(probs.shape[-1], generator=torch.Generator().manual_seed(mixed), dtype=torch.float64)
        gumbel = -torch.log(-torch.log(u.clamp(1e-300, 1.0 - 1e-16)))
        out[i] = torch.argmax(torch.log(probs[i].double()) + gumbel)
    return out
