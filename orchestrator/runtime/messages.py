"""What travels between the scheduler and the two workers. Small messages (token ids, tree shapes, counts)
come back to the scheduler; the bulky ones (`Pairs`: the target's hidden states; the draft trees) go from one
worker to the other as Ray objects without passing through it:

    scheduler ──NewSequence / keep──> TargetWorker ──RoundOutput──> scheduler
                                           └──Pairs──────────────────────> DraftWorker ──DraftOutput──> scheduler
                                                         TargetWorker <──trees── ┘
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from orchestrator.spec.sampling import SamplingParams


@dataclass
class Pairs:
    """Target states for the drafter, packed across requests: `[a1 a2 a3 | b1 | c1 c2]`. Pair i of a request
    is the aux hidden state at its position i and the token at position i+1."""

    request_ids: list[str]
    counts: list[int]  # pairs per request
    tokens: torch.Tensor  # [M] x[t+1]
    aux: torch.Tensor  # [M, k * hidden] aux hidden states at t

    @property
    def nbytes(self) -> int:
        return self.tokens.nelement() * self.tokens.element_size() + self.aux.nelement() * self.aux.element_size()

    def split(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out, offset = {}, 0
        for rid, n in zip(self.request_ids, self.counts, strict=True):
            out[rid] = (self.tokens[offset : offset + n], self.aux[offset : offset + n])
            offset += n
        return out

    @classmethod
    def pack(cls, parts: dict[str, tuple[torch.Tensor, torch.Tensor]], width: int) -> Pairs:
        """parts: request -> (tokens [m], aux [m, width])."""
        if not parts:
            return cls([], [], torch.zeros(0, dtype=torch.long), torch.zeros(0, width))
        ids = list(parts)
        tokens = torch.cat([parts[r][0] for r in ids])
        aux = torch.cat([parts[r][1] for r in ids])
        return cls(ids, [parts[r][0].numel() for r in ids], tokens, aux)


@dataclass
class NewSequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class SeqUpdate:
    """What one request got from a target call: tokens and maybe a finish reason, or an error."""

    request_id: str
    tokens: list[int] = field(default_factory=list)  # emitted this round (cut at EOS / max_tokens)
    finish_reason: str | None = None  # "stop" (EOS) or "length"; None: still running
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of which accepted
    error: str | None = None  # the request failed here (the target holds nothing of it any more)
    status: int = 500  # with error: the HTTP status it means (400: the request itself is at fault)
    retry: bool = False  # with error: nothing was allocated for lack of room; admit it again later


@dataclass
class RoundOutput:
    """A target call: per-request updates, where the time went (wall-clock stamps for the timeline), and the
    target's KV slots afterwards."""

    updates: list[SeqUpdate]
    verified_tokens: int
    compute_s: float
    started: float
    pairs_bytes: int
    free_slots: int


@dataclass
class TreeSketch:
    """A draft tree as the scheduler sees it: enough to pick nodes by expected acceptance."""

    parents: torch.Tensor  # [n]
    scores: torch.Tensor  # [n] cumulative draft log-probability


@dataclass
class DraftOutput:
    sketches: dict[str, TreeSketch]
    compute_s: float
    started: float
    pairs_bytes: int
    incarnation: str  # differs after the actor restarted (its caches are then empty)
    seen: dict[str, int]  # pairs the drafter holds per drafted request
    retired: list[str]  # requests past the drafter's context: never drafted again
    free_slots: int
