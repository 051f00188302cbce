"""The matplotlib bar of a plan that a run saves next to plan.json."""

from __future__ import annotations

from pathlib import Path

from finetune.memory.tracker import CATEGORIES
from finetune.plan.search import Plan


def plot_breakdown(plan: Plan, path: str | Path) -> None:
    """One stacked bar of the breakdown next to a bar of the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 5))
    bottom = 0.0
    for key in CATEGORIES:
        value = plan.breakdown.get(key, 0) / 2**30
        if value > 0:
            ax.bar("plan", value, bottom=bottom, label=key)
            bottom += value
    ax.bar("budget", plan.budget_bytes / 2**30, color="lightgrey")
    ax.set_ylabel("GiB")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
