"""A proposer that replays known continuations: the tests' way to make every acceptance case happen, and
the benchmarks' oracle of controlled acceptance (no drafter model, so what is timed is the target side)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from orchestrator.spec.tree import DraftTree


class ReplayProposer:
    """A test proposer that knows each prompt's reference continuation and offers it, corrupted at a random
    depth, so rounds accept anything from nothing to the whole tree: at each depth the true token sits among
    `width` siblings at a random place, and the true path is cut at a random depth.

    references: {"prompts": [[ids]], "outputs": [[ids]]} or the path of such a JSON file (the serving tests
    build it inside the DraftWorker actor: `proposer_factory: orchestrator.spec.replay:ReplayProposer`). A request is
    recognised from its first pairs: its prompt without the first token, then the tokens emitted so far.
    """

    def __init__(
        self,
        references: str | dict,
        vocab: int = 49152,
        depth: int = 4,
        width: int = 1,
        seed: int = 0,
        accept_rate: float | None = None,
    ):
        """accept_rate: each level's true token survives with this probability (a geometric cut: acceptance
        under control, for benchmarks); None: the cut is uniform over 0..depth+1 (every case, for tests)."""
        if accept_rate is not None and not 0.0 <= accept_rate <= 1.0:
            raise ValueError(f"accept_rate must be in [0, 1], got {accept_rate}")
        self.accept_rate = accept_rate
        data = references if isinstance(references, dict) else json.loads(Path(references).read_text())
        self.by_prompt = {tuple(p[1:]): out for p, out in zip(data["prompts"], data["outputs"], strict=True)}
        self.vocab, self.depth, self.width = vocab, depth, width
        self.rng = torch.Generator().manual_seed(seed)
        self.state: dict[str, tuple[list[int], int]] = {}  # request -> (reference, tokens emitted)

    def release(self, request_id: str) -> None:
        self.state.pop(request_id, None)

    def _rand(self, n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=self.rng))

    def _cut(self, depth: int) -> int:
        if self.accept_rate is None:
            return self._rand(depth + 2)
        cut = 0
        while cut <= depth and float(torch.rand((), generator=self.rng)) < self.accept_rate:
            cut += 1
        return cut

    def _wrong(self, token: int) -> int:
        return (token + 1 + self._rand(self.vocab - 1)) % self.vocab

    def propose(self, items):
        trees = []
        for item in items:
            tokens = item.tokens.tolist()
            if item.request_id not in self.state:
                self.state[item.request_id] = next(
                    ((ref, len(tokens) - len(p)) for p, ref in self.by_prompt.items() if tuple(tokens[: len(p)]) == p),
                    ([], 0),  # an unknown prompt: no drafts
                )
            else:
                ref, done = self.state[item.request_id]
                self.state[item.request_id] = (ref, done + len(tokens))
            ref, done = self.state[item.request_id]
            ref = ref[done:]
            depth = min(self.depth, item.budget, len(ref))
            cut = self._cut(depth)  # the true path survives `cut` levels (> depth: all of them)
            tokens, parents, scores, parent = [], [], [], -1
            for level in range(depth):
                true = ref[level] if level < cut else self._wrong(ref[level])
                place = self._rand(self.width)
                siblings = [self._wrong(ref[level]) for _ in range(self.width)]
                siblings = list(dict.fromkeys(siblings[:place] + [true] + siblings[place + 1 :]))
                if len(tokens) + len(siblings) > item.budget:
                    break
                start = len(tokens)
                tokens += siblings
                parents += [parent] * len(siblings)
                scores += [(level + 1) * math.log(0.7) + i * math.log(0.3) for i in range(len(siblings))]
                parent = start + siblings.index(true)
            as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
            trees.append(DraftTree(as_long(tokens), as_long(parents), {}, torch.tensor(scores)))
        return trees
