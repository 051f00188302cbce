"""What a plan says beyond its numbers: the matplotlib bar a run saves next to plan.json, and the room that
blocks a plan that does not fit."""

from __future__ import annotations

from pathlib import Path

from finetune.errors import FinetuneError
from finetune.memory.offload import offload_dir_for
from finetune.memory.offload_disk import OFFLOAD_DIR_HINT, OffloadDirError
from finetune.memory.tracker import CATEGORIES
from finetune.plan.search import Candidate, Plan
from finetune.recipe.offload_tiers import STORES
from finetune.recipe.schema import Recipe


def blocked_by_room(plan: Plan) -> Candidate | None:
    """Where nothing fits though a configuration's device memory would: the leanest such configuration, turned
    down for the room its offload lacks (memory.offload_dir's free space, host RAM). None when device memory is
    what is short (then a larger budget helps; here it does not)."""
    if plan.fits:
        return None
    return next((c for c in plan.rejected if c.kind in ("offload_space", "host_ram")
                 and c.peak_bytes <= plan.budget_bytes), None)


def room_error(recipe: Recipe, blocked: Candidate) -> FinetuneError:
    """The one-line error for a plan `blocked_by_room`: memory.offload_dir's folder (exit 2, as the run's own
    check of the folder says it), or host RAM."""
    if STORES["offload_dir"] in (blocked.reason or ""):
        folder = offload_dir_for(recipe.memory, recipe.output.dir).expanduser().absolute()
        return OffloadDirError(f"memory.offload_dir {folder}: nothing fits, {blocked.reason}", hint=OFFLOAD_DIR_HINT)
    return FinetuneError(f"nothing fits host RAM: {blocked.reason}",
                         hint="free host RAM, raise memory.offload_cpu_limit, or keep the experts and activations "
                              "on the device (memory.offload: none, memory.offload_experts: none)")


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
