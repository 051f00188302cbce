"""The ladder of cheaper plans an out-of-memory recovery walks down (see finetune.train.recovery).

Halve the micro-batch at the same effective batch (the next divisor of the loader's micro-batch B when it
is odd) down to 1; then turn on, one at a time and keeping the earlier ones, activation checkpointing,
each offload tier after the current one that frees the training device (finetune.recipe.offload_tiers
order: cpu on CUDA, then disk), chunked loss and tiled MLP, each only when the planner predicts it fits the
memory free now; last, streaming the frozen weights (memory.offload_weights, the first tier that frees the
device: cpu on CUDA, disk on a CPU run), which costs link time but leaves the device only the layers in flight.
Settings are the planner's table (finetune.recipe.settings), by name. Pure recipe logic: the trainer applies
what it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from finetune.recipe.offload_tiers import TIERS
from finetune.recipe.schema import Recipe
from finetune.recipe.settings import Settings, read_settings, write_settings

# The settings (names in finetune.recipe.settings' table) a recovery may change.
NAMES = ("micro_batch_size", "gradient_accumulation_steps", "activation_checkpointing", "offload", "chunked_loss",
         "tiled_mlp", "offload_weights")


def settings_of(recipe: Recipe) -> dict[str, Any]:
    """The recipe's values of NAMES (what an out-of-memory event reports as from/to)."""
    values = read_settings(recipe)
    return {name: values[name] for name in NAMES}


def rungs(recipe: Recipe, device: str, unusable: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """The alternatives at micro-batch 1, cheapest change first; each adds to the ones before it.
    `unusable`: offload tiers whose preflight failed in this run."""
    m = recipe.memory
    rungs = [{"activation_checkpointing": True}] if m.activation_checkpointing is not True else []
    names = [t.name for t in TIERS]
    later = TIERS[names.index(m.offload) + 1:] if m.offload in names else TIERS
    rungs += [{"offload": t.name} for t in later if t.frees_device(device) and t.name not in unusable]
    if m.chunked_loss is not True and m.kernels != "liger":  # Liger's fused loss already keeps no logits
        rungs.append({"chunked_loss": True})
    if m.tiled_mlp is not True and recipe.data.max_seq_len > m.tiled_mlp_tokens:
        rungs.append({"tiled_mlp": True})
    streams = next((t.name for t in TIERS if t.frees_device(device) and t.name not in unusable), None)
    if m.offload_weights == "none" and streams is not None and _allowed(recipe, {"offload_weights": streams}):
        rungs.append(_streaming(recipe, streams))
    return rungs


STREAMING = ("offload_weights_ahead", "offload_weights_resident")  # the streaming's own settings


def _streaming(recipe: Recipe, tier: str) -> dict[str, Any]:
    """The rung that streams the frozen weights from `tier`: its read-ahead and resident layers at the settings
    table's defaults where the recipe leaves them auto (no plan is made mid-run to choose them)."""
    values = read_settings(recipe)
    defaults = {f.name: f.default for f in fields(Settings)}
    return {"offload_weights": tier, **{name: defaults[name] for name in STREAMING if values[name] == "auto"}}


def _allowed(recipe: Recipe, values: dict[str, Any]) -> bool:
    """Whether the recipe validates with `values` (weight streaming is refused with a full fine-tune, compile,
    several GPUs, expert offload or expert adapters: the schema says which)."""
    try:
        write_settings(recipe, values)
    except ValueError:
        return False
    return True


@dataclass
class Cheaper:
    recipe: Recipe | None  # the next plan, or None when nothing is left
    splits: int  # sub-micro-batches per loader batch
    min_budget_bytes: int | None = None  # when nothing is left: the planner's smallest working budget


def cheaper(recipe: Recipe, loader_batch: int, loader_accumulation: int, splits: int,
            plan_for: Callable[[Recipe], Any], unusable: frozenset[str] = frozenset()) -> Cheaper:
    """The next plan after an out-of-memory error at `splits` sub-micro-batches per loader batch."""
    nxt = next((k for k in range(splits + 1, loader_batch + 1) if loader_batch % k == 0 and k % splits == 0), None)
    if nxt is not None:
        return Cheaper(write_settings(recipe, {"micro_batch_size": loader_batch // nxt,
                                               "gradient_accumulation_steps": loader_accumulation * nxt}), nxt)
    for rung in rungs(recipe, "cuda" if torch.cuda.is_available() else "cpu", unusable):
        recipe = write_settings(recipe, rung)
        try:
            if plan_for(recipe).fits:
                return Cheaper(recipe, splits)
        except Exception:  # noqa: BLE001 - no prediction (a model the planner cannot trace): try it for real
            return Cheaper(recipe, splits)
    try:  # nothing left: what the leanest settings need, by the planner
        plan = plan_for(recipe)
    except Exception:  # noqa: BLE001 - no prediction for this model; the error says so
        return Cheaper(None, splits)
    return Cheaper(None, splits, plan.min_budget_bytes or plan.peak_bytes + recipe.memory.gpu_memory_margin)
