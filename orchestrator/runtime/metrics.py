"""Serving metrics, exported through `ray.util.metrics` (Ray's Prometheus endpoint adds the `ray_` prefix;
every metric is tagged with the application's `model`). Grafana panels read these names.

| name | kind | meaning |
|---|---|---|
| aerie_acceptance_length | histogram | tokens a request gained per verification round (1 + accepted drafts) |
| aerie_accepted_per_depth_total | counter, tag `depth` | rounds whose accepted path reached depth d (d = 1, 2, ...) |
| aerie_draft_tokens_total | counter | draft tokens the target verified |
| aerie_accepted_tokens_total | counter | draft tokens the target accepted |
| aerie_rounds_total | counter, tag `kind` | target rounds: `spec` (with drafts) or `target_only` |
| aerie_verify_batch_size | histogram | requests in one verification round |
| aerie_budget_use | histogram | verified tokens / global verification budget, per round |
| aerie_draft_latency_s | histogram | one draft call, as the scheduler waits for it |
| aerie_verify_latency_s | histogram | one verify call, as the scheduler waits for it |
| aerie_queue_depth | gauge | requests waiting for a KV slot |
| aerie_kv_slots_free | gauge, tag `worker` | KV slots free on the `target` / `draft` worker (as it last reported) |
| aerie_kv_slots_used | gauge, tag `worker` | KV slots in use on the `target` / `draft` worker |
| aerie_running_requests | gauge | requests being decoded |
| aerie_ttft_s | histogram | submit -> first token |
| aerie_itl_s | histogram | time between tokens of one request (a round's gap split over its tokens) |
| aerie_errors_total | counter, tag `kind` | errors: `target_died`, `timeout`, `internal` (requests), `draft_died` |
| aerie_worker_transfer_bytes_total | counter, tag `direction` | bytes sent `target_to_draft` / `draft_to_target` |
"""

from __future__ import annotations

LATENCY_BOUNDS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0]
SIZE_BOUNDS = [1, 2, 4, 8, 16, 32, 64, 128]
FRACTION_BOUNDS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


class ServingMetrics:
    """The scheduler's Prometheus metrics (created inside a Ray process)."""

    def __init__(self, model: str) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        tags = {"model": model}

        def hist(name, desc, bounds):
            h = Histogram(name, desc, boundaries=bounds, tag_keys=("model",))
            h.set_default_tags(tags)
            return h

        def counter(name, desc, keys=()):
            c = Counter(name, desc, tag_keys=("model", *keys))
            c.set_default_tags(tags)
            return c

        def gauge(name, desc, keys=()):
            g = Gauge(name, desc, tag_keys=("model", *keys))
            g.set_default_tags(tags)
            return g

        self.acceptance_length = hist("aerie_acceptance_length", "1 + accepted drafts per round", SIZE_BOUNDS)
        self.accepted_per_depth = counter("aerie_accepted_per_depth_total", "rounds accepting depth d", ("depth",))
        self.draft_tokens = counter("aerie_draft_tokens_total", "draft tokens verified")
        self.accepted_tokens = counter("aerie_accepted_tokens_total", "draft tokens accepted")
        self.rounds = counter("aerie_rounds_total", "target rounds", ("kind",))
        self.batch_size = hist("aerie_verify_batch_size", "requests per verification round", SIZE_BOUNDS)
        self.budget_use = hist("aerie_budget_use", "verified tokens / budget", FRACTION_BOUNDS)
        self.draft_latency = hist("aerie_draft_latency_s", "draft call latency", LATENCY_BOUNDS)
        self.verify_latency = hist("aerie_verify_latency_s", "verify call latency", LATENCY_BOUNDS)
        self.queue_depth = gauge("aerie_queue_depth", "requests waiting")
        self.running = gauge("aerie_running_requests", "requests decoding")
        self.slots_free = gauge("aerie_kv_slots_free", "free KV slots", ("worker",))
        self.slots_used = gauge("aerie_kv_slots_used", "KV slots in use", ("worker",))
        self.ttft = hist("aerie_ttft_s", "time to first token", LATENCY_BOUNDS)
        self.itl = hist("aerie_itl_s", "inter-token latency", LATENCY_BOUNDS)
        self.errors = counter("aerie_errors_total", "errors", ("kind",))
        self.transfer_bytes = counter("aerie_worker_transfer_bytes_total", "bytes between the workers", ("direction",))

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


TOTALS = (
    "rounds",
    "spec_rounds",
    "batch",
    "verified_tokens",
    "budget_tokens",
    "draft_calls",
    "draft_call_s",
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
)


class Meter:
    """Every statistic a scheduler keeps, counted here once: `totals` and `acceptance` (its /stats, what the
    benchmark and the rollout diff) and, when it serves (`export`), the Prometheus metrics, from the same calls."""

    def __init__(self, budget_tokens: int, export: ServingMetrics | None = None) -> None:
        from orchestrator.spec.acceptance import Acceptance

        self.budget_tokens, self.export = budget_tokens, export
        self.totals: dict[str, float] = dict.fromkeys(TOTALS, 0.0)
        self.acceptance = Acceptance()

    def verify_round(
        self, drafted: list[int], accepted: list[int], verified: int, latency: float, compute_s: float, pairs: int
    ) -> None:
        """One verification round: per request, draft tokens verified and accepted."""
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
        if self.export is not None:
            self.export.round(len(drafted), verified, self.budget_tokens, drafted, accepted)
            self.export.verify_latency.observe(latency)

    def draft_call(self, latency: float, compute_s: float) -> None:
        self.totals["draft_calls"] += 1
        self.totals["draft_call_s"] += latency
        self.totals["draft_compute_s"] += compute_s
        if self.export is not None:
            self.export.draft_latency.observe(latency)

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
