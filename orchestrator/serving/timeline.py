"""The rollout's timeline plot: requests/s per backend as the router counted them, and the decisions."""

from __future__ import annotations

from pathlib import Path


def plot_timeline(timeline: list[dict], path: Path, events: list[dict] | None = None, window_s: float = 5.0) -> None:
    """Requests/s per backend over a sliding `window_s` (router counters), failures as red crosses, and the
    rollout's decisions as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    apps = sorted({a for row in timeline for a in row["backends"]})
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for app in apps:
        pts = [(row["t"], row["backends"][app]) for row in timeline if app in row["backends"]]
        if pts[-1][1]["requests"] == pts[0][1]["requests"]:
            continue  # no traffic in this period
        ts, rate, j = [], [], 0
        for t, counts in pts:
            while pts[j][0] < t - window_s:
                j += 1
            if t > pts[j][0]:
                ts.append(t)
                rate.append((counts["requests"] - pts[j][1]["requests"]) / (t - pts[j][0]))
        ax.plot(ts, rate, label=f"{app} req/s")
        fails = [t for (t, a), (_, b) in zip(pts, pts[1:], strict=False) if b["failed"] > a["failed"]]
        if fails:
            ax.scatter(fails, [0] * len(fails), marker="x", color="red", label=f"{app} failures")
    for e in events or []:
        if e["event"] in ("routes", "promoted", "rolled back", "deleted"):
            ax.axvline(e["t"], color="grey", linewidth=0.6, linestyle=":")
            label = e["event"] if e["event"] != "routes" else " ".join(f"{a}:{w:g}" for a, w in e["routes"].items())
            ax.text(e["t"], ax.get_ylim()[1], label, rotation=90, va="top", ha="right", fontsize=7)
    ax.set_xlabel("seconds since the rollout started")
    ax.set_ylabel(f"requests / s ({window_s:g} s window)")
    if ax.get_legend_handles_labels()[0]:  # no traffic at all: nothing to label
        ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
