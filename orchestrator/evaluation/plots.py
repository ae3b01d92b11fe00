"""Evaluation plots: tau by context bucket, per-depth acceptance, tau by template variant."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
        ax.set_ylabel("acceptance length tau")
        ax.set_title("tau by context length")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / "tau_by_context.png")
        fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, entry in drafters.items():
        for method in methods:
            rates = entry["engine"][method]["overall"]["per_depth_acceptance"]
            ax.plot(range(1, len(rates) + 1), rates, "o-", label=f"{name} {method}")
    ax.set_xlabel("draft depth")
    ax.set_ylabel("share of rounds accepting at least this deep")
    ax.set_ylim(0, 1)
    ax.set_title("per-depth acceptance (all prompts)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "per_depth_acceptance.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

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
        ax.set_ylabel("acceptance length tau")
        ax.set_title("tau by template variant")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / "tau_by_template.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
