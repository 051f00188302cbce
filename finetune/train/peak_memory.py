"""Record the measured peak memory of a run in its training log rows (and so in metrics.jsonl): a policy.

On CUDA the allocator's own peak is read, at no cost; on CPU the tensor tracker (which sees every
operator through Python) tracks only the steps that can set a new peak.

More in docs/planner.md, "The measured peak (finetune/train/peak_memory.py)".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from finetune.memory.tracker import MemoryTracker
from finetune.train.policy import Part, Policy, Step

logger = logging.getLogger(__name__)

MODES = ("peaks", "every_step", "off")
MODE_VARIABLE = "FINETUNE_MEMORY_TRACKER"
FIRST_STEPS = 2  # step 1 creates the optimizer state, step 2 is the first to hold it from its start


class Signature(NamedTuple):
    """What one step's memory grows with, read off its loader batches (`step_signature`)."""

    micro_batches: int
    rows: int  # the most rows of a micro-batch
    longest: int  # the longest row
    padded: bool  # an attention_mask with a zero: transformers builds a 4-D mask (SDPA skips an all-ones one)
    pixels: int  # the most image input elements (pixel_values) of a micro-batch: what the vision tower runs on
    step_pixels: int  # the step's own: its micro-batches are all collated before the first runs


def step_signature(batches: Sequence[Mapping[str, Any]]) -> Signature:
    """The signature of one step's loader batches. Images count apart from the token shape: two image rows
    and one image row beside a text row are batches of the same shape, the first far heavier."""
    shapes = [next((v.shape for v in b.values() if isinstance(v, torch.Tensor) and v.dim() == 2), (0, 0))
              for b in batches]
    masks = [b.get("attention_mask") for b in batches]
    padded = any(isinstance(m, torch.Tensor) and not bool(m.all()) for m in masks)
    pixels = [v.numel() if isinstance(v := b.get("pixel_values"), torch.Tensor) else 0 for b in batches]
    return Signature(len(batches), max((s[0] for s in shapes), default=0), max((s[1] for s in shapes), default=0),
                     padded, max(pixels, default=0), sum(pixels))


def covers(tracked: Signature, step: Signature) -> bool:
    """Whether a tracked step's signature bounds `step`'s: as many micro-batches, none with more rows, longer
    rows or more pixels, padded if it is."""
    return tracked.micro_batches == step.micro_batches and all(
        t >= s for t, s in zip(tracked[1:], step[1:], strict=True))


class PeakMemory(Policy):
    """Add `peak_memory_bytes` (and on CPU `peak_memory_breakdown`) to every training log row.

    `mode` (CPU): `peaks` tracks the steps that can set a new peak (module docstring), `every_step` all of
    training, `off` none; default: $FINETUNE_MEMORY_TRACKER, else `peaks`."""

    def __init__(self, predicted_peak_bytes: int | None = None, tolerance: float = 0.05, mode: str | None = None):
        self.predicted = predicted_peak_bytes
        self.tolerance = tolerance
        self.mode = mode or os.environ.get(MODE_VARIABLE) or "peaks"
        if self.mode not in MODES:
            raise ValueError(f"{MODE_VARIABLE}={self.mode!r}: expected one of {', '.join(MODES)}")
        self.tracker: MemoryTracker | None = None
        self.warned = False
        self.closed = False
        self.active = False  # the tracker's dispatch mode is entered
        self.track_step = True  # the current step can set a new peak
        self._aside = False  # the tracker stands aside for the rest of this step (micro_batch)
        self.tracked: list[Signature] = []  # signatures of the steps tracked since the last restart
        self.tracked_steps: list[int] = []  # global steps (0-based) tracked, for tests and benchmarks
        self._first = FIRST_STEPS  # steps still to track whatever their batches

    def on_train_begin(self, loop) -> None:
        self.begin(loop.accelerator.unwrap_model(loop.model), loop.optimizer)

    def begin(self, model: torch.nn.Module | None, optimizer: Any = None) -> None:
        """Start measuring: CUDA's peak from here, or the CPU tracker on `model` and `optimizer`."""
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            return
        if self.mode == "off":
            return
        vocab = model.config.get_text_config().vocab_size if model is not None else None
        self.tracker = MemoryTracker(vocab_size=vocab)
        self.closed = False
        self.tracker.register_model(model)
        if optimizer is not None:
            self.tracker.register_optimizer(getattr(optimizer, "optimizer", optimizer))
        self._enter()

    def plan_updates(self, loop, step: Step, updates: list) -> list:
        """Decide before anything of the step runs (a GRPO policy after this one generates in its
        plan_updates) whether it is tracked; if not, the tracker stands aside until the step's end."""
        self.step_begins(step.collated, loop.state.step)
        if not self.track_step and self.active:
            self._stand_aside()
        return updates

    def step_begins(self, batches: Sequence[Mapping[str, Any]], completed: int) -> None:
        """A step of these loader batches begins (`completed` steps before it): track it if it can set a new
        peak."""
        if self.tracker is None or self.mode != "peaks":
            return
        signature = step_signature(batches)
        self.track_step = self._first > 0 or not any(covers(t, signature) for t in self.tracked)
        if self.track_step:
            self._first -= 1
            self.tracked.append(signature)
            self.tracked_steps.append(completed)

    def around_micro_batch(self, loop, part: Part, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        return self.micro_batch(run)

    def micro_batch(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run one micro-batch's forward and backward (`run`, which returns its loss). In a step that cannot set
        a new peak the tracker stands aside from here to the step's end (the optimizer update included: on CPU
        it runs a dozen operators per trained tensor); it still tags the gradients, and the loss, which the
        loop keeps into the next step, is tagged here (the gradient norm in `keep`)."""
        if not self._aside:
            if self.track_step or not self.active:
                return run()
            self._stand_aside()
        loss = run()
        self.keep(loss)
        return loss

    def keep(self, tensor: Any) -> None:
        """Count `tensor`, made while the tracker stood aside, which the loop keeps into the next step (a
        step's loss, its gradient norm), as a run tracked throughout counts it."""
        if self._aside and isinstance(tensor, torch.Tensor):
            self.tracker.tag(tensor, "activations")

    def after_update(self, loop, update, grad_norm) -> None:
        self.keep(grad_norm)

    def on_step_end(self, loop=None, step=None) -> None:
        self._back()

    def _stand_aside(self) -> None:
        self._exit()
        self._aside = True

    def _back(self) -> None:
        if self._aside:
            self._aside = False
            self._enter()

    def _enter(self) -> None:
        if self.tracker is not None and not self.active and not self.closed:
            self.tracker.__enter__()
            self.active = True

    def _exit(self) -> None:
        if self.active:
            self.tracker.__exit__(None, None, None)
            self.active = False

    def restart(self, predicted_peak_bytes: int | None) -> None:
        """After an OOM recovery: measure the peak afresh (not the failed attempt's) against the new plan,
        tracking the step being redone and the steps after it as at the start."""
        self.predicted, self.warned = predicted_peak_bytes, False
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        elif self.tracker is not None:
            self.tracker.reset_peak()
            self.tracked, self._first, self.track_step = [], FIRST_STEPS, True
            self._back()  # the step being redone is tracked

    def on_train_end(self, loop=None) -> None:
        self.close()

    def close(self) -> None:
        """Leave the tracker's dispatch mode (the loop calls on_train_end after an error too): a mode left
        active would track every later tensor op of the process (the UI's, the next run's)."""
        if self.tracker is not None and not self.closed:
            self._exit()
            self.tracker.remove_hooks()
        self.closed, self._aside = True, False

    def peak(self) -> dict[str, Any] | None:
        """The peak so far (None on CPU with mode `off`)."""
        if self.tracker is not None:
            return self.tracker.result()
        if not torch.cuda.is_available():
            return None
        return {"device": "cuda", "peak_bytes": int(torch.cuda.max_memory_allocated()),
                "peak_reserved_bytes": int(torch.cuda.max_memory_reserved())}

    def log(self, loop, row: dict) -> None:
        if "loss" in row:
            self.add_peak(row)

    def add_peak(self, logs: dict) -> None:
        """`peak_memory_bytes` (and the breakdown, and a warning the first time it exceeds the plan) into
        `logs`."""
        result = self.peak()
        if result is None:
            return
        logs["peak_memory_bytes"] = result["peak_bytes"]
        if "breakdown" in result:
            logs["peak_memory_breakdown"] = result["breakdown"]
        if self.predicted and not self.warned and result["peak_bytes"] > self.predicted * (1 + self.tolerance):
            self.warned = True
            logs["memory_warning"] = (f"measured peak {result['peak_bytes']:,} B is more than "
                                      f"{self.tolerance:.0%} above the plan's {self.predicted:,} B")
            logger.warning(logs["memory_warning"])
