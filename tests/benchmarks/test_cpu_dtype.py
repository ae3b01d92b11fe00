"""The CPU dtype step benchmark on the tiny target: a line per (dtype, tokens), the verify steps' cost over decoding."""

from __future__ import annotations

from orchestrator.benchmarks.cpu_dtype import main


def test_every_dtype_and_step_size_is_timed(tiny_dir, capsys):
    main(["--model", str(tiny_dir), "--context", "12", "--tokens", "1", "3", "--repeats", "2", "--threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["bfloat16", "1"],
        ["bfloat16", "3"],
        ["float32", "1"],
        ["float32", "3"],
    ]
    assert all(" ms [" in line for line in lines) and "over 1" in lines[1] and "over 1" in lines[3]


def test_a_batch_of_sequences_steps_together(tiny_dir, capsys):
    args = ["--model", str(tiny_dir), "--context", "12", "--tokens", "1", "4", "--repeats", "2", "--threads", "1"]
    main([*args, "--sequences", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["bfloat16", "1"],
        ["bfloat16", "4"],
        ["float32", "1"],
        ["float32", "4"],
    ]
