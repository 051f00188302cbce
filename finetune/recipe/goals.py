"""What a newcomer's "goal" means as recipe values: one table, read by the UI's basic form and by
`finetune.api.apply_goal`, so "quick test" is the same recipe wherever it is chosen.

Only keys a goal is about are set; everything else keeps what the recipe (or the schema's default) says.
`auto` leaves the value to the planner (finetune/recipe/settings.py lists those keys).
"""

from __future__ import annotations

from typing import Any

GOALS: dict[str, dict[str, Any]] = {
    # Minutes, not hours: few steps on a sample of the data, short sequences, a small adapter.
    "quick test": {
        "data.max_seq_len": 512, "data.max_samples": 200, "training.max_steps": 30, "adapter.r": 8,
        "adapter.alpha": 16, "training.micro_batch_size": "auto", "training.gradient_accumulation_steps": "auto",
        "training.effective_batch_size": 8, "output.save_steps": 30,
    },
    # The whole data for a few epochs, a held-out split to watch, a larger adapter and batch, a gentler rate.
    "best quality": {
        "training.max_steps": None, "training.epochs": 3, "data.max_samples": None, "data.validation_split": 0.05,
        "adapter.r": 64, "adapter.alpha": 128, "training.learning_rate": 1.0e-4,
        "training.micro_batch_size": "auto", "training.gradient_accumulation_steps": "auto",
        "training.effective_batch_size": 32, "quantization.bits": "auto",
    },
    # One long sequence per micro-batch, every memory saving the planner knows left to it.
    "longest context": {
        "data.max_seq_len": 32768, "training.micro_batch_size": 1, "training.gradient_accumulation_steps": "auto",
        "training.effective_batch_size": 8, "memory.activation_checkpointing": True, "memory.offload": "auto",
        "memory.chunked_loss": "auto", "memory.tiled_mlp": "auto",
    },
}


SUMMARIES = {  # one line each, for the UI's goal picker
    "quick test": "minutes on a 200-record sample, 512 tokens, 30 steps",
    "best quality": "the whole data for 3 epochs, a 5% eval split, a rank-64 adapter",
    "longest context": "32k tokens, one sequence per micro-batch, memory savings left to the planner",
}


def goal_values(goal: str) -> dict[str, Any]:
    """The recipe keys ("section.field") and values of `goal`; KeyError names the known goals."""
    if goal not in GOALS:
        raise KeyError(f"unknown goal {goal!r}; choose one of: {', '.join(GOALS)}")
    return dict(GOALS[goal])
