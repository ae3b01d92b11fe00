"""Serving benchmark: an async client drives the HTTP endpoint at several concurrencies, speculation on and
off with the same deployment code in the same run, and reports per-user throughput, TTFT, inter-token
latency and the ratios; plus the scheduler's budget use, the per-round cost of the disaggregated path, and
(at concurrency 1) the in-process engine on the same prompts for comparison.

Each request streams MT-Bench first turns with `ignore_eos`, so every request yields exactly `max_tokens`
tokens (or its own length in `max_tokens_range`). Per-user output tokens/s = tokens / (last chunk - request
sent); TPOT = (e2e - TTFT) / (tokens - 1); ITL = gaps between streamed chunks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveInt, field_validator
from tqdm import tqdm

from orchestrator.config import StrictModel
from orchestrator.console import bar
from orchestrator.errors import AerieError
from orchestrator.runtime.metrics import DRAFT_REASONS
from orchestrator.serving.backends import backend_of, build_application
from orchestrator.serving.launch import read_serve_config
from orchestrator.spec.acceptance import Acceptance

log = logging.getLogger(__name__)


class BenchmarkServingConfig(StrictModel):
    """`python -m jobs.benchmark_serving` settings."""

    app: str = Field(description="Serve config file of the application (configs/*/serve*.yaml)")
    app_overrides: list[str] = Field([], description="dotted key=value overrides of the application's args")
    vllm_app: str | None = Field(
        None, description="also the vLLM backend (its Serve config): same prompts, same drafter, same run"
    )
    vllm_overrides: list[str] = Field([], description="dotted key=value overrides of the vLLM app's args")
    arms: dict[str, list[str]] = Field(
        {},
        description="more deployments of `app`, each with these extra overrides, in the same interleaved run (e.g. "
        "{tap: [tap.enabled=true]}); arm_ratios: each arm's per-user tokens/s over the app's, paired, per mode; an "
        "arm with no overrides ({twin: []}) is the app again: speedup_pooled pools every such pair's requests",
    )
    modes: list[Literal["spec", "no-spec"]] = Field(
        ["spec", "no-spec"],
        min_length=1,
        description="speculation on (spec), off (no-spec): each a deployment of every backend; the speedup needs both",
    )
    concurrency: list[int] = Field([1, 4, 16], min_length=1, description="users sending requests at once")
    requests_per_user: int = Field(2, ge=1, description="requests = concurrency x this (at least min_requests)")
    repeats: int = Field(3, ge=1, description="runs of each level per mode, interleaved (ABBA...): pairs for the CI")
    min_requests: int = Field(
        4, ge=1, description="fewest requests per level and run; also the prompts of the in-process comparison"
    )
    warmup_per_user: int = Field(
        1, ge=0, description="unmeasured requests per user before each level (the scheduler learns its rates)"
    )
    max_tokens: int = Field(64, ge=1, description="tokens per request (EOS ignored)")
    max_tokens_range: tuple[PositiveInt, PositiveInt] | None = Field(
        None,
        description="[lo, hi]: request i asks for its own length in that range (`answer_lengths`; the same in every "
        "mode and repeat), so answers end at different times as real traffic's do. None: all `max_tokens`: the users "
        "stay in lockstep, and whichever mode desynchronizes them prefills in smaller batches",
    )
    prompts: str = Field(
        "mtbench", description="'mtbench' (first turns, chat) or 'validation:DIR' (a collection's held-out split)"
    )

    num_prompts: int = Field(16, ge=1, description="prompts cycled over")
    in_process: bool = Field(True, description="also time the in-process SpecEngine at concurrency 1")
    trace_concurrency: int | None = Field(4, description="write the round timeline of this level (spec mode)")
    spans: bool = Field(
        False,
        description="keep every level's worker calls, both modes, in spans_MODE_cN.json (with the level's counters and "
        "prompt lengths): what `jobs.plan` fits the simulator's cost model to",
    )
    port: int = Field(8000, description="Serve HTTP port on 127.0.0.1")
    address: str | None = Field(None, description="Ray cluster (default: RAY_ADDRESS, else a local Ray)")
    output_dir: str = Field(description="where result.json and the timeline go")

    @field_validator("max_tokens_range")
    @classmethod
    def _range(cls, v: tuple[int, int] | None) -> tuple[int, int] | None:
        if v is not None and v[0] > v[1]:
            raise ValueError(f"max_tokens_range {list(v)}: give [lo, hi] with lo <= hi")
        return v


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def stream_request(client, url: str, model: str, prompt: dict, max_tokens: int, ignore_eos: bool = True) -> dict:
    """prompt: {"messages": [...]} (chat completions) or {"prompt": [token ids]} (completions); greedy, and with
    `ignore_eos` exactly `max_tokens` long."""
    chat = "messages" in prompt
    body = {
        "model": model,
        **prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    stamps, tokens, prompt_tokens, error, done = [], 0, 0, None, False
    endpoint = "chat/completions" if chat else "completions"
    async with client.stream("POST", f"{url}/v1/{endpoint}", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"}
        async for line in r.aiter_lines():
            done = done or line == "data: [DONE]"
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
                break
            if event.get("usage"):
                tokens, prompt_tokens = event["usage"]["completion_tokens"], event["usage"]["prompt_tokens"]
            choice = (event.get("choices") or [{}])[0]
            if (choice.get("delta") or {}).get("content") or choice.get("text"):
                stamps.append(time.perf_counter())
    if error or not stamps or not done:
        return {"error": error or ("no tokens" if done else "the stream ended without [DONE]")}
    e2e, ttft = stamps[-1] - sent, stamps[0] - sent
    return {
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "e2e_s": e2e,
        "ttft_s": ttft,
        "tpot_s": (e2e - ttft) / max(1, tokens - 1),
        "itl_s": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
    }


def answer_lengths(cfg: BenchmarkServingConfig, n: int) -> list[int]:
    """max_tokens of requests 0..n-1: `max_tokens`, or spread over `max_tokens_range` (a stride coprime with the
    range's width visits every length before repeating one)."""
    if cfg.max_tokens_range is None:
        return [cfg.max_tokens] * n
    return spread_lengths(*cfg.max_tokens_range, n)


def spread_lengths(lo: int, hi: int, n: int) -> list[int]:
    """n lengths in [lo, hi]: a stride coprime with the range's width visits every length before repeating one."""
    width = hi - lo + 1
    stride = next(s for s in range(37, 37 + width + 1) if math.gcd(s, width) == 1)
    return [lo + (i * stride) % width for i in range(n)]


async def run_requests(
    url: str,
    model: str,
    prompts: list[dict],
    concurrency: int,
    n: int,
    max_tokens: int | list[int],
    progress: tqdm | None = None,
) -> tuple[list[dict], float]:
    """`n` requests, `concurrency` at a time (closed loop): each request's measurements (in request order; request
    i sends prompts[i % len] for max_tokens[i % len], or `max_tokens` if one number) and the wall time; `progress`
    (a bar) advances by one as each request ends."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    from orchestrator.serving.guard import auth_headers

    async with httpx.AsyncClient(timeout=600, headers=auth_headers()) as client:

        async def user(i):
            async with sem:
                length = max_tokens[i % len(max_tokens)] if isinstance(max_tokens, list) else max_tokens
                measured = await stream_request(client, url, model, prompts[i % len(prompts)], length)
            if progress is not None:
                progress.update()
            return measured

        began = time.perf_counter()
        results = await asyncio.gather(*[user(i) for i in range(n)])
        return results, time.perf_counter() - began


def summarise_requests(runs: list[tuple[list[dict], float]], concurrency: int) -> dict:
    """Summary over one or more runs of the same level (repeats): throughput per run and overall, latencies over
    every request; `per_request_tok_s` (None where a request failed) pairs requests across modes."""
    results = [r for batch, _ in runs for r in batch]
    ok = [r for r in results if "error" not in r]
    itl = [g for r in ok for g in r["itl_s"]]
    per_user = [r["tokens"] / r["e2e_s"] for r in ok]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "repeats": len(runs),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if "error" in r})[:3],
        "per_user_tok_s": statistics.mean(per_user) if per_user else 0.0,
        "per_request_tok_s": [None if "error" in r else r["tokens"] / r["e2e_s"] for r in results],
        "prompt_tokens": [r.get("prompt_tokens") for r in ok],
        "total_tok_s": sum(r["tokens"] for r in ok) / sum(wall for _, wall in runs),
        "wall_s": sum(wall for _, wall in runs),
        "ttft_p50_s": _quantile([r["ttft_s"] for r in ok], 0.5),
        "ttft_p99_s": _quantile([r["ttft_s"] for r in ok], 0.99),
        "tpot_p50_s": _quantile([r["tpot_s"] for r in ok], 0.5),
        "itl_p50_s": _quantile(itl, 0.5),
        "itl_p99_s": _quantile(itl, 0.99),
        "e2e_p50_s": _quantile([r["e2e_s"] for r in ok], 0.5),
        "e2e_p99_s": _quantile([r["e2e_s"] for r in ok], 0.99),
    }


async def drive(
    url: str, model: str, prompts: list[dict], concurrency: int, n: int, max_tokens: int | list[int]
) -> dict:
    """`n` requests, `concurrency` at a time (closed loop); summary of the measurements."""
    return summarise_requests([await run_requests(url, model, prompts, concurrency, n, max_tokens)], concurrency)


def paired_speedup(spec: dict, plain: dict) -> dict:
    """Per-user tokens/s, speculation on / off: request i of repeat r in one mode paired with the same request in
    the other (same prompt, run next to it), a bootstrap interval over those pairs (`stats.paired_ratio`)."""
    from orchestrator.stats import paired_ratio

    pairs = [
        (a, b)
        for a, b in zip(spec["per_request_tok_s"], plain["per_request_tok_s"], strict=True)
        if a is not None and b is not None
    ]
    if not pairs:
        return {"ratio": 0.0, "low": None, "high": None, "n": 0}
    return paired_ratio([a for a, _ in pairs], [b for _, b in pairs])


def pool(levels: list[dict]) -> dict:
    """Levels of identical deployments (the same mode and users) as one, for `paired_speedup`: their requests in
    order, deployment after deployment."""
    return {"per_request_tok_s": [x for level in levels for x in level["per_request_tok_s"]]}


def scheduler_delta(before: dict, after: dict) -> dict:
    """What the scheduler did between two /stats snapshots. Acceptance length has vLLM's meaning (drafted
    request-steps only), as for the vLLM backend; `drafted_share` says how many request-steps drafted."""
    d = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float)) and k in before}
    rounds = max(1, d.get("rounds", 0))
    acceptance = Acceptance.from_dict(after["acceptance"]) - Acceptance.from_dict(before["acceptance"])
    out = {
        "rounds": d.get("rounds", 0),
        "spec_round_share": d.get("spec_rounds", 0) / rounds,
        "mean_batch": d.get("batch", 0) / rounds,
        "budget_use": d.get("verified_tokens", 0) / max(1, d.get("budget_tokens", 0)),
        "verified_tokens_per_round": d.get("verified_tokens", 0) / rounds,
        "acceptance_length": acceptance.acceptance_length,
        "acceptance": acceptance.to_dict(),  # the counters: intervals, comparisons (serving.canary)
        "acceptance_measured": (  # measurement rounds' whole trees (SpecScheduler.measure), where both have them
            Acceptance.from_dict(after["acceptance_measured"]) - Acceptance.from_dict(before["acceptance_measured"])
        ).to_dict()
        if "acceptance_measured" in after and "acceptance_measured" in before
        else None,
        "drafted_share": acceptance.drafts / max(1, d.get("batch", 0)),
        "acceptance_rate": acceptance.accepted / max(1, acceptance.draft_tokens),
        "target_to_draft_bytes_per_round": d.get("target_to_draft_bytes", 0) / rounds,
        "draft_to_target_bytes_per_round": d.get("draft_to_target_bytes", 0) / rounds,
        "drafted_by": {r: d.get(f"drafted_{r}", 0) for r in DRAFT_REASONS} | {"catch_ups": d.get("catch_ups", 0)},
        # drafted rounds' time beyond target-only's for their tokens, a share of all rounds' time: what drafting
        # cost (negative: saved) by the chooser's own accounting, free of the deployments' differences
        "drafting_excess": d.get("drafted_excess_s", 0) / d["round_s"] if d.get("round_s") else None,
        "modes": after.get("modes"),  # the mode choosers' measurements when the level ended
        "calibration": after.get("calibration"),  # the budget policy's state when the level ended
        "cost": after.get("cost"),
    }
    for side in ("draft", "verify"):
        calls = d.get(f"{side}_calls", 0)
        if calls:
            out[f"{side}_call_ms"] = 1e3 * d[f"{side}_call_s"] / calls
            out[f"{side}_compute_ms"] = 1e3 * d[f"{side}_compute_s"] / calls
            out[f"{side}_overhead_ms"] = out[f"{side}_call_ms"] - out[f"{side}_compute_ms"]
    if d.get("draft_calls"):
        out["draft_waited_ms"] = 1e3 * d["draft_waited_s"] / d["draft_calls"]  # of draft_call_ms: on the round's path
    return out


def write_trace(spans: list[dict], out_dir: Path, label: str) -> list[Path]:
    """The round timeline as a Chrome trace (chrome://tracing, Perfetto) and a PNG."""
    if not spans:
        return []
    t0 = min(s["ts"] for s in spans)
    events = [
        {
            "name": f"{s['name']} g{s['group']} ({s['batch']} req, {s['tokens']} tok)",
            "ph": "X",
            "ts": (s["ts"] - t0) * 1e6,
            "dur": s["dur"] * 1e6,
            "pid": s["worker"],
            "tid": f"group {s['group']}",
        }
        for s in spans
    ]
    trace = out_dir / f"trace_{label}.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    from orchestrator.evaluation.plots import _plt

    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 2.6))
    drafts = [s["ts"] for s in spans if s["name"] == "draft"]
    start = max(t0, drafts[len(drafts) // 2] - 0.5) if drafts else t0  # 2 s around the middle draft: readable
    window = [s for s in spans if start <= s["ts"] <= start + 2.0]
    rows = {"target": 1, "draft": 0}
    colors = {0: "tab:blue", 1: "tab:orange"}
    for s in window:
        ax.barh(
            rows[s["worker"]],
            s["dur"],
            left=s["ts"] - start,
            color=colors.get(s["group"], "grey"),
            edgecolor="black",
            linewidth=0.3,
        )
    ax.set_yticks([0, 1], ["DraftWorker", "TargetWorker"])
    ax.set_xlabel("seconds (blue: micro-batch 0, orange: micro-batch 1)")
    ax.set_title(f"rounds over time, {label}")
    fig.tight_layout()
    png = out_dir / f"timeline_{label}.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [trace, png]


def busy_overlap(spans: list[dict]) -> float:
    """Share of the draft worker's busy time during which the target was also busy (pipelining at work)."""
    target = sorted((s["ts"], s["ts"] + s["dur"]) for s in spans if s["worker"] == "target")
    draft = [(s["ts"], s["ts"] + s["dur"]) for s in spans if s["worker"] == "draft"]
    busy = sum(b - a for a, b in draft)
    both = sum(max(0.0, min(b, d) - max(a, c)) for a, b in draft for c, d in target)
    return both / busy if busy else 0.0


def in_process_round_ms(app_args: dict, prompts: list[list[int]], max_tokens: int) -> dict:
    """The in-process engine at concurrency 1 on the same prompts: tokens/s and the per-round cost breakdown
    (`round_costs`), the reference for the disaggregated path's."""
    from orchestrator.engine import load_engine
    from orchestrator.models.prepare import resolve_model
    from orchestrator.spec.proposer import SpecConfig
    from orchestrator.spec.sampling import SamplingParams
    from orchestrator.tracking.store import fetch_drafter

    model_dir = resolve_model(app_args["model"], app_args.get("models_dir", "models"))
    spec = SpecConfig.model_validate(app_args.get("spec", {}))
    dtype = app_args.get("dtype", "auto")  # the server's (its workers run on the CPU here, as this engine does)
    engine = load_engine(model_dir, fetch_drafter(app_args["drafter"]), spec, max_batch=1, dtype=dtype)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate([prompts[0]], params)  # warm-up
    totals: dict[str, float] = {}
    began, tokens = time.perf_counter(), 0
    for p in prompts:
        tokens += len(engine.generate([p], params)[0].token_ids)
        for k, v in engine.last_stats.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                totals[k] = totals.get(k, 0) + v
    wall = time.perf_counter() - began
    return {"tok_s": tokens / wall, **round_costs(totals, wall, tokens)}


def round_costs(d: dict, wall_s: float, tokens: int) -> dict:
    """Milliseconds per target round, from the scheduler's totals over a stretch of `wall_s` seconds that yielded
    `tokens`: draft and verify compute (inside the workers), calls (the rest of each call: Ray, serialisation,
    queues), draft calls' time hidden behind the rest of the round (chained draft calls), and the remainder
    (scheduling, prefill bookkeeping, HTTP, idle):
    round = draft compute + verify compute + calls - hidden + rest."""
    rounds = max(1, d.get("rounds", 0))
    compute = {side: 1e3 * d.get(f"{side}_compute_s", 0) / rounds for side in ("draft", "verify")}
    calls = sum(1e3 * (d.get(f"{side}_call_s", 0) - d.get(f"{side}_compute_s", 0)) / rounds for side in compute)
    hidden = 1e3 * (d.get("draft_call_s", 0) - d.get("draft_waited_s", 0)) / rounds
    round_ms = 1e3 * wall_s / rounds
    return {
        "rounds": d.get("rounds", 0),
        "round_ms": round_ms,
        "draft_compute_ms": compute["draft"],
        "verify_compute_ms": compute["verify"],
        "calls_ms": calls,
        "draft_hidden_ms": hidden,
        "rest_ms": round_ms - compute["draft"] - compute["verify"] - calls + hidden,
        "ms_per_token": 1e3 * wall_s / max(1, tokens),
        "tokens_per_round": tokens / rounds,
    }


def overhead_breakdown(level: dict, in_process: dict) -> dict:
    """The disaggregated path at concurrency 1 against the in-process engine: ms per round by part, and the
    overhead: ms per generated token, disaggregated / in-process - 1."""
    disaggregated = level["scheduler"]["round_costs"]
    return {
        "in_process": {k: v for k, v in in_process.items() if k != "tok_s"},
        "disaggregated": disaggregated,
        "overhead": disaggregated["ms_per_token"] / in_process["ms_per_token"] - 1,
    }


def load_prompts(source: str, n: int) -> list[dict]:
    """MT-Bench first turns as chat messages, or a collection's held-out conversations up to their first
    assistant token (token ids, rendered as collected: the drafter's own domain)."""
    if source == "mtbench":
        from orchestrator.data.prompts import mtbench_first_turns

        return [{"messages": r["messages"]} for r in mtbench_first_turns(n)]
    if source.startswith("validation:"):
        from orchestrator.evaluation.sets import validation_set

        items = validation_set(source.removeprefix("validation:"), n)
        if not items:
            raise AerieError(f"{source}: the collection has no validation conversations")
        return [{"prompt": list(item.ids)} for item in items]
    raise AerieError(f"prompts {source!r}: use 'mtbench', 'validation:DIR' or 'validation:COLLECT.yaml'")


def run_serving_benchmark(cfg: BenchmarkServingConfig, out_dir: Path) -> dict:
    """Deploy every (backend, mode) at once, then per concurrency level run them in turn, `repeats` times in
    alternating order (ABBA...), so the machine's drift falls on both sides of every ratio."""
    from ray import serve

    from orchestrator.cluster import init_ray, starts_private_ray
    from orchestrator.serving.guard import keys_for_servers

    _, app = read_serve_config(cfg.app, cfg.app_overrides)
    args = app["args"]
    if backend_of(app["import_path"]) == "disaggregated" and args.get("num_replicas", 1) > 1:
        raise AerieError(
            f"the serving benchmark reads one replica's scheduler (its /stats: rounds, costs, the timeline), and "
            f"{cfg.app} serves {args['num_replicas']} replicas: set app_overrides=[num_replicas=1]"
        )
    backends = [("", app)]
    if cfg.vllm_app:  # the same drafter as the disaggregated app unless overridden
        same = [f"drafter={args['drafter']}"] if args.get("drafter") else []
        backends.append(("vllm-", read_serve_config(cfg.vllm_app, same + list(cfg.vllm_overrides))[1]))
    for name, overrides in cfg.arms.items():
        backends.append((f"{name}-", read_serve_config(cfg.app, [*cfg.app_overrides, *overrides])[1]))
    prompts = load_prompts(cfg.prompts, cfg.num_prompts)
    private = starts_private_ray(cfg.address)
    if (written := keys_for_servers(private_ray=private)) is not None:
        log.info("wrote a new API key to %s (the benchmark's servers and clients use it)", written)
    init_ray(cfg.address)
    if private:  # nothing joins a private Ray: what does not fit now never will, and Serve would wait for it
        import ray

        check_fits(reservations([(b, m) for _, b in backends for m in cfg.modes]), ray.cluster_resources())
    serve.start(http_options={"host": "127.0.0.1", "port": cfg.port})
    deployed = [_Deployed(cfg, backend, mode, label, prompts) for label, backend in backends for mode in cfg.modes]
    result: dict = {"modes": {d.key: {} for d in deployed}, "files": [], "repeats": cfg.repeats}
    measured = sum(max(cfg.min_requests, c * cfg.requests_per_user) for c in cfg.concurrency)
    requests = bar(total=measured * cfg.repeats * len(deployed), desc="benchmark", unit="req")
    try:
        for c in cfg.concurrency:
            n = max(cfg.min_requests, c * cfg.requests_per_user)
            for d in deployed:
                if cfg.warmup_per_user:
                    warm = c * cfg.warmup_per_user
                    asyncio.run(drive(d.url, d.model, prompts[::-1], c, warm, answer_lengths(cfg, warm)[::-1]))
            before = {d.key: d.counters() for d in deployed}
            began = time.time()
            runs: dict[str, list] = {d.key: [] for d in deployed}
            for r in range(cfg.repeats):
                for d in deployed if r % 2 == 0 else deployed[::-1]:
                    requests.set_postfix_str(f"{d.key} c={c}")
                    runs[d.key].append(
                        asyncio.run(run_requests(d.url, d.model, prompts, c, n, answer_lengths(cfg, n), requests))
                    )
            for d in deployed:
                level = summarise_requests(runs[d.key], c)
                level["scheduler"] = d.delta(before[d.key], c, began, out_dir, result)
                if not d.vllm:
                    level["scheduler"]["round_costs"] = round_costs(
                        d.raw_delta,
                        level["wall_s"],
                        sum(r["tokens"] for b, _ in runs[d.key] for r in b if "error" not in r),
                    )
                result["modes"][d.key][c] = level
                log.info("%s c=%d: %.1f tok/s per user, %d failed", d.name, c, level["per_user_tok_s"], level["failed"])
    finally:
        requests.close()
        for d in deployed:
            serve.delete(d.name)
    compare(result, cfg, [label for label, _ in backends])
    if cfg.in_process and "spec" in cfg.modes and args.get("drafter"):
        from orchestrator.data.prompts import render_chat
        from orchestrator.models.prepare import resolve_model
        from orchestrator.models.tokenizer import load_tokenizer

        tok = load_tokenizer(resolve_model(args["model"], args.get("models_dir", "models")))
        ids = [p["prompt"] if "prompt" in p else render_chat(tok, p["messages"]) for p in prompts[: cfg.min_requests]]
        result["in_process_c1"] = in_process_round_ms(args, ids, cfg.max_tokens)
        spec_c1 = result["modes"].get("spec", {}).get(1) or result["modes"].get("spec", {}).get("1")
        if spec_c1:
            result["overhead_c1"] = overhead_breakdown(spec_c1, result["in_process_c1"])
    return result


def compare(result: dict, cfg: BenchmarkServingConfig, labels: list[str]) -> None:
    """The ratios of a run's levels (`result["modes"]`), into `result`: each backend's speculation on / off
    (`speedup`, `vllm_speedup`, `ARM_speedup`), the pooled one over identical deployments (`speedup_pooled`), and
    each arm against the app as configured (`arm_ratios`). labels: the backends' prefixes ("", "vllm-", "ARM-")."""
    for label in labels:
        spec, plain = result["modes"].get(f"{label}spec"), result["modes"].get(f"{label}no-spec")
        if spec and plain:
            key = f"{label.replace('-', '_')}speedup"
            result[key] = {c: paired_speedup(spec[c], plain[c]) for c in cfg.concurrency}
    twins = [f"{name}-" for name, overrides in cfg.arms.items() if not overrides]  # the app deployed again
    if twins and "speedup" in result:  # every pair of identical deployments, pooled: a deployment's luck averages
        modes = result["modes"]
        result["speedup_pooled"] = {
            c: paired_speedup(*(pool([modes[f"{label}{m}"][c] for label in ["", *twins]]) for m in ("spec", "no-spec")))
            for c in cfg.concurrency
        }
        result["pooled_deployments"] = 1 + len(twins)
    for name in cfg.arms:  # the arm against the app as configured, mode by mode (tap on / off, ...)
        ratios = result.setdefault("arm_ratios", {}).setdefault(name, {})
        for mode in cfg.modes:
            arm, base = result["modes"][f"{name}-{mode}"], result["modes"][mode]
            ratios[mode] = {c: paired_speedup(arm[c], base[c]) for c in cfg.concurrency}


def reservations(deployments: list[tuple[dict, str]]) -> dict[str, float]:
    """What the disaggregated deployments' workers reserve together: (application entry, mode) each, all at once
    (the draft worker only where speculation is on). vLLM deployments are sized by vLLM and left out."""
    from orchestrator.serving.app import SpecServeConfig

    total: dict[str, float] = {}
    for app, mode in deployments:
        if backend_of(app["import_path"]) != "disaggregated":
            continue
        args = SpecServeConfig.model_validate(app["args"])
        for worker in [args.target] + ([args.draft] if mode == "spec" else []):
            for resource, amount in worker.bundle().items():
                total[resource] = total.get(resource, 0.0) + amount
    return total


def check_fits(needed: dict[str, float], cluster: dict[str, float]) -> None:
    """Every deployment of the run is up at once: an AerieError naming what does not fit, instead of Serve waiting
    forever for workers the cluster cannot place."""
    short = {r: (n, cluster.get(r, 0.0)) for r, n in needed.items() if n > cluster.get(r, 0.0) + 1e-9}
    if short:
        what = ", ".join(f"{n:g} {r} (the cluster has {have:g})" for r, (n, have) in short.items())
        raise AerieError(
            f"the benchmark's deployments run at once and their workers reserve {what}: lower the workers' "
            f"reservations in app_overrides (e.g. target.num_cpus=0.25, draft.num_cpus=0.25) or deploy fewer arms "
            f"or modes"
        )


class _Deployed:
    """One backend in one mode, deployed under its own route and warmed up."""

    def __init__(self, cfg: BenchmarkServingConfig, app: dict, mode: str, label: str, prompts: list[dict]) -> None:
        import httpx
        from ray import serve

        from orchestrator.serving.guard import auth_headers

        self.cfg, self.mode, self.key = cfg, mode, f"{label}{mode}"
        self.vllm = backend_of(app["import_path"]) == "vllm"
        self.name = f"bench-{label}{mode}"
        log.info("deploying %s", self.name)
        built = build_application(app, speculation=mode == "spec")
        serve.run(built, name=self.name, route_prefix=f"/{self.name}")
        self.url = f"http://127.0.0.1:{cfg.port}/{self.name}"
        self.model = httpx.get(f"{self.url}/v1/models", headers=auth_headers(), timeout=60).json()["data"][0]["id"]
        asyncio.run(drive(self.url, self.model, prompts, 2, 2, 8))  # warm-up (also feeds the cost model)

    def counters(self):
        return _counters(self.url, self.name, self.vllm)

    def delta(self, before, c: int, began: float, out_dir: Path, result: dict) -> dict:
        """What the backend did over the level (every repeat); the round timeline at trace_concurrency."""
        import httpx

        from orchestrator.serving.guard import auth_headers

        if self.vllm:
            time.sleep(2)  # Ray exports the engine's counters every second or so
            return vllm_delta(before, self.counters())
        timeline = self.mode == "spec" and c == self.cfg.trace_concurrency
        trace = timeline or self.cfg.spans
        after = httpx.get(f"{self.url}/stats", params={"trace": trace}, headers=auth_headers(), timeout=60).json()
        out = scheduler_delta(before, after)
        self.raw_delta = {k: after[k] - before[k] for k in before if isinstance(before[k], (int, float)) and k in after}
        spans = [s for s in after.get("trace", []) if s["ts"] >= began]
        if timeline:
            out["draft_busy_overlapped"] = busy_overlap(spans)
            result["files"] += [str(p) for p in write_trace(spans[-400:], out_dir, f"{self.mode}_c{c}")]
        if self.cfg.spans:
            acceptance = Acceptance.from_dict(after["acceptance"]) - Acceptance.from_dict(before["acceptance"])
            kept = {"totals": self.raw_delta, "acceptance": dataclasses.asdict(acceptance), "spans": spans}
            path = out_dir / f"spans_{self.key}_c{c}.json"
            path.write_text(json.dumps(kept))
            result["files"].append(str(path))
        return out


def _counters(url: str, app: str, vllm: bool):
    import httpx

    from orchestrator.serving.counters import vllm_counters
    from orchestrator.serving.guard import auth_headers

    return vllm_counters(app) if vllm else httpx.get(f"{url}/stats", headers=auth_headers(), timeout=60).json()


def vllm_delta(before: Acceptance, after: Acceptance) -> dict:
    """vLLM's speculation between two counter snapshots."""
    return {"acceptance_length": (after - before).acceptance_length, "drafts": (after - before).drafts}


def format_table(result: dict) -> str:
    lines = [
        "| mode | users | per-user tok/s | total tok/s | TTFT p50/p99 s | ITL p50/p99 ms | tau | budget use "
        "| drafted (excess) | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, levels in result["modes"].items():
        for c, r in levels.items():
            s = r["scheduler"]
            use = f"{s['budget_use']:.2f}" if "budget_use" in s else "-"
            drafted = f"{s['drafted_share']:.1%}" if "drafted_share" in s else "-"
            if s.get("drafting_excess") is not None and s.get("drafted_share"):
                drafted += f" ({s['drafting_excess']:+.1%})"
            lines.append(
                f"| {mode} | {c} | {r['per_user_tok_s']:.1f} | {r['total_tok_s']:.1f} | "
                f"{r['ttft_p50_s'] or 0:.2f}/{r['ttft_p99_s'] or 0:.2f} | "
                f"{1e3 * (r['itl_p50_s'] or 0):.0f}/{1e3 * (r['itl_p99_s'] or 0):.0f} | "
                f"{s['acceptance_length']:.2f} | {use} | {drafted} | {r['failed']} |"
            )
    from orchestrator.stats import format_ratio

    for key, backend in (("speedup", "disaggregated"), ("vllm_speedup", "vLLM")):
        if key in result:
            lines.append(
                f"{backend}: speculation on / off, per-user tok/s, 95% interval over request pairs "
                f"({result.get('repeats', 1)} interleaved repeats): "
                + ", ".join(f"{c} users {format_ratio(x)}" for c, x in result[key].items())
            )
    if "speedup_pooled" in result:
        lines.append(
            f"disaggregated, pooled over {result['pooled_deployments']} identical deployments per mode (arms with no "
            "overrides): " + ", ".join(f"{c} users {format_ratio(x)}" for c, x in result["speedup_pooled"].items())
        )
    if "overhead_c1" in result:
        o = result["overhead_c1"]
        lines += [
            "",
            "| ms per round, 1 user | in-process engine | disaggregated (Ray Serve) |",
            "|---|---|---|",
        ]
        for part, name in (
            ("draft_compute_ms", "draft compute"),
            ("verify_compute_ms", "verify compute"),
            ("calls_ms", "worker calls beyond compute (Ray)"),
            ("draft_hidden_ms", "draft calls hidden behind the rest (chained)"),
            ("rest_ms", "scheduling, prefill, HTTP, idle"),
            ("round_ms", "round"),
            ("tokens_per_round", "tokens per round"),
            ("ms_per_token", "ms per token"),
        ):
            lines.append(f"| {name} | {o['in_process'][part]:.2f} | {o['disaggregated'][part]:.2f} |")
        lines.append(f"disaggregated overhead vs in-process, ms per token: {100 * o['overhead']:+.1f}%")
    return "\n".join(lines)
