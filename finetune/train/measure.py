"""`finetune measure`: run N real training steps under the tracker and report the peak and its breakdown.

The steps are `finetune.step.training_step.training_step`: the micro-batch forward + backward the loop runs in
`finetune run` and the planner traces on `meta`, then the loop's optimizer update. It lives next to
training (not under memory/) because it calls the planner for `auto` settings.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from finetune.memory.layer_recompute import compile_layers
from finetune.memory.memory_config import apply_memory_config
from finetune.memory.tracker import MemoryTracker, measure_step
from finetune.memory.weight_store import weight_store_of
from finetune.plan.search import planned_sequence
from finetune.recipe.schema import Recipe
from finetune.recipe.settings import auto_keys, read_settings
from finetune.step.preference import (
    PreferenceLoss,
    batch_layout,
    batch_reference_logps,
    loads_reference_adapter,
    reference_is_current,
    synthetic_batch,
)
from finetune.step.training_step import autocast_for, enable_checkpointing, mixed_precision, training_step


def step_setup(recipe: Recipe, scratch: str | Path | None = None,
               **plan_kwargs: Any) -> tuple[Recipe, torch.nn.Module, torch.optim.Optimizer, int]:
    """The recipe as `finetune run` trains it (adapter.init_from's shape, `auto` keys resolved by the planner
    with `plan_kwargs`), its model with adapter and memory settings in training mode, its optimizer and the
    vocabulary size: what measuring a real step needs (measure, benchmarks). `scratch`: the folder whose
    offload/ holds expert offload files when memory.offload_dir is unset (default output.dir); they go with
    `weight_store_of(model).close()`, or when the process exits."""
    from finetune.model.adapter import apply_adapter
    from finetune.model.kernels import apply_kernels
    from finetune.model.load import load_model
    from finetune.optim import build_optimizer
    from finetune.recipe.init_from import resolve_init_from

    recipe = resolve_init_from(recipe)
    if auto_keys(recipe):
        from finetune.plan import predict

        recipe = predict(recipe, **plan_kwargs).apply(recipe).recipe
    model, _tokenizer, _path = load_model(recipe.model, recipe.quantization, packing=recipe.data.packing)
    vocab = model.config.get_text_config().vocab_size
    checkpointing = bool(recipe.memory.activation_checkpointing)
    model = apply_adapter(model, recipe.adapter, checkpointing=checkpointing,
                          reference=loads_reference_adapter(recipe))
    apply_memory_config(model, recipe.memory, scratch if scratch is not None else recipe.output.dir)
    apply_kernels(model, recipe.memory.kernels)
    compile_layers(model, recipe.training.compile)
    enable_checkpointing(model, checkpointing, recipe.memory.checkpoint_every_n_layers)
    model.train()
    optimizer = build_optimizer(model, recipe.optimizer, recipe.training.learning_rate,
                                steps_per_update=recipe.training.gradient_accumulation_steps,
                                max_grad_norm=recipe.training.max_grad_norm)
    return recipe, model, optimizer, vocab


def measure(recipe: Recipe, steps: int = 2) -> dict[str, Any]:
    """Run `steps` optimizer steps at the recipe's micro-batch and the row length its plan prices (the data's
    longest example, at most max_seq_len: `finetune.plan.search.planned_sequence`); return the tracker result
    (with training.precompute_reference, the reference pass over one micro-batch first, as a run does, its
    tracked peak as `reference_pass_bytes`).

    `auto` settings are resolved by the planner first.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="finetune-measure-") as scratch:
        from finetune.memory.offload import activation_offload

        recipe, model, optimizer, vocab = step_setup(recipe, scratch)
        gen = torch.Generator().manual_seed(recipe.training.seed)
        preference = PreferenceLoss.of(recipe.training, fused=recipe.memory.kernels == "liger")
        rows = recipe.training.micro_batch_size * (preference.rows_per_example if preference is not None else 1)
        batch = synthetic_batch(preference, recipe.training.micro_batch_size, planned_sequence(recipe), vocab, device,
                                gen, layout=batch_layout(rows, recipe.data.packing))

        offload = activation_offload(model, recipe.memory, scratch)  # files under offload_dir or scratch

        accumulation = recipe.training.gradient_accumulation_steps
        autocast = autocast_for(mixed_precision(recipe.model.dtype, device == "cuda"))

        passes: list[int] = []

        def run(tracker: MemoryTracker) -> None:
            if preference is not None and preference.reference_precomputed:
                with tracker.window("reference_pass"), autocast():  # the pass before training, as `run` does
                    batch_reference_logps(model, batch, bool(recipe.memory.chunked_loss)
                                          or recipe.memory.kernels == "liger",
                                          current=reference_is_current(recipe))
                passes.append(tracker.windows["reference_pass"][0])
            for _ in range(steps):
                training_step(model, [batch] * accumulation, optimizer, max_grad_norm=recipe.training.max_grad_norm,
                              chunked_loss=bool(recipe.memory.chunked_loss), autocast=autocast, offload=offload,
                              tracker=tracker, preference=preference)

        try:
            result = measure_step(run, model=model, optimizer=optimizer, vocab_size=vocab, device=device)
        finally:
            if offload is not None:
                offload.close()  # the disk tier's threads and files go before the scratch folder does
            if weight_store_of(model) is not None:
                weight_store_of(model).close()  # and the weight store's (expert offload's or weight streaming's)
    result["steps"] = steps
    if passes:  # the tracked peak of the pass, next to the plan's reference_pass_bytes
        result["reference_pass_bytes"] = passes[0]
    result["settings"] = read_settings(recipe)
    return result

