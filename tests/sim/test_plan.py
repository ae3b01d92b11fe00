"""jobs.plan on a GPU plan: roofline costs from constants, every setup at every concurrency, the GPUs an SLO needs,
the sweep of fixed settings, an MLflow run; and a plan that is missing its hardware says so in one line."""

from __future__ import annotations

import pytest
import yaml

from orchestrator.config import load_config
from orchestrator.errors import AerieError
from orchestrator.sim.plan import PlanConfig, run_plan
from orchestrator.sim.roofline import Accelerator, ModelShape, Placement, roofline_cost

GPU = {
    "name": "toy",
    "hbm_bytes_s": 1e12,
    "flops": {"bf16": 1e15},
    "per_layer_s": 1e-5,
}
NETWORK = {"nvlink": {"bandwidth_bytes_s": 1e11, "latency_s": 1e-6}, "infiniband": {"bandwidth_bytes_s": 1e10}}
TARGET = {
    "name": "toy-8b",
    "layers": 32,
    "hidden_size": 4096,
    "dense_params": 8e9,
    "active_params": 8e9,
    "kv_bytes_per_token": 131072,
}
DRAFTER = {
    "name": "head",
    "layers": 1,
    "hidden_size": 4096,
    "dense_params": 4e8,
    "active_params": 4e8,
    "kv_bytes_per_token": 4096,
}


def test_a_roofline_step_reads_the_weights_until_compute_takes_over():
    cost = roofline_cost(ModelShape(**TARGET), Accelerator(**GPU), Placement())
    assert cost.seconds(1) == pytest.approx(32 * 1e-5 + 16e9 / 1e12, rel=1e-3)  # 16 GB of bf16 at 1 TB/s
    assert cost.seconds(2000) == pytest.approx(32 * 1e-5 + 2 * 8e9 * 2000 / 1e15, rel=1e-3)  # compute-bound
    moe = ModelShape(**TARGET | {"experts": 64, "experts_per_token": 2, "expert_params": 1e8, "dense_params": 1e9})
    moe_cost = roofline_cost(moe, Accelerator(**GPU), Placement(gpus=2))
    assert moe_cost.experts_read(1) == pytest.approx(2)
    assert moe_cost.experts_read(10_000) == pytest.approx(64)  # every expert, once
    assert moe_cost.seconds(8) > moe_cost.seconds(1)


def test_a_gpu_plan_simulates_every_setup_sizes_the_slo_and_logs_to_mlflow(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    (tmp_path / "hw.yaml").write_text(yaml.safe_dump({"gpu": GPU, "network": NETWORK}))
    plan = {
        "hardware": str(tmp_path / "hw.yaml"),
        "target": TARGET,
        "drafter": DRAFTER,
        "acceptance": {"chain": [0.8, 0.7, 0.6]},
        "setups": [
            {"name": "off", "kind": "target-only"},
            {"name": "colocated", "kind": "colocated", "spec": {"method": "chain", "num_spec_tokens": 3}},
            {
                "name": "disaggregated",
                "kind": "disaggregated",
                "spec": {"method": "chain", "num_spec_tokens": 3},
                "scheduler": {"micro_batches": 1, "budget_tokens": 64},
            },
        ],
        "users": [1, 4],
        "max_batch": 8,
        "requests_per_user": 2,
        "prompt_tokens": [64],
        "max_tokens": 32,
        "slo": {"rate_per_s": 50, "tpot_ms": 40, "requests": 24, "steps": 2},
        "sweep": True,
        "output_dir": str(tmp_path / "out"),
    }
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    cfg = load_config(PlanConfig, tmp_path / "plan.yaml")
    out = tmp_path / "out"
    out.mkdir()
    result = run_plan(cfg, out)["plan"]
    levels = {(r["setup"], r["users"]): r for r in result["levels"]}
    assert len(levels) == 6 and all(r["failed"] == 0 for r in levels.values())
    assert levels[("colocated", 1)]["speedup"] > 1.5  # tau ~2.9 on a memory-bound step
    assert levels[("disaggregated", 1)]["tau"] > 2
    slo = {s["setup"]: s for s in result["slo"]}
    assert slo["colocated"]["gpus"] <= slo["off"]["gpus"]
    assert slo["disaggregated"]["gpus"] % 2 == 0  # target and drafter GPUs per replica
    assert {r["users"] for r in result["sweep"]} == {1, 4} and all(r["best"] > 0 for r in result["sweep"])
    # a chain-3 setup's policy is held against what it could choose: off, chains 1-3, its chain whole
    assert all(
        r["policy_best"] in {"off", "chain 1", "chain 2", "chain 3", "its drafts, whole"} for r in result["sweep"]
    )
    assert all(r["policy_ratio"] >= r["ratio"] for r in result["sweep"])
    assert (out / "plan.md").is_file() and (out / "plan.png").is_file()
    from orchestrator.tracking.store import client

    run = client().get_run(result["mlflow_run_id"])
    assert run.data.metrics["colocated.u1.speedup"] == pytest.approx(levels[("colocated", 1)]["speedup"])


def test_a_plan_without_its_hardware_or_drafter_is_refused_in_one_line(tmp_path):
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump({"setups": [{"name": "x", "kind": "target-only"}]}))
    with pytest.raises(AerieError, match="gpu, network, target and acceptance"):
        load_config(PlanConfig, tmp_path / "plan.yaml")
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump({"hardware": str(tmp_path / "missing.yaml")}))
    with pytest.raises(AerieError, match="missing.yaml"):
        load_config(PlanConfig, tmp_path / "plan.yaml")
