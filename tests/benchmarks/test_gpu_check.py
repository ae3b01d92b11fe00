"""`make gpu-check` runs on a GPU machine only; here its pieces run small on the CPU, in bf16 (the dtype the
GPU runs), so the script does not rot between GPU sessions."""

from __future__ import annotations

import torch

from orchestrator.benchmarks.gpu_check import SMALL, _run_engine, check_steps, successor_target, table
from orchestrator.engine.engine import SpecEngine
from orchestrator.runtime.workers import DraftWorker, TargetWorker
from orchestrator.spec.replay import ReplayProposer
from orchestrator.spec.sampling import SamplingParams


def test_successor_target_continuation_is_known_and_speculation_keeps_it_in_bf16():
    """The throughput target's greedy continuation is perm[...] by a wide margin, so the replay proposer can
    offer it; in bf16 the engine emits exactly it, target-only and speculative (chain of 4, 80% accepted)."""
    shape = SMALL | {"num_hidden_layers": 8, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256}
    shape |= {"head_dim": 32}
    model, perm = successor_target(shape, torch.device("cpu"))
    assert model.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (6, 11, 3)]
    continuations = []
    for p in prompts:
        token, out = p[-1], []
        for _ in range(12):
            token = int(perm[token])
            out.append(token)
        continuations.append(out)
    target = TargetWorker(model, [], max_batch=3, max_model_len=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    _, tau = _run_engine(torch.device("cpu"), SpecEngine(target), prompts, params, continuations)
    assert tau is None
    refs = {"prompts": prompts, "outputs": continuations}
    spec = SpecEngine(target, DraftWorker(ReplayProposer(refs, 512, 4, accept_rate=0.8), 3), 4)
    _, tau = _run_engine(torch.device("cpu"), spec, prompts, params, continuations)
    assert tau > 1.5


def test_table_renders_every_section():
    row = {"sequences_equal": "2/2", "tokens_before_first_difference": "32/32", "acceptance_length": 2.5}
    result = {
        "lossless": {"rows": [row | {"path": "replay chain", "dtype": "float32", "against": "transformers fp32"}]},
        "training": {"steps": 100, "loss_first10": 9.0, "loss_last10": 3.0, "falls": True, "seconds": 12.0},
        "throughput": {
            "shape": {"hidden_size": 4096},
            "prompt_tokens": 128,
            "new_tokens": 128,
            "accept_rate": 0.8,
            "rows": [
                {
                    "batch": 1,
                    "engine_tok_s": 40.0,
                    "spec_tok_s": 100.0,
                    "transformers_tok_s": 30.0,
                    "spec_over_engine": [2.5, 2.4, 2.6],
                    "spec_over_transformers": [3.3, 3.2, 3.4],
                    "acceptance_length": 3.3,
                }
            ],
        },
    }
    result["steps"] = {"error": "Traceback (most recent call last):\n  ...\nRuntimeError: CUDA out of memory"}
    text = table(result)
    assert "| replay chain | float32 |" in text and "falls: True" in text and "| 1 | 40.0 | 100.0 | 30.0 |" in text
    assert "## steps: FAILED: RuntimeError: CUDA out of memory" in text


def test_step_times_cover_every_shape_and_render():
    """The planner's step times, small on the CPU: every (batch, context, new) target forward and both drafter
    round shapes at each batch, positive and rendered."""
    steps = check_steps(torch.device("cpu"), quick=True, repeats=1)
    assert {(r["batch"], r["context"], r["new"]) for r in steps["target"]} == {
        (b, 64, n) for b in (1, 4) for n in (1, 4, 16)
    }
    assert {(r["shape"], r["batch"]) for r in steps["drafter"]} == {(s, b) for s in ("chain", "tree") for b in (1, 4)}
    assert all(r["seconds"] > 0 for r in steps["target"] + steps["drafter"])
    assert "| tree | 4 |" in table({"steps": steps})


def test_serving_forwards_choose_their_attention_kernels():
    """On CUDA, the serving path's forwards run one kernel for decoding and verification alike (memory-efficient,
    math as the fallback): no flash (mask-free calls only), no cuDNN (a new plan for every new shape, ~20 ms each
    on an H200, `make gpu-check`'s profile). The setting does not leak out."""
    from orchestrator.models.layers import attention_kernels

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with attention_kernels(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    with attention_kernels(torch.device("cpu")):
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_invariance_and_profile_sections_run_small_on_the_cpu(tmp_path):
    """The GPU run's diagnostic sections, small: a verify forward equals decode forwards bit for bit for one
    sequence (the CPU's kernels too, at that prefix; batched beside a longer sequence it need not), the EAGLE
    chain's outputs are counted, and the profile has both tables. (On an H200 every row is 0 and every count
    6/6: docs/operating/gpus.md.)"""
    from orchestrator.benchmarks.gpu_check import check_invariance, check_profile

    inv = check_invariance(torch.device("cpu"), tmp_path, quick=True)
    beside = "beside a longer sequence (9 vs 25 tokens)"
    assert {(r["model"], r["against_1_token"]) for r in inv["rows"]} == {
        (m, a) for m in ("tiny", "8B shape") for a in ("5 tokens", "1 token, masked", beside)
    }
    assert all(r["max_abs_diff"] == 0.0 for r in inv["rows"] if r["against_1_token"] != beside)
    assert {r["prefix"] for r in inv["verify_against_decode"]} >= {5, 20, 64, 129}
    equal = inv["eagle_chain_equal_target_only_bf16"]
    assert len(equal) == 4 and all(v.endswith("/6") for v in equal.values())
    profile = check_profile(torch.device("cpu"), quick=True)
    assert set(profile["tables"]) == {"engine + replay, 32 tokens", "EAGLE-3.1 chain of 5, 3 rounds"}
    assert "aten::mm" in profile["tables"]["engine + replay, 32 tokens"]
    assert "## profile: EAGLE-3.1 chain of 5, 3 rounds" in table({"profile": profile})
