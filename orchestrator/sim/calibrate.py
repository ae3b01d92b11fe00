"""Fit the simulator to a serving benchmark of this machine, then predict that benchmark.

`jobs.benchmark_serving ... spans=true` keeps every worker call of every level and mode (`spans_MODE_cN.json`:
tokens, cached context, batch, compute seconds) and the scheduler's totals. From them:

- the target's step cost: least squares over verify calls (`fit_step_cost`: fixed, tree mask, per token, per
  cached token), the prefill's over prefill calls, the drafter's over draft calls (one forward per tree level);
- `call_s`: the mean of (call latency - compute) over the calls at one user (more users also queue, which the
  simulation adds itself); `round_s`: what a target round took beyond its calls there (scheduling, streaming,
  HTTP), from the same totals;
- acceptance: the per-position rates of the speculating levels.

Then each level is simulated as the benchmark ran it (its users, requests, prompt lengths, max_tokens) and set
beside what was measured: per-user tokens/s both modes, and the speed-up.
"""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.errors import AerieError
from orchestrator.sim.costs import AcceptanceProfile, CostModel, Step, StepCost, fit_step_cost
from orchestrator.sim.run import SimConfig, simulate
from orchestrator.spec.acceptance import Acceptance


def load_benchmark(out_dir: str | Path) -> tuple[dict, dict[tuple[str, int], dict]]:
    """(result.json, {(mode, users): its spans file}) of a serving benchmark run with spans=true."""
    out_dir = Path(out_dir)
    result_path = out_dir / "result.json"
    if not result_path.is_file():
        raise AerieError(f"{out_dir} holds no result.json: run jobs.benchmark_serving with output_dir={out_dir}")
    result = json.loads(result_path.read_text())
    levels = {}
    for mode in ("spec", "no-spec"):
        for c, measured in result["modes"].get(mode, {}).items():
            path = out_dir / f"spans_{mode}_c{c}.json"
            if not path.is_file():
                raise AerieError(f"{path} is missing: run the benchmark with spans=true to calibrate on it")
            levels[(mode, int(c))] = json.loads(path.read_text()) | {"measured": measured}
    return result, levels


def fit_costs(levels: dict[tuple[str, int], dict], depth: int, topk: int, aux_bytes_per_token: int) -> CostModel:
    """The cost model of these measured levels (see the module docstring)."""
    spans = [s for level in levels.values() for s in level["spans"]]
    verify = [
        Step(s["tokens"], s["dur"], s["context"], s["tokens"] > s["batch"]) for s in spans if s["name"] == "verify"
    ]
    prefill = [Step(s["tokens"], s["dur"], s["tokens"]) for s in spans if s["name"] == "prefill"]
    draft = [
        Step(s["tokens"] + (depth - 1) * s["batch"] * topk, s["dur"], s["context"], forwards=depth)
        for s in spans
        if s["name"] == "draft"
    ]
    calls, overhead, rest = 0, 0.0, []
    for (_mode, users), level in levels.items():
        t = level["totals"]
        if users != 1 or not t.get("rounds"):  # more users queue for the workers: that is the simulation's to add
            continue
        for side in ("verify", "draft"):
            calls += t.get(f"{side}_calls", 0)
            overhead += t.get(f"{side}_call_s", 0.0) - t.get(f"{side}_compute_s", 0.0)
        prefills = [s["dur"] for s in level["spans"] if s["name"] == "prefill"]
        waited = t.get("draft_waited_s", t.get("draft_call_s", 0.0))  # chained draft calls overlap the rest
        calls_s = t.get("verify_call_s", 0.0) + waited + sum(prefills)
        rest.append((level["measured"]["wall_s"] - calls_s, t["rounds"], len(prefills)))  # one user: the server's
    return CostModel(
        target=fit_step_cost(verify),
        prefill=fit_step_cost(prefill) if len(prefill) >= 4 else None,
        draft=fit_step_cost(draft) if len(draft) >= 4 else StepCost(),
        call_s=(call_s := overhead / max(1, calls)),
        round_s=max(0.0, sum(r - p * call_s for r, _, p in rest) / sum(n for _, n, _ in rest)) if rest else 0.0,
        aux_bytes_per_token=aux_bytes_per_token,
    )


def measured_profile(levels: dict[tuple[str, int], dict]) -> AcceptanceProfile:
    """The speculating levels' per-position acceptance (a tree's, siblings included: `sibling` 0)."""
    total = Acceptance()
    for (mode, _), level in levels.items():
        if mode == "spec":
            total = total + Acceptance.from_dict(level["acceptance"])
    rates = total.per_position_rates()
    return AcceptanceProfile.from_rates(rates or [0.0], sibling=0.0)


def _lengths(bench: dict) -> dict:
    """The benchmark's answer lengths as a workload's: all `max_tokens`, or drawn from `max_tokens_range`."""
    spread = bench.get("max_tokens_range")
    if not spread:
        return {"max_tokens": bench["max_tokens"]}
    return {"max_tokens": spread[1], "answer_tokens": list(range(spread[0], spread[1] + 1))}


def predict(levels: dict, bench: dict, app_args: dict, costs: CostModel, profile: AcceptanceProfile) -> list[dict]:
    """Each level of the benchmark simulated as it ran, beside its measurement."""
    rows = []
    for (mode, users), level in sorted(levels.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        measured = level["measured"]
        prompts = [p for p in measured.get("prompt_tokens", []) if p] or [128]
        sim = SimConfig(
            scheduler=app_args.get("scheduler", {}),
            spec=app_args.get("spec", {}),
            speculation=mode == "spec",
            costs=costs,
            acceptance=profile,
            workload={
                "users": users,
                "requests": measured["requests"],
                "prompt_tokens": prompts,
                **_lengths(bench),
                "warmup": users * bench.get("warmup_per_user", 0),
            },
        )
        got = simulate(sim)
        rows.append(
            {
                "mode": mode,
                "users": users,
                "measured_tok_s": measured["per_user_tok_s"],
                "predicted_tok_s": got["per_user_tok_s"],
                "error": got["per_user_tok_s"] / measured["per_user_tok_s"] - 1,
                "measured_drafted_share": measured["scheduler"].get("spec_round_share"),
                "predicted_drafted_share": got["drafted_share"],
                "measured_tau": measured["scheduler"].get("acceptance_length"),
                "predicted_tau": got["tau"],
            }
        )
    return rows


def speedups(rows: list[dict]) -> list[dict]:
    """Speculation on / off per level, measured and predicted."""
    by = {(r["mode"], r["users"]): r for r in rows}
    out = []
    for users in sorted({r["users"] for r in rows}):
        on, off = by.get(("spec", users)), by.get(("no-spec", users))
        if on and off:
            measured = on["measured_tok_s"] / off["measured_tok_s"]
            predicted = on["predicted_tok_s"] / off["predicted_tok_s"]
            out.append(
                {"users": users, "measured": measured, "predicted": predicted, "error": predicted / measured - 1}
            )
    return out
