"""Learning rate and Adam's beta2 when the batch differs from the one they were tuned for.

The rules (README "Batch size from the gradient noise scale"; sources in docs/batch_size.md):
- learning rate x sqrt(B / B_ref) for Adam-family optimizers (random-matrix analysis of Adam; the square-root
  rule), x (B / B_ref) for SGD (the linear scaling rule); the factor is capped at MAX_LR_FACTOR because
  Adam's optimal learning rate rises and then FALLS past a batch size (the "Surge" phenomenon), so an
  extrapolation far up is not trusted;
- beta2_new = beta2 ** (B / B_ref): the second moment's half-life stays fixed in tokens (Marek et al.,
  "Small Batch Size Training for Language Models").

B counts sequences per optimizer step (micro_batch_size x gradient_accumulation_steps x distributed.gpus).
Torch-free: the schema's checks, `finetune plan` and `finetune run` use the same function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune.recipe.optimizers import optimizer_spec
from finetune.recipe.schema import Recipe

MAX_LR_FACTOR = 4.0  # at most 4x the tuned learning rate (16x the batch under the square-root rule)
# The largest batch worth its tokens: McCandlish et al. price a batch B at E_min (1 + B / B_noise) tokens and
# S_min (1 + B_noise / B) steps, so B <= TOKEN_WASTE x B_noise costs at most ~10% more tokens than the
# smallest batch for the same loss while most of the steps are saved.
TOKEN_WASTE = 0.1


@dataclass(frozen=True)
class BatchRule:
    """The learning rate and betas for `batch` sequences per step, from values tuned at `reference`."""

    reference: int
    batch: int
    rule: str  # "sqrt" or "linear"
    learning_rate: float
    new_learning_rate: float
    betas: tuple[float, float] | None  # None: the optimizer has no beta2 that follows the batch
    new_betas: tuple[float, float] | None
    capped: bool  # the learning-rate factor hit MAX_LR_FACTOR

    def describe(self) -> str:
        """One line for `finetune plan` and the run log."""
        text = (f"batch {self.batch} vs reference {self.reference} sequences: learning rate "
                f"{self.learning_rate:.3g} -> {self.new_learning_rate:.3g} ({self.rule} rule"
                + (f", capped at {MAX_LR_FACTOR:g}x" if self.capped else "") + ")")
        if self.betas is not None and self.new_betas is not None:
            text += f", beta2 {self.betas[1]:.6g} -> {self.new_betas[1]:.6g} (same half-life in tokens)"
        return text


def scale_for_batch(learning_rate: float, betas: tuple[float, float], optimizer: str, reference: int,
                    batch: int) -> BatchRule:
    """Apply the rules for registered optimizer `optimizer` (its spec names the family's rule)."""
    if reference < 1 or batch < 1:
        raise ValueError(f"batch sizes must be >= 1, got reference {reference}, batch {batch}")
    spec = optimizer_spec(optimizer)
    ratio = batch / reference
    factor = math.sqrt(ratio) if spec.lr_batch_scaling == "sqrt" else ratio
    capped = factor > MAX_LR_FACTOR
    new_betas = (betas[0], betas[1] ** ratio) if spec.uses_beta2 else None
    return BatchRule(reference, batch, spec.lr_batch_scaling, learning_rate,
                     learning_rate * min(factor, MAX_LR_FACTOR), tuple(betas) if spec.uses_beta2 else None,
                     new_betas, capped)


def reference_batch(recipe: Recipe) -> int | None:
    """The batch (sequences per step) the recipe's learning rate and betas are for: reference_batch_size, else
    the effective batch the recipe asks for (effective_batch_size, or micro-batch x accumulation when both
    are numbers); None when the recipe leaves it to the planner (then nothing is rescaled)."""
    t = recipe.training
    if t.reference_batch_size is not None:
        return t.reference_batch_size
    if isinstance(t.effective_batch_size, int):
        return t.effective_batch_size
    if isinstance(t.micro_batch_size, int) and isinstance(t.gradient_accumulation_steps, int):
        return t.micro_batch_size * t.gradient_accumulation_steps * recipe.distributed.gpus
    return None


def apply_batch_rules(recipe: Recipe, reference: int | None) -> tuple[Recipe, BatchRule | None]:
    """`recipe` (micro-batch, accumulation and optimizer resolved) with the learning rate and betas for its
    effective batch, tuned at `reference` (reference_batch(recipe) before the planner resolved it). The copy
    names its own batch as reference_batch_size, so its recipe.yaml is rescaled only once."""
    t = recipe.training
    batch = int(t.micro_batch_size) * int(t.gradient_accumulation_steps) * recipe.distributed.gpus
    if reference is None or reference == batch:
        return recipe, None
    rule = scale_for_batch(t.learning_rate, recipe.optimizer.betas, recipe.optimizer.name, reference, batch)
    out = recipe.model_copy(deep=True)
    out.training.learning_rate = rule.new_learning_rate
    out.training.reference_batch_size = batch
    if rule.new_betas is not None:
        out.optimizer.betas = rule.new_betas
    return out, rule


def auto_schedule(micro_batch: int, optimizer: str, layerwise: bool, max_accumulation: int) -> str:
    """What `effective_batch_size: auto` will do, for `finetune plan` (the run decides from measurements)."""
    start = 2 if micro_batch == 1 or layerwise else 1
    spec = optimizer_spec(optimizer)
    follows = "learning rate x " + ("sqrt" if spec.lr_batch_scaling == "sqrt" else "linear") + " of the batch ratio" \
        + (f" (capped at {MAX_LR_FACTOR:g}x)" if spec.lr_batch_scaling == "sqrt" else "") \
        + (", beta2 ** ratio" if spec.uses_beta2 else "")
    return (f"effective batch auto: starts at {micro_batch * start} sequences (micro-batch {micro_batch} x "
            f"{start}); the accumulation doubles while the batch stays within {TOKEN_WASTE:g} x the measured "
            f"noise scale, up to {micro_batch * max_accumulation}; {follows}")


def advise(gns_tokens: float | None, tokens_per_sequence: float, batch_used: int, learning_rate: float,
           betas: tuple[float, float], optimizer: str) -> dict:
    """What to use next time, from a run's final noise scale (labelled tokens): the largest power-of-two batch
    of sequences within TOKEN_WASTE x the noise scale, and the learning rate and betas the rules give it
    from the ones used at `batch_used`. As recipe keys, so `finetune plan --advice RUN_DIR` can apply them."""
    if not gns_tokens or tokens_per_sequence <= 0:
        return {"reason": "no noise scale was measured (too few steps, or micro-batch 1 without accumulation)"}
    batch = 1
    while 2 * batch * tokens_per_sequence <= TOKEN_WASTE * gns_tokens:
        batch *= 2
    rule = scale_for_batch(learning_rate, betas, optimizer, batch_used, batch)
    settings = {"training.effective_batch_size": batch, "training.gradient_accumulation_steps": "auto",
                "training.reference_batch_size": batch, "training.learning_rate": float(f"{rule.new_learning_rate:.4g}")}
    if rule.new_betas is not None:
        settings["optimizer.betas"] = [rule.new_betas[0], float(f"{rule.new_betas[1]:.6g}")]
    return {"settings": settings, "reason": (
        f"measured noise scale {gns_tokens:.4g} labelled tokens = {gns_tokens / tokens_per_sequence:.3g} sequences; "
        f"batches up to {TOKEN_WASTE:g}x that waste few tokens: {batch} sequences; " + rule.describe())}
