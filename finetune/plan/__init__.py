"""Memory plan: predict the peak per component without loading weights, and choose settings that fit.

`predict` plans with the default `Planner` (`DEFAULT_PLANNER`, whose `clear()` drops every cache the planner
holds in memory); `predict(recipe, planner=Planner())` plans with caches of its own."""

from finetune.plan.planner import DEFAULT as DEFAULT_PLANNER
from finetune.plan.planner import Planner
from finetune.plan.report import blocked_by_room, room_error
from finetune.plan.search import Candidate, Plan, RejectionKind, predict

__all__ = ["Candidate", "DEFAULT_PLANNER", "Plan", "Planner", "RejectionKind", "blocked_by_room", "plot_breakdown",
           "predict", "room_error"]


def plot_breakdown(plan: Plan, path) -> None:
    """Stacked bar of the predicted breakdown against the budget, saved to `path` (PNG/SVG)."""
    from finetune.plan.report import plot_breakdown as _plot

    _plot(plan, path)
