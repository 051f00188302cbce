"""Which trained weight gets which treatment, and the preset low-rank settings: from names and shapes only.

Works on `(name, shape, dtype)` triples so the planner can ask about a meta-device model and
`build_optimizer` about a real one, and both get the same answer.

More in docs/architecture.md, "Optimizer presets (finetune/optim/presets.py)".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetune.errors import FinetuneError
from finetune.recipe.optimizers import LowRankPreset, optimizer_spec
from finetune.recipe.reference import resolve
from finetune.recipe.schema import OptimizerConfig

ParamSpec = tuple[str, tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class LowRankSettings:
    """The resolved projection settings of one APOLLO/GaLore optimizer."""

    method: str  # "apollo" or "galore"
    rank: int
    update_proj_gap: int
    scale: float
    proj_type: str
    scale_type: str | None  # APOLLO only: "channel" or "tensor"


@dataclass(frozen=True)
class ParamPlan:
    """The trained parameters split by treatment, each list in model order."""

    own: list[ParamSpec]  # given the optimizer's own update: low-rank projection (APOLLO/GaLore), Muon, ...
    decayed: list[ParamSpec]  # other >= 2-D weights: plain AdamW (or the base optimizer) with decay
    undecayed: list[ParamSpec]  # 1-D (biases, norms): no weight decay
    low_rank: LowRankSettings | None


def _targeted(name: str, targets: str | list[str] | None) -> bool:
    module = name.rsplit(".", 1)[0]
    if targets is None or targets == "all-linear":
        return True
    targets = [targets] if isinstance(targets, str) else targets
    return any(t in module for t in targets)


def plan_params(name: str, specs: list[ParamSpec], opt: OptimizerConfig) -> ParamPlan:
    """Split trained parameters into own / decayed / undecayed and resolve the low-rank settings.

    `own` is what the registry spec selects: the targeted weights wider than the rank for a low-rank
    optimizer, the weights its `own_params` function picks otherwise (none for plain optimizers).

    Raises FinetuneError when a low-rank optimizer would save nothing (no targeted weight wider than the
    rank, e.g. GaLore rank >= LoRA r) or when target_modules matches no trained 2-D weight.
    """
    if name == "auto":
        raise FinetuneError("optimizer.name is auto: the planner must resolve it before the optimizer is built")
    spec = optimizer_spec(name)
    matrices = [s for s in specs if len(s[1]) >= 2]
    undecayed = [s for s in specs if len(s[1]) < 2]
    if spec.low_rank is None:
        picks = resolve(spec.own_params) if spec.own_params else None
        own = [s for s in matrices if picks and picks(s[0], s[1])]
        return ParamPlan(own, [s for s in matrices if s not in own], undecayed, None)
    targeted = [s for s in matrices if _targeted(s[0], opt.target_modules)]
    if not targeted:
        where = f"optimizer.target_modules={opt.target_modules!r}" if opt.target_modules else "the default targets"
        raise FinetuneError(
            f"optimizer {name}: {where} match no trained 2-D weight, so nothing would get the low-rank treatment",
            hint="Name module-name parts of trained weights (e.g. [q_proj, v_proj], attn, mlp) or use adamw.")
    width = max(min(s[1][-2:]) for s in targeted)
    low_rank = _resolve(spec.low_rank, opt, width)
    projected = [s for s in targeted if min(s[1][-2:]) > low_rank.rank]
    if not projected:
        narrow = min(targeted, key=lambda s: min(s[1][-2:]))
        raise FinetuneError(
            f"optimizer {name} with rank {low_rank.rank}: no trained weight is wider than the rank (e.g. "
            f"{narrow[0]} is {' x '.join(map(str, narrow[1]))}), so the projected gradient and optimizer state "
            "would be as large as the weight itself: no memory saving",
            hint="With LoRA the trained matrices are only adapter.r wide: set optimizer.rank below adapter.r "
                 "(or leave it null for the preset), or use adamw / adamw_8bit for adapters.")
    chosen = {s[0] for s in projected}
    rest = [s for s in matrices if s[0] not in chosen]
    return ParamPlan(projected, rest, undecayed, low_rank)


def _resolve(preset: LowRankPreset, opt: OptimizerConfig, width: int) -> LowRankSettings:
    """The registry's preset with the rank for `width`, overridden by every key the recipe sets."""
    return LowRankSettings(
        method=preset.method,
        rank=opt.rank if opt.rank is not None else preset.rank(width),
        update_proj_gap=opt.update_proj_gap if opt.update_proj_gap is not None else preset.update_proj_gap,
        scale=opt.scale if opt.scale is not None else preset.scale,
        proj_type=opt.proj_type if opt.proj_type is not None else preset.proj_type,
        scale_type=opt.scale_type if opt.scale_type is not None else preset.scale_type,
    )


def projected_shape(shape: tuple[int, ...], settings: LowRankSettings) -> tuple[tuple[int, int], tuple[int, int]]:
    """(low-rank gradient shape, projection matrix shape) for a weight, as the upstream projectors choose.

    std compresses the shorter side (right projection when rows >= cols: state rows x rank, projection
    rank x cols), reverse_std the longer one.
    """
    m, n = shape
    r = settings.rank
    return ((m, r), (r, n)) if projection_side(shape, settings.proj_type) == "right" else ((r, n), (m, r))


def projection_side(shape: tuple[int, ...], proj_type: str) -> str:
    """"right" (gradient @ P.T, P is rank x cols) or "left" (P.T @ gradient, P is rows x rank)."""
    if proj_type in ("std", "reverse_std"):
        return "right" if (shape[0] >= shape[1]) == (proj_type == "std") else "left"
    return proj_type
