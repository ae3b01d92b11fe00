"""`make gpu-check`: what only a GPU shows, in one script of at most 10 minutes, with no Ray, vLLM or MLflow
(the check machine has PyTorch, transformers and safetensors; `make gpu-deps` brings pydantic and omegaconf).

1. lossless: greedy speculative generation (chain and tree) of a tiny random Llama equals transformers'
   greedy `generate` on the device (float32), and in bfloat16 speculative equals target-only decoding.
2. training: 100 steps of the TTT objective under bf16 autocast on the device; the loss falls.
3. throughput: per-user tokens/s of the engine with and without speculation at batch 1/4/16, on a target of
   Llama-3.1-8B's shape in bf16 whose greedy continuation is known in advance (token i is followed by
   perm[i], by a wide margin), with a replay proposer that offers that continuation and errs at a set rate;
   next to transformers' `generate` on a model of the same shape. Runs interleave and repeat; the table gives
   medians and, for ratios, the range over repeats.
4. steps: the step times the capacity planner's cost model needs (`orchestrator/sim/roofline.py`), on the
   same Llama-3.1-8B-shaped target: one target forward over `new` tokens per sequence at batch 1/4/16/64 and
   256/2048 cached tokens each, and one EAGLE-3.1 drafter round (its 8B-shaped layer, a 32k draft vocabulary)
   as the draft worker runs it, chain of 5 and tree (depth 4, top 4, 16 nodes). `jobs.plan` sets them beside
   the roofline of the same GPU.

    python -m orchestrator.benchmarks.gpu_check [--device cuda] [--quick] [--out DIR] [--skip ...]

A check that fails is recorded (its traceback in gpu-check.json) and the others still run.

`--quick` shrinks every shape so the script runs on a CPU in a minute (the unit test does that).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SMALL = LLAMA_8B | {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 2048,
}
TINY = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "initializer_range": 0.2,  # peaked logits: greedy ties are not decided by rounding
    "tie_word_embeddings": False,
    "eos_token_id": None,  # transformers' generate runs to max_new_tokens, as the engine with ignore_eos
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tiny_target(out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(out, safe_serialization=True)
    return out


def _tiny_drafter(work: Path) -> Path:
    """A random EAGLE-3.1 drafter of the tiny target (made once per run)."""
    from orchestrator.models.checkpoint import save_drafter
    from orchestrator.models.init import init_drafter
    from orchestrator.models.target import TargetModel

    out = work / "drafter"
    if not out.is_dir():
        save_drafter(init_drafter(TargetModel.from_pretrained(work / "tiny", device="cpu")), out)
    return out


def check_lossless(device: torch.device, work: Path, quick: bool) -> dict:
    """Greedy, fp32: transformers vs the engine target-only, with the EAGLE drafter (chain, tree) and with a
    replay proposer that offers transformers' continuation and errs (so rounds accept 0..all drafts).
    bf16: speculative vs target-only on the device (and target-only vs transformers fp32, for scale)."""
    from transformers import LlamaForCausalLM

    from orchestrator.engine.engine import SpecEngine, load_engine
    from orchestrator.runtime.workers import DraftWorker
    from orchestrator.spec.proposer import SpecConfig
    from orchestrator.spec.replay import ReplayProposer
    from orchestrator.spec.sampling import SamplingParams

    model_dir = _tiny_target(work / "tiny")
    drafter_dir = _tiny_drafter(work)
    new = 16 if quick else 64
    gen = torch.Generator().manual_seed(1)
    lengths = (5, 14) if quick else (5, 9, 14, 21, 30, 47)
    prompts = [torch.randint(3, TINY["vocab_size"], (n,), generator=gen).tolist() for n in lengths]
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    reference = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p], device=device), max_new_tokens=new, do_sample=False, pad_token_id=0)
            reference.append(out[0, len(p) :].tolist())
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    shapes = {"chain": SpecConfig(method="chain", num_spec_tokens=4), "tree": SpecConfig(method="tree")}
    refs = {"prompts": prompts, "outputs": reference}
    rows = []
    for dtype in ("float32", "bfloat16"):
        kw = {"eos_token_ids": [], "device": str(device), "dtype": dtype}
        plain = load_engine(model_dir, None, max_batch=len(prompts), **kw)
        base = [g.token_ids for g in plain.generate(prompts, params)]
        gap = functools.partial(_divergence_gap, hf, device, prompts)
        rows.append(_agreement("target-only", dtype, "transformers fp32", base, None, reference, gap))
        # the same prompts one at a time: does target-only bf16 depend on what else is in the batch?
        alone = [plain.generate([p], params)[0].token_ids for p in prompts]
        rows.append(_agreement("target-only, one at a time", dtype, "target-only, batched", alone, None, base, gap))
        want, against = (reference, "transformers fp32") if dtype == "float32" else (base, "target-only bf16")
        for name, spec in shapes.items():
            engine = load_engine(model_dir, drafter_dir, spec, len(prompts), **kw)
            rows.append(_agreement(f"eagle {name}", dtype, against, *_generate(engine, prompts, params), want, gap))
            depth, width, nodes = spec.shape()
            proposer = ReplayProposer(refs, TINY["vocab_size"], depth, width=min(width, 3), accept_rate=0.7)
            engine = SpecEngine(plain.target, DraftWorker(proposer, len(prompts)), nodes)
            rows.append(_agreement(f"replay {name}", dtype, against, *_generate(engine, prompts, params), want, gap))
    return {"tokens_per_prompt": new, "prompts": len(prompts), "rows": rows}


def _divergence_gap(hf, device, prompts, got, want) -> float | None:
    """Where two greedy outputs first differ, how far apart the two tokens are in transformers' float32 logits
    after the common prefix, relative to the largest logit: about 2^-8 and below is bf16 rounding deciding a near
    tie; much more is a bug. The largest over the differing sequences (None: none differ)."""
    gaps = []
    for p, a, b in zip(prompts, got, want, strict=True):
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if i is None:
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([p + b[:i]], device=device)).logits[0, -1].float()
        gaps.append(abs(float(logits[b[i]] - logits[a[i]])) / float(logits.abs().max()))
    return max(gaps) if gaps else None


def _tau(gens) -> float | None:
    """Acceptance length over the requests (vLLM's: 1 + accepted / drafted request-steps); None: no drafts."""
    accepted = sum(g.acceptance.accepted for g in gens)
    steps = sum(g.acceptance.drafts for g in gens)
    return 1 + accepted / steps if steps else None


def _generate(engine, prompts, params) -> tuple[list[list[int]], float | None]:
    gens = engine.generate(prompts, params)
    return [g.token_ids for g in gens], _tau(gens)


def _agreement(name: str, dtype: str, against: str, got: list, tau: float | None, want: list, gap=None) -> dict:
    """How many sequences (and tokens, up to the first difference) equal the reference; with `gap`
    (`_divergence_gap`), how close to a tie the first differences were."""
    equal = sum(a == b for a, b in zip(got, want, strict=True))
    prefix = 0
    for a, b in zip(got, want, strict=True):
        prefix += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
    return {
        "path": name,
        "dtype": dtype,
        "against": against,
        "sequences_equal": f"{equal}/{len(want)}",
        "tokens_before_first_difference": f"{prefix}/{sum(len(w) for w in want)}",
        "acceptance_length": tau,
        "divergence_gap": gap(got, want) if gap is not None and equal < len(want) else None,
    }


def check_training(device: torch.device, work: Path, quick: bool) -> dict:
    """TTT steps under bf16 autocast on hidden states the tiny target computes on the device."""
    from orchestrator.models.drafter import DrafterConfig
    from orchestrator.models.init import new_drafter, target_head_weight
    from orchestrator.models.target import TargetModel
    from orchestrator.train.objective import Batch, DraftTrainingModel

    model_dir = work / "tiny"
    if not model_dir.is_dir():
        _tiny_target(model_dir)
    target = TargetModel.from_pretrained(model_dir, dtype="float32", device=device, packed=False)
    gen = torch.Generator().manual_seed(2)
    b, t, steps = (4, 32, 20) if quick else (8, 96, 100)
    ids = torch.randint(3, TINY["vocab_size"], (b, t), generator=gen)
    cache = target.new_cache(b, t)
    out = target(ids.flatten(), cache, torch.arange(b), torch.full((b,), t), logits="none")
    batch = Batch(  # clones: the target ran in inference mode, whose tensors autograd may not save
        ids.to(device),
        torch.ones(b, t, dtype=torch.bool, device=device),
        torch.full((b,), t, device=device),
        out.aux_hidden.view(b, t, -1).clone(),
        out.final_hidden.view(b, t, -1).clone(),
    )
    vocab = torch.arange(TINY["vocab_size"])
    config = DrafterConfig.for_target(target.hf_config, target.aux_layer_ids, vocab.numel(), "eagle3.1")
    head = target_head_weight(target).float().cpu()
    drafter = new_drafter(config, head, target.norm.weight.float().cpu(), vocab)
    model = DraftTrainingModel(drafter, target.embed_tokens.weight.float().cpu(), head.clone()).to(device)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=2e-3)
    losses, began = [], time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss, stats = model(batch, 3, 0.8)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    _sync(device)
    first, last = statistics.mean(losses[:10]), statistics.mean(losses[-10:])
    acc = (stats.correct / stats.count.clamp_min(1)).tolist()
    return {
        "steps": steps,
        "loss_first10": first,
        "loss_last10": last,
        "falls": last < first,
        "acc_per_step_last": acc,
        "seconds": time.perf_counter() - began,
    }


def successor_target(hf: dict, device: torch.device, seed: int = 0):
    """A TargetModel of this shape (bf16) with random weights whose greedy continuation is known: the
    embedding dominates the residual stream and lm_head row perm[i] is embedding row i, so after token i the
    argmax is perm[i] by a margin no rounding changes. Returns (model, perm)."""
    from orchestrator.models.layers import rope_inv_freq
    from orchestrator.models.target import TargetModel

    with torch.device("meta"):
        model = TargetModel(hf, dtype=torch.bfloat16)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "embed" in name or "lm_head" in name:
                continue
            else:
                std = 1e-3 if ("o_proj" in name or "down_proj" in name) else 0.02
                p.normal_(0.0, std, generator=gen)
        model.embed_tokens.weight.normal_(0.0, 1.0, generator=gen)
        perm = torch.randperm(hf["vocab_size"], generator=torch.Generator().manual_seed(seed))
        model.lm_head.weight.copy_(model.embed_tokens.weight[perm.argsort().to(device)])
    model.inv_freq = rope_inv_freq(model.cfg).to(device)
    return model, perm


def check_throughput(device: torch.device, quick: bool, repeats: int = 3) -> dict:
    """Per-user tokens/s: engine target-only, engine + replay proposer (accept rate a, chain of 4), and
    transformers' generate, at batch 1/4/16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from orchestrator.engine.engine import SpecEngine
    from orchestrator.runtime.workers import DraftWorker, TargetWorker
    from orchestrator.spec.replay import ReplayProposer
    from orchestrator.spec.sampling import SamplingParams

    hf = SMALL if quick else LLAMA_8B
    prompt_len, new, accept, depth = (32, 32, 0.8, 4) if quick else (128, 128, 0.8, 4)
    batches = (1, 4) if quick else (1, 4, 16)
    model, perm = successor_target(hf, device)
    target = TargetWorker(model, [], max_batch=max(batches), max_model_len=prompt_len + new + depth + 8)
    hf_cfg = LlamaConfig(**({k: v for k, v in hf.items() if k != "architectures"} | {"eos_token_id": None}))
    with torch.device(device):
        reference_model = LlamaForCausalLM._from_config(hf_cfg, dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(3)
    rows = []
    for batch in batches:
        prompts = [torch.randint(3, hf["vocab_size"], (prompt_len,), generator=gen).tolist() for _ in range(batch)]
        continuations = []
        for p in prompts:
            token, out = p[-1], []
            for _ in range(new):
                token = int(perm[token])
                out.append(token)
            continuations.append(out)
        refs = {"prompts": prompts, "outputs": continuations}
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        plain = SpecEngine(target)
        spec = SpecEngine(target, DraftWorker(ReplayProposer(refs, hf["vocab_size"], depth, accept_rate=accept)), depth)
        ids = torch.tensor(prompts, device=device)

        runs = {
            "engine": functools.partial(_run_engine, device, plain, prompts, params, continuations),
            "engine+spec": functools.partial(_run_engine, device, spec, prompts, params, continuations),
            "transformers": functools.partial(_run_transformers, device, reference_model, ids, new),
        }
        for fn in runs.values():  # warm-up (allocator, kernels)
            fn()
        got: dict[str, list[float]] = {k: [] for k in runs}
        taus = []
        for r in range(repeats):
            order = list(runs)[r % 3 :] + list(runs)[: r % 3]  # interleaved, rotating order
            for name in order:
                tps, tau = runs[name]()
                got[name].append(tps)
                if tau is not None:
                    taus.append(tau)
        ratio_base = [s / b for s, b in zip(got["engine+spec"], got["engine"], strict=True)]
        ratio_hf = [s / b for s, b in zip(got["engine+spec"], got["transformers"], strict=True)]
        rows.append(
            {
                "batch": batch,
                "engine_tok_s": statistics.median(got["engine"]),
                "spec_tok_s": statistics.median(got["engine+spec"]),
                "transformers_tok_s": statistics.median(got["transformers"]),
                "spec_over_engine": [statistics.median(ratio_base), min(ratio_base), max(ratio_base)],
                "spec_over_transformers": [statistics.median(ratio_hf), min(ratio_hf), max(ratio_hf)],
                "acceptance_length": statistics.mean(taus) if taus else None,
            }
        )
    shape = {k: hf[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    return {"shape": shape, "prompt_tokens": prompt_len, "new_tokens": new, "accept_rate": accept, "rows": rows}


def check_steps(device: torch.device, quick: bool, repeats: int = 5) -> dict:
    """Median seconds of one target forward (batch x new tokens x cached tokens, fake cached KV: the time does
    not depend on its values) and of one EAGLE-3.1 drafter round (chain of 5, tree 4x4 budget 16) per batch."""
    from orchestrator.models.init import init_drafter
    from orchestrator.spec.proposer import EagleProposer, ProposeItem
    from orchestrator.spec.sampling import SamplingParams

    hf = SMALL if quick else LLAMA_8B
    batches = (1, 4) if quick else (1, 4, 16, 64)
    contexts = (64,) if quick else (256, 2048)
    news = (1, 4, 16)
    model, _ = successor_target(hf, device)
    cache = model.new_cache(max(batches), max(contexts) + max(news))
    gen = torch.Generator().manual_seed(4)

    def timed(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            _sync(device)
            began = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    target_rows = []
    for batch in batches:
        slots = torch.arange(batch)
        for context in contexts:
            for new in news:
                ids = torch.randint(3, hf["vocab_size"], (batch * new,), generator=gen)
                num = torch.full((batch,), new)

                def forward(ids=ids, slots=slots, num=num, context=context):
                    cache.lengths[slots] = context
                    cache.block_start[slots] = context
                    model(ids, cache, slots, num, logits="all")

                row = {"batch": batch, "context": context, "new": new, "seconds": timed(forward)}
                target_rows.append(row)
    draft_vocab = min(32000, hf["vocab_size"] // 2)
    drafter = init_drafter(model, "eagle3.1", torch.arange(draft_vocab)).to(device)
    aux_width = len(drafter.config.aux_layer_ids) * hf["hidden_size"]
    params = SamplingParams(max_tokens=64, temperature=0.0)
    draft_rows = []
    for name, (depth, topk, budget) in {"chain": (5, 1, 5), "tree": (4, 4, 16)}.items():
        for batch in batches:
            proposer = EagleProposer(drafter, depth, topk, max_requests=batch, max_tokens=max(contexts) + 256)

            def items(m: int, budget: int = budget, batch: int = batch) -> list:
                return [
                    ProposeItem(
                        f"r{i}",
                        torch.randint(3, hf["vocab_size"], (m,), generator=gen),
                        torch.randn(m, aux_width, generator=gen, dtype=torch.bfloat16),
                        params,
                        None,
                        budget,
                    )
                    for i in range(batch)
                ]

            proposer.propose(items(min(contexts), 0))  # the prompt's pairs, committed
            seconds = timed(lambda proposer=proposer, items=items: proposer.propose(items(2)))  # 2 new pairs each
            draft_rows.append({"shape": name, "batch": batch, "seconds": seconds})
    shape = {k: hf[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    return {
        "shape": shape,
        "draft_vocab": draft_vocab,
        "draft_context": min(contexts),
        "target": target_rows,
        "drafter": draft_rows,
    }


def check_invariance(device: torch.device, work: Path, quick: bool) -> dict:
    """Why bf16 speculation can differ from target-only: the logits of 5 tokens decoded one forward each (decode
    steps) against the same 5 in one forward (a verify step), and one at a time with an explicit mask
    (the attention's masked path alone), on the tiny target and the 8B-shaped one; with cuBLAS' reduced-
    precision bf16 reductions allowed (PyTorch's default) and not; and a short sequence's decode step alone against
    the same step batched beside a longer one (its attention span padded); a verify step against decode steps after
    prefixes of many lengths. Then the tiny target's greedy outputs, EAGLE chain against target-only and target-only
    batched against each prompt alone, with reduced-precision reductions on and off."""
    from orchestrator.engine.engine import load_engine
    from orchestrator.models.target import TargetModel
    from orchestrator.spec.proposer import SpecConfig
    from orchestrator.spec.sampling import SamplingParams

    model_dir = work / "tiny"
    if not model_dir.is_dir():
        _tiny_target(model_dir)
    models = {"tiny": TargetModel.from_pretrained(model_dir, dtype="bfloat16", device=device)}
    models["8B shape"] = successor_target(SMALL if quick else LLAMA_8B, device)[0]
    matmul = torch.backends.cuda.matmul
    default = matmul.allow_bf16_reduced_precision_reduction
    gen = torch.Generator().manual_seed(5)
    rows = []
    try:
        for reduced in (True, False):
            matmul.allow_bf16_reduced_precision_reduction = reduced
            for name, model in models.items():
                ids = torch.randint(3, model.vocab_size, (25,), generator=gen)
                logits = {}
                for how, new, mask in (("1 token", 1, None), ("5 tokens", 5, None), ("1 token, masked", 1, True)):
                    cache = model.new_cache(1, 64)
                    slot = torch.tensor([0])
                    model(ids[:20], cache, slot, torch.tensor([20]), logits="none")
                    block = None if mask is None else torch.ones(1, 1, 1, dtype=torch.bool)
                    rows_out = []
                    for at in range(20, 25, new):  # tokens 20..24: one forward each, or one forward of all 5
                        out = model(ids[at : at + new], cache, slot, torch.tensor([new]), block_mask=block)
                        rows_out.append(out.logits.float())
                    logits[how] = torch.cat(rows_out)  # [5, vocab]
                # the first 9 tokens' last decode step beside a 25-token sequence: its span padded to 25
                short = model.new_cache(1, 64)
                model(ids[:8], short, torch.tensor([0]), torch.tensor([8]), logits="none")
                alone = model(ids[8:9], short, torch.tensor([0]), torch.tensor([1])).logits.float()  # [1, vocab]
                pair = model.new_cache(2, 64)
                model(ids[:8], pair, torch.tensor([0]), torch.tensor([8]), logits="none")
                model(ids[:24], pair, torch.tensor([1]), torch.tensor([24]), logits="none")
                both = model(ids[[8, 24]], pair, torch.tensor([0, 1]), torch.tensor([1, 1])).logits  # [2, vocab]
                both = both.float()
                base = logits["1 token"]
                scale = float(base.abs().max())
                diff = float((both[0] - alone[0]).abs().max())
                rows.append(
                    {
                        "reduced_precision": reduced,
                        "model": name,
                        "against_1_token": "beside a longer sequence (9 vs 25 tokens)",
                        "max_abs_diff": diff,
                        "relative": diff / float(alone.abs().max()),
                    }
                )
                for how in ("5 tokens", "1 token, masked"):
                    diff = float((logits[how] - base).abs().max())
                    rows.append(
                        {
                            "reduced_precision": reduced,
                            "model": name,
                            "against_1_token": how,
                            "max_abs_diff": diff,
                            "relative": diff / scale,
                        }
                    )
        matmul.allow_bf16_reduced_precision_reduction = default
        prefixes = []  # does a verify forward's row equal the decode forward's, wherever the sequence stands?
        for name, model in models.items():
            ids = torch.randint(3, model.vocab_size, (200,), generator=gen)
            for prefix in (5, 12, 20, 33, 64, 100, 129, 190):
                one, five = model.new_cache(1, 256), model.new_cache(1, 256)
                slot = torch.tensor([0])
                model(ids[:prefix], one, slot, torch.tensor([prefix]), logits="none")
                model(ids[:prefix], five, slot, torch.tensor([prefix]), logits="none")
                steps = [model(ids[t : t + 1], one, slot, torch.tensor([1])).logits for t in range(prefix, prefix + 5)]
                block = model(ids[prefix : prefix + 5], five, slot, torch.tensor([5])).logits
                diff = float((torch.cat(steps).float() - block.float()).abs().max())
                prefixes.append({"model": name, "prefix": prefix, "max_abs_diff": diff})
        kw = {"eos_token_ids": [], "device": str(device), "dtype": "bfloat16"}
        prompts = [torch.randint(3, TINY["vocab_size"], (n,), generator=gen).tolist() for n in (5, 9, 14, 21, 30, 47)]
        params = SamplingParams(max_tokens=16 if quick else 64, temperature=0.0, ignore_eos=True)
        drafter_dir = _tiny_drafter(work)
        equal = {}
        for reduced in (True, False):
            matmul.allow_bf16_reduced_precision_reduction = reduced
            plain = load_engine(model_dir, None, max_batch=len(prompts), **kw)
            base = [g.token_ids for g in plain.generate(prompts, params)]
            spec = load_engine(model_dir, drafter_dir, SpecConfig(num_spec_tokens=4), len(prompts), **kw)
            got = [g.token_ids for g in spec.generate(prompts, params)]
            same = sum(a == b for a, b in zip(got, base, strict=True))
            equal[f"reduced precision {reduced}"] = f"{same}/{len(prompts)}"
            alone = [plain.generate([p], params)[0].token_ids for p in prompts]  # target-only, each prompt alone
            same = sum(a == b for a, b in zip(alone, base, strict=True))
            equal[f"reduced precision {reduced}, target-only batched = alone"] = f"{same}/{len(prompts)}"
    finally:
        matmul.allow_bf16_reduced_precision_reduction = default
    return {"rows": rows, "verify_against_decode": prefixes, "eagle_chain_equal_target_only_bf16": equal}


def check_profile(device: torch.device, quick: bool) -> dict:
    """Where a round's time goes on the 8B shape, batch 1: torch.profiler's top operators (self time on the
    host and on the device) for the engine with the free replay proposer, and for one EAGLE-3.1 drafter round."""
    from torch.profiler import ProfilerActivity, profile

    from orchestrator.engine.engine import SpecEngine
    from orchestrator.models.init import init_drafter
    from orchestrator.runtime.workers import DraftWorker, TargetWorker
    from orchestrator.spec.proposer import EagleProposer, ProposeItem
    from orchestrator.spec.replay import ReplayProposer
    from orchestrator.spec.sampling import SamplingParams

    hf = SMALL if quick else LLAMA_8B
    model, perm = successor_target(hf, device)
    prompt = torch.randint(3, hf["vocab_size"], (128,), generator=torch.Generator().manual_seed(6)).tolist()
    token, continuation = prompt[-1], []
    for _ in range(32):
        token = int(perm[token])
        continuation.append(token)
    refs = {"prompts": [prompt], "outputs": [continuation]}
    target = TargetWorker(model, [], max_batch=1, max_model_len=256)
    engine = SpecEngine(target, DraftWorker(ReplayProposer(refs, hf["vocab_size"], 4, accept_rate=0.8)), 4)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    engine.generate([prompt], params)  # warm-up
    tables = {}
    with profile(activities=activities) as prof:
        engine.generate([prompt], params)
        _sync(device)
    tables["engine + replay, 32 tokens"] = _top(prof, sort)
    drafter = init_drafter(model, "eagle3.1", torch.arange(min(32000, hf["vocab_size"] // 2))).to(device)
    aux_width = len(drafter.config.aux_layer_ids) * hf["hidden_size"]
    proposer = EagleProposer(drafter, 5, 1, max_requests=1, max_tokens=512)

    def items(m: int, budget: int) -> list:
        aux = torch.randn(m, aux_width, dtype=torch.bfloat16)
        return [ProposeItem("r", torch.randint(3, hf["vocab_size"], (m,)), aux, params, None, budget)]

    proposer.propose(items(128, 0))
    proposer.propose(items(2, 5))  # warm-up
    with profile(activities=activities) as prof:
        for _ in range(3):
            proposer.propose(items(2, 5))
        _sync(device)
    tables["EAGLE-3.1 chain of 5, 3 rounds"] = _top(prof, sort)
    return {"tables": tables}


def _top(prof, sort: str, rows: int = 20) -> str:
    for key in (sort, "self_cpu_time_total"):  # the device's column only where the profiler recorded one
        try:
            return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
        except (AttributeError, KeyError, RuntimeError):
            continue
    return ""


def _run_engine(device, engine, prompts, params, continuations) -> tuple[float, float | None]:
    """Per-user tokens/s of one engine run, and its acceptance length; the output must be the continuation."""
    _sync(device)
    began = time.perf_counter()
    gens = engine.generate(prompts, params)
    _sync(device)
    took = time.perf_counter() - began
    if [g.token_ids for g in gens] != continuations:
        raise AssertionError("greedy output is not the target's known continuation")
    return params.max_tokens / took, _tau(gens)


def _run_transformers(device, model, ids: torch.Tensor, new: int) -> tuple[float, None]:
    _sync(device)
    began = time.perf_counter()
    with torch.no_grad():
        mask = torch.ones_like(ids)
        model.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
        )
    _sync(device)
    return new / (time.perf_counter() - began), None


def table(result: dict) -> str:
    """The markdown of the checks that ran (a failed one: its error's last line)."""
    lines = [f"GPU check: {result.get('env', {})}", ""]
    for name, part in result.items():
        if name == "env":
            continue
        if "error" in part:
            lines += [f"## {name}: FAILED: {part['error'].strip().splitlines()[-1]}", ""]
        else:
            lines += _SECTIONS[name](part) + [""]
    return "\n".join(lines).rstrip()


def _lossless_lines(part: dict) -> list[str]:
    header = "| path | dtype | against | sequences equal | tokens before first difference | tau | gap at first diff |"
    lines = ["## lossless (greedy)", header, "|---" * 7 + "|"]
    for r in part["rows"]:
        tau = "" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        gap = "" if r.get("divergence_gap") is None else f"{r['divergence_gap']:.1e}"
        row = [r["path"], r["dtype"], r["against"], r["sequences_equal"], r["tokens_before_first_difference"], tau, gap]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _training_lines(t: dict) -> list[str]:
    return [
        f"## training: {t['steps']} TTT steps, bf16 autocast: loss {t['loss_first10']:.3f} (first 10) -> "
        f"{t['loss_last10']:.3f} (last 10), falls: {t['falls']}, {t['seconds']:.1f} s"
    ]


def _throughput_lines(th: dict) -> list[str]:
    lines = [
        f"## throughput: shape {th['shape']}, bf16, prompt {th['prompt_tokens']} + {th['new_tokens']} tokens, "
        f"replay proposer accept rate {th['accept_rate']} (chain of 4); per-user tokens/s, medians",
        "| batch | engine | engine+spec | transformers | spec/engine [min, max] | spec/transformers [min, max] | tau |",
        "|---" * 7 + "|",
    ]
    for r in th["rows"]:
        a, b = r["spec_over_engine"], r["spec_over_transformers"]
        tau = "" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        lines.append(
            f"| {r['batch']} | {r['engine_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['transformers_tok_s']:.1f} | "
            f"{a[0]:.2f} [{a[1]:.2f}, {a[2]:.2f}] | {b[0]:.2f} [{b[1]:.2f}, {b[2]:.2f}] | {tau} |"
        )
    return lines


def _steps_lines(st: dict) -> list[str]:
    lines = [
        f"## steps: shape {st['shape']}, bf16; target forward, ms (median)",
        "| batch | cached tokens | new tokens per sequence | ms |",
        "|---" * 4 + "|",
    ]
    lines += [f"| {r['batch']} | {r['context']} | {r['new']} | {1e3 * r['seconds']:.2f} |" for r in st["target"]]
    lines += [
        "",
        f"EAGLE-3.1 drafter round ({st['draft_vocab']} draft tokens), 2 new pairs per request, ms (median)",
        "| shape | batch | ms |",
        "|---" * 3 + "|",
    ]
    lines += [f"| {r['shape']} | {r['batch']} | {1e3 * r['seconds']:.2f} |" for r in st["drafter"]]
    return lines


def _invariance_lines(part: dict) -> list[str]:
    lines = [
        "## bf16 invariance: the logits of 5 tokens decoded one forward each, against",
        "| cuBLAS reduced-precision reductions | target | against | max abs diff | relative to the largest logit |",
        "|---" * 5 + "|",
    ]
    for r in part["rows"]:
        lines.append(
            f"| {r['reduced_precision']} | {r['model']} | {r['against_1_token']} | {r['max_abs_diff']:.2e} | "
            f"{r['relative']:.1e} |"
        )
    equal = part["eagle_chain_equal_target_only_bf16"]
    lines += ["", "EAGLE chain = target-only, bf16, sequences equal, by reduced-precision setting:"]
    lines += [f"- {how}: {got}" for how, got in equal.items()]
    prefixes = part.get("verify_against_decode", [])
    if prefixes:
        lines += [
            "",
            "a 5-token forward (verification) against 5 one-token forwards (decoding), after prefixes of n tokens:",
            "| target | prefix tokens | max abs diff |",
            "|---" * 3 + "|",
        ]
        lines += [f"| {r['model']} | {r['prefix']} | {r['max_abs_diff']:.2e} |" for r in prefixes]
    return lines


def _profile_lines(part: dict) -> list[str]:
    lines = []
    for name, text in part["tables"].items():
        lines += [f"## profile: {name}", "```", text, "```"]
    return lines


_SECTIONS = {
    "lossless": _lossless_lines,
    "training": _training_lines,
    "throughput": _throughput_lines,
    "steps": _steps_lines,
    "invariance": _invariance_lines,
    "profile": _profile_lines,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes (a CPU smoke run)")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/gpu-check"))
    parser.add_argument("--skip", nargs="*", default=[], choices=tuple(_SECTIONS))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons mean fp32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    result: dict = {"env": env}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, fn in (
            ("lossless", lambda: check_lossless(device, work, args.quick)),
            ("training", lambda: check_training(device, work, args.quick)),
            ("throughput", lambda: check_throughput(device, args.quick)),
            ("steps", lambda: check_steps(device, args.quick)),
            ("invariance", lambda: check_invariance(device, work, args.quick)),
            ("profile", lambda: check_profile(device, args.quick)),
        ):
            if name in args.skip:
                continue
            began = time.perf_counter()
            try:
                result[name] = fn()
            except Exception:  # noqa: BLE001 - one GPU session: record it, run the other checks
                result[name] = {"error": traceback.format_exc()}
                print(result[name]["error"], flush=True)
            print(f"{name}: done in {time.perf_counter() - began:.0f} s", flush=True)
            (out / "gpu-check.json").write_text(json.dumps(result, indent=2) + "\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    text = table(result)
    (out / "gpu-check.md").write_text(text + "\n")
    print(text)
    return 1 if any("error" in v for k, v in result.items() if k != "env") else 0


if __name__ == "__main__":
    raise SystemExit(main())
