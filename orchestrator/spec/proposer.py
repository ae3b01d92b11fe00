"""Proposers turn a request's newest target states into a draft tree. `EagleProposer` drafts with an
EAGLE-3 / 3.1 drafter: chains (topk 1) or EAGLE-2 dynamic trees.

Each round the engine hands over, per request, the pairs the target just produced: the aux hidden state at
position t and the token x[t+1] that follows it (after prefill: the whole prompt plus the first sampled
token; after a round: the root plus the accepted path, with the token emitted after it). The drafter appends
those pairs to its KV cache for good (positions t), then drafts speculatively above them:

    committed pairs ... (h_t, x_t+1)  ->  depth 1 (token d1, rope t+1)  ->  depth 2 (d2, rope t+2) ...

Speculative entries are dropped at the start of the next round. Dynamic trees (EAGLE-2): at every depth the
`topk` best frontier nodes (by cumulative draft log-probability) get `topk` children each; after `depth`
levels the best `budget` nodes are kept, always with their parents and earlier-drawn siblings, which keeps
verification lossless. Sampling requests draw children from the draft distribution q without replacement
(Gumbel top-k) and record q; greedy requests take the top-k deterministically.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import torch
from pydantic import Field

from orchestrator.config import StrictModel
from orchestrator.models.drafter import Drafter
from orchestrator.spec.sampling import SamplingParams
from orchestrator.spec.tree import BestFirst, DraftTree
from orchestrator.spec.verify import probabilities

if TYPE_CHECKING:
    from orchestrator.tracking.store import DrafterRef


class SpecConfig(StrictModel):
    """How to speculate: a chain of `num_spec_tokens`, or an EAGLE-2 dynamic tree."""

    method: Literal["chain", "tree"] = Field("chain", description="chain drafts or dynamic trees")
    num_spec_tokens: int = Field(3, ge=1, description="chain: draft tokens per round")
    depth: int = Field(4, ge=1, description="tree: most draft levels")
    topk: int = Field(4, ge=1, description="tree: children per expanded node and nodes expanded per level")
    budget: int = Field(16, ge=1, description="tree: most draft tokens the target verifies per request")

    def shape(self) -> tuple[int, int, int]:
        """(depth, topk, most nodes per request) of the proposer."""
        if self.method == "chain":
            return self.num_spec_tokens, 1, self.num_spec_tokens
        return self.depth, self.topk, self.budget


@dataclass
class ProposeItem:
    """One request's input to a drafting round."""

    request_id: str
    tokens: torch.Tensor  # [m] x[t+1] for each new target state
    aux: torch.Tensor  # [m, k * target_hidden] aux hidden states at positions t
    params: SamplingParams
    generator: torch.Generator | None
    budget: int  # most tree nodes this round (0: no draft)


class Proposer(Protocol):
    """What the draft side needs from a drafting method (EAGLE, or a test's replay proposer). A proposer with
    a bounded context also has `max_context` (tokens, drafted ones included) and `depth`."""

    def propose(self, items: list[ProposeItem]) -> list[DraftTree]: ...

    def release(self, request_id: str) -> None: ...


@dataclass
class _Candidate:
    parent: int  # candidate index of the parent, -1 = root
    token: int
    score: float  # cumulative draft log-probability
    depth: int
    order: int  # rank among its siblings (drawing order)
    children: list[int] = field(default_factory=list)


@dataclass
class _Growing:
    """A request's tree while it grows (candidates in creation order)."""

    item: ProposeItem
    slot: int
    base_position: int  # rope position of the last committed pair
    committed: int  # drafter cache length before speculation
    candidates: list[_Candidate] = field(default_factory=list)
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)  # parent -> [vocab] its children's q
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # candidate -> [hidden] drafter state (forwarded)
    in_cache: list[int] = field(default_factory=list)  # candidates whose KV entries follow `committed`


class EagleProposer:
    """Draft trees from an EAGLE-3 / 3.1 drafter (its KV cache holds one slot per live request)."""

    def __init__(self, drafter: Drafter, depth: int, topk: int, max_requests: int = 64, max_tokens: int | None = None):
        assert depth >= 1 and topk >= 1
        self.drafter = drafter
        self.depth, self.topk = depth, topk
        self.cache = drafter.new_cache(max_requests, max_tokens)
        self.max_context = self.cache.max_tokens
        self.slots: dict[str, int] = {}
        self.committed: dict[str, int] = {}

    def release(self, request_id: str) -> None:
        if request_id in self.slots:
            self.cache.release(self.slots.pop(request_id))
            self.committed.pop(request_id)

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem]) -> list[DraftTree]:
        growing = self._commit_pairs(items)
        active = [g for g in growing if g.item.budget > 0]
        for depth in range(2, self.depth + 1):
            expand = [(g, self._frontier(g, depth - 1)) for g in active if depth <= g.item.budget]
            expand = [(g, nodes) for g, nodes in expand if nodes]
            if not expand:
                break
            logits = self._forward_nodes(expand)  # [N, draft_vocab] the expanded nodes', in order
            self._add_children([(g, node) for g, nodes in expand for node in nodes], logits)
        return [self._select(g) for g in growing]

    def _commit_pairs(self, items: list[ProposeItem]) -> list[_Growing]:
        """Append each request's new (state, token) pairs for good; draft depth 1 from the last one."""
        for item in items:
            if item.request_id not in self.slots:
                self.slots[item.request_id] = self.cache.allocate()
                self.committed[item.request_id] = 0
            self.cache.truncate(self.slots[item.request_id], self.committed[item.request_id])
        slots = torch.tensor([self.slots[i.request_id] for i in items])  # [B]
        num = torch.tensor([i.tokens.numel() for i in items])  # [B] new pairs each
        aux = torch.cat([i.aux for i in items]).to(self.drafter.device, self.drafter.dtype)  # [M, k * target_hidden]
        hidden = self.drafter.combine_aux(aux)  # [M, hidden]
        last = torch.cumsum(num, 0) - 1  # [B] each request's last row
        # out.logits [B, draft_vocab], out.next_hidden [B, hidden]: its last pair's
        out = self.drafter(torch.cat([i.tokens for i in items]), hidden, self.cache, slots, num, rows=last)
        growing = []
        for row, item in enumerate(items):
            committed = int(self.cache.lengths[self.slots[item.request_id]])
            self.committed[item.request_id] = committed
            g = _Growing(item, self.slots[item.request_id], committed - 1, committed)
            g.hidden[-1] = out.next_hidden[row]
            growing.append(g)
        drafting = [row for row, g in enumerate(growing) if g.item.budget > 0]
        self._add_children([(growing[row], -1) for row in drafting], out.logits[drafting])
        return growing

    def _add_children(self, nodes: list[tuple[_Growing, int]], draft_logits: torch.Tensor) -> None:
        """Draw `topk` children of each (request, parent) (parent -1 = root) from its row of draft logits
        [len(nodes), draft_vocab]. Greedy requests' rows in one top-k, sampled requests' one by one."""
        greedy = [i for i, (g, _) in enumerate(nodes) if g.item.params.greedy]
        top: dict[int, tuple[list[int], list[float]]] = {}
        if greedy:  # the top k over the draft vocabulary (everything else has probability 0)
            rows = draft_logits if len(greedy) == len(nodes) else draft_logits[greedy]  # [G, draft_vocab]
            best = torch.topk(torch.log_softmax(rows.float(), dim=-1), self.topk)  # values, indices [G, k]
            tokens, logps = self.drafter.to_target_ids(best.indices).tolist(), best.values.tolist()
            top = dict(zip(greedy, zip(tokens, logps, strict=True), strict=True))
        for i, (g, parent) in enumerate(nodes):
            tokens, logps = top[i] if i in top else self._draw(g, parent, draft_logits[i])
            self._append(g, parent, tokens, logps)

    def _draw(self, g: _Growing, parent: int, draft_logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """`topk` children of `parent` drawn without replacement from the request's sampling distribution over its
        draft logits [draft_vocab] (kept in `draft_probs` for verification): tokens and their log-probabilities."""
        logits = self.drafter.target_logits(draft_logits[None])[0]  # [vocab], -inf outside the draft vocab
        q = probabilities(logits, g.item.params).cpu()  # [vocab], drawn with the request's (CPU) generator
        logq = torch.log(q)  # [vocab]
        gumbel = -torch.log(-torch.log(torch.rand(q.shape, generator=g.item.generator).clamp_min(1e-20)))
        keys = torch.topk(logq + gumbel, self.topk)  # values, indices [k]
        drawn = keys.indices[torch.isfinite(keys.values)]  # drawn without replacement, in drawing order
        g.draft_probs[parent] = q
        return drawn.tolist(), logq[drawn].tolist()

    def _append(self, g: _Growing, parent: int, tokens: list[int], logps: list[float]) -> None:
        """Add `parent`'s children (tokens in drawing order, their draft log-probabilities) as candidates."""
        base = 0.0 if parent < 0 else g.candidates[parent].score
        depth = 1 if parent < 0 else g.candidates[parent].depth + 1
        for order, (token, logp) in enumerate(zip(tokens, logps, strict=True)):
            g.candidates.append(_Candidate(parent, token, base + logp, depth, order))
            if parent >= 0:
                g.candidates[parent].children.append(len(g.candidates) - 1)

    def _frontier(self, g: _Growing, depth: int) -> list[int]:
        """The `topk` best candidates at `depth` (by cumulative log-probability) to expand next."""
        at_depth = [i for i, c in enumerate(g.candidates) if c.depth == depth]
        return sorted(at_depth, key=lambda i: -g.candidates[i].score)[: self.topk]

    def _forward_nodes(self, expand: list[tuple[_Growing, list[int]]]) -> torch.Tensor:
        """Run the drafter on the nodes to expand: each sees the committed prefix and its own ancestors. Returns
        their draft logits [N, draft_vocab], in order."""
        tokens, hidden, positions, masks = [], [], [], []
        for g, nodes in expand:
            width = len(g.in_cache) + len(nodes)
            mask = torch.zeros(len(nodes), width, dtype=torch.bool)  # [nodes, drafted cache + nodes]
            for row, node in enumerate(nodes):
                ancestors = set(_ancestors(g, node))
                mask[row, : len(g.in_cache)] = torch.tensor([c in ancestors for c in g.in_cache], dtype=torch.bool)
                mask[row, len(g.in_cache) + row] = True
                parent = g.candidates[node].parent
                tokens.append(g.candidates[node].token)
                hidden.append(g.hidden[parent])
                positions.append(g.base_position + g.candidates[node].depth)
            masks.append(mask)
        width = max(m.shape[1] for m in masks)
        rows = max(m.shape[0] for m in masks)
        block = torch.zeros(len(expand), rows, width, dtype=torch.bool)  # [B, most nodes, widest mask]
        for b, m in enumerate(masks):
            block[b, : m.shape[0], : m.shape[1]] = m
        slots = torch.tensor([g.slot for g, _ in expand])  # [B]
        num = torch.tensor([len(nodes) for _, nodes in expand])  # [B] nodes each (N in all)
        starts = torch.tensor([g.committed for g, _ in expand])  # [B] where each one's mask starts
        out = self.drafter(  # out.logits [N, draft_vocab], out.next_hidden [N, hidden]
            torch.tensor(tokens),  # [N]
            torch.stack(hidden),  # [N, hidden] each node's parent state
            self.cache,
            slots,
            num,
            positions=torch.tensor(positions),
            block_mask=block,
            mask_start=starts,
        )
        row = 0
        for g, nodes in expand:
            for node in nodes:
                g.hidden[node] = out.next_hidden[row]
                row += 1
            g.in_cache.extend(nodes)
        return out.logits

    def _select(self, g: _Growing) -> DraftTree:
        """Keep the `budget` best candidates, each with its parent and earlier-drawn siblings."""
        if g.item.budget <= 0 or not g.candidates:
            return DraftTree.empty()
        cands = g.candidates
        order = BestFirst([([c.parent for c in cands], [c.score for c in cands])])
        chosen: list[int] = []
        while len(chosen) < g.item.budget and (best := order.pop()) is not None:
            order.take(*best)
            chosen.append(best[1])
        chosen.sort(key=lambda i: (cands[i].depth, i))  # parents first, siblings in drawing order
        index = {node: pos for pos, node in enumerate(chosen)}
        tokens = torch.tensor([cands[i].token for i in chosen])  # [n]
        parents = torch.tensor([index[cands[i].parent] if cands[i].parent >= 0 else -1 for i in chosen])  # [n]
        probs = {index.get(p, -1) if p >= 0 else -1: q for p, q in g.draft_probs.items() if p < 0 or p in index}
        scores = torch.tensor([cands[i].score for i in chosen])  # [n] cumulative draft log-probability
        return DraftTree(tokens, parents, probs, scores)


def _ancestors(g: _Growing, node: int) -> list[int]:
    out = []
    parent = g.candidates[node].parent
    while parent >= 0:
        out.append(parent)
        parent = g.candidates[parent].parent
    return out


def load_eagle_proposer(
    source: str | Path | DrafterRef,
    target_dir: str | Path,
    depth: int,
    topk: int,
    max_requests: int,
    *,
    cache_dir: str | Path = "runs/drafter-cache",
    aux_layer_ids: Sequence[int] | None = None,
    device: str = "auto",
    dtype: str = "auto",
    max_model_len: int | None = None,
) -> EagleProposer:
    """An EagleProposer over a vLLM-format drafter for the target in `target_dir`. A drafter that shares the
    target's embedding gets just that tensor, read by name from the target's safetensors.

    source: a drafter directory, or a pinned `DrafterRef`, fetched here into `cache_dir` (on this node: a
    draft worker fetches its own copy). aux_layer_ids: the layers the target captures; a drafter that reads
    other layers is refused. device, dtype: where the drafter runs (auto: this worker's GPU in bfloat16 when
    it has one); max_model_len: tokens per request its KV cache is sized for (default: its config's)."""
    from torch import nn

    from orchestrator.errors import AerieError
    from orchestrator.models.checkpoint import load_drafter
    from orchestrator.models.target import load_safetensors_dir, read_hf_config
    from orchestrator.tracking.store import DrafterRef

    drafter_dir = source.fetch(cache_dir) if isinstance(source, DrafterRef) else Path(source)
    hf = read_hf_config(target_dir)
    drafter = load_drafter(drafter_dir, dtype, packed=True, device=device, target_num_layers=hf["num_hidden_layers"])
    if aux_layer_ids is not None and tuple(drafter.config.aux_layer_ids) != tuple(aux_layer_ids):
        raise AerieError(
            f"drafter {drafter_dir} reads target layers {list(drafter.config.aux_layer_ids)}, but the target "
            f"captures {list(aux_layer_ids)}: restart the server so that both read the same drafter"
        )
    if drafter.config.vocab_size != hf["vocab_size"] or drafter.config.target_hidden_size != hf["hidden_size"]:
        raise AerieError(
            f"drafter {drafter_dir} was built for vocab {drafter.config.vocab_size} / hidden "
            f"{drafter.config.target_hidden_size}, the target has {hf['vocab_size']} / {hf['hidden_size']}"
        )
    if not drafter.config.stores_embeddings:
        name = "model.embed_tokens.weight"
        weight = load_safetensors_dir(target_dir, [name], device=drafter.device, missing_ok=True).get(name)
        if weight is None:
            raise AerieError(f"{target_dir}: no {name} for the drafter to share")
        drafter.share_embedding(nn.Embedding.from_pretrained(weight.to(drafter.dtype), freeze=True))
    return EagleProposer(drafter, depth, topk, max_requests, max_model_len)
