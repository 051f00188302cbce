"""Layer-wise updates: weights stepped from backward hooks so the model's gradients are never all resident.

One inner optimizer per parameter (same class and settings as the normal optimizer; APOLLO seeds numbered
as in the normal optimizer), driven by `Tensor.register_post_accumulate_grad_hook`. Two modes, chosen by
`steps_per_update` (gradient accumulation).

More in docs/architecture.md, "Layer-wise optimizer updates (finetune/optim/layerwise.py)".
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch

from finetune.optim.lowrank import LowRankAdamW

CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


class LayerwiseOptimizer(torch.optim.Optimizer):
    """An Optimizer facade over per-parameter optimizers updated from backward hooks.

    `param_groups` are the inner optimizers' own group dicts, so an LR scheduler built on this object
    drives them. `step()` finishes the optimizer step (see the module docstring); `zero_grad()` clears
    pending gradients. state_dict() holds each inner optimizer's state, in parameter order.
    """

    def __init__(self, groups: list[dict], factory: Callable[..., torch.optim.Optimizer], *,
                 steps_per_update: int = 1, max_grad_norm: float | None = None):
        if steps_per_update < 1:
            raise ValueError(f"steps_per_update must be >= 1, got {steps_per_update}")
        self.steps_per_update = steps_per_update
        self.max_grad_norm = max_grad_norm if max_grad_norm and max_grad_norm > 0 else None
        self.inner: dict[torch.Tensor, torch.optim.Optimizer] = {}
        index = 0
        for group in groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                self.inner[p] = factory([{"params": [p], **settings}], seed_offset=index)
                index += 1
        super().__init__([g for o in self.inner.values() for g in o.param_groups], {})
        self._norms: list[torch.Tensor] = []  # immediate mode: norms of the gradients applied this step
        self._fresh = False  # a backward hook ran since the last step()
        self._norm: float | None = None  # the last completed step's norm
        self._prev_norm: float | None = None  # immediate mode: the norm used to clip the current step
        # The hooks live on the parameters, and autograd does not show Python's garbage collector what a
        # tensor's hooks hold: a hook bound to this optimizer (which holds the parameters) would make a cycle
        # the collector cannot see, keeping the model, the loop and their memory alive after the run.
        # The hooks hold the optimizer weakly; once it is gone they do nothing.
        self._handles = [p.register_post_accumulate_grad_hook(_weak_hook(self)) for p in self.inner]

    def _compressed(self, p: torch.Tensor) -> bool:
        opt = self.inner[p]
        return isinstance(opt, LowRankAdamW) and opt.param_groups[0].get("method") == "galore"

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        self._fresh = True
        if self.steps_per_update > 1:
            if self._compressed(p):
                self.inner[p].accumulate(p)
            return
        self._norms.append(torch.linalg.vector_norm(p.grad))  # stays on the device: no sync per weight
        if self.max_grad_norm is not None and self._prev_norm is not None:
            p.grad.mul_(min(1.0, self.max_grad_norm / (self._prev_norm + CLIP_EPS)))
        self.inner[p].step()
        p.grad = None

    def _pending_norms(self) -> list[torch.Tensor]:
        norms = [torch.linalg.vector_norm(p.grad) for p in self.inner if p.grad is not None]
        for opt in self.inner.values():
            if isinstance(opt, LowRankAdamW):
                norms += opt.accumulated_norms()
        return norms

    def grad_norm(self) -> float:
        """Global gradient norm of the current step (pending or just applied) before clipping."""
        if not self._fresh:
            return self._norm or 0.0
        norms = self._norms if self.steps_per_update == 1 else self._pending_norms()
        return math.sqrt(sum(float(n) ** 2 for n in norms))  # per-weight norms combined, as clip_grad_norm_

    @torch.no_grad()
    def step(self, closure=None):
        """Finish the optimizer step: in accumulate mode clip and update every weight; record the norm."""
        loss = closure() if closure is not None else None
        norm = self.grad_norm()
        if self.steps_per_update > 1:
            factor = 1.0
            if self.max_grad_norm is not None:
                factor = min(1.0, self.max_grad_norm / (norm + CLIP_EPS))
            for p, opt in self.inner.items():
                if factor != 1.0:
                    if p.grad is not None:
                        p.grad.mul_(factor)
                    if isinstance(opt, LowRankAdamW):
                        opt.scale_accumulated_(factor)
                opt.step()
                p.grad = None
        self._norm, self._prev_norm, self._norms, self._fresh = norm, norm, [], False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.inner:
            p.grad = None

    def discard_pending(self) -> bool:
        """Forget the current step's gradients (an out-of-memory retry redoes the step). False when that
        cannot undo it: in immediate mode a hook that ran has already updated its weight."""
        if self.steps_per_update == 1 and self._fresh:
            return False
        self.zero_grad()
        for opt in self.inner.values():
            for state in opt.state.values():
                state.pop("grad_acc", None)  # GaLore's projected accumulators
        self._norms, self._fresh = [], False
        return True

    def remove_hooks(self) -> None:
        """Detach from the model (the optimizer stops updating in backward)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def state_dict(self) -> dict:
        return {"inner": [opt.state_dict() for opt in self.inner.values()], "prev_norm": self._prev_norm}

    def load_state_dict(self, state_dict: dict) -> None:
        inner = state_dict["inner"]
        if len(inner) != len(self.inner):
            raise ValueError(f"layer-wise optimizer state has {len(inner)} parameters, this model trains {len(self.inner)}")
        for opt, sd in zip(self.inner.values(), inner, strict=True):
            opt.load_state_dict(sd)
        self._prev_norm = state_dict["prev_norm"]
        self._norm = self._prev_norm


def _weak_hook(optimizer: LayerwiseOptimizer) -> Callable[[torch.Tensor], None]:
    ref = weakref.ref(optimizer)

    def hook(p: torch.Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner._hook(p)

    return hook


def layerwise_of(optimizer: object) -> LayerwiseOptimizer | None:
    """The LayerwiseOptimizer behind `optimizer` (unwrapping accelerate's AcceleratedOptimizer), else None."""
    while optimizer is not None and not isinstance(optimizer, LayerwiseOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer
