"""The thin-link table of `make cluster-demo`, from rows as repeats of the run leave them (no cluster needed)."""

from __future__ import annotations

import pytest

from orchestrator.cluster_demo import summarize, table
from orchestrator.netcluster import NetCluster, Node, cpu_between


def row(arm: str, rate, repeat: int, tok_s: float, drafted: float = 0.0, call=None) -> dict:
    return {
        "arm": arm,
        "rate_mbit": rate,
        "repeat": repeat,
        "load": {"per_user_tok_s": tok_s, "failed": 0, "requests": 10},
        "spec_round_share": drafted,
        "ms_per_round": 50.0,
        "draft_call_ms": call,
        "link_bytes_per_round": 2000.0,
        "counted_bytes_per_round": 1900.0,
        "cpu_ms_per_round": {"head": 5.0, "target": 40.0 + repeat, "draft": 30.0 * drafted},
    }


def test_each_rate_is_paired_with_the_target_only_run_of_its_own_repeat():
    # The machine drifts: repeat 1 is twice as slow for both arms. Pairing within a repeat sees a steady 1.5x;
    # pooling the repeats would not.
    rows = [
        row("target only", None, 0, 10.0),
        row("speculation", None, 0, 15.0, 0.9, 30.0),
        row("speculation", 5.0, 0, 10.0, 0.0),
        row("speculation", 5.0, 1, 5.0, 0.0),
        row("speculation", None, 1, 7.5, 0.7, 50.0),
        row("target only", None, 1, 5.0),
    ]
    summary = summarize(rows)
    assert [(s["arm"], s["rate_mbit"], s["repeats"]) for s in summary] == [
        ("target only", None, 2),
        ("speculation", None, 2),
        ("speculation", 5.0, 2),
    ]
    fast = summary[1]
    assert fast["vs_target_only"]["ratio"] == pytest.approx(1.5)
    assert fast["vs_target_only"]["low"] == pytest.approx(1.5) and fast["vs_target_only"]["high"] == pytest.approx(1.5)
    assert fast["spec_round_share"] == pytest.approx(0.8) and fast["draft_call_ms"] == pytest.approx(40.0)
    assert summary[2]["vs_target_only"]["ratio"] == pytest.approx(1.0) and summary[2]["draft_call_ms"] is None
    assert summary[0]["failed"] == 0 and summary[0]["requests"] == 20
    lines = table(summary).splitlines()
    assert lines[2].startswith("| target only | unlimited | 7.50 | baseline | 0 / 20 | 0% |")
    assert lines[3].startswith("| speculation | unlimited | 11.25 | 1.50x [1.50, 1.50] | 0 / 20 | 80% |")
    assert lines[4].startswith("| speculation | 5 Mbit/s | 7.50 | 1.00x [1.00, 1.00] |")
    assert lines[3].endswith("| head 5 / target 40 / draft 24 |")  # each node's CPU per round, over the repeats


def test_one_repeat_gives_a_ratio_without_an_interval():
    summary = summarize([row("target only", None, 0, 10.0), row("speculation", 100.0, 0, 9.0, 0.1, 60.0)])
    assert "0.90x (n=1)" in table(summary)


def test_a_nodes_cpu_time_between_two_readings():
    # pid 1 ran 2 s more, pid 2 started between the readings (all its time counts), pid 3 ended (not counted)
    assert cpu_between({1: 10.0, 3: 4.0}, {1: 12.0, 2: 0.5}) == pytest.approx(2.5)


def test_a_node_with_cores_of_its_own_runs_its_commands_on_them():
    cluster = NetCluster({})
    cluster.nodes["target"] = Node("target", "198.51.100.11", cores=(0,))
    cluster.nodes["draft"] = Node("draft", "198.51.100.12")
    assert cluster.command("target", ["ray", "start"]) == [
        *("ip", "netns", "exec", "aerie-target", "taskset", "-c", "0", "ray", "start")
    ]
    assert cluster.command("draft", ["ray", "start"]) == ["ip", "netns", "exec", "aerie-draft", "ray", "start"]
