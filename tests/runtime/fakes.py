"""Fast stand-ins for the scheduler's tests: the real TargetWorker and DraftWorker run in this process over a
table model and a table proposer, called through a client that injects faults and reorders the event loop.

`TableModel` replaces TargetModel: its next-token distribution at a position is a fixed function of (the
previous token, the token, its rope position), and it reads the previous token from what is really in its
KV cache, so every cache operation the worker does (append, keep_appended, release) shows in the output.
`reference()` decodes a prompt without any of the machinery, the oracle of every greedy and seeded check.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from types import SimpleNamespace

import torch

from orchestrator.models.kv_cache import KVCache
from orchestrator.runtime.clients import Client, Done, WorkerFailed, WorkerLost
from orchestrator.spec.sampling import SamplingParams
from orchestrator.spec.tree import DraftTree
from orchestrator.spec.verify import probabilities, seeded_choice

VOCAB = 24
POISON = VOCAB - 1  # a prompt token whose next-token distribution is NaN: that request fails in the worker


def _mix(*xs: int) -> int:
    h = 0x2545F491
    for x in xs:
        h = (h * 6364136223846793005 + x * 1442695040888963407 + 1) % 2**63
    return h >> 17


def table_logits(prev: int, token: int, position: int) -> torch.Tensor:
    """[VOCAB] logits: a favourite, a runner-up, the rest unlikely, the poison token never; NaN after it."""
    if POISON in (prev, token):
        return torch.full((VOCAB,), math.nan)
    h = _mix(prev, token, position)
    first = h % (VOCAB - 1)
    second = (first + 1 + (h >> 8) % (VOCAB - 2)) % (VOCAB - 1)
    logits = torch.full((VOCAB,), -2.0)
    logits[POISON] = -math.inf
    logits[second], logits[first] = 1.0, 2.5
    return logits


class TableModel:
    """A TargetModel stand-in (see the module docstring)."""

    vocab_size, hidden_size, aux_layer_ids = VOCAB, 2, (1,)

    def __init__(self, context: int = 64) -> None:
        self.cfg = SimpleNamespace(max_position_embeddings=context)

    def new_cache(self, num_slots: int, max_tokens: int | None = None) -> KVCache:
        return KVCache(1, 1, 1, num_slots, max_tokens or self.cfg.max_position_embeddings, initial_tokens=8)

    def __call__(self, token_ids, cache, slots, num_tokens, positions=None, block_mask=None, logits="all"):
        cache.reserve(slots, num_tokens)
        rows, states, offset = [], [], 0
        for b, (slot, n) in enumerate(zip(slots.tolist(), num_tokens.tolist(), strict=True)):
            start = int(cache.lengths[slot])
            tokens = token_ids[offset : offset + n].tolist()
            cache.keys[0][slot, 0, start : start + n, 0] = torch.tensor(tokens, dtype=torch.float32)
            for i in range(n):
                visible = range(i) if block_mask is None else [k for k in range(i) if block_mask[b, i, k]]
                parent = max(visible, default=-1)  # a tree node's parent is its nearest visible row
                prev = tokens[parent] if parent >= 0 else int(cache.keys[0][slot, 0, start - 1, 0]) if start else -1
                position = int(positions[offset + i]) if positions is not None else start + i
                rows.append(table_logits(prev, tokens[i], position))
                states.append([float(tokens[i]), float(position), float(prev)])
            offset += n
        cache.advance(slots, num_tokens)
        out = torch.stack(rows)
        if logits == "last":
            out = out[torch.cumsum(num_tokens, 0) - 1]
        states = torch.tensor(states)  # [N, 3]: what a row saw, so a captured row can be checked exactly
        return SimpleNamespace(logits=out, aux_hidden=states[:, :2], final_hidden=states[:, 1:])


def reference(prompt: list[int], params: SamplingParams, eos: frozenset[int] = frozenset()) -> list[int]:
    """Greedy or seeded decoding of the table model, one token at a time, no cache, no drafts."""
    seq, out = list(prompt), []
    while True:
        logits = table_logits(seq[-2] if len(seq) > 1 else -1, seq[-1], len(seq) - 1)
        if params.greedy:
            token = int(logits.argmax())
        else:
            token = int(seeded_choice(probabilities(logits[None], params), params.seed, torch.tensor([len(out)]))[0])
        out.append(token)
        seq.append(token)
        if (token in eos and not params.ignore_eos) or len(out) >= params.max_tokens:
            return out


class TableProposer:
    """Drafts the table model's greedy continuation, corrupted at a random depth, `width` siblings per level:
    rounds accept anything from nothing to the whole tree. Holds `max_requests` requests (an error beyond)."""

    def __init__(self, depth: int = 3, width: int = 2, seed: int = 0, max_requests: int = 16, max_context=None):
        self.depth, self.width, self.max_requests = depth, width, max_requests
        self.max_context = max_context
        self.rng = random.Random(seed)
        self.seqs: dict[str, list[int]] = {}  # the pair tokens seen per request: x1, x2, ...

    def release(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)

    def propose(self, items) -> list[DraftTree]:
        trees = []
        for item in items:
            if item.request_id not in self.seqs and len(self.seqs) >= self.max_requests:
                raise RuntimeError("TableProposer: no free slot")
            seq = self.seqs.setdefault(item.request_id, [])
            seq += item.tokens.tolist()
            trees.append(self._tree(seq, item.budget))
        return trees

    def _tree(self, seq: list[int], budget: int) -> DraftTree:
        prev, token, position = (seq[-2] if len(seq) > 1 else -1), seq[-1], len(seq)
        cut = self.rng.randrange(self.depth + 2)  # the true path survives `cut` levels
        tokens, parents, scores, parent = [], [], [], -1
        for level in range(min(self.depth, budget)):
            true = int(table_logits(prev, token, position + level).argmax())
            drawn = true if level < cut else (true + 1) % (VOCAB - 1)  # wrong, but never the poison token
            siblings = list(dict.fromkeys([drawn, *[(true + 2 + i) % (VOCAB - 1) for i in range(self.width - 1)]]))
            if len(tokens) + len(siblings) > budget:
                break
            start = len(tokens)
            for i, t in enumerate(siblings):
                tokens.append(t)
                parents.append(parent)
                scores.append((level + 1) * math.log(0.7) + i * math.log(0.3))
            parent, prev, token = start, token, drawn
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        return DraftTree(as_long(tokens), as_long(parents), {}, torch.tensor(scores))


class FaultyWorker(Client):
    """A worker in this process behind the scheduler's client interface, with faults on demand.

    plan(method) -> None or one of
      "die":     the worker dies now (a fresh one replaces it: its state is gone) and the call fails (WorkerLost)
      "restart": the worker restarted silently before this call (fresh state; the call succeeds)
      "raise":   the call fails without running (WorkerFailed)
      "late":    the call runs but its answer never arrives (WorkerLost, as a timeout)
    Each call runs when it is submitted and suspends before its answer arrives (as a Ray call does), with `rng` a
    random number of times (other tasks run meanwhile).
    """

    def __init__(self, make: Callable[[], object], plan=None, rng: random.Random | None = None, tick=None):
        self.make, self.plan, self.rng, self.tick = make, plan or (lambda method: None), rng, tick
        self.worker = make()
        self.calls: dict[str, int] = {}
        self.timeouts: list[tuple[str, float | None]] = []  # (method, the bound the caller gave the call)

    def submit(self, method: str, *args, returns: int = 1) -> FaultyCall:
        """Runs at once, in submission order (as an actor runs the calls of one caller: a release sent after
        this call runs after it); its answer "arrives" when awaited, after suspending."""
        self.calls[method] = self.calls.get(method, 0) + 1
        if self.tick is not None:
            self.tick()
        fault = self.plan(method)
        if fault in ("die", "restart"):
            self.worker = self.make()
        lost = [a for a in args if isinstance(a, Lost)]
        if fault == "die":
            done = Lost.failed(WorkerLost(f"{method}: the worker died"), returns)
        elif fault == "raise":
            done = Lost.failed(WorkerFailed(f"{method}: injected failure"), returns)
        elif lost:  # (Ray: "could not be computed", a task error)
            done = Lost.failed(WorkerFailed(f"{method}: an argument could not be computed ({lost[0].error})"), returns)
        else:
            done = Done.run(getattr(self.worker, method), method, args, returns)
            if fault == "late" and done.error is None:
                done.error = WorkerLost(f"{method}: no answer in time")
        return FaultyCall(self, method, done)

    def cast(self, method: str, *args) -> None:
        getattr(self.worker, method)(*args)


class Lost:
    """A later result of a call that failed, as a Ray ref to it is: handed to another call (a chained draft call),
    it fails that call without running it."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    @classmethod
    def failed(cls, error: Exception, returns: int) -> Done:
        return Done(refs=tuple(cls(error) for _ in range(returns - 1)), error=error)


class FaultyCall:
    """A `FaultyWorker` call in flight: its answer comes after a random number of suspensions."""

    def __init__(self, worker: FaultyWorker, method: str, done: Done) -> None:
        self.worker, self.method, self.done = worker, method, done

    @property
    def refs(self):
        return self.done.refs

    async def result(self, timeout_s: float | None = None):
        self.worker.timeouts.append((self.method, timeout_s))
        for _ in range(1 + (self.worker.rng.randrange(3) if self.worker.rng else 0)):  # a remote call suspends
            await asyncio.sleep(0)
        return await self.done.result()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CharTokenizer:
    """Token i is the letter chr(97 + i): stop strings over token ids."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(97 + i) for i in ids)
