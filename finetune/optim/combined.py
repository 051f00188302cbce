"""Several torch optimizers over disjoint parameters, presented to the loop as one optimizer."""

from __future__ import annotations

import torch


class CombinedOptimizer(torch.optim.Optimizer):
    """Steps each part in turn. The parts share this object's param_groups and state, so an LR scheduler,
    zero_grad(), state_dict()/load_state_dict() and the state-size measurement see a single optimizer."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts
        super().__init__([g for part in parts for g in part.param_groups], {})
        self._share()

    def _share(self) -> None:
        """Point every part at this object's groups (in order) and state (keyed by parameter: no clashes)."""
        start = 0
        for part in self.parts:
            end = start + len(part.param_groups)
            part.param_groups, part.state = self.param_groups[start:end], self.state
            start = end

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # replaces this object's groups and state: share the new ones
        self._share()
