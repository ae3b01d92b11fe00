"""Training that goes on across sessions from a committed drafter (`drafter.continue_from`), and the tau table a
committed drafter carries (`aerie convert-drafter --evaluation`). No Ray: the config resolution and the record."""

from __future__ import annotations

import json

import pytest

from orchestrator.cli import tau_table
from orchestrator.errors import AerieError
from orchestrator.train.config import TrainConfig
from orchestrator.train.run import continued


def _cfg(where) -> TrainConfig:
    return TrainConfig.model_validate(
        {
            "name": "broad",
            "model": "m",
            "data": "d",
            "output": "o",
            "max_steps": 1,
            "drafter": {"variant": "eagle3.1", "continue_from": str(where), "draft_vocab_coverage": 0.99},
        }
    )


def test_nothing_committed_yet_trains_from_scratch(tmp_path):
    cfg, previous = continued(_cfg(tmp_path / "absent"))
    assert previous is None and cfg.name == "broad"
    assert cfg.drafter.init_from is None and cfg.drafter.draft_vocab_coverage == 0.99  # sized as configured


def test_a_committed_drafter_is_continued_under_a_run_of_its_own(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights v1")
    record = {"tokens": 1000, "tokens_cumulative": 5000, "data_positions": [{"epoch": 0, "consumed": 7}]}
    (tmp_path / "provenance.json").write_text(json.dumps({"training": record}))
    cfg, previous = continued(_cfg(tmp_path))
    assert previous == record
    assert cfg.drafter.init_from == str(tmp_path) and cfg.drafter.draft_vocab_coverage is None  # its vocabulary
    first = cfg.name
    assert first.startswith("broad-from-")
    (tmp_path / "model.safetensors").write_bytes(b"weights v2")  # the next increment, after a commit
    assert continued(_cfg(tmp_path))[0].name not in (first, "broad")


def test_a_half_committed_drafter_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(AerieError, match="no model.safetensors"):
        continued(_cfg(tmp_path))


def test_init_from_and_continue_from_exclude_each_other(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        TrainConfig.model_validate(
            {
                "name": "x",
                "model": "m",
                "data": "d",
                "output": "o",
                "max_steps": 1,
                "drafter": {"variant": "eagle3", "continue_from": "a", "init_from": "b"},
            }
        )


def test_the_tau_table_comes_from_the_evaluation(tmp_path):
    result = {
        "drafters": {
            "eagle3.1": {
                "source": "models:/d@eagle3-1",
                "engine": {
                    "chain-5": {"overall": {"acceptance_length": 2.1}, "sets": {"mtbench": {"acceptance_length": 2.0}}},
                    "draft_vocab_coverage": {"mtbench": 0.97},
                },
                "vllm_check": {"method": "chain-5", "sets": {"mtbench": {"vllm_tau": 1.98, "engine_tau": 2.0}}},
            }
        }
    }
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result))
    table = tau_table(str(path), "eagle3.1")
    assert table["table"] == {"chain-5": {"all": 2.1, "mtbench": 2.0}, "vllm:chain-5": {"mtbench": 1.98}}
    with pytest.raises(AerieError, match="no drafter named 'eagle3'"):
        tau_table(str(path), "eagle3")


def test_a_converted_drafter_records_the_config_its_training_ran_with(tiny_dir, tmp_path):
    """`make drafters` trains EAGLE-3 from the EAGLE-3.1 file with overrides: provenance.json records the config
    the job ran with (train_config.json beside the export), and the file it started from."""
    import torch

    from orchestrator.cli import main
    from orchestrator.models.checkpoint import save_drafter
    from orchestrator.models.init import init_drafter
    from orchestrator.models.target import TargetModel

    target = TargetModel.from_pretrained(tiny_dir)
    src = save_drafter(init_drafter(target, "eagle3", torch.arange(64)), tmp_path / "exported")
    file = tmp_path / "train.yaml"
    file.write_text("name: broad\ndrafter: {variant: eagle3.1}\n")
    out = tmp_path / "committed"
    assert main(["convert-drafter", str(src), "--out", str(out), "--train-config", str(file)]) == 0
    assert json.loads((out / "provenance.json").read_text())["train_config"]["drafter"]["variant"] == "eagle3.1"
    ran = {"name": "broad-eagle3", "drafter": {"variant": "eagle3"}, "max_steps": 577}
    (src / "train_config.json").write_text(json.dumps(ran))
    assert main(["convert-drafter", str(src), "--out", str(out), "--train-config", str(file)]) == 0
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["train_config"] == ran and provenance["train_config_file"] == str(file)
