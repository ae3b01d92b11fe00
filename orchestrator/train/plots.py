"""Training curves: weighted loss, and top-1 accuracy per TTT position (train and validation)."""

from __future__ import annotations

from pathlib import Path


def plot_training(history: dict[str, list[tuple[int, float]]], steps: int, out: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, style in (("loss", "-"), ("val_loss_step_0", "--")):
        if key in history:
            xs, ys = zip(*history[key], strict=True)
            ax_loss.plot(xs, ys, style, label=key)
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    colors = plt.cm.viridis([j / max(1, steps - 1) for j in range(steps)])
    for j in range(steps):
        for prefix, style in (("", "-"), ("val_", "o--")):
            key = f"{prefix}acc_step_{j}"
            if key in history:
                xs, ys = zip(*history[key], strict=True)
                ax_acc.plot(xs, ys, style, color=colors[j], label=f"{prefix or 'train '}position {j + 1}")
    ax_acc.set_xlabel("optimizer step")
    ax_acc.set_ylabel("top-1 accuracy vs target")
    ax_acc.set_ylim(0, 1)
    ax_acc.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
