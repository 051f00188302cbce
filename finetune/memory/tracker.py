"""A deterministic tensor-level memory tracker that splits the peak into categories.

Why: on CPU there is no allocator statistic for torch tensors (tracemalloc does not see them), and torch's
own `MemTracker` fails when some parameters are frozen (LoRA). A `TorchDispatchMode` sees every tensor an
operator returns; counting live *storages* (views share one) by identity, with a weakref callback for the
free, gives an exact, reproducible peak. On CUDA the allocator's own peak is reported as the total and the
tracker supplies the split.

Categories: weights (frozen), trainable_weights, gradients, optimizer_state, activations (anything
allocated while tracking that is not one of the others), logits_and_loss (tensors of at most 3
dimensions whose last is the vocabulary), other (tensors allocated inside the optimizer step that are not its state).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any

import torch

from finetune.compat import TorchDispatchMode, tree_flatten

CATEGORIES = (
    "weights", "trainable_weights", "gradients", "optimizer_state", "activations", "logits_and_loss", "other",
)


def _quant_state_tensors(module: torch.nn.Module) -> Iterable[torch.Tensor]:
    """bitsandbytes Linear4bit keeps absmax / code (and the nested ones of double quant) outside parameters."""
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    while state is not None:
        for name in ("absmax", "code", "offset"):
            value = getattr(state, name, None)
            if isinstance(value, torch.Tensor):
                yield value
        state = getattr(state, "state2", None)


class MemoryTracker(TorchDispatchMode):
    """Count live tensor storages while active; remember the peak and its breakdown.

    Use as a context manager around training steps, after `register_model` (and `register_optimizer`)::

        tracker = MemoryTracker(vocab_size=config.vocab_size)
        tracker.register_model(model); tracker.register_optimizer(opt)
        with tracker:
            loss = model(**batch).loss; loss.backward()
            with tracker.optimizer_step(): opt.step()
            opt.zero_grad()
        tracker.result()
    """

    def __init__(self, vocab_size: int | None = None, device: str | torch.device | None = None,
                 host_values: bool = False):
        super().__init__()
        self.vocab_size = vocab_size
        self.device = torch.device(device) if device is not None else None
        # A planner trace on meta whose forward reads some values (a vision-language model's pixels and index
        # tensors, kept on the CPU): what it computes on the CPU stands for device tensors of the real run and
        # counts too; their meta copies (`as_stand_in`) are those same tensors and do not.
        self._host = host_values
        self._meta = self.device is not None and self.device.type == "meta"
        self._live: dict[int, list] = {}  # storage id -> [nbytes, category, seq]
        self._refs: dict[int, weakref.ref] = {}
        self._totals = dict.fromkeys(CATEGORIES, 0)
        self._seq = 0
        self._phase = "activations"
        self.current = 0
        self.peak = 0
        self.peak_breakdown = dict(self._totals)
        self._peak_seq = 0
        self._hooks: list[Any] = []
        self._window: str | None = None
        self.windows: dict[str, tuple[int, dict[str, int]]] = {}

    # -- bookkeeping -------------------------------------------------------------------------------------
    def _on_device(self, t: torch.Tensor) -> bool:
        if t.is_meta:  # only a planner trace on `meta` counts them; offload's meta placeholders hold nothing
            return self._meta
        return self.device is None or t.device.type == self.device.type or self._host

    @contextmanager
    def as_stand_in(self):
        """Meta copies made inside are of host values already counted (`host_values`): not counted again."""
        meta, self._meta = self._meta, False
        try:
            yield
        finally:
            self._meta = meta

    def _add(self, storage: torch.UntypedStorage, category: str) -> None:
        key = id(storage)
        nbytes = storage.nbytes()
        entry = self._live.get(key)
        if entry is not None:
            if entry[0] != nbytes:  # a resize_ in place
                self._totals[entry[1]] += nbytes - entry[0]
                self.current += nbytes - entry[0]
                entry[0] = nbytes
                self._update_peak()
            return
        if nbytes == 0:
            return
        self._seq += 1
        self._live[key] = [nbytes, category, self._seq]
        self._refs[key] = weakref.ref(storage, lambda _r, key=key: self._free(key))
        self._totals[category] += nbytes
        self.current += nbytes
        self._update_peak()

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        self._refs.pop(key, None)
        if entry is not None:
            self._totals[entry[1]] -= entry[0]
            self.current -= entry[0]

    def _update_peak(self) -> None:
        if self._window is not None and self.current > self.windows[self._window][0]:
            self.windows[self._window] = (self.current, dict(self._totals))
        if self.current > self.peak:
            self.peak = self.current
            self.peak_breakdown = dict(self._totals)
            self._peak_seq = self._seq

    def reset_peak(self) -> None:
        """From now on the peak is the highest point after this call (what is live now counts)."""
        self.peak = self.current
        self.peak_breakdown = dict(self._totals)
        self._peak_seq = self._seq

    def tag(self, tensor: torch.Tensor, category: str) -> None:
        """Move a tensor's storage to `category` (also in the peak breakdown if it was live at the peak)."""
        if not isinstance(tensor, torch.Tensor) or not self._on_device(tensor):
            return
        storage = tensor.untyped_storage()
        entry = self._live.get(id(storage))
        if entry is None:
            self._add(storage, category)
            return
        old = entry[1]
        if old == category:
            return
        self._totals[old] -= entry[0]
        self._totals[category] += entry[0]
        if entry[2] <= self._peak_seq:  # alive now and allocated before the peak: it was part of the peak
            self.peak_breakdown[old] -= entry[0]
            self.peak_breakdown[category] += entry[0]
        entry[1] = category

    # -- registration ------------------------------------------------------------------------------------
    def register_model(self, model: torch.nn.Module) -> None:
        """Count parameters and buffers (frozen vs trainable, 4-bit quant states) and tag gradients."""
        for module in model.modules():
            for tensor in _quant_state_tensors(module):
                self.tag(tensor, "weights")
        for param in model.parameters():
            self.tag(param, "trainable_weights" if param.requires_grad else "weights")
            if param.requires_grad:
                self._hooks.append(param.register_post_accumulate_grad_hook(lambda p: self.tag(p.grad, "gradients")))
        for buffer in model.buffers():
            self.tag(buffer, "weights")

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Tag the optimizer's state tensors after every step (accelerate's wrapper: its inner optimizer)."""
        optimizer = getattr(optimizer, "optimizer", optimizer)
        self._hooks.append(optimizer.register_step_post_hook(lambda opt, _a, _k: self._tag_optimizer_state(opt)))
        self._tag_optimizer_state(optimizer)

    def _tag_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        flat, _ = tree_flatten([dict(s) for s in optimizer.state.values()])
        for value in flat:
            # GaLore/APOLLO keep their projection matrices inside projector objects
            inner = [value] if isinstance(value, torch.Tensor) else list(getattr(value, "__dict__", {}).values())
            for tensor in inner:
                if isinstance(tensor, torch.Tensor):
                    self.tag(tensor, "optimizer_state")

    def remove_hooks(self) -> None:
        """Detach the gradient and optimizer hooks (the model and optimizer outlive the tracker)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def switch_window(self, name: str) -> None:
        """From now on, record the peak (and its breakdown) under `name` as well."""
        self._window = name
        if name not in self.windows or self.current > self.windows[name][0]:
            self.windows[name] = (self.current, dict(self._totals))

    @contextmanager
    def window(self, name: str):
        """Also record the peak (and its breakdown) reached inside this named phase, e.g. 'backward'."""
        previous = self._window
        self.switch_window(name)
        try:
            yield
        finally:
            self._window = previous

    @contextmanager
    def optimizer_step(self):
        """Tensors allocated inside count as `other` until the step hook tags the state among them."""
        previous, self._phase = self._phase, "other"
        try:
            yield
        finally:
            self._phase = previous

    # -- dispatch ----------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Every operator of a tracked step passes here (tens of thousands a step): kept to the fewest Python calls.
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):  # most operators: no tree to flatten
            self._seen(out)
        else:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._seen(t)
        return out

    def _seen(self, t: torch.Tensor) -> None:
        """Count an operator's output: a new storage, or a live one resized in place (a view of a live one:
        nothing to do)."""
        if t.is_sparse or not self._on_device(t):
            return
        storage = t.untyped_storage()
        entry = self._live.get(id(storage))
        if entry is not None and entry[0] == storage.nbytes():
            return
        category = self._phase
        # logits are [tokens, vocab] or [rows, tokens, vocab]; a 4-D attention mask [rows, 1, s, s] whose s
        # equals the vocabulary size is not
        if category == "activations" and self.vocab_size is not None and 0 < t.dim() <= 3 \
                and t.shape[-1] == self.vocab_size:
            category = "logits_and_loss"
        self._add(storage, category)

    def result(self) -> dict[str, Any]:
        """`{"device", "peak_bytes", "breakdown"}` of everything seen so far (CUDA: allocator totals too)."""
        device = self.device.type if self.device is not None else "cpu"
        out: dict[str, Any] = {"device": device, "peak_bytes": int(self.peak),
                               "breakdown": {k: int(v) for k, v in self.peak_breakdown.items()}}
        if device == "cuda" and torch.cuda.is_available():
            out["tracked_peak_bytes"] = out["peak_bytes"]
            out["peak_bytes"] = int(torch.cuda.max_memory_allocated())
            out["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
        return out


def measure_step(fn: Callable[[MemoryTracker], Any], *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, vocab_size: int | None = None,
                 device: str | torch.device | None = None) -> dict[str, Any]:
    """Run `fn(tracker)` under a fresh tracker and return its peak and breakdown."""
    tracker = MemoryTracker(vocab_size=vocab_size, device=device)
    if model is not None:
        tracker.register_model(model)
    if optimizer is not None:
        tracker.register_optimizer(optimizer)
    if tracker.device is not None and tracker.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        with tracker:
            fn(tracker)
    finally:
        tracker.remove_hooks()
    return tracker.result()
