"""The batch a plan trains and the advice a finished run gives the next: how `run` rescales the learning rate
and beta2 for the plan's batch (lines for `finetune plan`), and a run's advised batch, learning rate and betas
written over a recipe (`finetune plan --advice RUN_DIR`, the UI's "use the advice" button)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from finetune.recipe.load import load_recipe, recipe_data, validate_recipe
from finetune.recipe.schema import Recipe
from finetune.rundir import RunDir

if TYPE_CHECKING:
    from finetune.plan import Plan


def batch_plan(recipe: Recipe, plan: Plan) -> list[str]:
    """How `run` rescales the learning rate and beta2 for the plan's batch, and the schedule of
    `effective_batch_size: auto`, as lines for `finetune plan` (none when neither applies)."""
    from finetune.recipe.batch_rules import (
        MAX_ACCUMULATION,
        apply_batch_rules,
        auto_schedule,
        reference_batch,
    )

    resolved, rule = apply_batch_rules(plan.apply(recipe).recipe, reference_batch(recipe))
    lines = [f"batch rules: {rule.describe()}"] if rule is not None else []
    effective, t, gpus = recipe.training.effective_batch_size, resolved.training, resolved.distributed.gpus
    trained = int(t.micro_batch_size) * int(t.gradient_accumulation_steps) * gpus
    if isinstance(effective, int) and trained != effective:  # no micro-batch that divides the batch fits
        processes = f" x {gpus} processes" if gpus > 1 else ""
        lines.append(f"batch: trains {t.micro_batch_size} x {t.gradient_accumulation_steps} accumulation"
                     f"{processes} = {trained} sequences per step, not training.effective_batch_size "
                     f"{effective}: the micro-batch{' x processes' if gpus > 1 else ''} does not divide it; give "
                     "a batch it divides, or a micro-batch that divides it, to train exactly that batch")
    if recipe.training.effective_batch_size == "auto":
        lines.append(auto_schedule(int(resolved.training.micro_batch_size), resolved.optimizer.name,
                                   resolved.optimizer.layerwise, MAX_ACCUMULATION,
                                   resolved.training.noise_scale_split_every, resolved.training.method))
    return lines


def run_advice(run_dir: str | Path) -> tuple[list[str], str]:
    """The batch, learning rate and betas a finished run advises for the next one (results.json, from its
    measured noise scale) as `--set` overrides, and why. FinetuneError when the run has no advice."""
    import json

    from finetune.errors import UsageError

    results = RunDir(Path(run_dir)).read_results()
    advice = (results or {}).get("advice")
    if not advice or "settings" not in advice:
        why = advice["reason"] if advice else "it has no results.json with advice (not finished, or an older version)"
        raise UsageError(f"--advice {run_dir}: no batch advice: {why}",
                            hint="give a finished run directory of this version, or plan without --advice")
    return [f"{k}={json.dumps(v)}" for k, v in advice["settings"].items()], advice["reason"]


def apply_advice(recipe: Recipe | str | Path, run_dir: str | Path, overrides: list[str] | None = None
                 ) -> tuple[Recipe, list[str], str]:
    """`recipe` (a Recipe, or a recipe file read as `load_recipe` reads it) with a finished run's advice
    written over it, then `overrides` (the command line's --set, which win): what `finetune plan --advice
    RUN_DIR` plans and the UI's "use the advice" button writes into the form. Returns (the new recipe, the
    `key=value` settings the advice applied, why).

    A micro-batch pinned above the advised batch, or one that does not divide it, would make the run train
    another batch (micro x accumulation: 4 x 2 = 8 for an advice of 6; the learning rate rescaled to it): the
    advice releases it to auto, so the planner picks one that divides the batch, and `why` says so. A
    micro-batch the overrides pin stays, with a note."""
    import json

    from finetune.recipe.batch_rules import accumulation_for
    from finetune.recipe.load import apply_overrides, parse_override

    advised, why = run_advice(run_dir)
    overrides = list(overrides or [])

    def build(items: list[str]) -> Recipe:
        if isinstance(recipe, Recipe):
            return validate_recipe(apply_overrides(recipe_data(recipe), items),
                                   f"the recipe with the advice of {run_dir}")
        return load_recipe(recipe, items)

    if build(overrides).training.effective_batch_tokens is not None:
        advised, why = _in_tokens(advised, why, run_dir)
    new = build(advised + overrides)
    t, gpus = new.training, new.distributed.gpus
    batch, micro = t.effective_batch_size, t.micro_batch_size
    trained = accumulation_for(batch, micro, gpus) * micro * gpus \
        if isinstance(batch, int) and isinstance(micro, int) else batch
    if trained != batch:  # the pinned micro-batch trains another batch
        pinned = f"training.micro_batch_size {micro}" + (f" x {gpus} processes" if gpus > 1 else "")
        problem = (f"is above the advised batch of {batch}" if micro * gpus > batch else
                   f"does not divide the advised batch of {batch} (it would train {trained})")
        if any(parse_override(item)[0] == ["training", "micro_batch_size"] for item in overrides):
            why += (f". Note: --set {pinned} {problem} and wins; leave it out (or set one that divides the "
                    "batch) to follow the advice")
        else:
            advised = [*advised, f"training.micro_batch_size={json.dumps('auto')}"]
            new = build(advised + overrides)
            why += (f". The recipe's {pinned} {problem}: the advice released it to auto, so the planner "
                    "picks a micro-batch that divides the batch")
    return new, advised, why


# the advice's keys that are in sequences, which a batch in tokens (training.effective_batch_tokens) refuses or
# does not use; the advised batch is given in tokens instead
SEQUENCE_KEYS = ("training.effective_batch_size", "training.gradient_accumulation_steps",
                 "training.reference_batch_size")


def _in_tokens(advised: list[str], why: str, run_dir: str | Path) -> tuple[list[str], str]:
    """The advice for a recipe whose effective batch is in tokens: its batch of sequences as
    training.effective_batch_tokens (that many of the advising run's sequences, at their mean real tokens:
    data_stats.json), with the learning rate and betas the rules gave that batch; the keys in sequences left
    out. Where the run's token counts are not there, no batch change (nor its learning rate and betas)."""
    import json

    from finetune.recipe.load import parse_override

    values = {".".join(parse_override(item)[0]): item for item in advised}
    batch = values.get("training.effective_batch_size")
    if batch is None:
        return advised, why
    try:
        stats = json.loads(RunDir(Path(run_dir)).data_stats.read_text())
        per_sequence = stats["train_tokens"] / stats["train_sequences"]
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        kept = [item for key, item in values.items()
                if key not in (*SEQUENCE_KEYS, "training.learning_rate", "optimizer.betas")]
        return kept, (f"{why}. The recipe's batch is in tokens (training.effective_batch_tokens) and the run's "
                      "data_stats.json does not say its tokens per sequence: no batch change advised")
    sequences = int(parse_override(batch)[1])
    tokens = max(1, round(sequences * per_sequence))
    kept = [item for key, item in values.items() if key not in SEQUENCE_KEYS]
    return [f"training.effective_batch_tokens={tokens}", *kept], (
        f"{why}. The recipe's batch is in tokens: {sequences} sequence(s) of the run's {per_sequence:.4g} tokens "
        f"each = training.effective_batch_tokens {tokens}")
