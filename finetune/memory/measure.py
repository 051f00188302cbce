"""`finetune measure`: run N real training steps under the tracker and report the peak and its breakdown.

The training step here is deliberately minimal (forward with labels, backward, optimizer step) and lives in
`training_step`, which the planner also runs on the `meta` device, so predictions and measurements follow
the same code path; `finetune run` steps through FinetuneTrainer (issue #12 makes the three one step).
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from finetune.memory.chunked_loss import causal_lm_loss
from finetune.memory.layer_recompute import apply_memory_config
from finetune.memory.tracker import MemoryTracker, measure_step
from finetune.recipe.schema import Recipe
from finetune.recipe.settings import read_settings


def enable_checkpointing(model: torch.nn.Module, enabled: bool, every_n: int) -> None:
    """Non-reentrant checkpointing of one decoder layer in every `every_n`."""
    if enabled:
        model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=every_n)
    model.config.use_cache = False


def training_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer | None,
                  accumulation: int, tracker: MemoryTracker | None = None, backward_window: str = "backward",
                  chunked_loss: bool = False, offload: Any = None) -> None:
    """One optimizer step over `accumulation` micro-batches; tracker windows forward/backward/optimizer.

    offload: an ActivationOffload entered around each micro-batch's forward and backward, as the Trainer does.
    """
    from contextlib import nullcontext

    def window(name: str):
        return tracker.window(name) if tracker is not None else nullcontext()

    for _ in range(accumulation):
        with offload if offload is not None else nullcontext():
            _forward_backward(model, batch, accumulation, window, backward_window, chunked_loss)
    if optimizer is not None:
        with window("optimizer"), (tracker.optimizer_step() if tracker is not None else nullcontext()):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _forward_backward(model, batch, accumulation, window, backward_window, chunked_loss) -> None:
    with window("forward"):
        loss = (causal_lm_loss(model, batch) if chunked_loss else model(**batch).loss) / accumulation
    with window(backward_window):
        loss.backward()


def measure(recipe: Recipe, steps: int = 2) -> dict[str, Any]:
    """Run `steps` optimizer steps at the recipe's micro-batch and max_seq_len; return the tracker result.

    `auto` settings are resolved by the planner first.
    """
    if recipe.auto_keys():  # measure what `finetune run` would train: the planner's choice
        from finetune.plan import predict

        recipe = predict(recipe).apply(recipe)
    from finetune.model.adapter import apply_adapter
    from finetune.model.load import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _tokenizer, _path = load_model(recipe.model, recipe.quantization)
    vocab = model.config.get_text_config().vocab_size
    checkpointing = bool(recipe.memory.activation_checkpointing)
    model = apply_adapter(model, recipe.adapter, checkpointing=checkpointing)
    apply_memory_config(model, recipe.memory)
    enable_checkpointing(model, checkpointing, recipe.memory.checkpoint_every_n_layers)
    model.train()
    from finetune.optim import build_optimizer

    optimizer = build_optimizer(model, recipe.optimizer, recipe.training.learning_rate,
                                steps_per_update=recipe.training.gradient_accumulation_steps,
                                max_grad_norm=recipe.training.max_grad_norm)
    gen = torch.Generator().manual_seed(recipe.training.seed)
    ids = torch.randint(0, vocab, (recipe.training.micro_batch_size, recipe.data.max_seq_len), generator=gen)
    batch = {"input_ids": ids.to(device), "labels": ids.to(device)}

    with tempfile.TemporaryDirectory(prefix="finetune-measure-") as scratch:
        from finetune.memory.offload import activation_offload

        offload = activation_offload(model, recipe.memory, scratch)  # files under offload_dir or scratch

        def run(tracker: MemoryTracker) -> None:
            for _ in range(steps):
                training_step(model, batch, optimizer, recipe.training.gradient_accumulation_steps, tracker,
                              chunked_loss=bool(recipe.memory.chunked_loss), offload=offload)

        result = measure_step(run, model=model, optimizer=optimizer, vocab_size=vocab, device=device)
    result["steps"] = steps
    result["settings"] = read_settings(recipe)
    return result

