"""Memory plan: predict the peak per component without loading weights, and choose settings that fit."""

from finetune.plan.search import Candidate, Plan, predict

__all__ = ["Candidate", "Plan", "predict", "plan_command", "plot_breakdown"]


def plan_command(recipe, gpu_memory: str | None, as_json: bool, device: str | None = None) -> int:
    """CLI body of `finetune plan`: print the plan (JSON or tables); exit 0 if it fits, 1 if nothing fits.

    device: cpu or cuda; default cuda when available or when an explicit GPU size is given, else cpu.
    """
    from finetune.plan.report import render_plan

    plan = predict(recipe, gpu_memory=gpu_memory, device=device)
    if as_json:
        print(plan.to_json())
    else:
        render_plan(plan)
    return 0 if plan.fits else 1


def plot_breakdown(plan: Plan, path) -> None:
    """Stacked bar of the predicted breakdown against the budget, saved to `path` (PNG/SVG)."""
    from finetune.plan.report import plot_breakdown as _plot

    _plot(plan, path)
