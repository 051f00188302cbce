"""The ladder of cheaper plans an out-of-memory recovery walks down (see finetune.train.recovery).

Halve the micro-batch at the same effective batch (the next divisor of the loader's micro-batch B when it
is odd) down to 1; then turn on, one at a time and keeping the earlier ones, activation checkpointing,
cpu offload (CUDA only), disk offload, chunked loss and tiled MLP, each only when the planner predicts it
fits the memory free now. Pure recipe logic: the trainer applies what it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from finetune.recipe.schema import Recipe

# What a recovery may change, as recipe keys.
KEYS = ("training.micro_batch_size", "training.gradient_accumulation_steps", "memory.activation_checkpointing",
        "memory.offload", "memory.chunked_loss", "memory.tiled_mlp")


def settings_of(recipe: Recipe) -> dict[str, Any]:
    """The recipe's values of KEYS (what an out-of-memory event reports as from/to)."""
    return {k: getattr(getattr(recipe, k.split(".")[0]), k.split(".")[1]) for k in KEYS}


def with_settings(recipe: Recipe, settings: dict[str, Any]) -> Recipe:
    """A validated copy of `recipe` with {"section.key": value} replaced."""
    data = recipe.model_dump()
    for key, value in settings.items():
        section, name = key.split(".")
        data[section][name] = value
    return Recipe.model_validate(data)


def rungs(recipe: Recipe, cuda: bool) -> list[dict[str, Any]]:
    """The alternatives at micro-batch 1, cheapest change first; each adds to the ones before it."""
    m = recipe.memory
    rungs = [{"memory.activation_checkpointing": True}] if m.activation_checkpointing is not True else []
    if cuda and m.offload == "none":
        rungs.append({"memory.offload": "cpu"})
    if m.offload != "disk":
        rungs.append({"memory.offload": "disk"})
    if m.chunked_loss is not True:
        rungs.append({"memory.chunked_loss": True})
    if m.tiled_mlp is not True and recipe.data.max_seq_len > m.tiled_mlp_tokens:
        rungs.append({"memory.tiled_mlp": True})
    return rungs


def measured_gpu_memory() -> int | None:
    """What this process could use now: free device memory plus what its own allocator holds (None on CPU)."""
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved()


@dataclass
class Cheaper:
    recipe: Recipe | None  # the next plan, or None when nothing is left
    splits: int  # sub-micro-batches per loader batch
    min_budget_bytes: int | None = None  # when nothing is left: the planner's smallest working budget


def cheaper(recipe: Recipe, loader_batch: int, loader_accumulation: int, splits: int,
            plan_for: Callable[[Recipe], Any]) -> Cheaper:
    """The next plan after an out-of-memory error at `splits` sub-micro-batches per loader batch."""
    nxt = next((k for k in range(splits + 1, loader_batch + 1) if loader_batch % k == 0 and k % splits == 0), None)
    if nxt is not None:
        return Cheaper(with_settings(recipe, {"training.micro_batch_size": loader_batch // nxt,
                                              "training.gradient_accumulation_steps": loader_accumulation * nxt}),
                       nxt)
    for rung in rungs(recipe, torch.cuda.is_available()):
        recipe = with_settings(recipe, rung)
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
