"""The two sides of speculative decoding, each implemented once. The in-process engine calls them directly
(`LocalWorker`); disaggregated serving runs each as a Ray actor on its own node group (GB200: target nodes
and draft nodes, `RemoteWorker`). The `SpecScheduler` drives both the same way:

    SpecScheduler ──prefill(new) / verify(keep, trees)──> TargetWorker  (target model, KV caches, verification)
          │ <──────── RoundOutput (token ids, finish, slots) + Pairs ──┘
          └──propose(requests, [Pairs, ...])──> DraftWorker                 (drafter, its KV caches)
                <── DraftOutput (tree sketches) + trees ──┘

Between calls the target's cache holds every token of a request except the last emitted one (the root of
the next tree). The target keeps every request's committed pairs, so a restarted draft worker (or one that
skipped rounds) is brought up to date (`history`) and speculation resumes mid-request.

Failures stay with their request: a request the target cannot serve (a prompt past the context, a
distribution that is not finite, an id it no longer holds) gets an error update, and nothing of it is kept;
the other requests of the call go on. Everything a request allocates is checked for first.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from orchestrator.data.traffic import Captured, TapConfig, TrafficTap
from orchestrator.errors import AerieError
from orchestrator.models.device import DTYPES
from orchestrator.models.target import TargetModel, config_sha256
from orchestrator.runtime.messages import (
    DraftOutput,
    NewSequence,
    Pair,
    Pairs,
    RoundOutput,
    SeqUpdate,
    TreeSketch,
    payload_nbytes,
)
from orchestrator.spec.proposer import ProposeItem, Proposer
from orchestrator.spec.sampling import SamplingParams, new_generator
from orchestrator.spec.tree import DraftTree, pack_trees
from orchestrator.spec.verify import Verifier

log = logging.getLogger(__name__)


def finish_reason(token: int, length: int, params: SamplingParams, eos_ids: frozenset[int]) -> str | None:
    """The one EOS / length rule: "stop" on EOS (unless ignore_eos), "length" at max_tokens, else None."""
    if token in eos_ids and not params.ignore_eos:
        return "stop"
    return "length" if length >= params.max_tokens else None


@dataclass
class _Seq:
    slot: int
    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int] = field(default_factory=list)
    length: int = 0  # tokens emitted
    root: int = -1  # last emitted token (not yet in the cache)
    history: list[Pair] = field(default_factory=list)  # committed pairs, one per call that emitted tokens
    final: list[torch.Tensor] | None = None  # kept for the traffic tap: [m, hidden] per pair, else None


def _best(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max and argmax [T] of a call's logits [T, V], on the CPU: one pass (and one copy from a GPU) for
    the whole batch, which every request's verdict then reads (`Verifier.verify`)."""
    values, indices = logits.max(dim=-1)
    return values.cpu(), indices.cpu()


def _identity() -> dict:
    import ray

    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
    return {"node_id": node, "pid": os.getpid(), "threads": torch.get_num_threads()}


class TargetWorker:
    """The target model, the KV caches of up to `max_batch` requests, and lossless verification."""

    def __init__(
        self,
        model: TargetModel | str | Path,
        eos_token_ids: Sequence[int],
        max_batch: int = 16,
        aux_layer_ids: Sequence[int] | None = None,
        torch_threads: int | None = None,
        verifier: Verifier | None = None,
        device: str = "auto",
        dtype: str = "auto",
        max_model_len: int | None = None,
        tap: TapConfig | None = None,
        tap_writer: str | None = None,
    ) -> None:
        """model: a loaded TargetModel (in-process) or its directory (a Ray actor loads it on its node, onto
        `device` in `dtype`: auto = its GPU in bfloat16 when it has one). max_model_len: tokens per request
        (prompt + output) the KV caches are sized for (default: the model's context). tap: the traffic tap's
        config (enabled): a sampled share of the finished requests it is allowed to capture is written there, in the
        folder `tap_writer` (default: host-pid; a restarted actor passes its name to keep its folder and budget)."""
        if torch_threads:
            torch.set_num_threads(torch_threads)
        model_dir = Path(model) if isinstance(model, str | Path) else None
        if isinstance(model, str | Path):
            aux = tuple(aux_layer_ids) if aux_layer_ids else None
            model = TargetModel.from_pretrained(model, aux_layer_ids=aux, dtype=dtype, device=device)
        self.model = model
        self.max_batch = max_batch
        self.cache = model.new_cache(max_batch, max_model_len)
        self.context = self.cache.max_tokens
        self.width = model.hidden_size * len(model.aux_layer_ids)
        self.eos_ids = frozenset(eos_token_ids)
        self.verifier = verifier or Verifier()
        self.seqs: dict[str, _Seq] = {}
        self.tap = self._start_tap(tap, model_dir, tap_writer) if tap is not None and tap.enabled else None
        self._sampler = random.Random(0)

    def _start_tap(self, cfg: TapConfig, model_dir: Path | None, writer: str | None) -> TrafficTap:
        """The tap, its manifest naming the target as a collection's does (training checks it against its own)."""
        model = self.model
        meta = {
            "name": model_dir.name if model_dir is not None else "target",
            "config_sha256": config_sha256(model_dir) if model_dir is not None else None,
            "hidden_size": model.hidden_size,
            "num_hidden_layers": getattr(model, "num_layers", None),
            "vocab_size": model.vocab_size,
            "aux_layer_ids": list(model.aux_layer_ids),
        }
        return TrafficTap(cfg, meta, writer=writer or f"{socket.gethostname()}-{os.getpid()}")

    def ready(self) -> dict:
        return _identity() | {
            "free_slots": self.cache.free_slots,
            "max_batch": self.max_batch,
            "context": self.context,
            **({"tap": dataclasses.asdict(self.tap.stats)} if self.tap is not None else {}),
        }

    def _check(self, s: NewSequence) -> str | None:
        """Why the target cannot take this request (None: it can)."""
        n = len(s.prompt_ids)
        if n == 0:
            return "empty prompt"
        if n + s.params.max_tokens > self.context:
            return (
                f"prompt of {n} tokens + max_tokens {s.params.max_tokens} exceeds the context window of {self.context}"
            )
        if not all(0 <= t < self.model.vocab_size for t in s.prompt_ids):
            return f"prompt token ids must be in 0..{self.model.vocab_size - 1}"
        return None

    @torch.inference_mode()
    def prefill(self, new: list[NewSequence]) -> tuple[RoundOutput, Pairs]:
        """Prefill prompts (one packed forward) and choose each first token (output position 0)."""
        began, stamp = time.perf_counter(), time.time()
        updates, admitted = [], []
        for s in new:
            self.release([s.request_id])  # a retried prefill starts over
            try:  # everything that can fail before anything is allocated
                error, generator = self._check(s), new_generator(s.params)
            except Exception as err:  # noqa: BLE001 (this request fails, the others go on)
                error = f"bad sampling parameters: {err}"
            if error is not None:
                updates.append(SeqUpdate(s.request_id, error=error, status=400))
            elif not self.cache.free_slots:
                updates.append(SeqUpdate(s.request_id, error="no free KV slot on the target", status=503, retry=True))
            else:
                q = _Seq(self.cache.allocate(), s.params, generator, list(s.prompt_ids))
                if s.capture and self.tap is not None and self._sampler.random() < self.tap.cfg.sample:
                    q.final = []
                self.seqs[s.request_id] = q
                admitted.append(s)
        parts, tokens = {}, sum(len(s.prompt_ids) for s in admitted)
        if admitted:
            seqs = [self.seqs[s.request_id] for s in admitted]
            try:  # out.logits [B, V] (each prompt's last position), out.aux_hidden [T, k * hidden]
                out = self.model(
                    torch.tensor([t for s in admitted for t in s.prompt_ids]),  # [T] every prompt, packed
                    self.cache,
                    torch.tensor([q.slot for q in seqs]),  # [B]
                    torch.tensor([len(s.prompt_ids) for s in admitted]),  # [B] tokens each
                    logits="last",
                )
            except BaseException:
                self.release([s.request_id for s in admitted])
                raise
            offset, best = 0, _best(out.logits)
            for row, (s, q) in enumerate(zip(admitted, seqs, strict=True)):
                rows = slice(offset, offset + len(s.prompt_ids))
                aux = out.aux_hidden[rows]  # [n, k * hidden]
                offset += len(s.prompt_ids)
                try:
                    one = slice(row, row + 1)
                    top = (best[0][one], best[1][one])
                    token = self.verifier.verify(DraftTree.empty(), out.logits[one], q.params, q.generator, 0, top)
                    pair = Pair(torch.tensor(s.prompt_ids[1:] + [token.next_token]), aux.to("cpu", copy=True))
                    final = self._kept(out.final_hidden[rows]) if q.final is not None else None  # [n, H]
                    updates.append(self._emit(s.request_id, q, [token.next_token], pair, parts, final))
                except Exception as err:  # noqa: BLE001 (this request fails, the others go on)
                    updates.append(self._fail(s.request_id, err))
        return self._output(updates, tokens, began, stamp, parts)

    @torch.inference_mode()
    def verify(self, keep: dict[str, list[int]], trees: dict[str, DraftTree] | None) -> tuple[RoundOutput, Pairs]:
        """One target forward over `[root_a, tree_a... | root_b, tree_b... | ...]` for the requests in `keep`
        (each tree cut to its `keep` nodes; no tree: a target-only step), then accept and compact."""
        began, stamp = time.perf_counter(), time.time()
        updates = [
            SeqUpdate(r, error="the target no longer holds this request (the target restarted)", status=503)
            for r in keep
            if r not in self.seqs
        ]
        ids = [r for r in keep if r in self.seqs]
        seqs = [self.seqs[r] for r in ids]
        chosen = [self._tree(r, q, keep[r], trees) for r, q in zip(ids, seqs, strict=True)]
        parts, verified = {}, sum(1 + t.size for t in chosen)
        if ids:
            slots = torch.tensor([q.slot for q in seqs])  # [B]
            # tokens [T] (T = sum of 1 + tree size), positions [T], num [B], block_mask: tree attention
            tokens, positions, num, block_mask = pack_trees([q.root for q in seqs], chosen, self.cache.lengths[slots])
            if verified == len(ids):  # target-only: plain causal decoding (no mask to apply: ~3% faster here)
                positions = block_mask = None
            try:  # out.logits [T, V], out.aux_hidden [T, k * hidden]
                out = self.model(tokens, self.cache, slots, num, positions=positions, block_mask=block_mask)
            except BaseException:
                self.release(ids)
                raise
            offset, compact, best = 0, {}, _best(out.logits)
            for rid, q, tree in zip(ids, seqs, chosen, strict=True):
                rows = slice(offset, offset + 1 + tree.size)  # its root and tree nodes
                offset += 1 + tree.size
                try:
                    top = (best[0][rows], best[1][rows])
                    verdict = self.verifier.verify(tree, out.logits[rows], q.params, q.generator, q.length, top)
                    kept = torch.tensor([0] + [1 + i for i in verdict.accepted])  # [a + 1] rows: root + accepted path
                    compact[q.slot] = kept
                    emitted = [int(tree.tokens[i]) for i in verdict.accepted] + [verdict.next_token]  # a + 1 tokens
                    aux = out.aux_hidden[rows][kept.to(out.aux_hidden.device)]  # [a + 1, k * hidden]
                    pair = Pair(torch.tensor(emitted), aux.to("cpu", copy=True))  # what the draft side is sent
                    final = None
                    if q.final is not None:  # [a + 1, hidden] for the tap
                        final = self._kept(out.final_hidden[rows][kept.to(out.final_hidden.device)])
                    update = self._emit(rid, q, emitted, pair, parts, final)
                    update.drafted, update.accepted = tree.size, len(verdict.accepted)
                except Exception as err:  # noqa: BLE001 (this request fails, the others go on)
                    compact.pop(q.slot, None)
                    update = self._fail(rid, err)
                updates.append(update)
            try:  # the cache keeps root + accepted path of every request (one move per layer for all)
                self.cache.keep_appended(list(compact), list(compact.values()))
            except BaseException:
                self.release(ids)
                raise
        return self._output(updates, verified, began, stamp, parts)

    def _tree(self, rid: str, q: _Seq, keep: list[int], trees: dict[str, DraftTree] | None) -> DraftTree:
        """The request's tree cut to `keep`, and to what its cache still has room for (drafts are optional: a
        tree that does not fit its request is dropped, the round goes on target-only for it)."""
        tree = (trees or {}).get(rid)
        if tree is None or not keep:
            return DraftTree.empty()
        try:
            tree = tree.subtree(keep)
        except (AssertionError, IndexError, KeyError) as err:
            log.warning("request %s: draft tree unusable (%s); verifying without it", rid, err)
            return DraftTree.empty()
        room = self.context - int(self.cache.lengths[q.slot]) - 1
        return tree if tree.size <= room else tree.subtree(list(range(max(0, room))))  # prefixes stay closed

    def _emit(
        self, rid: str, q: _Seq, tokens: list[int], pair: Pair, parts: dict[str, Pair], final: torch.Tensor | None
    ) -> SeqUpdate:
        """Append tokens up to EOS / max_tokens; a finished request frees its slot (and, kept for the tap, is
        offered to it). final: [rows of pair, hidden] when the request is kept for the tap."""
        out, reason = [], None
        for token in tokens:
            out.append(token)
            q.length += 1
            reason = finish_reason(token, q.length, q.params, self.eos_ids)
            if reason is not None:
                break
        q.root = out[-1]
        if reason is None:
            q.history.append(pair)
            parts[rid] = pair
            if q.final is not None:
                q.final.append(final)
        else:
            if q.final is not None:
                self._offer(q, pair, final, len(out))
            self.release([rid])
        return SeqUpdate(rid, out, reason)

    def _kept(self, final: torch.Tensor) -> torch.Tensor:
        """Final hidden states kept for the tap: on the CPU, already in the shards' dtype (bf16: 1/6 of what the
        request's aux history holds)."""
        return final.to("cpu", DTYPES[self.tap.cfg.dtype], copy=True)

    def _offer(self, q: _Seq, last: Pair, final: torch.Tensor, emitted: int) -> None:
        """A finished request to the tap: positions 0..T-1 of prompt + answer, T = prompt + answer - 1 (the
        last token was never forwarded); of this call's rows only the first `emitted` (the answer was cut at
        EOS / max_tokens). Never raises: a tap problem is not the request's."""
        try:
            pairs = [*q.history, Pair(last.tokens[:emitted], last.aux[:emitted])]
            finals = [*q.final, final[:emitted]]
            answer = torch.cat([p.tokens for p in pairs])[len(q.prompt_ids) - 1 :]  # [E] every emitted token
            if answer.numel() < 2:
                return  # nothing to learn from: no answer token is an input
            ids = torch.cat([torch.tensor(q.prompt_ids), answer[:-1]])  # [T]
            mask = torch.arange(ids.numel()) >= len(q.prompt_ids)  # [T] the answer's tokens
            aux = torch.cat([p.aux for p in pairs]).to(DTYPES[self.tap.cfg.dtype])  # [T, k * hidden]
            fin = torch.cat(finals)  # [T, hidden]: already the shards' dtype
            self.tap.offer(Captured(ids, mask, aux, fin))
        except Exception:  # noqa: BLE001
            log.exception("the traffic tap could not take a finished request")

    def _fail(self, rid: str, err: Exception) -> SeqUpdate:
        log.exception("request %s failed in the target worker", rid, exc_info=err)
        self.release([rid])
        return SeqUpdate(rid, error=f"{type(err).__name__}: {err}")

    def _output(self, updates, tokens: int, began: float, stamp: float, parts: dict) -> tuple[RoundOutput, Pairs]:
        pairs = Pairs.pack(parts, self.width)
        took = time.perf_counter() - began
        out = RoundOutput(updates, tokens, took, stamp, pairs.nbytes, self.cache.free_slots)
        return out, pairs

    def history(self, request_ids: list[str], since: dict[str, int] | None = None) -> tuple[int, Pairs]:
        """The committed pairs of these requests from pair `since[r]` on (default: all of them), to bring a
        draft worker up to date. Returns (bytes, pairs)."""
        parts = {}
        for r in request_ids:
            q = self.seqs.get(r)
            start = (since or {}).get(r, 0)
            if q is None or not q.history:
                continue
            tokens = torch.cat([p.tokens for p in q.history])  # [m]
            aux = torch.cat([p.aux for p in q.history])  # [m, k * hidden]
            if tokens.numel() > start:
                parts[r] = Pair(tokens[start:], aux[start:])
        pairs = Pairs.pack(parts, self.width)
        return pairs.nbytes, pairs

    def close_tap(self, timeout_s: float = 30.0) -> dict | None:
        """Write what the traffic tap still holds and stop it (the replica is shutting down): its stats, or None
        without a tap. Requests finishing after it are not captured."""
        if self.tap is None:
            return None
        self.tap.close(timeout_s)
        return dataclasses.asdict(self.tap.stats)

    def release(self, request_ids: list[str]) -> None:
        """Forget these requests (unknown ids are ignored: a release may cross the request's own end)."""
        for r in request_ids:
            q = self.seqs.pop(r, None)
            if q is not None:
                self.cache.release(q.slot)


class DraftWorker:
    """A proposer (the EAGLE drafter, or a test's) and the requests it drafts for; turns target states into
    draft trees."""

    def __init__(
        self, proposer: Proposer | Callable[[], Proposer], max_requests: int = 16, torch_threads: int | None = None
    ) -> None:
        """proposer: the proposer (in-process) or a factory that builds it (a Ray actor builds it on its node,
        fetching the drafter there). A factory that fails leaves a worker whose `ready()` and `propose()` raise
        its error in one line (the traceback is logged): the replica reports it instead of waiting."""
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.error: str | None = None
        if hasattr(proposer, "propose"):
            self.proposer = proposer
        else:
            try:
                self.proposer = proposer()
            except Exception as err:  # noqa: BLE001 (kept and raised by ready(), see above)
                log.exception("the draft worker could not build its proposer")
                self.proposer, self.error = None, " ".join(f"{type(err).__name__}: {err}".split())
        self.max_requests = max_requests
        self.max_context: int | None = getattr(self.proposer, "max_context", None)
        self.depth: int = getattr(self.proposer, "depth", 0)
        self.generators: dict[str, torch.Generator | None] = {}  # the requests drafted for
        self.seen: dict[str, int] = {}  # pairs committed per request
        self.retired: dict[str, None] = {}  # past the drafter's context: never drafted again
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"

    @property
    def free_slots(self) -> int:
        return self.max_requests - len(self.generators)

    def _check_built(self) -> None:
        if self.error is not None:
            raise AerieError(f"the draft worker (node {_identity()['node_id']}) has no proposer: {self.error}")

    def ready(self) -> dict:
        self._check_built()
        return _identity() | {
            "free_slots": self.free_slots,
            "max_requests": self.max_requests,
            "max_context": self.max_context,
            "incarnation": self.incarnation,
        }

    @torch.inference_mode()
    def propose(
        self, requests: list[tuple[str, SamplingParams, int]], reset: Sequence[str] = (), *pairs: Pairs
    ) -> tuple[DraftOutput, dict[str, DraftTree]]:
        """requests: (request_id, params, most nodes); reset: requests whose pairs are their whole history again
        (forget them first); pairs: `Pairs` not yet drafted from, oldest first, each its own argument (Ray
        resolves a top-level ref before the call, inlined when small; a ref inside a list would cost this
        worker a `ray.get`, one more round trip per call). Pairs of requests not drafted now are dropped."""
        self._check_built()
        began, stamp = time.perf_counter(), time.time()
        self.release(list(reset))
        new: dict[str, list[Pair]] = {}
        for p in pairs:
            for rid, pair in p.split().items():
                new.setdefault(rid, []).append(pair)
        items, retired = [], []
        for rid, params, budget in requests:
            got = new.get(rid)
            if not got or rid in self.retired:
                continue
            count = sum(g.tokens.numel() for g in got)
            if self.max_context is not None and self.seen.get(rid, 0) + count + self.depth > self.max_context:
                self.release([rid])
                self.retired[rid] = None
                retired.append(rid)
                continue
            if rid not in self.generators:
                if not self.free_slots:
                    continue  # more requests than slots: this one goes undrafted
                self.generators[rid] = new_generator(params, stream=1)  # never the target's stream
            self.seen[rid] = self.seen.get(rid, 0) + count
            tokens = torch.cat([g.tokens for g in got])  # [m] new since its last draft
            aux = torch.cat([g.aux for g in got])  # [m, k * hidden]
            items.append(ProposeItem(rid, tokens, aux, params, self.generators[rid], budget))
        trees = dict(zip([i.request_id for i in items], self.proposer.propose(items), strict=True)) if items else {}
        sketches = {
            rid: TreeSketch(t.parents, t.scores if t.scores is not None else torch.zeros(t.size))  # [n] each
            for rid, t in trees.items()
        }
        out = DraftOutput(
            sketches=sketches,
            compute_s=time.perf_counter() - began,
            started=stamp,
            pairs_bytes=sum(p.nbytes for p in pairs),
            incarnation=self.incarnation,
            seen={rid: self.seen[rid] for rid in trees},
            retired=retired,
            free_slots=self.free_slots,
            trees_bytes=payload_nbytes(trees),
            ingested=sum(i.tokens.numel() for i in items),
        )
        return out, trees

    def release(self, request_ids: list[str]) -> None:
        for r in request_ids:
            self.retired.pop(r, None)
            if r in self.generators:
                del self.generators[r]
                self.seen.pop(r, None)
                self.proposer.release(r)
