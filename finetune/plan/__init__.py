"""Memory plan: predict the peak per component without loading weights, and choose settings that fit.

`predict` plans with the default `Planner` (`DEFAULT_PLANNER`, whose `clear()` drops every cache the planner
holds in memory); `predict(recipe, planner=Planner())` plans with caches of its own. The names load on first
use: the planner's torch-free modules (context checks, sizes) import without torch, so `finetune validate`
reports a user's mistake in a fraction of a second."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from finetune.plan.planner import DEFAULT as DEFAULT_PLANNER
    from finetune.plan.planner import Planner
    from finetune.plan.report import blocked_by_room, room_error
    from finetune.plan.search import Candidate, Plan, RejectionKind, predict

_NAMES = {"DEFAULT_PLANNER": ("finetune.plan.planner", "DEFAULT"), "Planner": ("finetune.plan.planner", "Planner"),
          "blocked_by_room": ("finetune.plan.report", "blocked_by_room"),
          "room_error": ("finetune.plan.report", "room_error"),
          **{name: ("finetune.plan.search", name) for name in ("Candidate", "Plan", "RejectionKind", "predict")}}

__all__ = ["Candidate", "DEFAULT_PLANNER", "Plan", "Planner", "RejectionKind", "blocked_by_room", "plot_breakdown",
           "predict", "room_error"]


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'finetune.plan' has no attribute {name!r}")
    module, attribute = _NAMES[name]
    return getattr(importlib.import_module(module), attribute)


def plot_breakdown(plan: Plan, path) -> None:
    """Stacked bar of the predicted breakdown against the budget, saved to `path` (PNG/SVG)."""
    from finetune.plan.report import plot_breakdown as _plot

    _plot(plan, path)
