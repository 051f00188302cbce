"""Optimizer-state and gradient sizes predicted from shapes alone, and measured on a real optimizer.

The prediction mirrors what each optimizer allocates on its first step (tests compare it byte for byte with
`measured_state_bytes` after one step). It counts every tensor the state holds, wherever it lives,
including the 4-byte step counters torch keeps on the CPU and bitsandbytes' two 1 KiB quantisation maps
per optimizer object (one object per weight in layer-wise mode).
"""

from __future__ import annotations

import math

import torch

from finetune.optim.factories import BNB_MIN_8BIT_SIZE
from finetune.optim.presets import ParamSpec, plan_params, projected_shape
from finetune.recipe.optimizers import optimizer_spec
from finetune.recipe.reference import resolve
from finetune.recipe.schema import OptimizerConfig

StateBytes = tuple[int, bool]  # (bytes, uses bitsandbytes' quantisation maps)

_STEP_TENSOR = 4  # torch AdamW / Adafactor keep `step` as a float32 scalar tensor
_BNB_QMAPS = 2 * 256 * 4  # bitsandbytes: the signed and unsigned dynamic maps, 256 float32 each
_BNB_BLOCK = 256


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def adamw_state(shape: tuple[int, ...], itemsize: int, opt: OptimizerConfig, own: bool) -> StateBytes:
    """torch AdamW: exp_avg, exp_avg_sq and the step tensor."""
    return 2 * _numel(shape) * itemsize + _STEP_TENSOR, False


def low_rank_state(shape: tuple[int, ...], itemsize: int, opt: OptimizerConfig, own: bool) -> StateBytes:
    """LowRankAdamW: exp_avg, exp_avg_sq (of the projected gradient for own weights); a python-int step."""
    return 2 * _numel(shape) * itemsize, False


def bnb_state(shape: tuple[int, ...], itemsize: int, opt: OptimizerConfig, own: bool) -> StateBytes:
    """bitsandbytes 8-bit Adam: two uint8 states plus one fp32 absmax per block; fp32 for small tensors."""
    numel = _numel(shape)
    if numel < BNB_MIN_8BIT_SIZE:
        return 2 * numel * 4, False
    blocks = -(-numel // _BNB_BLOCK)
    return 2 * numel + 2 * blocks * 4, True


def adafactor_state(shape: tuple[int, ...], itemsize: int, opt: OptimizerConfig, own: bool) -> StateBytes:
    """torch Adafactor: row and column factors of matrices, a full second moment for vectors; step tensor."""
    n = _numel(shape)
    if len(shape) >= 2:
        return _STEP_TENSOR + (n // shape[-1] + n // shape[-2]) * itemsize, False
    return _STEP_TENSOR + n * itemsize, False


def sgd_state(shape: tuple[int, ...], itemsize: int, opt: OptimizerConfig, own: bool) -> StateBytes:
    """torch SGD: a momentum buffer only when momentum > 0."""
    return (_numel(shape) * itemsize if opt.momentum else 0), False


def optimizer_state_bytes(name: str, trained_params: list[ParamSpec], opt: OptimizerConfig, *,
                          layerwise: bool | None = None) -> int:
    """Bytes of optimizer state after the first step for `trained_params` = [(name, shape, dtype)].

    Each parameter is sized by its registry spec's `state` rule; a low-rank weight by the same rule applied
    to its projected gradient's shape, plus GaLore's stored projection or APOLLO's norm-limiter scalar.
    `layerwise` defaults to opt.layerwise (it only changes bitsandbytes' per-object maps).
    """
    layerwise = opt.layerwise if layerwise is None else layerwise
    state = resolve(optimizer_spec(name).state)
    plan = plan_params(name, trained_params, opt)
    total, maps = 0, 0
    for (_, shape, dtype), own in [(s, True) for s in plan.own] + [(s, False) for s in plan.decayed + plan.undecayed]:
        size = _size(dtype)
        if own and plan.low_rank:
            low, matrix = projected_shape(shape, plan.low_rank)
            nbytes, uses_maps = state(low, size, opt, own)
            # GaLore keeps its SVD projection; APOLLO regenerates its random one and keeps a Fira scalar
            nbytes += _numel(matrix) * size if plan.low_rank.method == "galore" else size
        else:
            nbytes, uses_maps = state(shape, size, opt, own)
        total += nbytes
        maps += uses_maps
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
    # GaLore weights of LowRankAdamW accumulate projected (layerwise.py); galore_8bit is upstream's optimizer
    spec = optimizer_spec(opt.name)
    compressed = plan.own if spec.family == "low_rank" and plan.low_rank.method == "galore" else []
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
