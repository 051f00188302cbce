"""Record the measured peak memory of a Trainer run in its logs (and so in metrics.jsonl).

On CPU the tensor tracker runs for the whole training (deterministic, with the breakdown); on CUDA the
allocator's own peak is read, which costs nothing. Every log gets `peak_memory_bytes`; the first log after
the peak exceeds the plan's prediction by more than `tolerance` also gets a warning line.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import TrainerCallback

from finetune.memory.tracker import MemoryTracker

logger = logging.getLogger(__name__)


class PeakMemoryCallback(TrainerCallback):
    """Add `peak_memory_bytes` (and on CPU `peak_memory_breakdown`) to every Trainer log."""

    def __init__(self, predicted_peak_bytes: int | None = None, tolerance: float = 0.05):
        self.predicted = predicted_peak_bytes
        self.tolerance = tolerance
        self.tracker: MemoryTracker | None = None
        self.warned = False
        self.closed = False

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            return
        vocab = model.config.get_text_config().vocab_size if model is not None else None
        self.tracker = MemoryTracker(vocab_size=vocab)
        self.closed = False
        self.tracker.register_model(model)
        if optimizer is not None:
            self.tracker.register_optimizer(optimizer)
        self.tracker.__enter__()

    def restart(self, predicted_peak_bytes: int | None) -> None:
        """After an OOM recovery: measure the peak afresh (not the failed attempt's) against the new plan."""
        self.predicted, self.warned = predicted_peak_bytes, False
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        elif self.tracker is not None:
            self.tracker.reset_peak()

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Leave the tracker's dispatch mode. The Trainer calls on_train_end only when training ends normally,
        so the run also calls this after an error: a mode left active would track every later tensor op of
        the process (the UI's, the next run's)."""
        if self.tracker is not None and not self.closed:
            self.tracker.__exit__(None, None, None)
            self.tracker.remove_hooks()
        self.closed = True

    def peak(self) -> dict[str, Any]:
        if self.tracker is not None:
            return self.tracker.result()
        return {"device": "cuda", "peak_bytes": int(torch.cuda.max_memory_allocated()),
                "peak_reserved_bytes": int(torch.cuda.max_memory_reserved())}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        result = self.peak()
        logs["peak_memory_bytes"] = result["peak_bytes"]
        if "breakdown" in result:
            logs["peak_memory_breakdown"] = result["breakdown"]
        if self.predicted and not self.warned and result["peak_bytes"] > self.predicted * (1 + self.tolerance):
            self.warned = True
            logs["memory_warning"] = (f"measured peak {result['peak_bytes']:,} B is more than "
                                      f"{self.tolerance:.0%} above the plan's {self.predicted:,} B")
            logger.warning(logs["memory_warning"])
