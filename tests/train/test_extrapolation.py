"""The extrapolation experiment's statistics: tau per variant and the ratio's intervals over seeds and prompts,
pooled per condition from the evaluation's per-prompt counts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from orchestrator.evaluation.extrapolation import conditions, format_table
from orchestrator.stats import tau_ratio


def _counts(tau_per_prompt: list[float], seeds: int, drafts: int = 20) -> np.ndarray:
    """[seeds, prompts, 2]: `drafts` rounds per prompt, accepted so that tau is the given value."""
    row = [[drafts, round((t - 1) * drafts)] for t in tau_per_prompt]
    return np.array([row] * seeds, dtype=float)


def test_tau_ratio_of_equal_drafters_is_one_and_a_better_one_is_resolved():
    taus = [1.5, 2.0, 2.5, 3.0, 1.2, 2.2]
    same = tau_ratio(_counts(taus, 3), _counts(taus, 3))
    assert same["ratio"] == pytest.approx(1.0) and same["ratio_interval"] == pytest.approx([1.0, 1.0])
    assert same["tau_a"] == pytest.approx(1 + sum(round((t - 1) * 20) for t in taus) / (20 * len(taus)))
    better = tau_ratio(_counts([t + 0.3 for t in taus], 3), _counts(taus, 3))
    assert 1.0 < better["ratio_interval"][0] <= better["ratio"] <= better["ratio_interval"][1]
    noisy_seeds = np.concatenate([_counts([t + 0.6 for t in taus], 1), _counts([t - 0.6 for t in taus], 1)])
    wide = tau_ratio(noisy_seeds, _counts(taus, 2))  # seeds disagree: the interval says so
    assert wide["ratio_interval"][0] < 1.0 < wide["ratio_interval"][1]
    with pytest.raises(ValueError):
        tau_ratio(_counts(taus, 2), _counts(taus[:3], 2))


def test_conditions_pool_the_evaluation_rows_per_condition():
    labels = [["validation", "held-out"]] * 2 + [["long_context", "<=4096"]] + [["templates", "llama3-template"]]
    labels += [["templates", "plain-template"], ["templates", "chatml-pirate"]]
    per = {  # (variant, seed) -> per-prompt [drafts, accepted]
        ("eagle3", 0): [[10, 10], [10, 10], [10, 2], [10, 5], [10, 5], [10, 5]],
        ("eagle3", 1): [[10, 10], [10, 10], [10, 2], [10, 5], [10, 5], [10, 5]],
        ("eagle3.1", 0): [[10, 10], [10, 10], [10, 4], [10, 5], [10, 5], [10, 10]],
        ("eagle3.1", 1): [[10, 10], [10, 10], [10, 4], [10, 5], [10, 5], [10, 10]],
    }
    evaluation = {
        "prompt_labels": labels,
        "drafters": {
            f"extrapolation-{v}-seed{s}": {"engine": {"chain-5": {"per_prompt": rows}, "draft_vocab_coverage": {}}}
            for (v, s), rows in per.items()
        },
    }
    out = conditions(evaluation, ["eagle3", "eagle3.1"], [0, 1])
    assert out["training distribution (held-out)"]["ratio"] == pytest.approx(1.0)
    assert out["training distribution (held-out)"]["prompts"] == 2
    assert out["context <= 4096"]["eagle3"]["tau"] == pytest.approx(1.2)
    assert out["context <= 4096"]["ratio"] == pytest.approx(1.4 / 1.2)
    assert out["unseen chat templates"]["prompts"] == 2 and out["unseen chat templates"]["ratio"] == pytest.approx(1)
    assert out["out-of-distribution system prompts"]["ratio"] == pytest.approx(2.0 / 1.5)
    assert "context <= 1024" not in out  # no rows: no condition
    table = format_table({"variants": ["eagle3", "eagle3.1"], "seeds": [0, 1], "conditions": out})
    assert "| context <= 4096 | 1 | 1.200 [1.200, 1.200] | 1.400 [1.400, 1.400] | 1.167 [1.167, 1.167] |" in table


def test_the_job_trains_every_variant_and_seed_once_and_resumes(tmp_path, tiny_dir, monkeypatch):
    """The wiring, with the three jobs faked: who is trained with what, what a rerun skips, what is reported."""
    import json

    import orchestrator.data.collect as collect_mod
    import orchestrator.evaluation.evaluate as evaluate_mod
    import orchestrator.train.run as train_mod
    from orchestrator.evaluation.extrapolation import ExtrapolationConfig, run_extrapolation

    calls = {"collect": 0, "train": [], "evaluate": 0}

    def fake_collect(cfg, model_dir):
        calls["collect"] += 1
        (tmp_path / "data").mkdir(exist_ok=True)
        (tmp_path / "data" / "manifest.json").write_text("{}")
        return {"output": cfg.output, "total_tokens": 100}

    def fake_train(cfg):
        calls["train"].append(
            (cfg.drafter.variant, cfg.drafter.seed, cfg.seed, cfg.name, cfg.data, cfg.drafter.draft_vocab_size)
        )
        Path(cfg.output).mkdir(parents=True)
        (Path(cfg.output) / "config.json").write_text("{}")
        return {"exported": cfg.output, "steps": 3, "tokens": 30, "train_minutes": 0.1, "mlflow_run_id": cfg.name}

    def fake_evaluate(cfg):
        calls["evaluate"] += 1
        assert cfg.data == str(tmp_path / "data") and not cfg.vllm_check and list(cfg.methods) == ["chain-5"]
        labels = [["validation", "held-out"], ["long_context", "<=4096"]]
        drafters = {
            d.name: {"engine": {"chain-5": {"per_prompt": [[10, 10], [10, 9 if "3.1" in d.name else 3]]}}}
            for d in cfg.drafters
        }
        return {"prompt_labels": labels, "drafters": drafters}

    monkeypatch.setattr(collect_mod, "run_collection", fake_collect)
    monkeypatch.setattr(train_mod, "run_training", fake_train)
    monkeypatch.setattr(evaluate_mod, "run_evaluation", fake_evaluate)
    (tmp_path / "collect.yaml").write_text(
        json.dumps({"model": str(tiny_dir), "sources": [{"kind": "chitchat"}], "output": str(tmp_path / "data")})
    )
    (tmp_path / "train.yaml").write_text(json.dumps({"name": "x", "model": str(tiny_dir), "data": "x", "output": "x"}))
    cfg = ExtrapolationConfig(
        collect=str(tmp_path / "collect.yaml"),
        train=str(tmp_path / "train.yaml"),
        train_overrides=["max_steps=3"],
        seeds=[0, 1],
        output_dir=str(tmp_path / "out"),
        mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    result = run_extrapolation(cfg)
    assert calls["collect"] == 1 and calls["evaluate"] == 1
    assert sorted(c[:3] for c in calls["train"]) == [
        ("eagle3", 0, 0), ("eagle3", 1, 1), ("eagle3.1", 0, 0), ("eagle3.1", 1, 1)
    ]  # fmt: skip
    assert {c[4] for c in calls["train"]} == {str(tmp_path / "data")}
    assert result["conditions"]["context <= 4096"]["ratio"] == pytest.approx(1.9 / 1.3)
    assert (tmp_path / "out" / "ratios.png").is_file() and result["mlflow_run_id"]
    run_extrapolation(cfg)  # a rerun: everything was done with the same inputs
    assert calls["collect"] == 1 and len(calls["train"]) == 4 and calls["evaluate"] == 1

    run_extrapolation(cfg.model_copy(update={"seeds": [0, 1, 2]}))  # one more seed: two trainings, a new evaluation
    assert len(calls["train"]) == 6 and calls["evaluate"] == 2

    # A recipe choice instead of the variants: two arms of overrides, the same data, budget and seeds.
    calls["train"].clear()
    arms = {
        "vocab-4096": ["drafter.variant=eagle3.1", "drafter.draft_vocab_size=4096"],
        "vocab-8192": ["drafter.variant=eagle3.1", "drafter.draft_vocab_size=8192"],
    }
    result = run_extrapolation(cfg.model_copy(update={"arms": arms, "output_dir": str(tmp_path / "arms")}))
    assert sorted((c[3], c[1], c[5]) for c in calls["train"]) == [
        ("extrapolation-vocab-4096-seed0", 0, 4096), ("extrapolation-vocab-4096-seed1", 1, 4096),
        ("extrapolation-vocab-8192-seed0", 0, 8192), ("extrapolation-vocab-8192-seed1", 1, 8192),
    ]  # fmt: skip
    assert (
        result["variants"] == ["vocab-4096", "vocab-8192"] and "vocab-8192" in result["conditions"]["context <= 4096"]
    )
