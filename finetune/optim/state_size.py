"""Optimizer-state and gradient sizes predicted from shapes alone, and measured on a real optimizer.

The prediction mirrors what each optimizer allocates on its first step (tests compare it byte for byte with
`measured_state_bytes` after one step). It counts every tensor the state holds, wherever it lives,
including the 4-byte step counters torch keeps on the CPU and bitsandbytes' two 1 KiB quantisation maps
per optimizer object (one object per weight in layer-wise mode).
"""

from __future__ import annotations

import math

import torch

from finetune.optim.build import BNB_MIN_8BIT_SIZE
from finetune.optim.presets import ParamSpec, plan_params, projected_shape
from finetune.recipe.schema import OptimizerConfig

_STEP_TENSOR = 4  # torch AdamW / Adafactor keep `step` as a float32 scalar tensor
_BNB_QMAPS = 2 * 256 * 4  # bitsandbytes: the signed and unsigned dynamic maps, 256 float32 each
_BNB_BLOCK = 256


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _bnb(numel: int, itemsize: int) -> tuple[int, bool]:
    """(state bytes, uses the 8-bit maps) of one bitsandbytes Adam state for `numel` elements."""
    if numel < BNB_MIN_8BIT_SIZE:
        return 2 * numel * 4, False
    blocks = -(-numel // _BNB_BLOCK)
    return 2 * numel + 2 * blocks * 4, True


def _full_state(name: str, shape: tuple[int, ...], dtype: torch.dtype, opt: OptimizerConfig) -> tuple[int, bool]:
    """(bytes, uses bnb maps) of one non-projected parameter's state under optimizer `name`."""
    n, size = _numel(shape), _size(dtype)
    if name == "adamw":
        return 2 * n * size + _STEP_TENSOR, False
    if name == "sgd":
        return (n * size if opt.momentum else 0), False
    if name == "adafactor":
        if len(shape) >= 2:
            return _STEP_TENSOR + (n // shape[-1] + n // shape[-2]) * size, False
        return _STEP_TENSOR + n * size, False
    if name in ("adamw_8bit", "paged_adamw_8bit", "galore_8bit"):
        return _bnb(n, size)
    return 2 * n * size, False  # LowRankAdamW fallback AdamW: exp_avg, exp_avg_sq; python-int step


def optimizer_state_bytes(name: str, trained_params: list[ParamSpec], opt: OptimizerConfig, *,
                          layerwise: bool | None = None) -> int:
    """Bytes of optimizer state after the first step for `trained_params` = [(name, shape, dtype)].

    `layerwise` defaults to opt.layerwise (it only changes bitsandbytes' per-object maps).
    """
    layerwise = opt.layerwise if layerwise is None else layerwise
    plan = plan_params(name, trained_params, opt)
    total, maps = 0, 0
    for _, shape, dtype in plan.decayed + plan.undecayed:
        nbytes, uses_maps = _full_state(name, shape, dtype, opt)
        total += nbytes
        maps += uses_maps
    for _, shape, dtype in plan.projected:
        low, matrix = projected_shape(shape, plan.low_rank)
        size = _size(dtype)
        if plan.low_rank.method == "galore":
            total += _numel(matrix) * size  # the SVD projection (APOLLO regenerates its random one)
        if name == "galore_8bit":
            nbytes, uses_maps = _bnb(_numel(low), size)
            total += nbytes
            maps += uses_maps
        else:
            total += 2 * _numel(low) * size
            if plan.low_rank.method == "apollo":
                total += size  # Fira norm-limiter scalar
    objects_with_maps = maps if layerwise else min(maps, 1)
    return total + objects_with_maps * _BNB_QMAPS


def gradient_bytes(trained_params: list[ParamSpec], opt: OptimizerConfig, steps_per_update: int = 1) -> int:
    """Peak bytes of resident gradients (.grad plus layer-wise accumulators) during a training step.

    Normal: every gradient. Layer-wise, no accumulation: the largest single gradient. Layer-wise with
    accumulation: full gradients of weights that accumulate in .grad, the fp32 projected accumulators of
    GaLore weights, and one GaLore weight's full micro-batch gradient before it is projected.
    """
    full = {s[0]: _numel(s[1]) * _size(s[2]) for s in trained_params}
    if not opt.layerwise:
        return sum(full.values())
    if steps_per_update == 1:
        return max(full.values())
    plan = plan_params(opt.name, trained_params, opt)
    compressed = plan.projected if opt.name == "galore" else []
    names = {s[0] for s in compressed}
    accumulators = sum(_numel(projected_shape(s[1], plan.low_rank)[0]) * 4 for s in compressed)
    transient = max((full[n] for n in names), default=0)
    return sum(b for n, b in full.items() if n not in names) + accumulators + transient


def measured_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct tensor storages held in an optimizer's state (projection matrices included)."""
    from finetune.optim.layerwise import LayerwiseOptimizer

    optimizers = list(optimizer.inner.values()) if isinstance(optimizer, LayerwiseOptimizer) else [optimizer]
    seen: dict[int, int] = {}

    def visit(value) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        elif hasattr(value, "ortho_matrix"):
            visit(value.ortho_matrix)

    for opt in optimizers:
        for state in opt.state.values():
            visit(state)
    return sum(seen.values())
