"""`python -m jobs.benchmark_generate`: runs the engines side by side and writes result.json."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from orchestrator.cli import main


def _job(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jobs.benchmark_generate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def drafter_dir(smollm2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter") / "d"
    assert main(["init-drafter", "--model", str(smollm2_dir), "--out", str(out), "--draft-vocab-size", "4096"]) == 0
    return out


@pytest.mark.slow
def test_benchmark_writes_a_comparable_table(smollm2_dir, drafter_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "Hi"}]}\n{"prompt": "Once upon a time"}\n')
    proc = _job(
        f"model={smollm2_dir}",
        f"drafter={drafter_dir}",
        f"prompts={prompts}",
        "num_prompts=2",
        "max_tokens=6",
        "batch_sizes=[1,2]",
        "engines=[local,spec]",
        "spec.method=tree",
        "spec.depth=2",
        "spec.topk=2",
        "spec.budget=3",
        f"output_dir={tmp_path / 'out'}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    rows = {(r["engine"], r["batch_size"]): r for r in result["rows"]}
    assert set(rows) == {("local", 1), ("local", 2), ("spec", 1), ("spec", 2)}
    assert all(r["tokens"] == 12 and r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["spec", 1]["acceptance_length"] >= 1.0 and "x local" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["model=x", "output_dir=o", "engines=[spec]"], "need a drafter"),
        (["model=x", "output_dir=o", "batchsize=3"], "batchsize: Extra inputs are not permitted"),
        (["output_dir=o"], "model: Field required"),
        (["--config", "configs/none.yaml"], "config file 'configs/none.yaml' does not exist"),
    ],
    ids=["spec-without-drafter", "unknown-key", "missing-model", "missing-file"],
)
def test_bad_configs_are_one_line(args, message):
    proc = _job(*args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1]


def test_init_drafter_starts_from_the_target_head(smollm2_dir, drafter_dir):
    import torch

    from orchestrator.models import TargetModel, load_drafter

    target = TargetModel.from_pretrained(smollm2_dir, packed=False)
    drafter = load_drafter(drafter_dir)
    assert drafter.config.variant == "eagle3.1" and drafter.config.draft_vocab_size == 4096
    assert torch.equal(drafter.lm_head.weight, target.embed_tokens.weight[:4096])
    assert torch.equal(drafter.norm.weight, target.norm.weight)
