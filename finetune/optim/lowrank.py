"""GaLore and APOLLO as one AdamW, built on the projector classes of galore-torch and apollo-torch.

The update math is the upstream `galore_torch.GaLoreAdamW` / `apollo_torch.APOLLOAdamW` step, line for line
(tests/test_optim_lowrank.py checks bit-equality with both). We own the step so that layer-wise training can
feed it a gradient that was accumulated in projected form (`accumulate`), which the upstream step cannot
take, and to keep less state than upstream: APOLLO's random projection is regenerated from its seed at each
step instead of being stored (the APOLLO paper's point: it costs a randn, not rank x width memory), and
GaLore's projection owns its storage (upstream keeps a slice of the full SVD factor, so the whole
min(m,n) x n matrix stays alive for fp32 weights).

Param groups without a "method" key are plain AdamW with the same bias correction and decoupled decay as
upstream, so embeddings, norms and biases share the optimizer.
"""

from __future__ import annotations

import math

import torch

from finetune.optim.presets import projection_side


class LowRankAdamW(torch.optim.Optimizer):
    """AdamW whose groups with method="galore"/"apollo" keep their state in a rank-`rank` projection.

    Low-rank group keys: method, rank, update_proj_gap, scale, proj_type, scale_type (APOLLO).
    `seed_offset` numbers the parameters for APOLLO's random projections as upstream does (1, 2, ...), so
    one optimizer per parameter (layer-wise mode) can reproduce the seeds of one optimizer for all.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, seed_offset: int = 0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        index = seed_offset
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.requires_grad:
                    self.state[p]["seed"] = index

    def _projector(self, group: dict, state: dict):
        if "projector" not in state:
            # imported here: apollo_torch pulls in bitsandbytes (~1 s), which planning and the CLI never need
            from apollo_torch.random_projector import GradientProjector
            from galore_torch.galore_projector import GaLoreProjector

            if group["method"] == "apollo":
                state["projector"] = GradientProjector(
                    group["rank"], update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                    proj_type=group["proj_type"], seed=state["seed"])
            else:
                state["projector"] = GaLoreProjector(
                    group["rank"], update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                    proj_type=group["proj_type"])
        return state["projector"]

    def _project(self, group: dict, state: dict, grad: torch.Tensor, refresh: bool) -> torch.Tensor:
        """Project with the current matrix; `refresh` lets upstream renew it when the step is due."""
        projector = self._projector(group, state)
        if group["method"] == "apollo" and projector.ortho_matrix is None and "proj_seed" in state:
            side = projection_side(tuple(grad.shape), group["proj_type"])
            projector.ortho_matrix = projector.get_orthogonal_matrix(grad, group["rank"], side, state["proj_seed"])
        if refresh:
            before, seed = projector.ortho_matrix, getattr(projector, "seed", None)
            low = projector.project(grad, state.setdefault("step", 0))
            if projector.ortho_matrix is not before:
                projector.ortho_matrix = _owning(projector.ortho_matrix)
                if seed is not None:
                    state["proj_seed"] = seed  # the seed this matrix was drawn with
            return low
        gap = projector.update_proj_gap
        projector.update_proj_gap = math.inf  # 1 % inf != 0: upstream keeps the matrix it has
        try:
            return projector.project(grad, 1)
        finally:
            projector.update_proj_gap = gap

    @torch.no_grad()
    def accumulate(self, p: torch.Tensor) -> None:
        """Add p.grad, projected, to the parameter's low-rank accumulator and free p.grad (GaLore only).

        The first call of a step may renew the projection (every update_proj_gap steps) from this
        micro-batch's gradient; later calls reuse it. `step` then updates from the accumulated projection.
        """
        group = self._group_of(p)
        if group.get("method") != "galore":
            raise ValueError("accumulate() is for GaLore-projected parameters only")
        state = self.state[p]
        first = "grad_acc" not in state
        low = self._project(group, state, p.grad, refresh=first).float()
        if first:
            state["grad_acc"] = low
        else:
            state["grad_acc"].add_(low)
        p.grad = None

    def _group_of(self, p: torch.Tensor) -> dict:
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))

    def scale_accumulated_(self, factor: float) -> None:
        """Multiply every pending projected accumulator by `factor` (gradient clipping)."""
        for state in self.state.values():
            if "grad_acc" in state:
                state["grad_acc"].mul_(factor)

    def accumulated_norms(self) -> list[torch.Tensor]:
        """Norms of the pending projected accumulators."""
        return [torch.linalg.vector_norm(s["grad_acc"]) for s in self.state.values() if "grad_acc" in s]

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, and also move GaLore projections (inside projector objects, which torch does not
        visit) to their parameter's device: a resume loads the train state with map_location="cpu"."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            projector = state.get("projector")
            if projector is not None and projector.ortho_matrix is not None:
                projector.ortho_matrix = projector.ortho_matrix.to(p.device)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "grad_acc" in state:
                    low = state.pop("grad_acc").to(p.dtype)
                elif p.grad is not None:
                    low = None
                else:
                    continue
                self._update(p, group, state, low)
        return loss

    def _update(self, p: torch.Tensor, group: dict, state: dict, low: torch.Tensor | None) -> None:
        method = group.get("method")
        state.setdefault("step", 0)
        if method is not None and low is None:
            low = self._project(group, state, p.grad, refresh=True)
        grad = low if method is not None else p.grad
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(grad)
            state["exp_avg_sq"] = torch.zeros_like(grad)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        beta1, beta2 = group["betas"]
        state["step"] += 1
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = exp_avg_sq.sqrt().add_(group["eps"])
        step_size = group["lr"] * math.sqrt(1.0 - beta2 ** state["step"]) / (1.0 - beta1 ** state["step"])
        norm_grad = exp_avg / denom
        if method == "galore":
            norm_grad = state["projector"].project_back(norm_grad)
        elif method == "apollo":
            norm_grad = _apollo_scaled(p.grad, grad, norm_grad, group, state)
            state["projector"].ortho_matrix = None  # regenerated from proj_seed next step
        p.add_(norm_grad, alpha=-step_size)
        if group["weight_decay"] > 0.0:
            p.add_(p, alpha=-group["lr"] * group["weight_decay"])


def _apollo_scaled(full: torch.Tensor, low: torch.Tensor, norm_low: torch.Tensor, group: dict,
                   state: dict) -> torch.Tensor:
    """APOLLO steps 3-4: scale the full gradient by the low-rank Adam ratio, with Fira's norm limiter."""
    if group["scale_type"] == "channel":
        dim = 0 if full.shape[0] < full.shape[1] else 1
        factor = torch.norm(norm_low, dim=dim) / (torch.norm(low, dim=dim) + 1e-8)
        if dim == 1:
            factor = factor.unsqueeze(1)
    else:
        factor = torch.norm(norm_low) / (torch.norm(low) + 1e-8)
    scaled = full * factor
    scaled_norm = torch.norm(scaled)
    if "scaled_grad" in state:
        limiter = max(scaled_norm / (state["scaled_grad"] + 1e-8), 1.01) / 1.01
        scaled = scaled / limiter
        state["scaled_grad"] = scaled_norm / limiter
    else:
        state["scaled_grad"] = scaled_norm
    return scaled * math.sqrt(group["scale"])


def _owning(matrix):
    """A copy that owns exactly its elements when `matrix` is a view into a larger SVD factor."""
    if isinstance(matrix, list):
        return [_owning(m) for m in matrix]
    if matrix.untyped_storage().nbytes() != matrix.numel() * matrix.element_size():
        return matrix.clone(memory_format=torch.contiguous_format)
    return matrix
