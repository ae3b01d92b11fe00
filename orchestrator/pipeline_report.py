"""The pipeline's report: report.json (everything), report.md (tables and plots a person reads, each stage's log
file) and two plots: tau per evaluation set and drafter, and the serving speed-up per concurrency and backend."""

from __future__ import annotations

import json
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tau(evaluation: dict, path: Path) -> Path | None:
    """Grouped bars: tau per set (x) for each drafter, one panel per method."""
    drafters = evaluation.get("drafters") or {}
    if not drafters:
        return None
    plt = _plt()
    methods = [m for m in next(iter(drafters.values()))["engine"] if m != "draft_vocab_coverage"]
    fig, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 3.6), squeeze=False)
    for ax, method in zip(axes[0], methods, strict=True):
        sets = ["all", *next(iter(drafters.values()))["engine"][method]["sets"]]
        width = 0.8 / len(drafters)
        for i, (name, entry) in enumerate(drafters.items()):
            e = entry["engine"][method]
            taus = [
                e["overall"]["acceptance_length"] if s == "all" else e["sets"][s]["acceptance_length"] for s in sets
            ]
            ax.bar([x + i * width for x in range(len(sets))], taus, width, label=name)
        ax.set_xticks([x + width * (len(drafters) - 1) / 2 for x in range(len(sets))], sets, fontsize=8)
        ax.axhline(1.0, color="grey", linewidth=0.6)
        ax.set_title(f"acceptance length tau, {method}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_speedup(benchmark: dict, path: Path) -> Path | None:
    """Speculation on / off, per-user tokens/s, per concurrency, one line per backend."""
    series = {
        name: benchmark[key]
        for key, name in (("speedup", "disaggregated"), ("vllm_speedup", "vLLM"))
        if key in benchmark
    }
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for name, ratios in series.items():
        points = sorted((int(c), r) for c, r in ratios.items())  # r: paired_ratio's dict
        users = [c for c, _ in points]
        mid = [r["ratio"] for _, r in points]
        low = [r["ratio"] - (r["low"] if r["low"] is not None else r["ratio"]) for _, r in points]
        high = [(r["high"] if r["high"] is not None else r["ratio"]) - r["ratio"] for _, r in points]
        ax.errorbar(users, mid, yerr=[low, high], marker="o", capsize=3, label=name)
    ax.axhline(1.0, color="grey", linewidth=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent users")
    ax.set_ylabel("speed-up (spec / no spec)")
    ax.set_title("serving speed-up, per-user tokens/s (95% interval)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(report: dict, plots: list[Path]) -> str:
    from orchestrator.benchmarks.serving import format_table as benchmark_table
    from orchestrator.evaluation.evaluate import format_table as evaluation_table

    lines = [
        f"# Pipeline {report['name']}",
        "",
        f"Total {report['seconds']:.0f} s.",
        "",
        "| stage | status | seconds | log |",
    ]
    lines.append("|---|---|---|---|")
    for key, s in report["stages"].items():
        status = s["status"] + (f" ({s['reason']})" if s.get("reason") else "")
        log = f"`{s['log']}`" if s.get("log") else ""
        lines.append(f"| {key} | {status} | {s.get('seconds', '')} | {log} |")
    if report.get("log"):
        lines += [
            "",
            f"Between the stages (MLflow, Ray, the gate, this report) the pipeline logs to `{report['log']}`.",
        ]
    if report.get("ray_logs"):
        lines.append(f"The Ray workers (capture, Ray Train, Ray Serve) log to `{report['ray_logs']}`.")
    c = report["collection"]
    summary = c.get("summary", {})
    if c["online"]:
        data = "hidden states captured while training (`train.data: online`): nothing stored"
    elif "traffic_shards" in summary:  # jobs.adapt: served traffic (and a replay of a collection)
        data = (
            f"`{c['output']}`: served traffic, {summary['traffic_shards']} shards ({summary['held_out_shards']} "
            f"held out), {summary['replay_shards']} replayed; {summary.get('train_tokens', 0)} training and "
            f"{summary.get('validation_tokens', 0)} held-out tokens, manifest sha256 `{c['manifest_sha256']}` "
            f"(MLflow run `{c['run_id']}`)."
        )
    else:
        data = (
            f"`{c['output']}`: {summary.get('total_tokens', '?')} tokens, {summary.get('shards_planned', '?')} "
            f"shards, manifest sha256 `{c['manifest_sha256']}` (MLflow run `{c['run_id']}`)."
        )
    lines += [
        "",
        "## Data",
        data,
        "",
        "## Drafters",
        "| variant | version | steps | minutes | tokens | val tau (replayed chain) | MLflow run |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, t in report["trained"].items():
        estimate = t["final_metrics"].get("val_tau_chain", float("nan"))
        lines.append(
            f"| {variant} | `{t['registered']}` | {t['steps']} | {t['train_minutes']} | {t['tokens']} | "
            f"{estimate:.3f} | `{t['mlflow_run_id']}` |"
        )
    lines += ["", "## Acceptance (greedy, the project's engine)", evaluation_table(report["evaluation"]), ""]
    g = report["gate"]
    lines += ["## Gate", f"{'passed' if g['passed'] else 'failed'}: {g['reason']}", ""]
    d = report["deploy"]
    lines += ["## Deployment"]
    if "skipped" in d:
        lines.append(f"skipped: {d['skipped']}")
    else:
        lines.append(
            f"{d['decision']}: `{d['drafter']}` as `{d['app']}` ({d.get('reason') or ''}); endpoint {d['endpoint']}; "
            f"record `{d['record_dir']}`"
        )
    lines.append("")
    b = report["benchmark"]
    if "skipped" not in b:
        lines += ["## Serving benchmark (speculation on vs off, same run)", benchmark_table(b), ""]
    m = report["mlflow"]
    lines += [
        "## MLflow",
        f"tracking URI `{m['tracking_uri']}`; pipeline run `{m['pipeline_run']}` (a child run per stage).",
        "",
    ]
    lines += [f"![{p.stem}]({p.as_posix()})" for p in plots]
    return "\n".join(lines) + "\n"


def write_report(report: dict, out: Path) -> list[Path]:
    """report.json, report.md, then the plots."""
    plots = [
        p
        for p in (
            plot_tau(report["evaluation"], out / "tau_by_set.png"),
            plot_speedup(report["benchmark"], out / "speedup.png") if "skipped" not in report["benchmark"] else None,
        )
        if p is not None
    ]
    for extra in report["evaluation"].get("plots", []):
        if Path(extra).is_file():
            plots.append(Path(extra))
    report["plots"] = [str(p) for p in plots]
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    md = out / "report.md"
    md.write_text(markdown(report, [p.relative_to(out) if p.is_relative_to(out) else p for p in plots]))
    return [out / "report.json", md, *plots]
