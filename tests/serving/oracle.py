"""A test proposer for the serving path: it knows each prompt's greedy reference continuation and offers it,
corrupted at a random depth, so rounds accept anything from 0 drafts to the whole tree.

It is built inside the DraftWorker actor (`proposer_factory: tests.serving.oracle:OracleProposer`) from a JSON
file of {"prompts": [[ids...]], "outputs": [[ids...]]}. A request is recognised from its first pairs: the
prompt without its first token, then the first sampled token.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from orchestrator.spec.tree import DraftTree


class OracleProposer:
    def __init__(self, references: str, depth: int = 4, width: int = 1, seed: int = 0, vocab: int = 49152) -> None:
        self.vocab = vocab
        data = json.loads(Path(references).read_text())
        self.by_prompt = {tuple(p[1:]): out for p, out in zip(data["prompts"], data["outputs"], strict=True)}
        self.depth, self.width = depth, width
        self.rng = torch.Generator().manual_seed(seed)
        self.state: dict[str, tuple[list[int], int]] = {}  # request -> (reference, tokens emitted)

    def release(self, request_id: str) -> None:
        self.state.pop(request_id, None)

    def _rand(self, n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=self.rng))

    def _recognise(self, tokens: list[int]) -> tuple[list[int], int]:
        for prompt, ref in self.by_prompt.items():
            n = len(prompt)
            if tuple(tokens[:n]) == prompt:  # the whole history: prompt[1:], then the tokens emitted so far
                return ref, len(tokens) - n
        return [], 0  # an unknown prompt: no drafts

    def propose(self, items):
        trees = []
        for item in items:
            tokens = item.tokens.tolist()
            if item.request_id not in self.state:
                self.state[item.request_id] = self._recognise(tokens)
            else:
                ref, done = self.state[item.request_id]
                self.state[item.request_id] = (ref, done + len(tokens))
            ref, done = self.state[item.request_id]
            trees.append(self._tree(ref[done:], item.budget))
        return trees

    def _tree(self, ref: list[int], budget: int) -> DraftTree:
        depth = min(self.depth, budget, len(ref))
        cut = self._rand(depth + 2)  # the true path survives `cut` levels
        tokens, parents, scores, parent = [], [], [], -1
        for level in range(depth):
            true = ref[level] if level < cut else (ref[level] + 1) % self.vocab
            wrong = [(ref[level] + 2 + i) % self.vocab for i in range(self.width - 1)]
            siblings = list(dict.fromkeys([true, *wrong]))
            if len(tokens) + len(siblings) > budget:
                break
            start = len(tokens)
            for i, t in enumerate(siblings):
                tokens.append(t)
                parents.append(parent)
                scores.append((level + 1) * math.log(0.7) + i * math.log(0.3))
            parent = start
        return DraftTree(
            torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), {}, torch.tensor(scores)
        )
