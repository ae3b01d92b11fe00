"""Per-request sampling parameters, and each request's own random stream.

The same `SamplingParams` shape the target's and the drafter's distributions (temperature, then top-k, then
top-p, as vLLM applies them: `verify.probabilities`), so speculative verification compares like with like.
Every range is checked here, before a request reaches a worker: a value that would break sampling inside a
batch (a seed torch cannot take, a temperature whose logits overflow) is refused with a message naming it.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # torch.long, as vLLM's `seed` field
MIN_TEMPERATURE = 0.01  # below it (but above 0) logits / T overflow float32: use 0 for greedy


class SamplingParams(BaseModel):
    """How one request samples. temperature 0 means greedy (argmax)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    max_tokens: int = Field(128, ge=1, description="most tokens to generate")
    temperature: float = Field(0.0, ge=0.0, description=f"0 = greedy, else at least {MIN_TEMPERATURE}")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass kept")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = all")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="seed of this request's random stream")
    stop: tuple[str, ...] = Field((), description="stop strings (not included in the output)")
    ignore_eos: bool = Field(False, description="keep generating past EOS")

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if 0.0 < v < MIN_TEMPERATURE or not math.isfinite(v):
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def new_generator(params: SamplingParams, stream: int = 0) -> torch.Generator | None:
    """The request's own random stream: seeded by the request, else drawn from torch's global generator (so a
    program that seeds torch is reproducible). The draft side uses stream 1: a seeded request must not draw
    its drafts and its acceptance tests from the same numbers (correlated draws would break losslessness)."""
    if params.greedy:
        return None
    seed = int(torch.randint(0, 2**62, ())) if params.seed is None else params.seed
    return torch.Generator().manual_seed((seed * 0x9E3779B1 + stream) % 2**63 if stream else seed % 2**63)
