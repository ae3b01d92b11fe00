"""gpu-check's measured step times beside the roofline of the same GPU (the H200 run of 2026-12-04)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from orchestrator.sim.plan import PlanConfig
from orchestrator.sim.roofline import against_measured, against_measured_table, main

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "docs/operating/gpu-check-h200-2026-12-04.json"
PLAN = "configs/llama-3.1-8b/plan.yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the plan's hardware and serve configs are paths relative to the repository


def _plan() -> PlanConfig:
    return PlanConfig.model_validate(
        yaml.safe_load(Path(PLAN).read_text()) | {"hardware": "configs/hardware/h200.yaml"}
    )


def test_every_measured_step_gets_its_roofline_and_the_implied_floor():
    cfg = _plan()
    steps = json.loads(RUN.read_text())["steps"]
    result = against_measured(steps, cfg.target, cfg.gpu)
    assert len(result["rows"]) == len(steps["target"]) == 24
    decode = next(r for r in result["rows"] if (r["batch"], r["context"], r["new"]) == (1, 256, 1))
    # 7.5e9 bf16 parameters over 4.8 TB/s, plus 32 x 71 us; 256 cached tokens add 7 us
    assert abs(decode["roofline_s"] - (15e9 / 4.8e12 + 32 * 7.1e-5 + 256 * 131072 / 4.8e12)) < 1e-6
    # the eager engine's floor: (15.33 ms - the roofline's 3.13 ms read) / 32 layers
    assert 350e-6 < result["per_layer_s"] < 400e-6
    assert all(r["measured_over_roofline"] > 1 for r in result["rows"])
    assert "| 64 | 2048 | 16 | 56.49 |" in against_measured_table(result)


def test_cli_prints_the_table(capsys):
    assert main(["--gpu-check", str(RUN), "--plan", PLAN, "--hardware", "configs/hardware/h200.yaml"]) == 0
    assert "Llama-3.1-8B-Instruct on H200" in capsys.readouterr().out


def test_measured_costs_fit_the_small_batches_and_a_plan_takes_them(tmp_path):
    """The measured plan's costs: fitted to gpu-check's forwards, within 20% where the planner's users sit
    (batch <= 4); a gpu-check.json without steps is a one-line error."""
    from orchestrator.errors import AerieError
    from orchestrator.sim.plan import _measured, costs_of
    from orchestrator.sim.roofline import measured_costs

    steps = json.loads(RUN.read_text())["steps"]
    target, draft = measured_costs(steps)
    assert 0.010 < target.fixed_s < 0.016  # eager: the floor is most of a step
    for r in steps["target"]:
        if r["batch"] <= 4:
            predicted = target.seconds(r["batch"] * r["new"], r["batch"] * r["context"], r["new"] > 1)
            assert abs(predicted / r["seconds"] - 1) < 0.2, r
    assert draft.fixed_s > target.fixed_s  # a drafter forward cost more than a target one (cuDNN's plans)
    cfg = _plan().model_copy(update={"measured": str(RUN)})
    setup = cfg.setups[0]
    assert costs_of(cfg, setup).target.fixed_s == pytest.approx(target.fixed_s)  # the fit, not the roofline
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(AerieError, match="no measured steps"):
        _measured(str(tmp_path / "empty.json"))
