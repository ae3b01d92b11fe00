"""`make demo`'s pieces: the committed EAGLE-3.1 drafter (small, bf16, with its provenance) speculates on SmolLM2
losslessly, and `aerie demo` prints answers, acceptance length and the speed-up with its interval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.stats import format_ratio, paired_ratio

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "demo"
DRAFTER = ROOT / "drafters" / "smollm2-135m-broad-eagle3.1"


def test_the_committed_drafter_is_small_bf16_and_says_where_it_came_from():
    from orchestrator.models.checkpoint import load_drafter

    assert (DRAFTER / "model.safetensors").stat().st_size <= 25 * 2**20
    config = json.loads((DRAFTER / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["fc_norm"] and config["norm_output"]  # EAGLE-3.1
    provenance = json.loads((DRAFTER / "provenance.json").read_text())
    assert len(provenance["data"]["manifest_sha256"]) == 64
    assert provenance["train_config"]["drafter"]["variant"] == "eagle3.1"
    assert load_drafter(DRAFTER).config.variant == "eagle3.1"


def test_demo_answers_losslessly_with_acceptance_and_speedup(tmp_path, smollm2_dir, capsys):
    out = tmp_path / "demo.json"
    lines = (DEMO / "prompts.jsonl").read_text().splitlines()[:2]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    args = ["--model", str(smollm2_dir), "--drafter", str(DRAFTER), "--prompts", str(tmp_path / "p.jsonl")]
    assert main(["demo", *args, "--max-tokens", "24", "--repeats", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["identical"] and len(result["rows"]) == 2
    assert result["acceptance_length"] > 1.0  # a trained drafter: some drafts accepted
    assert result["speedup"]["n"] == 4 and result["speedup"]["low"] <= result["speedup"]["ratio"]
    printed = capsys.readouterr().out
    assert "Are you a human? Or Am I talking with the void?" in printed
    assert "speed-up" in printed and "acceptance length" in printed


def test_demo_bad_prompt_file_is_one_line(tmp_path, smollm2_dir, capsys):
    (tmp_path / "p.jsonl").write_text('{"messages": "not a list"}\n')
    args = ["--model", str(smollm2_dir), "--drafter", str(DRAFTER), "--prompts", str(tmp_path / "p.jsonl")]
    assert main(["demo", *args]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_paired_ratio_interval():
    r = paired_ratio([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert r["ratio"] == pytest.approx(2.0) and r["low"] == pytest.approx(2.0) and r["high"] == pytest.approx(2.0)
    noisy = paired_ratio([1.0, 1.2, 0.9, 1.1], [1.0, 1.0, 1.0, 1.0])
    assert noisy["low"] < 1.05 < noisy["high"] and noisy["n"] == 4
    assert format_ratio(paired_ratio([3.0], [2.0])) == "1.50x (n=1)"
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])
