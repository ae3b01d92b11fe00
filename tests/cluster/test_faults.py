"""Faults under steady streaming load on a cluster of network namespaces (the server as in test_serving.py:
scheduler and target worker on the target node, drafter on the draft node, router on the head). Each test
prints what the clients saw: requests sent, failed (with their errors), and how long until speculation resumed
or a replacement node served."""

from __future__ import annotations

import time

import pytest

from tests.cluster.conftest import Load, Watch, serve
from tests.cluster.test_serving import app_args

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(netcluster, smollm2_dir, tmp_path_factory):
    server = serve(netcluster, app_args(smollm2_dir), tmp_path_factory.mktemp("faults"))
    yield server
    server.stop()


def wait_for(cond, timeout_s: float, what: str, period_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(period_s)
    raise AssertionError(f"not within {timeout_s:g} s: {what}")


def summary(records: list[dict], t0: float) -> dict:
    failed = [r for r in records if "error" in r]
    return {
        "requests": len(records),
        "failed": len(failed),
        "errors": sorted({r["error"][:120] for r in failed})[:4],
        "failed_at_s": [round(r["ended"] - t0, 1) for r in failed][:10],
        "longest_s": round(max((r["ended"] - r["sent"] for r in records), default=0), 1),
    }


def longest_stall(rows: list[tuple]) -> float:
    """The longest time the server's round counter stood still (seconds, from the /stats rows)."""
    rows = [r for r in rows if r[3] is not None]
    longest, since = 0.0, rows[0] if rows else None
    for row in rows[1:]:
        if row[3] != since[3]:
            since = row
        longest = max(longest, row[0] - since[0])
    return round(longest, 1)


def test_draft_link_down_for_30s(netcluster, served):
    """The draft node cut off for 30 s: requests go on target-only (none fails); once the link is back (the node
    rejoining, or replaced if Ray declared it dead meanwhile) the drafter drafts again."""
    load, watch = Load(served.url), Watch(served.url)
    try:
        t0 = time.monotonic()
        wait_for(lambda: watch.speculating_since(t0), 120, "speculation under load")
        cut, replaced = time.monotonic(), None
        netcluster.link("draft", up=False)
        time.sleep(30)
        netcluster.link("draft", up=True)
        up = time.monotonic()
        # either the node rejoins, or Ray declared it dead while it was cut off and ends its raylet on return
        wait_for(lambda: watch.speculating_since(up) or not netcluster.ray_alive("draft"), 120, "rejoined or ended")
        if not netcluster.ray_alive("draft"):
            netcluster.add_node("draft", {"draft": 1})
            replaced = time.monotonic() - up
        resumed = wait_for(lambda: watch.speculating_since(up), 300, "speculation after the link came back")
        time.sleep(3)
    finally:
        records, rows = load.stop(), watch.stop()
    during = [r for r in rows if cut <= r[0] <= up and r[3] is not None]
    out = summary(records, cut) | {
        "resumed_after_link_up_s": round(resumed - up, 1),
        "replaced_after_s": replaced and round(replaced, 1),
        "rounds_while_cut": during[-1][3] - during[0][3] if during else 0,
        "spec_rounds_while_cut": during[-1][2] - during[0][2] if during else 0,
    }
    out["longest_stall_s"] = longest_stall(rows)
    print("draft link down 30 s:", out)
    assert out["failed"] == 0, out
    assert out["rounds_while_cut"] > 0, out  # target-only rounds went on (after draft_timeout_s)


def test_draft_node_killed(netcluster, served):
    """Every process of the draft node killed at once: requests go on target-only (none fails); a replacement
    draft node joins 10 s later and the drafter, restarted there, drafts again."""
    load, watch = Load(served.url), Watch(served.url)
    try:
        t0 = time.monotonic()
        wait_for(lambda: watch.speculating_since(t0), 120, "speculation under load")
        killed = time.monotonic()
        processes = netcluster.kill("draft")
        time.sleep(10)
        netcluster.add_node("draft", {"draft": 1})
        joined = time.monotonic()
        resumed = wait_for(lambda: watch.speculating_since(joined), 300, "speculation on the replacement node")
        time.sleep(3)
    finally:
        records, rows = load.stop(), watch.stop()
    during = [r for r in rows if killed <= r[0] <= joined and r[3] is not None]
    out = summary(records, killed) | {
        "processes_killed": processes,
        "rounds_until_replaced": during[-1][3] - during[0][3] if during else 0,
        "resumed_after_replacement_s": round(resumed - joined, 1),
        "longest_stall_s": longest_stall(rows),
    }
    print("draft node killed:", out)
    assert out["failed"] == 0, out
    assert out["rounds_until_replaced"] > 0, out


def test_target_node_killed(netcluster, served):
    """Every process of the target node killed (the target worker and the scheduler with it): requests in flight
    end with an error the client sees (an HTTP status or the stream's error event, or the stream cut), none hangs
    past the request timeout; once a replacement target node joins, new requests are served."""
    load = Load(served.url)
    try:
        wait_for(lambda: len(load.records) >= 2, 120, "requests served before the fault")
        killed = time.monotonic()
        processes = netcluster.kill("target")
        time.sleep(10)
        netcluster.add_node("target", {"target": 1})
        joined = time.monotonic()
        served_again = wait_for(
            lambda: next((r["ended"] for r in load.records if r["sent"] > joined and "error" not in r), None),
            600,
            "a request served by the replacement",
        )
    finally:
        records = load.stop()
    in_flight = [r for r in records if r["sent"] < killed < r["ended"]]
    out = summary(records, killed) | {
        "processes_killed": processes,
        "in_flight_at_kill": len(in_flight),
        "in_flight_failed": sum("error" in r for r in in_flight),
        "served_after_replacement_s": round(served_again - joined, 1),
    }
    print("target node killed:", out)
    assert out["in_flight_failed"] == out["in_flight_at_kill"] > 0, out
    assert out["longest_s"] <= 300 + 30, out  # request_timeout_s (app_args), and the client's own read
