"""The in-process tap benchmark: both workers decode the same blocks, the tap writes every request it was
offered, and the ratio comes with its interval."""

from __future__ import annotations

import pytest

from orchestrator.benchmarks.tap_cost import main, measure


def test_tap_cost_pairs_blocks_and_the_tap_writes_every_request(tiny_dir, tmp_path):
    result = measure(str(tiny_dir), batch=2, repeats=2, max_tokens=4, threads=1, output=str(tmp_path / "traffic"))
    r = result["tap_on_over_off"]
    assert r["n"] == 2 and r["low"] is not None and r["low"] <= r["ratio"] <= r["high"]
    tap = result["tap"]
    assert tap["offered"] == 2 * 3 and tap["dropped"] == 0  # warm-up and two blocks of 2 requests, tap side only
    assert tap["written_requests"] == 6 and tap["write_errors"] == 0


def test_one_repeat_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["--repeats", "1"])
    assert "--repeats must be at least 2" in capsys.readouterr().err
