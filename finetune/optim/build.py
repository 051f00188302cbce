"""Build the optimizer named in the recipe for the trainable parameters of a model.

Every name gets the optimizer its registry spec's factory makes (finetune/recipe/optimizers.py), with param
groups: weights given the optimizer's own update (APOLLO/GaLore projection, Muon), other matrices (with
weight decay) and 1-D parameters (biases, norms: no decay). `layerwise: true` wraps one such optimizer per
parameter in a `LayerwiseOptimizer` (finetune/optim/layerwise.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from finetune.errors import FinetuneError
from finetune.optim.presets import ParamPlan, ParamSpec, plan_params
from finetune.recipe.optimizers import optimizer_spec
from finetune.recipe.reference import resolve
from finetune.recipe.schema import OptimizerConfig


def trained_specs(model: torch.nn.Module) -> tuple[list[ParamSpec], dict[str, torch.nn.Parameter]]:
    """(name, shape, dtype) of each parameter with requires_grad, in model order, and name -> parameter."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise FinetuneError("the model has no trainable parameters; nothing for the optimizer to update")
    return [(n, tuple(p.shape), p.dtype) for n, p in params.items()], params


def param_groups(plan: ParamPlan, params: dict[str, torch.nn.Parameter], opt: OptimizerConfig) -> list[dict]:
    """Groups in a fixed order (own, decayed, undecayed); empty groups are left out.

    The own group carries "method": the low-rank method with its settings, else the optimizer's name."""
    groups = []
    if plan.own:
        group = {"params": [params[s[0]] for s in plan.own], "weight_decay": opt.weight_decay, "method": opt.name}
        low_rank = plan.low_rank
        if low_rank:
            group.update(method=low_rank.method, rank=low_rank.rank, update_proj_gap=low_rank.update_proj_gap,
                         scale=low_rank.scale, proj_type=low_rank.proj_type, scale_type=low_rank.scale_type)
        groups.append(group)
    if plan.decayed:
        groups.append({"params": [params[s[0]] for s in plan.decayed], "weight_decay": opt.weight_decay})
    if plan.undecayed:
        groups.append({"params": [params[s[0]] for s in plan.undecayed], "weight_decay": 0.0})
    return groups


def optimizer_factory(opt: OptimizerConfig, learning_rate: float) -> Callable[..., torch.optim.Optimizer]:
    """A function (groups, seed_offset=0) -> optimizer for `opt.name`, made by its registry spec's factory."""
    return resolve(optimizer_spec(opt.name).factory)(opt, learning_rate)


def build_optimizer(model: torch.nn.Module, opt: OptimizerConfig, learning_rate: float, *,
                    steps_per_update: int = 1, max_grad_norm: float | None = None) -> torch.optim.Optimizer:
    """The optimizer for `model`'s trainable parameters (LoRA adapters or all weights).

    `steps_per_update` (gradient accumulation) and `max_grad_norm` only matter with `opt.layerwise`, where
    the returned LayerwiseOptimizer updates weights from backward hooks and clips by itself.
    """
    specs, params = trained_specs(model)
    plan = plan_params(opt.name, specs, opt)
    cuda_only = optimizer_spec(opt.name).cuda_only
    if cuda_only and any(not p.is_cuda for p in params.values()):
        raise FinetuneError(f"optimizer {opt.name} needs a CUDA GPU: {cuda_only}")
    factory = optimizer_factory(opt, learning_rate)
    groups = param_groups(plan, params, opt)
    if opt.layerwise:
        from finetune.optim.layerwise import LayerwiseOptimizer

        return LayerwiseOptimizer(groups, factory, steps_per_update=steps_per_update, max_grad_norm=max_grad_norm)
    return factory(groups)


def register_safe_globals() -> None:
    """Let torch.load(weights_only=True) (as a resume loads the train state) read GaLore/APOLLO optimizer state."""
    from apollo_torch.random_projector import GradientProjector
    from apollo_torch.svd_projector import GaLoreProjector as ApolloSVDProjector
    from galore_torch.galore_projector import GaLoreProjector

    torch.serialization.add_safe_globals([GradientProjector, ApolloSVDProjector, GaLoreProjector])
