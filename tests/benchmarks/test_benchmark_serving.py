"""`python -m jobs.benchmark_serving` on the tiny target: both modes, two concurrencies, every number there."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.serving.conftest import REPO, app_args, free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_benchmark_job_reports_both_modes(tiny_chat, tiny_drafter, tmp_path):
    app = tmp_path / "serve.yaml"
    # Fixed budgets: the random drafter drafts every round (ModeChooser would rightly stop it drafting), so
    # the spec side's numbers (draft calls, trees) are there whatever the probe rate.
    args = app_args(
        tiny_chat,
        drafter=str(tiny_drafter),
        spec={"method": "tree", "depth": 3, "topk": 2, "budget": 6},
        scheduler={"adaptive": False},
    )
    app.write_text(
        yaml.safe_dump({"applications": [{"import_path": "orchestrator.serving.app:build_app", "args": args}]})
    )
    out = tmp_path / "bench"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.benchmark_serving",
            f"app={app}",
            "concurrency=[1,3]",
            "min_requests=3",
            "requests_per_user=1",
            "repeats=2",
            "max_tokens=12",
            "num_prompts=4",
            "trace_concurrency=3",
            f"port={free_port()}",
            f"output_dir={out}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads((out / "result.json").read_text())
    for mode in ("spec", "no-spec"):
        for level in result["modes"][mode].values():
            assert level["failed"] == 0 and level["per_user_tok_s"] > 0 and level["ttft_p50_s"] > 0
            assert 0 < level["scheduler"]["budget_use"] <= 1.0
    no_spec = result["modes"]["no-spec"]["1"]["scheduler"]
    assert no_spec["acceptance_length"] == 1.0 and no_spec["drafted_share"] == 0
    assert no_spec["drafting_excess"] == 0.0  # nothing drafted, nothing lost to it
    spec = result["modes"]["spec"]["1"]["scheduler"]
    assert spec["drafted_share"] > 0.5 and spec["acceptance_length"] >= 1.0  # fixed budgets: rounds draft
    assert result["modes"]["spec"]["1"]["scheduler"]["draft_call_ms"] > 0
    assert 0.05 <= spec["calibration"] <= 4.0 and spec["cost"]  # the budget policy's state, as /stats has it
    assert set(result["speedup"]) == {"1", "3"} and result["in_process_c1"]["tok_s"] > 0
    for c, ratio in result["speedup"].items():  # interleaved repeats: every request paired with its twin
        level = result["modes"]["spec"][c]
        assert level["repeats"] == 2 and ratio["n"] == level["requests"] == 2 * max(3, int(c))
        assert ratio["low"] <= ratio["ratio"] <= ratio["high"]
    o = result["overhead_c1"]
    for side in ("in_process", "disaggregated"):
        costs = o[side]
        assert costs["draft_compute_ms"] > 0 and costs["verify_compute_ms"] > 0 and costs["rounds"] > 0
        parts = costs["draft_compute_ms"] + costs["verify_compute_ms"] + costs["calls_ms"] + costs["rest_ms"]
        parts -= costs["draft_hidden_ms"]  # chained draft calls' time that overlapped the rest
        assert costs["draft_hidden_ms"] >= 0
        assert abs(parts - costs["round_ms"]) < 1e-6
    assert o["in_process"]["calls_ms"] < o["disaggregated"]["calls_ms"]  # local calls vs Ray actor calls
    assert (out / "trace_spec_c3.json").is_file() and (out / "timeline_spec_c3.png").is_file()
    assert "speculation on / off" in proc.stdout and "disaggregated overhead vs in-process" in proc.stdout
