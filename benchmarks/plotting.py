"""The benchmarks' shared plot: perplexity over the original's against a budget (log-2 x axis)."""

from __future__ import annotations

from pathlib import Path


def plot_ratio_curves(series: dict[str, list[tuple[float, float]]], path: Path, *, xlabel: str, ylabel: str,
                      title: str) -> None:
    """One line per ``series`` label through its (budget, ratio) points, the original at 1.0, to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, points in series.items():
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="original")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
