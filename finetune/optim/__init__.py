"""Optimizers: presets, low-rank (APOLLO/GaLore), 8-bit, layer-wise updates, and the state-size model.

Wiring into a transformers.Trainer subclass (tests/test_optim_trainer_wiring.py runs exactly this):

* in __init__, before training or resuming: `register_safe_globals()` (optimizer.pt is loaded with
  weights_only=True and holds GaLore/APOLLO projector objects);
* `create_optimizer`: `self.optimizer = build_optimizer(self.model, recipe.optimizer, args.learning_rate,
  steps_per_update=args.gradient_accumulation_steps, max_grad_norm=args.max_grad_norm)`; the Trainer's
  own scheduler, optimizer.step() and zero_grad() calls stay as they are;
* layer-wise mode (`layerwise_of(self.optimizer)` is not None): the optimizer clips and measures the norm
  itself, so `_clip_grad_norm` and `_get_grad_norm` return `layerwise_of(self.optimizer).grad_norm()`.

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
