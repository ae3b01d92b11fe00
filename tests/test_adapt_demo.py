"""`make adapt-demo`'s pieces that need no server (the demo itself runs ~30 minutes: docs/drafters/adapting.md)."""

import json
from pathlib import Path

from jobs.adapt import AdaptConfig
from orchestrator.adapt_demo import adapt_config, noise_prompts, report
from orchestrator.config import load_config
from orchestrator.evaluation import EvalConfig


def test_the_demo_adapts_on_its_own_traffic_and_mlflow_store(tmp_path):
    assert load_config(AdaptConfig, adapt_config(tmp_path, validation_prompts=64)).traffic.replay is None
    cfg = load_config(AdaptConfig, adapt_config(tmp_path, validation_prompts=64, replay="runs/collect/c"))
    assert cfg.traffic.replay == "runs/collect/c"
    assert cfg.traffic.output == str(tmp_path / "traffic") and cfg.output_dir == str(tmp_path / "adapt")
    assert cfg.mlflow_tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = cfg.evaluate.overrides
    evaluate = load_config(EvalConfig, cfg.evaluate.config, overrides)
    assert list(evaluate.methods) == [cfg.gate.method]  # the gate's method only
    assert "sets.validation_prompts=64" in overrides and sum(o.startswith("sets.validation") for o in overrides) == 1


def test_poisoned_traffic_is_the_same_noise_each_time_and_never_a_special_token():
    first, again = noise_prompts(3, seed=0), noise_prompts(3, seed=0)
    assert first == again and first != noise_prompts(3, seed=1)
    text = first[0]["messages"][0]["content"]
    assert "<|im_start|>" not in text and "<|endoftext|>" not in text and len(text.split()) > 10


def test_the_report_says_what_failed_even_when_the_adapt_job_did_not_finish():
    phase = {
        "acceptance_length": 1.5,
        "spec_round_share": 0.25,
        "load": {"requests": 9, "failed": 1, "per_user_tok_s": 7.5},
    }
    text = report({"domain": "code", "users": 4, "before": phase, "adapt_exit": 1, "failed_requests": 1})
    assert "1.500 (drafted 25% of rounds; 9 requests, 1 failed" in text and "jobs.adapt exit 1" in text
    assert "over the whole run: 1" in text


def test_a_bad_flag_is_one_line_and_exit_status_2_before_anything_starts(capsys):
    from orchestrator.adapt_demo import main

    assert main(["--capture", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --capture must be 10..") and err.count("\n") == 1 and "Traceback" not in err


def test_resume_needs_a_stopped_run_and_says_so_before_anything_starts(tmp_path, capsys):
    from orchestrator.adapt_demo import main

    assert main(["--resume", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --resume needs an earlier run's") and err.count("\n") == 1
    assert not (tmp_path / "serve.log").exists()  # no server was started


def test_a_resumed_report_counts_the_stopped_runs_failures_and_names_them():
    phase = {
        "acceptance_length": 1.8,
        "spec_round_share": 0.3,
        "load": {"requests": 9, "failed": 0, "per_user_tok_s": 9},
    }
    stopped = {"adapt_exit": 2, "adapt": {"deploy": {"reason": "did not start"}}, "during_adapt": {"failed": 0}}
    text = report(
        {"domain": "code", "users": 4, "after": phase, "adapt_exit": 0, "failed_requests": 0, "runs": [stopped]}
    )
    assert "resumed: run 1 stopped in jobs.adapt (exit 2; deploy: did not start)" in text


def test_live_acceptance_before_and_after_comes_with_intervals_that_cover_the_truth():
    import random

    from orchestrator.adapt_demo import live_change
    from orchestrator.spec.acceptance import Acceptance

    def load(p: float, drafts: int, rng: random.Random) -> dict:
        a = Acceptance()
        for _ in range(drafts):  # chains of 5: each next token accepted with probability p
            n = 0
            while n < 5 and rng.random() < p:
                n += 1
            a.record(5, n)
        return {"acceptance": a.to_dict(), "acceptance_length": a.acceptance_length}

    def mean_accepted(p: float) -> float:
        return sum(p**d for d in range(1, 6))

    rng, covered = random.Random(0), 0
    for _ in range(200):
        change = live_change(load(0.3, 300, rng), load(0.45, 200, rng))
        d, low, high = change["difference"]
        covered += low <= mean_accepted(0.45) - mean_accepted(0.3) <= high
        assert change["before"][1] <= change["before"][0] <= change["before"][2] and change["drafts"] == [300, 200]
    assert 180 <= covered <= 198  # 95% nominal
    assert live_change(None, load(0.4, 10, rng)) is None and live_change({"acceptance_length": 1.2}, {}) is None
    empty = {"acceptance": Acceptance().to_dict()}
    assert live_change(empty, load(0.4, 10, rng)) is None  # a load that never drafted has no interval
    text = report(
        {
            "domain": "code",
            "users": 4,
            "failed_requests": 0,
            "live_change": live_change(load(0.3, 50, rng), load(0.5, 50, rng)),
        }
    )
    assert "- live acceptance before 1." in text and "(95%; 50 and 50 drafts, every draft)" in text
    # where both loads have measurement rounds (whole trees), those are compared, not every draft
    measured = [dict(load(0.3, 300, rng), measured=load(p, 40, rng)["acceptance"]) for p in (0.2, 0.6)]
    change = live_change(*measured)
    assert change["counted"] == "measured" and change["drafts"] == [40, 40] and change["difference"][1] > 0
    assert live_change(measured[0], load(0.3, 300, rng))["counted"] == "every draft"


def test_a_next_round_asks_the_same_problems_anew_and_the_first_asks_as_humaneval_prompts_do():
    from orchestrator.adapt_demo import REGISTERED, ROUND_ASKS, asked
    from orchestrator.data.prompts import humaneval_prompts

    problems = humaneval_prompts(limit=3)
    assert asked(problems, 1) == problems
    second = asked(problems, 2)
    for p, q in zip(problems, second, strict=True):
        text = q["messages"][0]["content"]
        assert text.startswith(ROUND_ASKS[1]) and text.endswith(p["messages"][0]["content"][len(ROUND_ASKS[0]) :])
    assert second != problems and asked(second, 1) == problems
    cfg = load_config(AdaptConfig, "configs/smollm2-135m/adapt.yaml")
    assert cfg.registered_model == REGISTERED  # the server of a next round serves what jobs.adapt registers


def test_a_next_round_needs_a_round_that_promoted_and_keeps_it(tmp_path, capsys):
    import json

    from orchestrator.adapt_demo import main, next_round

    assert main(["--next-round", "--out", str(tmp_path)]) == 2
    assert "run the demo once first" in capsys.readouterr().err
    refused = {"adapt": {"deploy": {"skipped": "the gate failed"}}}
    (tmp_path / "result.json").write_text(json.dumps(refused))
    assert main(["--next-round", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "put no drafter in production (deploy: none)" in err and err.count("\n") == 1
    assert main(["--next-round", "--resume", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: --next-round starts a round")
    (tmp_path / "result.json").write_text(json.dumps({"round": 2, "adapt": {"deploy": {"decision": "promoted"}}}))
    assert next_round(tmp_path) == 3
    (tmp_path / "result.json").write_text(json.dumps({"poison": True, "adapt": {"deploy": {"decision": "promoted"}}}))
    assert main(["--next-round", "--out", str(tmp_path)]) == 2
    assert not (tmp_path / "serve.log").exists() and (tmp_path / "result.json").is_file()  # nothing started, kept


def test_a_damaged_earlier_result_is_one_line_for_next_round_and_resume(tmp_path, capsys):
    from orchestrator.adapt_demo import main

    (tmp_path / "adapt").mkdir()
    (tmp_path / "adapt" / "state.json").write_text("{}")
    for text in ("{not json", "[1, 2]"):
        (tmp_path / "result.json").write_text(text)
        for flag in ("--next-round", "--resume"):
            assert main([flag, "--out", str(tmp_path)]) == 2
            err = capsys.readouterr().err
            assert "result.json is" in err and "start afresh" in err and err.count("\n") == 1
    assert (tmp_path / "result.json").read_text() == "[1, 2]" and not (tmp_path / "serve.log").exists()


def test_the_canary_demo_summarizes_a_record_with_both_sides_draft_sizes():
    """The poisoned round's kept canary record (old servers compared trimmed with whole trees): the summary shows
    the skew that measurement rounds remove."""
    from orchestrator.canary_demo import rollout_summary

    record = json.loads((Path(__file__).parents[1] / "docs/operating/canary-poison-2026-12-05.json").read_text())
    s = rollout_summary(record)
    assert s["decision"] == "promoted" and s["test"]["canary_drafts"] == s["canary"]["drafts"] == 101
    assert (
        round(s["stable"]["draft_tokens_per_draft"], 2) == 1.05
        and round(s["canary"]["draft_tokens_per_draft"], 1) == 7.8
    )
    assert rollout_summary({})["canary"] == {
        "app": None,
        "drafts": 0,
        "acceptance_length": 1.0,
        "draft_tokens_per_draft": None,
    }
