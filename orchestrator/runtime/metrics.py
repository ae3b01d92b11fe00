"""Serving metrics, exported through `ray.util.metrics` (Ray's Prometheus endpoint adds the `ray_` prefix;
every metric is tagged with the application's `model`). Grafana panels read these names.

`METRICS` declares them all: `ServingMetrics` creates them from it and docs/reference/metrics.md is generated
from it, so the page, the dashboards' names and the code cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LATENCY_BOUNDS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
SIZE_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128)
FRACTION_BOUNDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass(frozen=True)
class Metric:
    """One exported metric: `ServingMetrics.<attr>` is it."""

    attr: str
    name: str
    kind: Literal["counter", "gauge", "histogram"]
    description: str
    tag_keys: tuple[str, ...] = ()  # beside `model`
    boundaries: tuple[float, ...] = ()  # histograms: the buckets' upper bounds


METRICS: tuple[Metric, ...] = (
    Metric(
        "acceptance_length",
        "aerie_acceptance_length",
        "histogram",
        "tokens a request gained per verification round (1 + accepted drafts)",
        boundaries=SIZE_BOUNDS,
    ),
    Metric(
        "accepted_per_depth",
        "aerie_accepted_per_depth_total",
        "counter",
        "rounds whose accepted path reached depth d (d = 1, 2, ...)",
        ("depth",),
    ),
    Metric("draft_tokens", "aerie_draft_tokens_total", "counter", "draft tokens the target verified"),
    Metric("accepted_tokens", "aerie_accepted_tokens_total", "counter", "draft tokens the target accepted"),
    Metric(
        "rounds", "aerie_rounds_total", "counter", "target rounds: `spec` (with drafts) or `target_only`", ("kind",)
    ),
    Metric(
        "batch_size",
        "aerie_verify_batch_size",
        "histogram",
        "requests in one verification round",
        boundaries=SIZE_BOUNDS,
    ),
    Metric(
        "budget_use",
        "aerie_budget_use",
        "histogram",
        "verified tokens / global verification budget, per round",
        boundaries=FRACTION_BOUNDS,
    ),
    Metric(
        "draft_latency",
        "aerie_draft_latency_s",
        "histogram",
        "one draft call, as the scheduler waits for it",
        boundaries=LATENCY_BOUNDS,
    ),
    Metric(
        "verify_latency",
        "aerie_verify_latency_s",
        "histogram",
        "one verify call, as the scheduler waits for it",
        boundaries=LATENCY_BOUNDS,
    ),
    Metric("queue_depth", "aerie_queue_depth", "gauge", "requests waiting for a KV slot"),
    Metric("running", "aerie_running_requests", "gauge", "requests being decoded"),
    Metric(
        "slots_free",
        "aerie_kv_slots_free",
        "gauge",
        "KV slots free on the `target` / `draft` worker (as it last reported)",
        ("worker",),
    ),
    Metric(
        "slots_used", "aerie_kv_slots_used", "gauge", "KV slots in use on the `target` / `draft` worker", ("worker",)
    ),
    Metric("ttft", "aerie_ttft_s", "histogram", "submit -> first token", boundaries=LATENCY_BOUNDS),
    Metric(
        "itl",
        "aerie_itl_s",
        "histogram",
        "time between tokens of one request (a round's gap split over its tokens)",
        boundaries=LATENCY_BOUNDS,
    ),
    Metric(
        "errors",
        "aerie_errors_total",
        "counter",
        "errors: requests ended by `target_lost`, `worker`, `timeout` or `internal`; `draft_died` (the draft worker)",
        ("kind",),
    ),
    Metric(
        "transfer_bytes",
        "aerie_worker_transfer_bytes_total",
        "counter",
        "bytes sent `target_to_draft` / `draft_to_target`",
        ("direction",),
    ),
)


class ServingMetrics:
    """The scheduler's Prometheus metrics (created inside a Ray process): one attribute per `METRICS` entry."""

    def __init__(self, model: str) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
        for m in METRICS:
            options = {"boundaries": list(m.boundaries)} if m.kind == "histogram" else {}
            metric = kinds[m.kind](m.name, m.description, tag_keys=("model", *m.tag_keys), **options)
            metric.set_default_tags({"model": model})
            setattr(self, m.attr, metric)

    def slots(self, free: dict[str, int], total: int) -> None:
        for worker, n in free.items():
            self.slots_free.set(n, {"worker": worker})
            self.slots_used.set(total - n, {"worker": worker})

    def round(self, batch: int, verified: int, budget: int, drafted: list[int], accepted: list[int]) -> None:
        self.batch_size.observe(batch)
        self.budget_use.observe(min(1.0, verified / budget))
        self.rounds.inc(1, {"kind": "spec" if sum(drafted) else "target_only"})
        if sum(drafted):
            self.draft_tokens.inc(sum(drafted))
        if sum(accepted):
            self.accepted_tokens.inc(sum(accepted))
        for d, a in zip(drafted, accepted, strict=True):
            if d:
                self.acceptance_length.observe(1 + a)
            for depth in range(1, a + 1):
                self.accepted_per_depth.inc(1, {"depth": str(depth)})


# why a round drafted (`Meter.drafted`): the mode chooser's first measurements of a batch size, its probes, its
# choice; a rollout's measurement window; `adaptive: false`
DRAFT_REASONS = ("start", "probe", "best", "measuring", "fixed")
TOTALS = (
    "rounds",
    "spec_rounds",
    "batch",
    "verified_tokens",
    "budget_tokens",
    "draft_calls",
    "draft_call_s",  # sent (a chained call: its verify call answered) to answered
    "draft_waited_s",  # what rounds waited for their draft calls (less than draft_call_s where chained calls overlap)
    "draft_compute_s",
    "draft_errors",
    "verify_calls",
    "verify_call_s",
    "verify_compute_s",
    "pairs_bytes",
    "target_to_draft_bytes",
    "draft_to_target_bytes",
    "target_failures",
    "draft_failures",
    *(f"drafted_{r}" for r in DRAFT_REASONS),
    "catch_ups",  # drafted rounds after target-only ones
    "round_s",  # rounds' seconds as the mode chooser measures them (both micro-batches': overlapping)
    "drafted_excess_s",  # drafted rounds' seconds beyond target-only's for their tokens (ModeChooser.excess)
)


class Meter:
    """Every statistic a scheduler keeps, counted here once: `totals` and `acceptance` (its /stats, what the
    benchmark and the rollout diff) and, when it serves (`export`), the Prometheus metrics, from the same calls."""

    def __init__(self, budget_tokens: int, export: ServingMetrics | None = None) -> None:
        from orchestrator.spec.acceptance import Acceptance

        self.budget_tokens, self.export = budget_tokens, export
        self.totals: dict[str, float] = dict.fromkeys(TOTALS, 0.0)
        self.acceptance = Acceptance()
        self.measured = Acceptance()  # measurement rounds' only (SpecScheduler.measure): whole trees

    def verify_round(
        self,
        drafted: list[int],
        accepted: list[int],
        verified: int,
        latency: float,
        compute_s: float,
        pairs: int,
        measuring: bool = False,
    ) -> None:
        """One verification round: per request, draft tokens verified and accepted; `measuring`: a measurement
        round's (its whole trees count in `measured` too)."""
        t = self.totals
        t["rounds"] += 1
        t["spec_rounds"] += 1 if sum(drafted) else 0
        t["batch"] += len(drafted)
        t["verified_tokens"] += verified
        t["budget_tokens"] += self.budget_tokens
        t["verify_calls"] += 1
        t["verify_call_s"] += latency
        t["verify_compute_s"] += compute_s
        t["pairs_bytes"] += pairs
        for d, a in zip(drafted, accepted, strict=True):
            self.acceptance.record(d, a)
            if measuring:
                self.measured.record(d, a)
        if self.export is not None:
            self.export.round(len(drafted), verified, self.budget_tokens, drafted, accepted)
            self.export.verify_latency.observe(latency)

    def draft_call(self, latency: float, compute_s: float, waited: float) -> None:
        """A draft call a round drafted from: its own time, its compute, and how long the round waited for it."""
        self.totals["draft_calls"] += 1
        self.totals["draft_call_s"] += latency
        self.totals["draft_waited_s"] += waited
        self.totals["draft_compute_s"] += compute_s
        if self.export is not None:
            self.export.draft_latency.observe(latency)

    def drafted(self, reason: str, catch_up: bool) -> None:
        """A round drafted, for `reason` (DRAFT_REASONS); `catch_up`: after target-only rounds."""
        self.totals[f"drafted_{reason}"] += 1
        self.totals["catch_ups"] += catch_up

    def round_time(self, seconds: float, excess: float | None) -> None:
        """A round's seconds, and for a drafted one what it took beyond target-only (ModeChooser.excess)."""
        self.totals["round_s"] += seconds
        self.totals["drafted_excess_s"] += excess or 0.0

    def draft_error(self) -> None:
        """The drafter raised (its worker lives)."""
        self.totals["draft_errors"] += 1

    def draft_lost(self) -> None:
        """The draft worker died."""
        self.totals["draft_failures"] += 1
        if self.export is not None:
            self.export.errors.inc(1, {"kind": "draft_died"})

    def target_failure(self) -> None:
        self.totals["target_failures"] += 1

    def request_error(self, kind: str) -> None:
        """A request ended with an error of `kind` (target_lost, worker, timeout, internal)."""
        self.totals[f"errors_{kind}"] = self.totals.get(f"errors_{kind}", 0) + 1
        if self.export is not None:
            self.export.errors.inc(1, {"kind": kind})

    def transfer(self, direction: str, nbytes: int) -> None:
        """Bytes one worker sends the other: `target_to_draft` (Pairs), `draft_to_target` (draft trees)."""
        self.totals[f"{direction}_bytes"] += nbytes
        if self.export is not None and nbytes:
            self.export.transfer_bytes.inc(nbytes, {"direction": direction})

    def tokens(self, since_submit: float, since_last: float | None, n: int) -> None:
        """A request got `n` tokens: its first (TTFT) or more (each `since_last / n` apart)."""
        if self.export is None:
            return
        if since_last is None:
            self.export.ttft.observe(since_submit)
        else:
            for _ in range(n):
                self.export.itl.observe(since_last / n)

    def load(self, waiting: int, running: int, free_slots: dict[str, int], max_batch: int) -> None:
        if self.export is not None:
            self.export.queue_depth.set(waiting)
            self.export.running.set(running)
            self.export.slots(free_slots, max_batch)
