"""The in-process engine: the runtime's TargetWorker and DraftWorker, driven by the same SpecScheduler the
server runs, in this process (no Ray). `aerie generate`, the evaluation, data regeneration and the benchmarks
use it, so what they measure is what the server does.

    SpecEngine.generate(prompts) ──submit──> SpecScheduler ──LocalWorker──> TargetWorker
                                                       └────LocalWorker──> DraftWorker (None: target-only)

One micro-batch and fixed tree budgets (`adaptive: false`): every round drafts and verifies each request's
whole tree, so measured acceptance is the drafter's, not the scheduler's timing. Greedy output equals
target-only decoding token for token; a seeded request gets the same tokens here as from the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from orchestrator.errors import AerieError
from orchestrator.runtime.clients import LocalWorker
from orchestrator.runtime.detok import TextStream
from orchestrator.runtime.scheduler import SchedulerConfig, SpecScheduler
from orchestrator.runtime.workers import DraftWorker, TargetWorker
from orchestrator.spec.acceptance import Acceptance
from orchestrator.spec.proposer import SpecConfig, load_eagle_proposer
from orchestrator.spec.sampling import SamplingParams


@dataclass
class Generation:
    """The result of one request."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length" (max_tokens)
    acceptance: Acceptance = field(default_factory=Acceptance)  # speculation statistics (vLLM's meaning)
    text: str | None = None  # set when a stop string cut the output
    error: str | None = None


class SpecEngine:
    """Speculative (or, without a draft worker, target-only) decoding in this process."""

    def __init__(
        self, target: TargetWorker, draft: DraftWorker | None = None, max_nodes: int = 0, tokenizer=None
    ) -> None:
        """max_nodes: draft tree nodes each request verifies per round; tokenizer: for stop strings."""
        self.target, self.draft, self.max_nodes, self.tokenizer = target, draft, max_nodes, tokenizer
        self.last_stats: dict = {}  # the scheduler's totals of the last `generate` (rounds, draft/verify seconds)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        raise_errors: bool = True,
        progress: tqdm | None = None,
    ) -> list[Generation]:
        """Run prompts to completion (continuous batching); results in prompt order. A request that fails
        raises AerieError, or (raise_errors=False) comes back with `error` set. progress: the caller's bar,
        advanced by one as each request finishes."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if self.tokenizer is None and any(p.stop for p in params):
            raise AerieError("stop strings need the engine's tokenizer")
        out = asyncio.run(self._generate(prompts, params, progress))
        failed = next((g for g in out if g.error is not None), None)
        if raise_errors and failed is not None:
            raise AerieError(failed.error)
        return out

    async def _generate(self, prompts, params, progress: tqdm | None = None) -> list[Generation]:
        n = self.target.max_batch
        cfg = SchedulerConfig(
            max_batch=n,
            budget_tokens=n * (1 + self.max_nodes),
            micro_batches=1,
            adaptive=False,
            request_timeout_s=1e12,  # nobody waits on the other side of a socket here
        )
        draft = LocalWorker(self.draft) if self.draft is not None else None
        scheduler = SpecScheduler(LocalWorker(self.target), draft, cfg, self.max_nodes, watchdog_s=None)
        scheduler.start()
        try:
            requests = [scheduler.submit(list(p), sp) for p, sp in zip(prompts, params, strict=True)]
            return await asyncio.gather(*[self._collect(scheduler, r, progress) for r in requests])
        finally:
            self.last_stats = scheduler.stats()
            await scheduler.close()

    async def _collect(self, scheduler: SpecScheduler, r, bar=None) -> Generation:
        text = TextStream(self.tokenizer if r.params.stop else None, r.params.stop)
        finish, error = None, None
        async for _, reason, failed in scheduler.text_events(r, text):
            finish = reason or finish
            error = failed.error if failed is not None else error
        if bar is not None:
            bar.update()
        return Generation(r.prompt_ids, text.ids, finish, r.acceptance, text.text if text.stopped else None, error)


def load_engine(
    model_dir: str | Path,
    drafter_dir: str | Path | None = None,
    spec: SpecConfig | None = None,
    max_batch: int = 16,
    tokenizer=None,
    eos_token_ids: Sequence[int] | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> SpecEngine:
    """An engine over a target directory, speculating with a vLLM-format drafter when one is given (the target
    then captures the drafter's aux layers). device, dtype: of both models (auto: the GPU in bfloat16 when
    there is one, else the CPU in float32)."""
    from orchestrator.models.checkpoint import drafter_aux_layer_ids
    from orchestrator.models.target import read_hf_config
    from orchestrator.models.tokenizer import eos_token_ids as read_eos
    from orchestrator.models.tokenizer import load_tokenizer

    if eos_token_ids is None:
        eos_token_ids = read_eos(model_dir, tokenizer if tokenizer is not None else load_tokenizer(model_dir))
    layers = read_hf_config(model_dir)["num_hidden_layers"]
    aux = drafter_aux_layer_ids(drafter_dir, layers) if drafter_dir is not None else None
    target = TargetWorker(model_dir, eos_token_ids, max_batch, aux_layer_ids=aux, device=device, dtype=dtype)
    if drafter_dir is None:
        return SpecEngine(target, tokenizer=tokenizer)
    depth, topk, nodes = (spec or SpecConfig()).shape()
    proposer = load_eagle_proposer(drafter_dir, model_dir, depth, topk, max_batch, device=device, dtype=dtype)
    draft = DraftWorker(proposer, max_batch)
    return SpecEngine(target, draft, nodes, tokenizer)
