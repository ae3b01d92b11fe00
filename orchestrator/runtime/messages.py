"""What travels between the scheduler and the two workers. Small messages (token ids, tree shapes, counts)
come back to the scheduler; the bulky ones (`Pairs`: the target's hidden states; the draft trees) go from one
worker to the other as Ray objects without passing through it:

    scheduler ──NewSequence / keep──> TargetWorker ──RoundOutput──> scheduler
                                           └──Pairs──────────────────────> DraftWorker ──DraftOutput──> scheduler
                                                         TargetWorker <──trees── ┘

Every message, and anything else that travels (a `DraftTree`, a `keep` dict), has a size in bytes by one rule,
`payload_nbytes`: tensor data plus small fixed sizes for the other fields (Ray's pickle framing not counted).
The scheduler counts the bytes that go between the two workers with it (`runtime/metrics.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from pydantic import BaseModel

from orchestrator.spec.sampling import SamplingParams


def payload_nbytes(obj) -> int:
    """Bytes of what travels: a tensor's data (elements x element size), 8 per int or float, 1 per bool, a
    string's UTF-8 length, summed through dataclasses, pydantic models, lists, tuples and dicts (keys too).

        Pairs(["r1"], [2], tokens [2] int64, aux [2, 1728] float32) -> 2 + 8 + 2*8 + 2*1728*4 = 13850
    """
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size()
    if obj is None:
        return 0
    if isinstance(obj, bool):
        return 1
    if isinstance(obj, int | float):
        return 8
    if isinstance(obj, str):
        return len(obj.encode())
    if isinstance(obj, dict):
        return sum(payload_nbytes(k) + payload_nbytes(v) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return sum(payload_nbytes(x) for x in obj)
    if dataclasses.is_dataclass(obj):
        return sum(payload_nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, BaseModel):
        return sum(payload_nbytes(getattr(obj, name)) for name in type(obj).model_fields)
    raise TypeError(f"payload_nbytes: no size rule for {type(obj).__name__}")


class Message:
    """A message between the scheduler and the workers: `nbytes` is its size (`payload_nbytes`)."""

    @property
    def nbytes(self) -> int:
        return payload_nbytes(self)


class Pair(NamedTuple):
    """One request's pairs, in order: pair i is the token at position t+1 and the aux state at t."""

    tokens: torch.Tensor  # [m] int64
    aux: torch.Tensor  # [m, k * hidden] the target's aux hidden states (k layers, concatenated)


@dataclass
class Pairs(Message):
    """Target states for the drafter, packed across requests: `[a1 a2 a3 | b1 | c1 c2]`. Pair i of a request
    is the aux hidden state at its position i and the token at position i+1."""

    request_ids: list[str]
    counts: list[int]  # pairs per request
    tokens: torch.Tensor  # [M] x[t+1]
    aux: torch.Tensor  # [M, k * hidden] aux hidden states at t

    def split(self) -> dict[str, Pair]:
        out, offset = {}, 0
        for rid, n in zip(self.request_ids, self.counts, strict=True):
            out[rid] = Pair(self.tokens[offset : offset + n], self.aux[offset : offset + n])
            offset += n
        return out

    @classmethod
    def pack(cls, parts: dict[str, Pair], width: int) -> Pairs:
        """parts: request -> its pairs (aux [m, width])."""
        if not parts:
            return cls([], [], torch.zeros(0, dtype=torch.long), torch.zeros(0, width))
        ids = list(parts)
        tokens = torch.cat([parts[r].tokens for r in ids])  # [M]
        aux = torch.cat([parts[r].aux for r in ids])  # [M, width]
        return cls(ids, [parts[r].tokens.numel() for r in ids], tokens, aux)


@dataclass
class NewSequence(Message):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    capture: bool = False  # the traffic tap may keep it (the server decided: tap on, the client did not opt out)


@dataclass
class SeqUpdate(Message):
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
class RoundOutput(Message):
    """A target call: per-request updates, where the time went (wall-clock stamps for the timeline), and the
    target's KV slots afterwards."""

    updates: list[SeqUpdate]
    verified_tokens: int
    compute_s: float
    started: float
    pairs_bytes: int  # the Pairs returned with it (they go to the draft worker)
    free_slots: int


@dataclass
class TreeSketch(Message):
    """A draft tree as the scheduler sees it: enough to pick nodes by expected acceptance."""

    parents: torch.Tensor  # [n]
    scores: torch.Tensor  # [n] cumulative draft log-probability


@dataclass
class DraftOutput(Message):
    sketches: dict[str, TreeSketch]
    compute_s: float
    started: float
    pairs_bytes: int  # the Pairs this call read (sent by the target worker)
    incarnation: str  # differs after the actor restarted (its caches are then empty)
    seen: dict[str, int]  # pairs the drafter holds per drafted request
    retired: list[str]  # requests past the drafter's context: never drafted again
    free_slots: int
    trees_bytes: int  # the trees returned with it (they go to the target worker)
    ingested: int = 0  # target states (pairs) the drafter took in before drafting
