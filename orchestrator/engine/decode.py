"""Target-only decoding, batched across requests: the baseline that speculative decoding must equal.

prefill: [p1 p1 p1 | p2 p2 | ...]  (packed prompts, logits of each last token only)
decode:  [a | b | c ...]           (one token per live request and step; finished requests leave)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from orchestrator.engine.sampling import SamplingParams, sample
from orchestrator.errors import AerieError
from orchestrator.models.target import TargetModel

if TYPE_CHECKING:
    from orchestrator.engine.spec_engine import RequestMetrics


@dataclass
class Generation:
    """The result of one request."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length" (max_tokens)
    metrics: RequestMetrics | None = None  # speculative decoding statistics
    text: str | None = None  # set when a stop string cut the output


@dataclass
class _Live:
    index: int
    slot: int
    params: SamplingParams
    generator: torch.Generator | None
    result: Generation


def new_generator(params: SamplingParams, stream: int = 0) -> torch.Generator | None:
    """The request's own random stream (seeded when the request says so). Disaggregated serving gives the
    draft side stream 1: a seeded request must not draw its drafts and its acceptance tests from the same
    numbers (the draws would be correlated, which breaks losslessness)."""
    if params.greedy:
        return None
    generator = torch.Generator()
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed if stream == 0 else (params.seed * 0x9E3779B1 + stream) % 2**63)
    return generator


def check_context(model: TargetModel, prompt: Sequence[int], params: SamplingParams) -> None:
    """A prompt plus its max_tokens must fit the model's context window (a user error otherwise)."""
    window = model.cfg.max_position_embeddings
    if not prompt:
        raise AerieError("empty prompt")
    if len(prompt) + params.max_tokens > window:
        raise AerieError(
            f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds the context window of {window}"
        )


def is_finished(result: Generation, params: SamplingParams, eos_ids: frozenset[int]) -> bool:
    """Set `finish_reason` once the last token is EOS or max_tokens is reached."""
    if not params.ignore_eos and result.token_ids and result.token_ids[-1] in eos_ids:
        result.finish_reason = "stop"
    elif len(result.token_ids) >= params.max_tokens:
        result.finish_reason = "length"
    return result.finish_reason is not None


class TargetDecoder:
    """Plain decoding with `TargetModel`, up to `max_batch` requests at a time."""

    def __init__(self, model: TargetModel, eos_token_ids: Sequence[int], max_batch: int = 16) -> None:
        self.model = model
        self.eos_ids = frozenset(eos_token_ids)
        self.max_batch = max_batch

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        """Generate for every prompt (token ids); results come back in prompt order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        for p, sp in zip(prompts, params, strict=True):
            check_context(self.model, p, sp)
        results = [Generation(list(p)) for p in prompts]
        for start in range(0, len(prompts), self.max_batch):
            chunk = range(start, min(start + self.max_batch, len(prompts)))
            self._run(chunk, results, params)
        return results

    def _run(self, indices: range, results: list[Generation], params: Sequence[SamplingParams]) -> None:
        max_len = max(len(results[i].prompt_ids) + params[i].max_tokens for i in indices)
        cache = self.model.new_cache(len(indices), max_len)
        live = [_Live(i, cache.allocate(), params[i], new_generator(params[i]), results[i]) for i in indices]
        tokens = torch.tensor([t for r in live for t in r.result.prompt_ids])
        num = torch.tensor([len(r.result.prompt_ids) for r in live])
        while live:
            slots = torch.tensor([r.slot for r in live])
            logits = self.model(tokens, cache, slots, num, logits="last").logits  # [B, vocab]
            next_ids = self._sample(logits, live)
            still = []
            for r, token in zip(live, next_ids.tolist(), strict=True):
                r.result.token_ids.append(token)
                if is_finished(r.result, r.params, self.eos_ids):
                    cache.release(r.slot)
                else:
                    still.append(r)
            live = still
            tokens = torch.tensor([r.result.token_ids[-1] for r in live], dtype=torch.long)
            num = torch.ones(len(live), dtype=torch.long)

    @staticmethod
    def _sample(logits: torch.Tensor, live: list[_Live]) -> torch.Tensor:
        if all(r.params.greedy for r in live):
            return logits.argmax(dim=-1)
        return torch.stack([sample(logits[i : i + 1], r.params, r.generator)[0] for i, r in enumerate(live)])
