"""`finetune measure`: run N real training steps under the tracker and report the peak and its breakdown.

The training step here is deliberately minimal (forward with labels, backward, optimizer step) and lives in
`training_step`, which the planner also runs on the `meta` device, so predictions and measurements follow
the same code path. Swap `training_step` for the Trainer's step once that exists on main.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from finetune.errors import FinetuneError
from finetune.memory.tracker import MemoryTracker, measure_step
from finetune.recipe.schema import Recipe


def enable_checkpointing(model: torch.nn.Module, enabled: bool, every_n: int) -> None:
    """Non-reentrant checkpointing of one decoder layer in every `every_n`."""
    if enabled:
        model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=every_n)
    model.config.use_cache = False


def training_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer | None,
                  accumulation: int, tracker: MemoryTracker | None = None, backward_window: str = "backward") -> None:
    """One optimizer step over `accumulation` micro-batches; tracker windows forward/backward/optimizer."""
    from contextlib import nullcontext

    def window(name: str):
        return tracker.window(name) if tracker is not None else nullcontext()

    for _ in range(accumulation):
        with window("forward"):
            loss = model(**batch).loss / accumulation
        with window(backward_window):
            loss.backward()
        del loss
    if optimizer is not None:
        with window("optimizer"), (tracker.optimizer_step() if tracker is not None else nullcontext()):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def measure(recipe: Recipe, steps: int = 2) -> dict[str, Any]:
    """Run `steps` optimizer steps at the recipe's micro-batch and max_seq_len; return the tracker result."""
    for key, value in (("training.micro_batch_size", recipe.training.micro_batch_size),
                       ("training.gradient_accumulation_steps", recipe.training.gradient_accumulation_steps),
                       ("memory.activation_checkpointing", recipe.memory.activation_checkpointing),
                       ("quantization.bits", recipe.quantization.bits), ("optimizer.name", recipe.optimizer.name)):
        if value == "auto":
            raise FinetuneError(f"{key} is auto; `finetune measure` needs concrete settings",
                                hint="run `finetune plan` first and measure its plan (Plan.apply(recipe))")
    from finetune.model.adapter import apply_adapter
    from finetune.model.load import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _tokenizer, _path = load_model(recipe.model, recipe.quantization)
    vocab = model.config.get_text_config().vocab_size
    checkpointing = bool(recipe.memory.activation_checkpointing)
    model = apply_adapter(model, recipe.adapter, checkpointing=checkpointing)
    enable_checkpointing(model, checkpointing, recipe.memory.checkpoint_every_n_layers)
    model.train()
    from finetune.optim import build_optimizer

    optimizer = build_optimizer(model, recipe.optimizer, recipe.training.learning_rate,
                                steps_per_update=recipe.training.gradient_accumulation_steps,
                                max_grad_norm=recipe.training.max_grad_norm)
    gen = torch.Generator().manual_seed(recipe.training.seed)
    ids = torch.randint(0, vocab, (recipe.training.micro_batch_size, recipe.data.max_seq_len), generator=gen)
    batch = {"input_ids": ids.to(device), "labels": ids.to(device)}

    def run(tracker: MemoryTracker) -> None:
        for _ in range(steps):
            training_step(model, batch, optimizer, recipe.training.gradient_accumulation_steps, tracker)

    result = measure_step(run, model=model, optimizer=optimizer, vocab_size=vocab, device=device)
    result["steps"] = steps
    return result


def measure_command(recipe: Recipe, steps: int, as_json: bool) -> int:
    """CLI body of `finetune measure`: print the measured peak (JSON or a table); exit code 0."""
    result = measure(recipe, steps)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        from finetune.plan.report import render_measurement

        render_measurement(result)
    return 0
