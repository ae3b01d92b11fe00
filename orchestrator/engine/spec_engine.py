"""The speculative decoding engine: draft rounds, lossless verification, continuous batching.

One `step()`:

    admit waiting requests  -> prefill their prompts (one packed target forward), sample the first token
    draft_round(live)       -> proposer turns each request's newest target states into a DraftTree
    verify_round(live, trees) -> one target forward over [root_a, tree_a... | root_b, tree_b... | ...]
                               (tree attention block per request), Verifier picks the accepted path and the
                               next token, the KV cache keeps root + path, the path's aux states go to the
                               proposer next round

Invariant between rounds: the target's cache holds every token of a request except the last emitted one
(the root of the next tree). Requests join and leave between rounds and carry their own SamplingParams.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from orchestrator.config import StrictModel
from orchestrator.engine.decode import Generation, check_context, new_generator
from orchestrator.engine.sampling import SamplingParams, sample
from orchestrator.models.target import TargetModel
from orchestrator.spec.proposer import EagleProposer, ProposeItem, Proposer
from orchestrator.spec.tree import DraftTree, pack_trees
from orchestrator.spec.verify import Verdict, Verifier


@dataclass
class RequestMetrics:
    """Speculation statistics of one request (vLLM's conventions: the bonus token counts)."""

    rounds: int = 0
    drafted: int = 0  # draft tokens offered to the target
    accepted: int = 0  # draft tokens accepted
    accepted_per_depth: list[int] = field(default_factory=list)  # rounds that accepted >= d+1 drafts
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per verification round: 1 + accepted / rounds."""
        return 1.0 + self.accepted / self.rounds if self.rounds else 1.0

    def per_depth_rates(self) -> list[float]:
        return [n / self.rounds for n in self.accepted_per_depth] if self.rounds else []

    def record(self, tree_size: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += tree_size
        self.accepted += accepted
        while len(self.accepted_per_depth) < accepted:
            self.accepted_per_depth.append(0)
        for d in range(accepted):
            self.accepted_per_depth[d] += 1


@dataclass
class Request:
    """A request inside the engine."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    budget: int  # draft tree nodes per round
    generator: torch.Generator | None
    output: list[int] = field(default_factory=list)
    slot: int = -1
    finish_reason: str | None = None
    text: str | None = None  # set when stop strings are checked
    pending_tokens: torch.Tensor | None = None  # [m] tokens following the new target states
    pending_aux: torch.Tensor | None = None  # [m, k * hidden] new target states for the proposer
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def root(self) -> int:
        return self.output[-1]


@dataclass
class StepStats:
    """One engine step: how much the target verified and how long each side took."""

    batch_size: int = 0
    verified_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0


class SpecEngine:
    """Speculative decoding over a `TargetModel` with an injected `Proposer` (None: target-only rounds)."""

    def __init__(
        self,
        target: TargetModel,
        proposer: Proposer | None,
        eos_token_ids: Sequence[int],
        budget: int,
        max_batch: int = 16,
        verifier: Verifier | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.target = target
        self.proposer = proposer
        self.eos_ids = frozenset(eos_token_ids)
        self.budget = budget
        self.max_batch = max_batch
        self.verifier = verifier or Verifier()
        self.detokenize = detokenize
        self.cache = target.new_cache(max_batch, max_tokens)
        self.waiting: list[Request] = []
        self.live: list[Request] = []
        self.finished: dict[int, Request] = {}
        self._next_id = 0
        self.last_step = StepStats()

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, budget: int | None = None) -> int:
        check_context(self.target, prompt_ids, params)
        request_id = self._next_id
        self._next_id += 1
        budget = self.budget if budget is None else budget
        self.waiting.append(Request(request_id, list(prompt_ids), params, budget, new_generator(params)))
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.live)

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Admit and prefill waiting requests, then one draft + verify round for every live request.
        Returns the requests that finished in this step. (Inference mode throughout: KV caches that grow
        inside the models' forwards are inference tensors, and compaction updates them in place.)"""
        stats = StepStats()
        done = self._admit(stats)
        batch = list(self.live)
        if batch:
            began = time.perf_counter()
            trees = self.draft_round(batch)
            stats.draft_s = time.perf_counter() - began
            began = time.perf_counter()
            done += self.verify_round(batch, trees)
            stats.verify_s = time.perf_counter() - began
            stats.batch_size = len(batch)
            stats.verified_tokens = sum(1 + t.size for t in trees)
            for r in batch:
                r.metrics.draft_s += stats.draft_s
                r.metrics.verify_s += stats.verify_s
        self.live = [r for r in self.live if r.finish_reason is None]
        self.last_step = stats
        return done

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        """Run prompts to completion (continuous batching); results in prompt order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        while self.has_unfinished():
            self.step()
        return [self.result(i) for i in ids]

    def result(self, request_id: int) -> Generation:
        r = self.finished.pop(request_id)
        return Generation(r.prompt_ids, r.output, r.finish_reason, r.metrics, r.text)

    # -- prefill ---------------------------------------------------------------------------------------------

    def _admit(self, stats: StepStats) -> list[Request]:
        room = self.max_batch - len(self.live)
        new, self.waiting = self.waiting[:room], self.waiting[room:]
        if not new:
            return []
        began = time.perf_counter()
        for r in new:
            r.slot = self.cache.allocate()
        out = self.target(
            torch.tensor([t for r in new for t in r.prompt_ids]),
            self.cache,
            torch.tensor([r.slot for r in new]),
            torch.tensor([len(r.prompt_ids) for r in new]),
            logits="last",
        )
        done, offset = [], 0
        for row, r in enumerate(new):
            token = int(sample(out.logits[row : row + 1], r.params, r.generator)[0])
            n = len(r.prompt_ids)
            r.pending_tokens = torch.tensor(r.prompt_ids[1:] + [token])
            r.pending_aux = out.aux_hidden[offset : offset + n]
            offset += n
            if self._emit(r, [token]):
                done.append(r)
            else:
                self.live.append(r)
        stats.prefill_s = time.perf_counter() - began
        return done

    # -- rounds ----------------------------------------------------------------------------------------------

    def draft_round(self, batch: list[Request]) -> list[DraftTree]:
        """One draft tree per request (empty trees when there is no proposer or no budget left)."""
        if self.proposer is None:
            return [DraftTree.empty() for _ in batch]
        items = [
            ProposeItem(r.request_id, r.pending_tokens, r.pending_aux, r.params, r.generator, self._round_budget(r))
            for r in batch
        ]
        return self.proposer.propose(items)

    def _round_budget(self, r: Request) -> int:
        """Never draft past max_tokens: a round emits at most budget + 1 tokens."""
        return max(0, min(r.budget, r.params.max_tokens - len(r.output) - 1))

    def verify_round(self, batch: list[Request], trees: list[DraftTree]) -> list[Request]:
        """Score every tree in one target forward, accept, compact the cache. Returns finished requests."""
        slots = torch.tensor([r.slot for r in batch])
        tokens, positions, num, block_mask = pack_trees([r.root for r in batch], trees, self.cache.lengths[slots])
        out = self.target(tokens, self.cache, slots, num, positions=positions, block_mask=block_mask)
        done, offset = [], 0
        for r, tree in zip(batch, trees, strict=True):
            rows = slice(offset, offset + 1 + tree.size)
            offset += 1 + tree.size
            verdict = self.verifier.verify(tree, out.logits[rows], r.params, r.generator)
            self._commit(r, tree, verdict, out.aux_hidden[rows])
            if self._emit(r, [int(tree.tokens[i]) for i in verdict.accepted] + [verdict.next_token]):
                done.append(r)
        return done

    def _commit(self, r: Request, tree: DraftTree, verdict: Verdict, aux: torch.Tensor) -> None:
        """Keep root + accepted path in the target cache; queue their states for the proposer."""
        keep = torch.tensor([0] + [1 + i for i in verdict.accepted])
        self.cache.keep_appended(r.slot, keep)
        r.pending_aux = aux[keep]
        r.pending_tokens = torch.cat([tree.tokens[verdict.accepted], torch.tensor([verdict.next_token])])
        r.metrics.record(tree.size, len(verdict.accepted))

    def _emit(self, r: Request, tokens: list[int]) -> bool:
        """Append tokens up to EOS / max_tokens / a stop string; finish and release the request if one hit."""
        for token in tokens:
            r.output.append(token)
            if token in self.eos_ids and not r.params.ignore_eos:
                r.finish_reason = "stop"
                break
            if len(r.output) >= r.params.max_tokens:
                r.finish_reason = "length"
                break
        if r.params.stop and self.detokenize is not None:
            self._check_stop_strings(r, len(tokens))
        if r.finish_reason is None:
            return False
        self.cache.release(r.slot)
        if self.proposer is not None:
            self.proposer.release(r.request_id)
        self.finished[r.request_id] = r
        return True

    def _check_stop_strings(self, r: Request, added: int) -> None:
        text = self.detokenize(r.output)
        hits = [(text.find(s), s) for s in r.params.stop if s in text]
        if hits:
            index, _ = min(hits)
            for n in range(max(1, len(r.output) - added), len(r.output) + 1):
                if any(s in self.detokenize(r.output[:n]) for s in r.params.stop):
                    del r.output[n:]
                    break
            r.text, r.finish_reason = text[:index], "stop"


class SpecConfig(StrictModel):
    """How to speculate: a chain of `num_spec_tokens`, or an EAGLE-2 dynamic tree."""

    method: Literal["chain", "tree"] = Field("chain", description="chain drafts or dynamic trees")
    num_spec_tokens: int = Field(3, ge=1, description="chain: draft tokens per round")
    depth: int = Field(4, ge=1, description="tree: most draft levels")
    topk: int = Field(4, ge=1, description="tree: children per expanded node and nodes expanded per level")
    budget: int = Field(16, ge=1, description="tree: most draft tokens the target verifies per request")

    def shape(self) -> tuple[int, int, int]:
        """(depth, topk, budget) of the proposer."""
        if self.method == "chain":
            return self.num_spec_tokens, 1, self.num_spec_tokens
        return self.depth, self.topk, self.budget


def load_spec_engine(
    target_dir: str | Path,
    drafter_dir: str | Path,
    spec: SpecConfig,
    eos_token_ids: Sequence[int],
    max_batch: int = 16,
    detokenize: Callable[[list[int]], str] | None = None,
) -> SpecEngine:
    """A SpecEngine over a target directory and a vLLM-format drafter, the target reading the drafter's aux
    layers."""
    from orchestrator.errors import AerieError
    from orchestrator.models.checkpoint import load_drafter
    from orchestrator.models.target import read_hf_config

    drafter = load_drafter(drafter_dir, packed=True)
    hf = read_hf_config(target_dir)
    if drafter.config.vocab_size != hf["vocab_size"] or drafter.config.target_hidden_size != hf["hidden_size"]:
        raise AerieError(
            f"drafter {drafter_dir} was built for vocab {drafter.config.vocab_size} / hidden "
            f"{drafter.config.target_hidden_size}, the target has {hf['vocab_size']} / {hf['hidden_size']}"
        )
    target = TargetModel.from_pretrained(target_dir, aux_layer_ids=drafter.config.aux_layer_ids)
    if not drafter.config.stores_embeddings:
        drafter.share_embedding(target.embed_tokens)
    depth, topk, budget = spec.shape()
    proposer = EagleProposer(drafter, depth, topk, max_requests=max_batch)
    return SpecEngine(target, proposer, eos_token_ids, budget, max_batch=max_batch, detokenize=detokenize)
