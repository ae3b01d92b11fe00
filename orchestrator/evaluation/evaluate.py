"""Acceptance evaluation: drafters side by side on the same prompts, with the project's engine (greedy,
chain and tree) and vLLM's tau on the same prompts, per set.

    prompts (sets.py) ──> for each drafter, for each method: the engine, greedy ──> tau per set / label,
                                                                                   per-depth acceptance
                      ──> vLLM (chain, same drafter, same prompts) ──> tau per set from vLLM's counters
    ──> table, plots, result.json, one MLflow run
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

from pydantic import Field
from tqdm import tqdm

from orchestrator.config import StrictModel
from orchestrator.console import bar
from orchestrator.engine import load_engine
from orchestrator.evaluation.plots import plot_evaluation
from orchestrator.evaluation.sets import EvalPrompt, long_context_set, mtbench_set, template_set, validation_set
from orchestrator.models.target import read_hf_config
from orchestrator.models.tokenizer import eos_token_ids, load_tokenizer
from orchestrator.redaction import redact
from orchestrator.spec.acceptance import Acceptance
from orchestrator.spec.proposer import SpecConfig
from orchestrator.spec.sampling import SamplingParams
from orchestrator.stats import tau_ratio
from orchestrator.tracking import client, fetch_drafter, tracking_uri

log = logging.getLogger(__name__)


class DrafterRef(StrictModel):
    name: str = Field(description="column name in the report")
    source: str = Field(description="drafter directory, s3:// prefix, or models:/NAME/VERSION | models:/NAME@ALIAS")


class SetsConfig(StrictModel):
    mtbench_questions: int = Field(20, ge=0, description="MT-Bench questions (two prompts each); 0 = skip")
    validation_prompts: int = Field(24, ge=0, description="0 = skip")
    long_context_buckets: list[int] = Field([512, 1024, 2048, 4096], description="context lengths in tokens")
    long_context_per_bucket: int = Field(4, ge=0, description="0 = skip")
    template_prompts: int = Field(8, ge=0, description="per template variant; 0 = skip")


class EvalConfig(StrictModel):
    """`python -m jobs.evaluate_drafter` settings."""

    model: str = Field(description="target: a Hugging Face directory or a packaged model name")
    models_dir: str = Field("models", description="where packaged models are prepared")
    drafters: list[DrafterRef] = Field(min_length=1, description="the drafters compared, on the same prompts")
    data: str | None = Field(
        None,
        description="whose validation split is evaluated: a finished collection, or a collect config (*.yaml) whose "
        "held-out conversations are rendered without capture (None: skip)",
    )
    sets: SetsConfig = Field(default_factory=SetsConfig, description="the prompts of each evaluation set")
    methods: dict[str, SpecConfig] = Field(
        default_factory=lambda: {
            "chain-5": SpecConfig(method="chain", num_spec_tokens=5),
            "tree": SpecConfig(method="tree", depth=5, topk=4, budget=16),
        },
        min_length=1,
        description="speculation methods each drafter runs, by the name the report gives them",
    )
    max_tokens: int = Field(96, ge=1, description="tokens generated per prompt (greedy, stops at EOS)")
    batch_size: int = Field(16, ge=1, description="requests decoded together (greedy output does not depend on it)")
    vllm_check: bool = Field(True, description="cross-check the first chain method's tau with vLLM on every set")
    vllm_tolerance: float = Field(0.05, ge=0, description="relative tau difference reported as a disagreement")
    output_dir: str = Field(description="result.json, table.md and plots")
    mlflow_tracking_uri: str | None = Field(
        None, description="None: MLFLOW_TRACKING_URI, else sqlite:///runs/mlflow.db"
    )
    mlflow_experiment: str = Field("aerie-evaluations", description="MLflow experiment of the evaluation's run")
    torch_threads: int = Field(2, ge=1, description="torch intra-op threads")


def build_sets(cfg: EvalConfig, model_dir: Path, tokenizer, eos) -> list[EvalPrompt]:
    s = cfg.sets
    prompts: list[EvalPrompt] = []
    if s.mtbench_questions:
        prompts += mtbench_set(model_dir, tokenizer, eos, s.mtbench_questions, cfg.max_tokens)
    if cfg.data and s.validation_prompts:
        prompts += validation_set(cfg.data, s.validation_prompts)
    if s.long_context_per_bucket:
        window = read_hf_config(model_dir).get("max_position_embeddings", 2048) - cfg.max_tokens
        prompts += long_context_set(tokenizer, s.long_context_buckets, s.long_context_per_bucket, window)
    if s.template_prompts:
        prompts += template_set(tokenizer, s.template_prompts)
    return prompts


def _tau_by(prompts: list[EvalPrompt], generations, key) -> dict[str, dict]:
    groups: dict[str, Acceptance] = defaultdict(Acceptance)
    for p, g in zip(prompts, generations, strict=True):
        groups[key(p)] += g.acceptance
    return {k: acc.summary() for k, acc in sorted(groups.items())}


def evaluate_drafter(
    cfg: EvalConfig, model_dir: Path, drafter_dir: Path, prompts, eos, name: str = "", progress: tqdm | None = None
) -> dict:
    """tau per set and per (set, label) for every method, with the project's engine; `progress` (a bar) advances
    by one per answer."""
    params = SamplingParams(max_tokens=cfg.max_tokens)
    out = {}
    for method, spec in cfg.methods.items():
        engine = load_engine(model_dir, drafter_dir, spec, max_batch=cfg.batch_size, eos_token_ids=eos)
        if progress is not None:
            progress.set_postfix_str(f"{name or drafter_dir.name} {method}")
        gens = engine.generate([p.ids for p in prompts], params, progress=progress)
        out[method] = {
            "overall": _tau_by(prompts, gens, lambda p: "all")["all"],
            "sets": _tau_by(prompts, gens, lambda p: p.set),
            "labels": _tau_by(prompts, gens, lambda p: f"{p.set}/{p.label}"),
            "per_prompt": [[g.acceptance.drafts, g.acceptance.accepted] for g in gens],  # for resampling
        }
        log.info("%s %s: tau %.3f", drafter_dir.name, method, out[method]["overall"]["acceptance_length"])
    out["draft_vocab_coverage"] = _coverage(engine.draft.proposer.drafter.t2d, prompts, gens)
    return out


def _coverage(t2d, prompts: list[EvalPrompt], generations) -> dict[str, float]:
    """Share of the target's generated tokens that the draft vocabulary contains, per set: a ceiling on
    acceptance (a token outside it can never be drafted)."""
    inside: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for p, g in zip(prompts, generations, strict=True):
        ids = g.token_ids
        inside[p.set][0] += int(t2d[ids].sum()) if ids else 0
        inside[p.set][1] += len(ids)
    return {k: round(a / max(n, 1), 4) for k, (a, n) in inside.items()}


def vllm_taus(model_dir: Path, drafter_dir: Path, k: int, prompts: list[EvalPrompt], max_tokens: int) -> dict:
    """tau per set from vLLM's counters (greedy, chain of k): one vLLM engine, one batch per set."""
    from orchestrator.engine.vllm_backend import VllmGenerator

    window = max(256, max(len(p.ids) for p in prompts) + max_tokens + k + 64)
    gen = VllmGenerator(model_dir, drafter_dir, num_spec_tokens=k, max_model_len=window)
    try:
        out = {}
        for name in dict.fromkeys(p.set for p in prompts):
            before = gen.counters()
            gen.generate([p.ids for p in prompts if p.set == name], SamplingParams(max_tokens=max_tokens))
            out[name] = (gen.counters() - before).acceptance_length
        return out
    finally:
        gen.close()


def vllm_check(engine: dict, theirs: dict, method: str, tolerance: float) -> dict:
    """The engine's tau next to vLLM's, per set."""
    sets = {}
    for name, tau in theirs.items():
        ours = engine[method]["sets"][name]["acceptance_length"]
        diff = abs(tau - ours) / ours
        sets[name] = {
            "engine_tau": ours,
            "vllm_tau": round(tau, 4),
            "relative_difference": round(diff, 4),
            "agrees": diff <= tolerance,
        }
    return {"method": method, "sets": sets, "agrees": all(s["agrees"] for s in sets.values())}


def run_evaluation(cfg: EvalConfig) -> dict:
    import torch

    from orchestrator.models.prepare import resolve_model

    torch.set_num_threads(cfg.torch_threads)
    model_dir = resolve_model(cfg.model, cfg.models_dir)
    uri = tracking_uri(cfg.mlflow_tracking_uri)
    drafters = {d.name: fetch_drafter(d.source, tracking=uri) for d in cfg.drafters}  # fails early if missing
    tokenizer = load_tokenizer(model_dir)
    eos = eos_token_ids(model_dir, tokenizer)
    prompts = build_sets(cfg, model_dir, tokenizer, eos)
    result = {"prompts": _count(prompts), "max_tokens": cfg.max_tokens, "drafters": {}}
    result["prompt_labels"] = [[p.set, p.label] for p in prompts]  # the rows of every method's per_prompt
    result["prompt_categories"] = [p.category for p in prompts]  # MT-Bench's, "" elsewhere
    chains = [(m, s) for m, s in cfg.methods.items() if s.method == "chain"]
    with bar(total=len(drafters) * len(cfg.methods) * len(prompts), desc="evaluate", unit="answer") as answers:
        for name, drafter_dir in drafters.items():
            entry = {"source": next(d.source for d in cfg.drafters if d.name == name)}
            entry["engine"] = evaluate_drafter(cfg, model_dir, drafter_dir, prompts, eos, name, answers)
            if cfg.vllm_check and prompts and chains:
                method, spec = chains[0]
                answers.set_postfix_str(f"{name} on vLLM")
                theirs = vllm_taus(model_dir, drafter_dir, spec.num_spec_tokens, prompts, cfg.max_tokens)
                entry["vllm_check"] = vllm_check(entry["engine"], theirs, method, cfg.vllm_tolerance)
            result["drafters"][name] = entry
    return _report(cfg, result)


def _count(prompts: list[EvalPrompt]) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for p in prompts:
        counts[p.set] += 1
    return dict(counts)


def format_table(result: dict) -> str:
    """Markdown: one row per (set, method), one column per drafter."""
    names = list(result["drafters"])
    first = result["drafters"][names[0]]["engine"]
    rows = ["| set | method | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for method in (m for m in first if m != "draft_vocab_coverage"):
        keys = ["all", *first[method]["sets"], *first[method]["labels"]]
        for key in dict.fromkeys(keys):
            cells = []
            for n in names:
                e = result["drafters"][n]["engine"][method]
                s = e["overall"] if key == "all" else e["sets"].get(key) or e["labels"].get(key)
                cells.append(f"{s['acceptance_length']:.3f}")
            rows.append(f"| {key} | {method} | " + " | ".join(cells) + " |")
    for key in first["draft_vocab_coverage"]:
        cells = [f"{result['drafters'][n]['engine']['draft_vocab_coverage'][key]:.3f}" for n in names]
        rows.append(f"| {key} | draft-vocab coverage of the output | " + " | ".join(cells) + " |")
    for n in names:
        check = result["drafters"][n].get("vllm_check")
        for set_name, c in (check or {}).get("sets", {}).items():
            verdict = "agree" if c["agrees"] else "DIFFER by more than the tolerance"
            rows.append(
                f"\nvLLM cross-check {n} ({check['method']}, {set_name}): engine {c['engine_tau']:.3f}, "
                f"vLLM {c['vllm_tau']:.3f} ({100 * c['relative_difference']:.1f}%: {verdict})"
            )
    return "\n".join(rows)


def set_rows(result: dict) -> dict[str, list[int]]:
    """The prompts (row numbers) of each set a result compares on: 'all', each set, and MT-Bench's categories as
    mtbench/CATEGORY."""
    sets = [s for s, _ in result["prompt_labels"]]
    categories = result.get("prompt_categories") or [""] * len(sets)
    groups = {name: [i for i, s in enumerate(sets) if name in ("all", s)] for name in ["all", *dict.fromkeys(sets)]}
    for c in dict.fromkeys(c for c in categories if c):  # MT-Bench by category: set/category
        groups[f"{sets[categories.index(c)]}/{c}"] = [i for i, x in enumerate(categories) if x == c]
    return groups


def per_prompt(result: dict, drafter: str, method: str, rows: list[int]):
    """A drafter's (drafted rounds, accepted drafts) per prompt of `rows` under `method`, as tau_ratio takes them
    ([1 seed, prompts, 2])."""
    import numpy as np

    return np.asarray(result["drafters"][drafter]["engine"][method]["per_prompt"], dtype=float)[rows][None]


def compare(result: dict) -> dict:
    """Per method and set ('all', each set, and MT-Bench's categories as mtbench/CATEGORY): every drafter's tau
    with its 95% bootstrap interval over prompts,
    and its ratio to the first drafter (the baseline) with the paired interval (the same prompt draws for both;
    stats.tau_ratio with one seed). {method: {set: {drafter: {"tau", "interval", "ratio", "ratio_interval"}}}}"""
    groups = set_rows(result)
    names = list(result["drafters"])
    methods = [m for m in result["drafters"][names[0]]["engine"] if m != "draft_vocab_coverage"]
    out: dict = {}
    for method in methods:
        for set_name, rows in groups.items():
            cells = {}
            for n in names:
                r = tau_ratio(per_prompt(result, n, method, rows), per_prompt(result, names[0], method, rows))
                cells[n] = {"tau": r["tau_a"], "interval": r["tau_a_interval"]}
                if n != names[0]:
                    cells[n].update(ratio=r["ratio"], ratio_interval=r["ratio_interval"])
            out.setdefault(method, {})[set_name] = cells
    return out


def format_comparison(comparison: dict, names: list[str]) -> str:
    """Markdown: tau [95% interval] per drafter, and each one's ratio to the first, per method and set."""
    head = [f"{n}" for n in names] + [f"{n} / {names[0]}" for n in names[1:]]
    rows = ["| method | set | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    for method, by_set in comparison.items():
        for set_name, cells in by_set.items():
            taus = [f"{c['tau']:.3f} [{c['interval'][0]:.3f}, {c['interval'][1]:.3f}]" for c in cells.values()]
            ratios = [
                f"{cells[n]['ratio']:.3f} [{cells[n]['ratio_interval'][0]:.3f}, {cells[n]['ratio_interval'][1]:.3f}]"
                for n in names[1:]
            ]
            rows.append(f"| {method} | {set_name} | " + " | ".join(taus + ratios) + " |")
    return "\n".join(rows) + "\n\nIntervals: 95% bootstrap over prompts (ratios paired by prompt)."


def _report(cfg: EvalConfig, result: dict) -> dict:
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result["comparison"] = compare(result)
    table = format_table(result) + "\n\n" + format_comparison(result["comparison"], list(result["drafters"]))
    (out / "table.md").write_text(table + "\n")
    plots = plot_evaluation(result, out)
    result["plots"] = [str(p) for p in plots]
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    mlflow = client(cfg.mlflow_tracking_uri)
    exp = mlflow.get_experiment_by_name(cfg.mlflow_experiment)
    exp_id = exp.experiment_id if exp else mlflow.create_experiment(cfg.mlflow_experiment)
    run = mlflow.create_run(exp_id, run_name="evaluate " + " vs ".join(result["drafters"]))
    from mlflow.entities import Metric, Param

    params = [Param(k, v) for k, v in redact(cfg.model_dump(mode="json")).items()]
    metrics = []
    for name, entry in result["drafters"].items():
        for method, e in entry["engine"].items():
            if method == "draft_vocab_coverage":
                continue
            metrics.append(Metric(f"tau.{name}.{method}.all", e["overall"]["acceptance_length"], 0, 0))
            for key, s in {**e["sets"], **e["labels"]}.items():
                safe = key.replace("<=", "le").replace(" ", "_")
                metrics.append(Metric(f"tau.{name}.{method}.{safe}", s["acceptance_length"], 0, 0))
        for set_name, c in entry.get("vllm_check", {}).get("sets", {}).items():
            metrics.append(Metric(f"tau_vllm.{name}.{set_name}", c["vllm_tau"], 0, 0))
    mlflow.log_batch(run.info.run_id, metrics=metrics, params=params[:100])
    mlflow.log_artifacts(run.info.run_id, str(out))
    mlflow.set_terminated(run.info.run_id)
    result["mlflow_run_id"] = run.info.run_id
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table)
    return result
