"""The two sides of disaggregated speculative decoding. In serving each runs as a Ray actor, on its own node
group (GB200: target nodes and draft nodes); the `SpecScheduler` drives them:

    SpecScheduler ──prefill(new) / verify(keep, trees_ref)──────────> TargetWorker  (target + KV caches)
          │ <──────── RoundOutput (token ids, finish, timings) + pairs_ref ──┘
          └──propose(items, [pairs_ref, ...])──> DraftWorker                      (drafter + its KV caches)
                <── TreeSketch per request (parents, scores) + trees_ref ──┘

`pairs_ref` (the aux hidden states of the tokens the target just committed, with the token following each)
goes straight from the target's node to the draft node as a Ray object, and `trees_ref` (the draft trees,
with their draft distributions when sampling) straight back: the scheduler sees only token ids, tree shapes
and scores, which is all it needs to split the verification budget.

The target worker keeps every request's committed pairs, so a restarted draft worker can be brought back up
to date (`history`) and speculation resumes mid-request.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from orchestrator.engine.decode import new_generator
from orchestrator.engine.sampling import SamplingParams, probabilities, sample, seeded_choice
from orchestrator.models.target import TargetModel
from orchestrator.spec.proposer import EagleProposer, ProposeItem, Proposer
from orchestrator.spec.tree import DraftTree, pack_trees
from orchestrator.spec.verify import Verifier


@dataclass
class Pairs:
    """Target states for the drafter, packed across requests: `[a1 a2 a3 | b1 | c1 c2]`."""

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
    def pack(cls, parts: dict[str, tuple[torch.Tensor, torch.Tensor]], hidden: int) -> Pairs:
        if not parts:
            return cls([], [], torch.zeros(0, dtype=torch.long), torch.zeros(0, hidden))
        ids = list(parts)
        tokens = torch.cat([parts[r][0] for r in ids])
        aux = torch.cat([parts[r][1] for r in ids])
        return cls(ids, [parts[r][0].numel() for r in ids], tokens, aux)


@dataclass
class SeqUpdate:
    """What one request got from a target round."""

    request_id: str
    tokens: list[int]  # emitted this round (cut at EOS / max_tokens)
    finish_reason: str | None  # "stop" (EOS) or "length"; None: still running
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of which accepted


@dataclass
class RoundOutput:
    """A target round: per-request updates and where the time went (wall-clock stamps for the timeline)."""

    updates: list[SeqUpdate]
    verified_tokens: int
    compute_s: float
    started: float
    pairs_bytes: int


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


@dataclass
class NewSequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class _Seq:
    slot: int
    params: SamplingParams
    generator: torch.Generator | None
    length: int = 0  # tokens emitted
    root: int = -1  # last emitted token (not yet in the cache)
    history: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # committed pairs


def _first_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The token after the prompt (output position 0), sampled as every later one is."""
    if params.seed is not None and not params.greedy:
        return seeded_choice(probabilities(logits, params), params.seed, torch.zeros(1, dtype=torch.long))[0]
    return sample(logits, params, generator)[0]


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


class TargetWorker:
    """The target model, the KV caches of up to `max_batch` requests, and lossless verification."""

    def __init__(
        self,
        model_dir: str | Path,
        aux_layer_ids: Sequence[int],
        eos_token_ids: Sequence[int],
        max_batch: int = 16,
        torch_threads: int | None = None,
    ) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.model = TargetModel.from_pretrained(model_dir, aux_layer_ids=tuple(aux_layer_ids))
        self.cache = self.model.new_cache(max_batch)
        self.eos_ids = frozenset(eos_token_ids)
        self.verifier = Verifier()
        self.seqs: dict[str, _Seq] = {}

    def ready(self) -> dict:
        return {"node_id": _node_id(), "pid": os.getpid(), "threads": torch.get_num_threads()}

    @torch.inference_mode()
    def prefill(self, new: list[NewSequence]) -> tuple[RoundOutput, Pairs]:
        """Prefill prompts (one packed forward), sample each first token."""
        began, stamp = time.perf_counter(), time.time()
        self.release([s.request_id for s in new])  # a retried prefill starts over
        for s in new:
            self.seqs[s.request_id] = _Seq(self.cache.allocate(), s.params, new_generator(s.params))
        seqs = [self.seqs[s.request_id] for s in new]
        out = self.model(
            torch.tensor([t for s in new for t in s.prompt_ids]),
            self.cache,
            torch.tensor([q.slot for q in seqs]),
            torch.tensor([len(s.prompt_ids) for s in new]),
            logits="last",
        )
        updates, parts, offset = [], {}, 0
        for row, (s, q) in enumerate(zip(new, seqs, strict=True)):
            token = int(_first_token(out.logits[row : row + 1], q.params, q.generator))
            n = len(s.prompt_ids)
            pair = (torch.tensor(s.prompt_ids[1:] + [token]), out.aux_hidden[offset : offset + n].clone())
            offset += n
            updates.append(self._emit(s.request_id, q, [token], pair, parts))
        pairs = Pairs.pack(parts, out.aux_hidden.shape[-1])
        tokens = sum(len(s.prompt_ids) for s in new)
        return RoundOutput(updates, tokens, time.perf_counter() - began, stamp, pairs.nbytes), pairs

    @torch.inference_mode()
    def verify(self, keep: dict[str, list[int]], trees: dict[str, DraftTree] | None) -> tuple[RoundOutput, Pairs]:
        """One target forward over `[root_a, tree_a... | root_b, tree_b... | ...]` for the requests in `keep`
        (each tree cut to its `keep` nodes; no tree: a target-only step), then accept and compact."""
        began, stamp = time.perf_counter(), time.time()
        ids = list(keep)
        chosen = [
            trees[r].subtree(keep[r]) if trees is not None and r in trees and keep[r] else DraftTree.empty()
            for r in ids
        ]
        seqs = [self.seqs[r] for r in ids]
        slots = torch.tensor([q.slot for q in seqs])
        tokens, positions, num, block_mask = pack_trees([q.root for q in seqs], chosen, self.cache.lengths[slots])
        out = self.model(tokens, self.cache, slots, num, positions=positions, block_mask=block_mask)
        updates, parts, offset = [], {}, 0
        for rid, q, tree in zip(ids, seqs, chosen, strict=True):
            rows = slice(offset, offset + 1 + tree.size)
            offset += 1 + tree.size
            verdict = self.verifier.verify(tree, out.logits[rows], q.params, q.generator, position=q.length)
            kept = torch.tensor([0] + [1 + i for i in verdict.accepted])
            self.cache.keep_appended(q.slot, kept)
            emitted = [int(tree.tokens[i]) for i in verdict.accepted] + [verdict.next_token]
            pair = (torch.tensor(emitted), out.aux_hidden[rows][kept].clone())
            update = self._emit(rid, q, emitted, pair, parts)
            update.drafted, update.accepted = tree.size, len(verdict.accepted)
            updates.append(update)
        pairs = Pairs.pack(parts, out.aux_hidden.shape[-1])
        return RoundOutput(updates, int(num.sum()), time.perf_counter() - began, stamp, pairs.nbytes), pairs

    def _emit(self, rid: str, q: _Seq, tokens: list[int], pair: tuple, parts: dict) -> SeqUpdate:
        """Append tokens up to EOS / max_tokens; a finished request frees its slot."""
        out, reason = [], None
        for token in tokens:
            out.append(token)
            q.length += 1
            if token in self.eos_ids and not q.params.ignore_eos:
                reason = "stop"
                break
            if q.length >= q.params.max_tokens:
                reason = "length"
                break
        q.root = out[-1]
        if reason is None:
            q.history.append(pair)
            parts[rid] = pair
        else:
            self.release([rid])
        return SeqUpdate(rid, out, reason)

    def history(self, request_ids: list[str]) -> Pairs:
        """Every committed pair of these requests (to bring a restarted draft worker up to date)."""
        parts = {
            r: (torch.cat([p[0] for p in self.seqs[r].history]), torch.cat([p[1] for p in self.seqs[r].history]))
            for r in request_ids
            if r in self.seqs and self.seqs[r].history
        }
        return Pairs.pack(parts, self.model.hidden_size * len(self.model.aux_layer_ids))

    def release(self, request_ids: list[str]) -> None:
        for r in request_ids:
            q = self.seqs.pop(r, None)
            if q is not None:
                self.cache.release(q.slot)


class DraftWorker:
    """The drafter (or an injected `Proposer`) and its KV caches; turns target states into draft trees."""

    def __init__(
        self,
        drafter_dir: str | Path | None,
        target_dir: str | Path,
        depth: int,
        topk: int,
        max_requests: int = 16,
        torch_threads: int | None = None,
        proposer_factory: Callable[[], Proposer] | None = None,
    ) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        if proposer_factory is not None:
            self.proposer = proposer_factory()
        else:
            self.proposer = EagleProposer(_load_drafter(drafter_dir, target_dir), depth, topk, max_requests)
        self.generators: dict[str, torch.Generator | None] = {}
        self.live: set[str] = set()
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"

    def ready(self) -> dict:
        return {"node_id": _node_id(), "pid": os.getpid(), "threads": torch.get_num_threads()}

    def propose(
        self, requests: list[tuple[str, SamplingParams, int]], pairs: list, reset: bool = False
    ) -> tuple[DraftOutput, dict[str, DraftTree]]:
        """requests: (request_id, params, most nodes); pairs: `Pairs` (or refs to them) not yet drafted from,
        oldest first. Pairs of requests not drafted now (finished meanwhile) are dropped. reset: the pairs are
        the requests' whole histories (after a restart): forget what is cached for them first."""
        import ray

        began, stamp = time.perf_counter(), time.time()
        if reset:
            self.release([rid for rid, _, _ in requests])
        pairs = [ray.get(p) if isinstance(p, ray.ObjectRef) else p for p in pairs]
        nbytes = sum(p.nbytes for p in pairs)
        new: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for p in pairs:
            for rid, pair in p.split().items():
                new.setdefault(rid, []).append(pair)
        items = []
        for rid, params, budget in requests:
            got = new.get(rid)
            if not got:  # nothing new to draft from (cannot happen in order; be safe: no draft this round)
                continue
            if rid not in self.generators:
                self.generators[rid] = new_generator(params, stream=1)  # never the target's stream
                self.live.add(rid)
            tokens, aux = torch.cat([g[0] for g in got]), torch.cat([g[1] for g in got])
            items.append(ProposeItem(rid, tokens, aux, params, self.generators[rid], budget))
        trees = dict(zip([i.request_id for i in items], self.proposer.propose(items), strict=True)) if items else {}
        sketches = {
            rid: TreeSketch(t.parents, t.scores if t.scores is not None else torch.zeros(t.size))
            for rid, t in trees.items()
        }
        return DraftOutput(sketches, time.perf_counter() - began, stamp, nbytes, self.incarnation), trees

    def release(self, request_ids: list[str]) -> None:
        for r in request_ids:
            if r in self.live:
                self.live.discard(r)
                self.generators.pop(r, None)
                self.proposer.release(r)


def _load_drafter(drafter_dir: str | Path | None, target_dir: str | Path):
    """A vLLM-format drafter; one that shares the target's embedding gets just that tensor from the target."""
    from safetensors import safe_open
    from torch import nn

    from orchestrator.errors import AerieError
    from orchestrator.models.checkpoint import load_drafter

    if drafter_dir is None:
        raise AerieError("speculation needs a drafter directory")
    drafter = load_drafter(drafter_dir, packed=True)
    if not drafter.config.stores_embeddings:
        for file in sorted(Path(target_dir).glob("*.safetensors")):
            with safe_open(file, framework="pt") as f:
                if "model.embed_tokens.weight" in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    weight = f.get_tensor("model.embed_tokens.weight").float()
                    drafter.share_embedding(nn.Embedding.from_pretrained(weight, freeze=True))
                    break
        else:
            raise AerieError(f"{target_dir}: no model.embed_tokens.weight for the drafter to share")
    return drafter
