"""`jobs.diagnose_drafter`: attention masses per drafting depth partition the attention exactly, and the job
writes its table, plots and MLflow run on a tiny target."""

from __future__ import annotations

import json

import pytest
import torch

from orchestrator.evaluation.diagnose import DiagnoseConfig, attention_masses, run_diagnosis
from orchestrator.models.target import TargetModel
from tests.helpers import random_drafter


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_masses_partition_attention_and_own_tokens_start_at_depth_two(tiny_dir, variant):
    target = TargetModel.from_pretrained(tiny_dir)
    drafter = random_drafter(target.hf_config, variant=variant, draft_vocab_size=64, seed=2, num_hidden_layers=2)
    drafter.share_embedding(target.embed_tokens)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (20,), generator=gen)
    aux = torch.randn(20, drafter.fc.in_features, generator=gen)
    masses = attention_masses(drafter, ids, aux, torch.arange(6, 14), depth=4, sinks=2)
    assert masses.shape == (4, 3)
    torch.testing.assert_close(masses.sum(-1), torch.ones(4))
    assert masses[0, 2] == 0 and (masses[1:, 2] > 0).all()  # depth 1 has no drafted token to look at
    assert (masses[:, 0] > 0).all() and (masses[:, 1] > 0).all()


def test_the_job_reports_every_context_and_drafter(tmp_path, tiny_chat, tiny_drafter, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    cfg = DiagnoseConfig(
        model=str(tiny_chat),
        drafters=[{"name": "a", "source": str(tiny_drafter)}, {"name": "b", "source": str(tiny_drafter)}],
        contexts=[128, 256],
        prompts_per_context=1,
        answer_tokens=6,
        depth=3,
        output_dir=str(tmp_path / "out"),
        torch_threads=1,
    )
    result = run_diagnosis(cfg)
    assert set(result["contexts"]) == {"<=128", "<=256"}
    same = result["contexts"]["<=128"]
    assert same["a"] == same["b"]  # the same drafter twice: same numbers
    assert all(abs(sum(p[d] for p in same["a"].values()) - 1) < 1e-3 for d in range(3))
    written = json.loads((tmp_path / "out" / "result.json").read_text())
    assert written["mlflow_run_id"] and len(written["plots"]) == 3
    assert "| <=256 | b | own |" in (tmp_path / "out" / "table.md").read_text()
