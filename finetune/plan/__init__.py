"""Memory plan: predict the peak per component without loading weights, and choose settings that fit."""

from finetune.plan.search import Candidate, Plan, predict

__all__ = ["Candidate", "Plan", "predict", "plot_breakdown"]


def plot_breakdown(plan: Plan, path) -> None:
    """Stacked bar of the predicted breakdown against the budget, saved to `path` (PNG/SVG)."""
    from finetune.plan.report import plot_breakdown as _plot

    _plot(plan, path)
