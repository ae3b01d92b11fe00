"""Draft trees: the tokens a proposer offers for one request in one round.

The root is the request's last emitted token (not yet in the target's KV cache); nodes hang below it in
topological order, siblings in the order they were drawn:

    root r ─┬─ 0:a ── 2:c          tokens  [a, b, c]
            └─ 1:b                 parents [-1, -1, 0]      (-1 = child of the root)

The target verifies `[r, a, b, c]` in one forward: each row sees the cached prefix, itself and its
ancestors (`attention_block`), at rope position `root_position + depth`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """One request's draft. `draft_probs[i]` is the distribution (over the target vocabulary) that the
    children of node i (i = -1: the root) were drawn from; absent for children chosen deterministically
    (greedy top-k), which verification treats as point masses."""

    tokens: torch.Tensor  # [n] target-vocabulary ids
    parents: torch.Tensor  # [n] index of each node's parent, -1 for the root's children
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)  # parent -> [vocab]
    scores: torch.Tensor | None = None  # [n] cumulative draft log-probability of the path to each node

    def __post_init__(self) -> None:
        assert self.tokens.shape == self.parents.shape
        assert self.scores is None or self.scores.shape == self.tokens.shape
        assert all(int(p) < i for i, p in enumerate(self.parents)), "parents must come before their children"

    @classmethod
    def chain(cls, tokens: list[int] | torch.Tensor, draft_probs: dict[int, torch.Tensor] | None = None) -> DraftTree:
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        return cls(tokens, torch.arange(tokens.numel()) - 1, draft_probs or {})

    @classmethod
    def empty(cls) -> DraftTree:
        return cls(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))

    @property
    def size(self) -> int:
        return self.tokens.numel()

    def depths(self) -> torch.Tensor:
        """[n] depth of each node (the root's children have depth 1)."""
        depth = torch.zeros(self.size, dtype=torch.long)
        for i, p in enumerate(self.parents.tolist()):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return depth

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = root) in drawing order."""
        return [i for i, p in enumerate(self.parents.tolist()) if p == node]

    def attention_block(self) -> torch.Tensor:
        """[n+1, n+1] bool over `[root, nodes...]`: row i sees column j iff j is i, an ancestor, or the root."""
        n = self.size
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents.tolist()):
            mask[i + 1] |= mask[p + 1]
            mask[i + 1, i + 1] = True
        return mask

    def subtree(self, keep: list[int]) -> DraftTree:
        """The tree restricted to nodes `keep` (ascending; each with its parent and earlier-drawn siblings, so
        verification stays lossless), renumbered.

            tokens [a, b, c], parents [-1, -1, 0], keep [0, 2] -> tokens [a, c], parents [-1, 0]
        """
        index = {node: i for i, node in enumerate(keep)}
        assert all(int(self.parents[n]) < 0 or int(self.parents[n]) in index for n in keep), "parent dropped"
        rows = torch.tensor(keep, dtype=torch.long)  # [m]
        parents = torch.tensor([index.get(int(self.parents[n]), -1) for n in keep], dtype=torch.long)  # [m]
        probs = {index[p] if p >= 0 else -1: q for p, q in self.draft_probs.items() if p < 0 or p in index}
        scores = None if self.scores is None else self.scores[rows]
        return DraftTree(self.tokens[rows], parents, probs, scores)

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node`."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]


def pack_trees(
    roots: list[int], trees: list[DraftTree], base: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs of one target forward verifying several requests' trees: `[r_a, a1, a2 | r_b | r_c, c1]`.

    roots: each request's last emitted token; base: [B] its cache length (the root's rope position).
    Returns tokens [N], positions [N] (base + depth), num_tokens [B] and block_mask [B, T, T].
    """
    blocks = [t.attention_block() for t in trees]
    width = max(b.shape[0] for b in blocks)
    block_mask = torch.zeros(len(trees), width, width, dtype=torch.bool)
    for i, b in enumerate(blocks):
        block_mask[i, : b.shape[0], : b.shape[0]] = b
    tokens = torch.cat([torch.cat([torch.tensor([r]), t.tokens]) for r, t in zip(roots, trees, strict=True)])
    zero = torch.zeros(1, dtype=torch.long)
    positions = torch.cat([base[i] + torch.cat([zero, t.depths()]) for i, t in enumerate(trees)])
    num = torch.tensor([1 + t.size for t in trees])
    return tokens, positions, num, block_mask


class BestFirst:
    """The nodes of several draft trees, best score first, each only once its parent and its earlier-drawn
    siblings are taken: the order in which verification may accept them, so any set of nodes taken this way
    keeps verification lossless. The one best-first selection of the project (the proposer's EAGLE-2 tree
    cut, the scheduler's global budget split).

        tree a: parents [-1, 0], scores [-.1, -.7];  tree b: parents [-1], scores [-1.2]
        pop -> (a, 0); take(a, 0) -> a:1 eligible;  pop -> (a, 1); take(a, 1);  pop -> (b, 0) ...

    A node popped but not taken (a request over its own cap) keeps its siblings and subtree out.
    """

    def __init__(self, trees: Sequence[tuple[Sequence[int], Sequence[float]]]) -> None:
        """trees: (parents [n], scores [n]) each, nodes in topological order, siblings in drawing order."""
        self.scores = [list(map(float, scores)) for _, scores in trees]
        self.children: list[dict[int, list[int]]] = []
        self.parents = [list(map(int, parents)) for parents, _ in trees]
        self.heap: list[tuple[float, int, int]] = []
        for t, parents in enumerate(self.parents):
            kids: dict[int, list[int]] = {}
            for i, p in enumerate(parents):
                kids.setdefault(p, []).append(i)
            self.children.append(kids)
            if -1 in kids:
                self._push(t, kids[-1][0])

    def _push(self, tree: int, node: int) -> None:
        heapq.heappush(self.heap, (-self.scores[tree][node], tree, node))

    def pop(self) -> tuple[int, int] | None:
        """(tree, node) of the best eligible node, or None when none is left."""
        return heapq.heappop(self.heap)[1:] if self.heap else None

    def take(self, tree: int, node: int) -> None:
        """Keep the popped node: its next sibling and its first child become eligible."""
        siblings = self.children[tree][self.parents[tree][node]]
        at = siblings.index(node)
        if at + 1 < len(siblings):
            self._push(tree, siblings[at + 1])
        if node in self.children[tree]:
            self._push(tree, self.children[tree][node][0])
