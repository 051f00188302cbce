"""Optimizers: presets, low-rank (APOLLO/GaLore), 8-bit, layer-wise updates, and the state-size model."""

from finetune.optim.build import build_optimizer, register_safe_globals
from finetune.optim.layerwise import LayerwiseOptimizer, layerwise_of
from finetune.optim.state_size import gradient_bytes, measured_state_bytes, optimizer_state_bytes

__all__ = [
    "LayerwiseOptimizer",
    "build_optimizer",
    "gradient_bytes",
    "layerwise_of",
    "measured_state_bytes",
    "optimizer_state_bytes",
    "register_safe_globals",
]
