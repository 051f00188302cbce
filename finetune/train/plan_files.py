"""The run directory's plan.json and plan.png, written atomically (at the start and after an OOM re-plan)."""

from __future__ import annotations

import os

from finetune.plan import Plan, plot_breakdown
from finetune.rundir import RunDir, atomic_write_text


def save_plan(run_dir: RunDir, plan: Plan) -> None:
    """Replace plan.json and plan.png; a reader (the UI) never sees a half-written file."""
    atomic_write_text(run_dir.plan, plan.to_json())
    tmp = run_dir.plan_plot.with_name(f".{run_dir.plan_plot.stem}.tmp{run_dir.plan_plot.suffix}")
    plot_breakdown(plan, tmp)
    os.replace(tmp, run_dir.plan_plot)
