"""The backends' acceptance counters, read as a rollout watches them.

Acceptance length is vLLM's: 1 + accepted draft tokens / drafted request-steps. The disaggregated backend
reports its counters on `/stats` (one replica answers each read; a canary compares its measurement rounds' whole
trees, `acceptance_measured`); the vLLM backend's engines export
`vllm:spec_decode_num_drafts` and `vllm:spec_decode_num_accepted_tokens` to Ray's Prometheus endpoints, per
replica. `CounterWindow` turns cumulative reads per replica into acceptance over a window.
"""

from __future__ import annotations

import json
import re
import urllib.request

from orchestrator.errors import AerieError
from orchestrator.serving.backends import BACKENDS, backend_of
from orchestrator.spec.acceptance import Acceptance


def get_json(url: str, timeout: float = 10) -> dict:
    from orchestrator.serving.guard import auth_headers

    with urllib.request.urlopen(urllib.request.Request(url, headers=auth_headers()), timeout=timeout) as r:
        return json.loads(r.read())


def stats_counters(base: str) -> dict[str, Acceptance]:
    """A disaggregated backend's measurement-round acceptance counters from its /stats (whole trees: what a canary
    compares, `SpecScheduler.measure`): {replica id: counters} of the one replica that answered (Serve picks one
    per request; `CounterWindow` keeps each replica's series)."""
    stats = get_json(f"{base}/stats")
    if "acceptance_measured" not in stats:
        raise AerieError(f"{base}/stats has no acceptance_measured: a server older than this rollout; redeploy it")
    return {stats.get("replica", ""): Acceptance.from_dict(stats["acceptance_measured"])}


_VLLM = {
    "drafts": "spec_decode_num_drafts",
    "draft_tokens": "spec_decode_num_draft_tokens",
    "accepted": "spec_decode_num_accepted_tokens",
}
_PER_POS = "spec_decode_num_accepted_tokens_per_pos"  # label `position`: 0, 1, ...
_SAMPLE = re.compile(r"^(?P<name>[^{\s]+)\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)")


def vllm_counters(app: str) -> Acceptance:
    """vLLM's acceptance counters summed over the engines of Serve application `app`."""
    return sum(vllm_counters_by_replica(app).values(), Acceptance())


def vllm_counters_by_replica(app: str) -> dict[str, Acceptance]:
    """vLLM's acceptance counters of every engine of Serve application `app` by replica id, from the Prometheus
    endpoint of every Ray node (samples carry the engine's `ReplicaId`)."""
    import ray

    replicas = {name.rsplit("#", 1)[-1] for name in replica_actors(app)}
    totals: dict[str, dict[str, float]] = {}
    per_pos: dict[str, dict[int, float]] = {}  # replica -> position -> drafts whose accepted path reached it
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        for line in text.splitlines():
            m = _SAMPLE.match(line)
            if not m:
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
            replica = labels.get("ReplicaId")
            if replica not in replicas:
                continue
            if m["name"] == f"ray_vllm_{_PER_POS}_total" and labels.get("position", "").isdigit():
                positions = per_pos.setdefault(replica, {})
                positions[int(labels["position"])] = positions.get(int(labels["position"]), 0.0) + float(m["value"])
            for key, metric in _VLLM.items():
                if m["name"] == f"ray_vllm_{metric}_total":
                    counts = totals.setdefault(replica, dict.fromkeys(_VLLM, 0.0))
                    counts[key] += float(m["value"])
    out = {}
    for r, c in totals.items():
        positions = per_pos.get(r, {})
        accepted_per_pos = [int(positions.get(d, 0)) for d in range(max(positions, default=-1) + 1)]
        out[r] = Acceptance(int(c["drafts"]), int(c["draft_tokens"]), int(c["accepted"]), accepted_per_pos)
    return out


def backend_counters(app: str, import_path: str, proxy: str) -> dict[str, Acceptance]:
    """Serve application `app`'s cumulative acceptance counters by replica (what `CounterWindow` takes); the
    disaggregated backend's through Serve's HTTP proxy at `proxy`."""
    from orchestrator.serving.router import BACKEND_PREFIX

    if backend_of(import_path) == "vllm":
        return vllm_counters_by_replica(app)
    return stats_counters(f"{proxy}{BACKEND_PREFIX}/{app}")


# what a disaggregated backend's scheduler did (its /stats totals), diffed over a canary window
ACTIVITY = ("rounds", "spec_rounds", "draft_calls", "draft_errors", "draft_failures", "catch_ups", "target_failures")


def backend_activity(app: str, import_path: str, proxy: str) -> dict:
    """A disaggregated backend's scheduler totals (`ACTIVITY`) and whether its drafter is alive, from /stats of
    the replica that answers: why a canary window measured few drafts (no rounds, no draft calls, a drafter lost).
    {} for the vLLM backend, whose engines draft every step."""
    from orchestrator.serving.router import BACKEND_PREFIX

    if backend_of(import_path) == "vllm":
        return {}
    stats = get_json(f"{proxy}{BACKEND_PREFIX}/{app}/stats")
    out = {key: int(stats.get(key, 0)) for key in ACTIVITY}
    out["measured_drafts"] = int(stats.get("acceptance_measured", {}).get("drafts", 0))
    return out | {key: stats.get(key) for key in ("draft_alive", "running", "replica")}


def activity_change(before: dict, after: dict) -> dict:
    """`after`'s counts less `before`'s (the same replica's: another replica's totals are shown as they are),
    its state (draft_alive, running) as it is."""
    same = before.get("replica") == after.get("replica")
    return {
        key: value - before.get(key, 0) if same and key in (*ACTIVITY, "measured_drafts") else value
        for key, value in after.items()
        if key != "replica"
    }


def replica_actors(app: str) -> list[str]:
    """Names of the Serve replica actors of application `app` ('SERVE_REPLICA::app#deployment#id')."""
    import ray

    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#")
    ]


def running_import_path(app: str) -> str:
    """The kind of a running backend, as its import path: the vLLM app's replicas are Ray Serve LLM's
    `LLMServer`."""
    vllm = any("#LLMServer" in name for name in replica_actors(app))
    return BACKENDS["vllm" if vllm else "disaggregated"][0]


class CounterWindow:
    """Acceptance over a window, from cumulative counters read per series (a backend replica), as Prometheus'
    increase(): a series counts from the read it is first seen in; one whose counters went down restarted and
    counts on from zero (what it counted before stays; a restart that climbs past its last read before the next
    one goes unseen and is undercounted, as in Prometheus); one no longer read keeps what it counted."""

    def __init__(self) -> None:
        self.first: dict[str, Acceptance] = {}
        self.last: dict[str, Acceptance] = {}
        self.banked = Acceptance()

    def update(self, reads: dict[str, Acceptance]) -> None:
        for series, value in reads.items():
            last = self.last.get(series)
            if last is None:
                self.first[series] = value
            elif value.drafts < last.drafts or value.draft_tokens < last.draft_tokens or value.accepted < last.accepted:
                self.banked = self.banked + (last - self.first[series])
                self.first[series] = Acceptance()
            self.last[series] = value

    def total(self) -> Acceptance:
        return sum((self.last[s] - self.first[s] for s in self.last), self.banked)
