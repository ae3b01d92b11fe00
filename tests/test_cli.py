"""`aerie` end to end: greedy generation equals transformers, and user errors are one clean line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from orchestrator.cli import main


def _aerie(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True, timeout=600
    )


def _generate_file(tmp_path, model_dir, lines: str, *extra: str) -> tuple[subprocess.CompletedProcess, object]:
    """Run `aerie generate` as a user would, on a prompt file with `lines`; returns the process and out path."""
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(lines)
    return _aerie("generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out), *extra), out


def _assert_one_line_error(proc: subprocess.CompletedProcess, pattern: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and pattern in errors[0], proc.stderr


def test_generate_local_greedy_equals_transformers(tmp_path, smollm2_dir, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    from orchestrator.data.prompts import mtbench_first_turns

    records = mtbench_first_turns(4)  # batches of 3 and 1; the engine's own exactness: tests/engine
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in records))
    out = tmp_path / "out.jsonl"
    args = ["generate", "--model", str(smollm2_dir), "--prompts", str(prompts), "--out", str(out)]
    assert main([*args, "--max-tokens", "32", "--batch-size", "3"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in rows] == list(range(1, 5))

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for record, row in zip(records, rows, strict=True):
        ids = smollm2_tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
        expected = hf.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :].tolist()
        assert row["token_ids"] == expected
        assert row["text"] == smollm2_tokenizer.decode(expected, skip_special_tokens=True)
        assert row["num_prompt_tokens"] == ids.shape[1]


def test_bad_jsonl_lines_are_reported_and_the_rest_served(tmp_path, smollm2_dir):
    lines = '{"prompt": "The capital of France is"}\n{not json\n{"messages": []}\n{"prompt": "One, two,"}\n'
    proc, out = _generate_file(tmp_path, smollm2_dir, lines, "--max-tokens", "4")
    _assert_one_line_error(proc, "p.jsonl:2: not valid JSON")
    assert "p.jsonl:3: 'messages' must be a non-empty list" in proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [("error" in r) for r in rows] == [False, True, True, False]
    assert all(len(r["token_ids"]) == 4 for r in rows if "error" not in r)


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (
            ["generate", "--model", "/nonexistent/model", "--prompts", "x.jsonl", "--out", "o.jsonl"],
            "model directory '/nonexistent/model' does not exist",
        ),
        (
            ["prepare-model", "gpt-17", "--out", "/tmp/never"],
            "unknown model 'gpt-17'; known: smollm2-135m-instruct",
        ),
        (["serve", "--config", "/nonexistent/serve.yaml"], "serve config '/nonexistent/serve.yaml' does not exist"),
        (
            ["serve", "--config", "configs/smollm2-135m/serve.yaml", "scheduler.max_batch=0"],
            "scheduler.max_batch: Input should be greater than or equal to 1",
        ),
        (
            ["serve", "--config", "configs/smollm2-135m/serve.yaml", "spec.method=beam"],
            "spec.method: Input should be 'chain' or 'tree'",
        ),
        (
            ["serve", "--config", "configs/smollm2-135m/serve.yaml", "drafter=/nonexistent/drafter"],
            "drafter '/nonexistent/drafter' is not a drafter directory",
        ),
        (
            ["serve", "--backend", "vllm", "--config", "configs/smollm2-135m/serve.yaml", "speculation=false"],
            "configs/smollm2-135m/serve.yaml is not a vllm config",
        ),
        (
            ["serve", "--backend", "vllm", "kv_cache_gib=0", "speculation=false"],
            "kv_cache_gib: Input should be greater than or equal to 1",
        ),
    ],
    ids=[
        "missing-model",
        "unknown-model-name",
        "serve-missing-config",
        "serve-bad-batch",
        "serve-bad-method",
        "serve-missing-drafter",
        "serve-wrong-backend",
        "serve-vllm-bad-arg",
    ],
)
def test_user_errors_are_one_line(args, pattern):
    _assert_one_line_error(_aerie(*args), pattern)


def test_empty_messages_only_file_fails_cleanly(tmp_path, smollm2_dir):
    proc, _ = _generate_file(tmp_path, smollm2_dir, '{"messages": []}\n')
    _assert_one_line_error(proc, "p.jsonl:1: 'messages' must be a non-empty list")


def test_prepare_model_is_idempotent(smollm2_dir):
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    assert main(["prepare-model", "smollm2-135m-instruct", "--out", str(smollm2_dir)]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before


def test_prompt_longer_than_the_context_is_one_line(tmp_path, smollm2_dir):
    proc, _ = _generate_file(tmp_path, smollm2_dir, '{"prompt": "hello"}\n', "--max-tokens", "9000")
    _assert_one_line_error(proc, "exceeds the context window of 8192")


def test_unsupported_target_fails_before_ray_and_names_the_vllm_backend(tmp_path):
    """A Kimi-K2-class (DeepSeek-V3 architecture) target on the disaggregated backend: one line, no Ray."""
    model = tmp_path / "kimi"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "num_hidden_layers": 61}))
    proc = _aerie("serve", "--config", "configs/smollm2-135m/serve.yaml", f"model={model}", "speculation=false")
    _assert_one_line_error(proc, "model_type 'deepseek_v3' is not supported by aerie's own target model")
    assert "use the vLLM backend" in proc.stderr and "Ray" not in proc.stderr
