"""Optimizers: presets, low-rank (APOLLO/GaLore), 8-bit, layer-wise updates, and the state-size model.

Wiring into the training loop (finetune/train/setup.py; tests/test_optim_loop_wiring.py runs it):

* before resuming: `register_safe_globals()` (train_state.pt is loaded with weights_only=True and holds
  GaLore/APOLLO projector objects);
* `build_optimizer(model, recipe.optimizer, learning_rate, steps_per_update=accumulation,
  max_grad_norm=...)`, once the model is built; the loop steps it, its scheduler and zero_grad();
* layer-wise mode (`layerwise_of(optimizer)` is not None): the optimizer clips and measures the norm itself,
  so the loop's `grad_norm()` returns `layerwise_of(optimizer).grad_norm()`; the loop keeps its
  `steps_per_update` equal to the backward passes of one update (`TrainLoop.sync_layerwise`).

Which names exist, and what each is built from and costs, is the registry: finetune/recipe/optimizers.py.
"""

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
