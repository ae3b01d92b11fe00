"""Acceptance counters with vLLM's meaning, the one the whole project reports.

vLLM counts, per request-step that verified at least one draft token (`spec_decode_num_drafts`), the draft
tokens offered (`_num_draft_tokens`), those accepted (`_num_accepted_tokens`) and, per position, how often the
accepted path reached it (`_num_accepted_tokens_per_pos`). Acceptance length (tau) = 1 + accepted / drafts:
tokens per target step, the bonus token included. Steps that verified no draft do not count.

    drafts 4 (accepted paths of length 2, 0, 3, 1): accepted 6, per position [3, 2, 1], tau 1 + 6/4 = 2.5
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Acceptance:
    drafts: int = 0  # request-steps verified with at least one draft token
    draft_tokens: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # [d]: drafts whose accepted path reached depth d+1

    def record(self, drafted: int, accepted: int) -> None:
        """One request-step that verified `drafted` draft tokens and accepted `accepted` of them."""
        if drafted <= 0:
            return
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted += accepted
        self.accepted_per_pos += [0] * (accepted - len(self.accepted_per_pos))
        for d in range(accepted):
            self.accepted_per_pos[d] += 1

    def _combine(self, other: Acceptance, sign: int) -> Acceptance:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine = self.accepted_per_pos + [0] * (n - len(self.accepted_per_pos))
        theirs = other.accepted_per_pos + [0] * (n - len(other.accepted_per_pos))
        return Acceptance(
            self.drafts + sign * other.drafts,
            self.draft_tokens + sign * other.draft_tokens,
            self.accepted + sign * other.accepted,
            [a + sign * b for a, b in zip(mine, theirs, strict=True)],
        )

    def __add__(self, other: Acceptance) -> Acceptance:
        return self._combine(other, 1)

    def __sub__(self, other: Acceptance) -> Acceptance:
        """Counts between two snapshots of cumulative counters."""
        return self._combine(other, -1)

    @property
    def acceptance_length(self) -> float:
        """tau = 1 + accepted / drafts (1.0 before any draft)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    def per_position_rates(self) -> list[float]:
        """Share of drafts whose accepted path reached depth d+1."""
        return [n / self.drafts for n in self.accepted_per_pos] if self.drafts else []

    def summary(self) -> dict:
        return {
            "acceptance_length": round(self.acceptance_length, 4),
            "per_depth_acceptance": [round(r, 4) for r in self.per_position_rates()],
            "drafts": self.drafts,
        }

    def to_dict(self) -> dict:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted": self.accepted,
            "accepted_per_pos": list(self.accepted_per_pos),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Acceptance:
        return cls(int(d["drafts"]), int(d["draft_tokens"]), int(d["accepted"]), list(d.get("accepted_per_pos", [])))
