"""Evaluation plots: tau by context bucket, per-depth acceptance, tau by template variant."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, ax, title: str, ylabel: str, path: Path) -> Path:
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_evaluation(result: dict, out: Path) -> list[Path]:
    plt = _plt()
    drafters = result["drafters"]
    methods = [m for m in next(iter(drafters.values()))["engine"] if m != "draft_vocab_coverage"]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, entry in drafters.items():
        for method in methods:
            labels = entry["engine"][method]["labels"]
            buckets = sorted((int(k.split("<=")[1]), v) for k, v in labels.items() if k.startswith("long_context/"))
            if buckets:
                ax.plot(
                    [b for b, _ in buckets],
                    [v["acceptance_length"] for _, v in buckets],
                    "o-",
                    label=f"{name} {method}",
                )
    if ax.lines:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens, bucket upper bound)")
        paths.append(_save(plt, fig, ax, "tau by context length", "acceptance length tau", out / "tau_by_context.png"))
    else:
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, entry in drafters.items():
        for method in methods:
            rates = entry["engine"][method]["overall"]["per_depth_acceptance"]
            ax.plot(range(1, len(rates) + 1), rates, "o-", label=f"{name} {method}")
    ax.set_xlabel("draft depth")
    ax.set_ylim(0, 1)
    rate = "share of drafted request-steps reaching this depth"
    paths.append(_save(plt, fig, ax, "per-depth acceptance (all prompts)", rate, out / "per_depth_acceptance.png"))

    variants = sorted(
        {
            k.split("/", 1)[1]
            for e in drafters.values()
            for k in e["engine"][methods[0]]["labels"]
            if k.startswith("templates/")
        }
    )
    if variants:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        bars = [(n, m) for n in drafters for m in methods]
        width = 0.8 / len(bars)
        for i, (name, method) in enumerate(bars):
            labels = drafters[name]["engine"][method]["labels"]
            ys = [labels[f"templates/{v}"]["acceptance_length"] for v in variants]
            ax.bar([x + i * width for x in range(len(variants))], ys, width, label=f"{name} {method}")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(variants))], variants, rotation=20, fontsize=8)
        path = out / "tau_by_template.png"
        paths.append(_save(plt, fig, ax, "tau by template variant", "acceptance length tau", path))
    return paths
