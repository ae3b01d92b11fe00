"""The tensor-parallel rules every vLLM engine of the project follows, and vLLM's per-call bar feeding the
caller's one bar (no engine starts here)."""

from __future__ import annotations

import functools
import io
import os

import pytest
from tqdm import tqdm

from orchestrator.engine.vllm_backend import _Advance, check_tensor_parallel, cpu_thread_binding, engine_env
from orchestrator.errors import AerieError

SHARDABLE = [  # (attention heads, KV heads, TP size, vLLM accepts)
    (4, 2, 1, True),
    (4, 2, 2, True),
    (4, 2, 4, True),  # TP 4 > 2 KV heads: each KV head replicated on two ranks
    (4, 2, 3, False),
    (9, 3, 2, False),  # SmolLM2-135M
    (9, 3, 3, True),
    (32, 8, 16, True),
    (32, 8, 3, False),
    (12, 8, 4, True),
    (12, 8, 6, False),  # heads divide by 6, 8 KV heads neither divide by 6 nor 6 by 8
]


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "ok"), SHARDABLE)
def test_tensor_parallel_sizes_vllm_accepts(heads, kv_heads, tp, ok):
    hf = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    if ok:
        check_tensor_parallel(hf, tp, "m")
    else:
        with pytest.raises(AerieError, match=f"tensor_parallel_size={tp} cannot shard m"):
            check_tensor_parallel(hf, tp, "m")


def test_the_error_is_one_line_naming_the_valid_sizes():
    with pytest.raises(AerieError) as err:
        check_tensor_parallel({"num_attention_heads": 9, "num_key_value_heads": 3}, 2, "smollm2-135m-instruct")
    message = str(err.value)
    assert "\n" not in message
    assert "9 attention heads, 3 KV heads" in message and message.endswith("valid sizes: [1, 3, 9]")


def test_no_kv_heads_means_as_many_as_attention_heads():
    check_tensor_parallel({"num_attention_heads": 8}, 8, "m")


@pytest.mark.parametrize(
    ("tp", "cpus", "bind"),
    [
        (2, [0, 1], "0|1"),
        (2, [0, 1, 2, 3], "0,1|2,3"),
        (2, [0, 1, 2, 3, 4], "0,1|2,3"),  # the odd core is left to vLLM's engine process
        (4, [8, 9, 10, 11, 12, 13, 14, 15], "8,9|10,11|12,13|14,15"),
        (1, [0, 1], "0,1"),
    ],
)
def test_cpu_thread_binding_gives_each_rank_its_own_cores(tp, cpus, bind):
    assert cpu_thread_binding(tp, cpus) == bind


def test_cpu_thread_binding_needs_a_core_per_rank():
    with pytest.raises(AerieError, match="needs a core per rank"):
        cpu_thread_binding(2, [0])


def test_engine_env_is_scoped_and_leaves_what_the_user_set(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with engine_env({"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "2"}):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "VLLM_CPU_KVCACHE_SPACE" not in os.environ


def test_vllms_bars_advance_the_callers_bar_and_draw_nothing(capsys):
    """What LLM.generate does with `use_tqdm` (vllm/entrypoints/common/offline.py): iterate a bar over the prompts
    it renders, then count finished requests on another, reading its elapsed time and setting a postfix."""
    answers = tqdm(total=5, file=io.StringIO())  # the caller's, over two generate calls
    advance = functools.partial(_Advance, caller=answers)
    for batch in (3, 2):
        list(advance(range(batch), desc="Rendering prompts"))
        pbar = advance(total=batch, desc="Processed prompts", dynamic_ncols=True, postfix="est. speed")
        for _ in range(batch):
            pbar.postfix = f"input: {10 / max(pbar.format_dict['elapsed'], 1e-9):.2f} toks/s"
            pbar.update(1)
        pbar.close()
    assert answers.n == 5
    assert capsys.readouterr() == ("", "")
