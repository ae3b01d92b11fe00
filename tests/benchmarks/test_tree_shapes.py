"""The tree-shape benchmark on the tiny chat model and a random drafter: a line per shape and pass, every pass's
answers as long as asked, and a bad shape as one line."""

from __future__ import annotations

from orchestrator.benchmarks.tree_shapes import main


def test_each_shape_is_timed_in_every_pass(tiny_chat, tiny_drafter, capsys):
    argv = ["--model", str(tiny_chat), "--drafter", str(tiny_drafter), "--prompts", "2", "--lengths", "3", "5"]
    assert main([*argv, "--shapes", "2/2/3", "1/2/2", "--passes", "2", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    passes = [line.split(":")[0] for line in lines if " pass " in line]
    assert passes == ["2/2/3 pass 0", "1/2/2 pass 0", "1/2/2 pass 1", "2/2/3 pass 1"]  # alternating order
    assert all("accepted to depth" in line for line in lines if " pass " in line)
    assert [line.split(":")[0] for line in lines[-2:]] == ["2/2/3", "1/2/2"]


def test_batches_and_target_only_decoding_are_timed_alike(tiny_chat, tiny_drafter, capsys, monkeypatch):
    import orchestrator.engine

    engines = []

    def load_engine(*args, **kwargs):
        engines.append(real(*args, **kwargs))
        return engines[-1]

    real = orchestrator.engine.load_engine
    monkeypatch.setattr(orchestrator.engine, "load_engine", load_engine)
    argv = ["--model", str(tiny_chat), "--drafter", str(tiny_drafter), "--prompts", "3", "--lengths", "3", "5"]
    assert main([*argv, "--shapes", "off", "2/2/3", "--passes", "1", "--batch", "2", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["off pass 0", "2/2/3 pass 0", "off", "2/2/3"]
    assert "tau 1.000" in lines[0] and "draft 0.0 ms" in lines[0], lines[0]  # target-only: nothing drafted
    for engine in engines:  # two requests side by side in some rounds, never more
        stats = engine.last_stats
        assert stats["rounds"] < stats["batch"] <= 2 * stats["rounds"], stats


def test_a_bad_shape_is_one_line(tiny_chat, tiny_drafter, capsys):
    assert main(["--model", str(tiny_chat), "--drafter", str(tiny_drafter), "--shapes", "2/0/3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: shape '2/0/3'") and len(err.splitlines()) == 1
    assert main(["--model", str(tiny_chat), "--drafter", str(tiny_drafter), "--shapes", "2x3"]) == 2
    assert "or off" in capsys.readouterr().err
    assert main(["--model", str(tiny_chat), "--drafter", str(tiny_drafter), "--shapes", "off", "--batch", "0"]) == 2
