"""The training step: one micro-batch forward + backward, and one optimizer update.

Why one module: `finetune run` (the training loop, finetune/train/loop.py, calls it), `finetune measure` and the
planner's trace on the `meta` device all call `forward_backward`, so "the plan traces the real step" holds by
construction. `optimizer_update` is the loop's update (clip or measure the gradient norm,
optimizer step, scheduler step, zero_grad) for the callers that drive their own loop (measure, tests); the
planner prices the update by formula (see plan/memory_model.py) and traces no optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from finetune.memory.chunked_loss import AUX_LOSS, add_metric, causal_lm_loss
from finetune.memory.tracker import MemoryTracker
from finetune.model.family import vision_parts
from finetune.model.moe import aux_loss_coef
from finetune.model.vision import inputs_require_grad
from finetune.optim import layerwise_of
from finetune.step.preference import Metrics, PreferenceLoss, preference_loss
from finetune.units import dtype_name, torch_dtype

_NULL = contextlib.nullcontext


def enable_checkpointing(model: torch.nn.Module, enabled: bool, every_n: int) -> None:
    """Non-reentrant checkpointing of one decoder layer in every `every_n` (what TrainingArguments asks for)."""
    if enabled:
        model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=every_n)
        if vision_parts(model):  # transformers hooked its vision tower too: see inputs_require_grad
            inputs_require_grad(model)
    model.config.use_cache = False


def mixed_precision(dtype: str, cuda: bool) -> str | None:
    """bf16 / fp16 autocast the run uses for model.dtype `dtype` (auto: bf16 where supported); None on CPU."""
    if not cuda:
        return None
    bf16 = torch.cuda.is_bf16_supported()
    name = dtype_name(dtype, "cuda", bf16)
    return name if name == "fp16" or (name == "bf16" and bf16) else None


def autocast_for(precision: str | None) -> Callable[[], contextlib.AbstractContextManager]:
    """The autocast context of mixed precision `precision` (accelerate's, without an Accelerator)."""
    if precision is None:
        return _NULL
    dtype = torch_dtype(precision)
    return lambda: torch.autocast("cuda", dtype=dtype)


def compute_loss(model: torch.nn.Module, inputs: Mapping[str, Any], num_items_in_batch: Any = None,
                 chunked_loss: bool = False, preference: PreferenceLoss | None = None,
                 metrics: Metrics | None = None) -> torch.Tensor:
    """The loss of one micro-batch: the model's causal-LM loss, or chunked so full logits never exist, or the
    preference loss (`finetune.step.preference`; its rewards and margins are added to `metrics`). A
    mixture-of-experts model with a load-balancing loss (router_aux_loss_coef) adds it, as its forward does with
    output_router_logits, and logs it as `aux_loss` in `metrics`.

    num_items_in_batch: labelled tokens of the whole accumulated batch (the loss is then a sum over this
    micro-batch divided by it, as the loop passes it), or None for a per-micro-batch mean.
    """
    if preference is not None:
        return preference_loss(model, inputs, preference, chunked_loss, metrics)
    router = aux_loss_coef(model) is not None  # a MoE router's load-balancing loss is part of the objective
    if chunked_loss:
        return causal_lm_loss(model, inputs, num_items_in_batch, metrics=metrics)
    if num_items_in_batch is not None:
        inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
    if not router:
        return model(**inputs).loss
    out = model(**inputs, output_router_logits=True)  # the model adds router_aux_loss_coef x aux_loss
    add_metric(metrics, AUX_LOSS, out.aux_loss)
    return out.loss


def _window(tracker: MemoryTracker | None, name: str) -> contextlib.AbstractContextManager:
    return tracker.window(name) if tracker is not None else _NULL()


def forward_backward(model: torch.nn.Module, inputs: Mapping[str, Any], *, accumulation: int = 1,
                     num_items_in_batch: Any = None, chunked_loss: bool = False,
                     autocast: Callable[[], contextlib.AbstractContextManager] = _NULL, offload: Any = None,
                     backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
                     tracker: MemoryTracker | None = None, backward_window: str = "backward",
                     preference: PreferenceLoss | None = None, metrics: Metrics | None = None) -> torch.Tensor:
    """One micro-batch of a training step, exactly as `finetune run` trains it; returns the detached loss.

    The loss is scaled for `accumulation` micro-batches the way the loop scales it: divided by
    `num_items_in_batch` when given (the model normalises the summed loss), else by `accumulation`.
    autocast: the mixed-precision context (the loop's accelerator.autocast); offload: an ActivationOffload
    entered around forward and backward; backward: the loop's accelerator.backward (fp16 loss scaling);
    tracker: record the forward and `backward_window` phases (measure, the planner's trace); preference: the
    DPO/ORPO/KTO loss instead of the causal-LM loss (its reference forward is part of the forward phase).
    """
    with offload if offload is not None else _NULL():
        with _window(tracker, "forward"):
            with autocast():
                loss = compute_loss(model, inputs, num_items_in_batch, chunked_loss, preference, metrics)
            if num_items_in_batch is None or preference is not None:
                loss = loss / accumulation
        with _window(tracker, backward_window):
            backward(loss)
    return loss.detach()


def grad_norm(model: torch.nn.Module, optimizer: Any, max_grad_norm: float | None) -> float | torch.Tensor:
    """Clip to `max_grad_norm` (None or 0: only measure) and return the norm before clipping.

    Layer-wise optimizers clip and measure inside the optimizer: the full gradient is never resident.
    """
    layerwise = layerwise_of(optimizer)
    if layerwise is not None:
        return layerwise.grad_norm()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf"))


def optimizer_update(model: torch.nn.Module, optimizer: Any, scheduler: Any = None,
                     max_grad_norm: float | None = None, tracker: MemoryTracker | None = None) -> float | torch.Tensor:
    """The update after the micro-batches of a step, in the loop's order: gradient norm (clipped when
    max_grad_norm is set), optimizer step, scheduler step, gradients freed. Returns the gradient norm."""
    norm = grad_norm(model, optimizer, max_grad_norm)
    with _window(tracker, "optimizer"), (tracker.optimizer_step() if tracker is not None else _NULL()):
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    model.zero_grad(set_to_none=True)
    return norm


def training_step(model: torch.nn.Module, micro_batches: list[Mapping[str, Any]], optimizer: Any = None, *,
                  scheduler: Any = None, max_grad_norm: float | None = None, **step: Any) -> list[torch.Tensor]:
    """One optimizer step over `micro_batches` (forward_backward each, then optimizer_update if an optimizer
    is given); `step`: forward_backward's keywords. Returns the micro-batch losses."""
    step.setdefault("accumulation", len(micro_batches))
    losses = [forward_backward(model, batch, **step) for batch in micro_batches]
    if optimizer is not None:
        optimizer_update(model, optimizer, scheduler, max_grad_norm, step.get("tracker"))
    return losses
