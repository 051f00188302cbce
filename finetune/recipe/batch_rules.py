"""Learning rate and Adam's beta2 when the batch differs from the one they were tuned for.

The rules (docs/training.md "Batch size from the gradient noise scale"; sources in docs/batch_size.md):
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
import statistics
from dataclasses import dataclass

from finetune.recipe.methods import method_spec
from finetune.recipe.optimizers import optimizer_spec
from finetune.recipe.schema import Recipe

MAX_LR_FACTOR = 4.0  # at most 4x the tuned learning rate (16x the batch under the square-root rule)
# When to accumulate. On one device accumulation does not raise throughput: it only spreads each optimizer
# step's fixed cost (t_opt: clipping, the update, the noise-scale read) over more micro-batches (t_micro each).
# McCandlish et al. price a batch of B tokens at E_min (1 + B / B_noise) tokens to reach a given loss, so with
# b tokens per micro-batch and k micro-batches per step the wall time to that loss is proportional to
#     cost(k) = (1 + k b / B_noise) (t_micro + t_opt / k),
# which is convex in k with its minimum at k* = sqrt(t_opt B_noise / (t_micro b)): accumulation grows with the
# noise scale, and stays 1 where the optimizer step is cheap next to a micro-batch (LoRA, small models), as the
# small-batch results say (Marek et al.).
# But a run's length is fixed in tokens (epochs over the user's data), so tokens a larger batch wastes are loss
# the run never gets back: the batch may grow only while the model's token price stays within TOKEN_SLACK of
# the micro-batch's, (1 + k b / B_noise) / (1 + b / B_noise) <= 1 + TOKEN_SLACK ("saves steps without wasting
# tokens"). The slack is small because the measured B_noise (B_simple) overestimates the critical batch:
# 4-40x in benchmarks/results/batch_size.txt, as McCandlish et al. warn for an ill-conditioned Hessian.
MAX_ACCUMULATION = 64  # the most micro-batches `effective_batch_size: auto` puts in one update
TOKEN_SLACK = 0.02  # the most extra tokens (predicted) a larger batch may cost next to one micro-batch
MIN_GAIN = 0.02  # a larger accumulation must cut the predicted time to a loss by 2%: no churn on noisy estimates
TIMING_WINDOW = 64  # step times kept (the median of each kind is used)
TIMING_SKIP = 2  # first loop steps not timed (allocation, lazy optimizer state)


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


def accumulation_for(effective: int, micro: int, processes: int = 1) -> int:
    """Micro-batches per process and step that keep `effective` sequences per step: the batch rounded up to
    a multiple of micro x processes where they do not divide it (then it trains micro x processes x this)."""
    return max(1, math.ceil(effective / (micro * processes)))


def wall_time(accumulation: int, tokens_per_micro: float, gns_tokens: float, t_micro: float, t_opt: float) -> float:
    """Seconds per E_min token to reach a loss with `accumulation` micro-batches of `tokens_per_micro`
    labelled tokens per optimizer step (the cost(k) above, divided by the micro-batch's tokens)."""
    return (1 + accumulation * tokens_per_micro / gns_tokens) * (t_micro + t_opt / accumulation) / tokens_per_micro


def token_overhead(batch: float, gns: float) -> float:
    """The extra tokens to a loss of `batch` units next to one unit, at noise scale `gns` in those units."""
    return (1 + batch / gns) / (1 + 1 / gns) - 1


def token_cap(gns_tokens: float, tokens_per_micro: float) -> int:
    """The most micro-batches per update whose token_overhead stays within TOKEN_SLACK of one micro-batch's."""
    return max(1, math.floor(1 + TOKEN_SLACK * (gns_tokens + tokens_per_micro) / tokens_per_micro + 1e-9))


def update_batch(gns_tokens: float | None, tokens_per_sequence: float, current: int, micro: int) -> int:
    """Sequences per optimizer update during the batch-size warmup below the micro-batch (the critical batch
    starts near 0 and grows, Critical Batch Size Revisited): the largest power of two dividing `micro`, or
    `micro` itself, whose token_overhead next to ONE sequence stays within TOKEN_SLACK (token_cap in
    sequences); never below `current`, and `current` while no noise scale is measured."""
    if not gns_tokens or gns_tokens <= 0 or tokens_per_sequence <= 0:
        return current
    cap = token_cap(gns_tokens, tokens_per_sequence)
    sizes = [b for b in (1 << i for i in range(micro.bit_length())) if micro % b == 0] + [micro]
    return max([current] + [b for b in sizes if b <= cap])


def best_accumulation(gns_tokens: float | None, tokens_per_micro: float, t_micro: float | None,
                      t_opt: float | None, current: int = 1, limit: int = 64) -> int:
    """The accumulation that minimises wall_time within the token_cap, never below `current` (the critical
    batch grows during training, Critical Batch Size Revisited) nor above `limit`, and only where it saves
    MIN_GAIN of the time; `current` while the noise scale or a step time is not measured yet."""
    if not gns_tokens or gns_tokens <= 0 or not t_micro or t_opt is None or tokens_per_micro <= 0:
        return current
    limit = min(limit, token_cap(gns_tokens, tokens_per_micro))
    best = math.sqrt(max(t_opt, 0.0) * gns_tokens / (t_micro * tokens_per_micro))  # k*, the continuous optimum
    candidates = {min(max(k, current), limit) for k in (math.floor(best), math.ceil(best))}
    new = min(candidates, key=lambda k: wall_time(k, tokens_per_micro, gns_tokens, t_micro, t_opt))
    saved = 1 - wall_time(new, tokens_per_micro, gns_tokens, t_micro, t_opt) \
        / wall_time(current, tokens_per_micro, gns_tokens, t_micro, t_opt)
    return new if new > current and saved >= MIN_GAIN else current


class StepTimes:
    """Measured seconds per loop step, split into forward-backward and the rest of the step (clipping, the
    update): t_micro is a forward-backward, t_opt the rest of an updating step. A layer-wise optimizer updates
    inside the last backward (`update_in_backward`): its t_micro comes from the steps that only accumulated
    and its t_opt is what an updating step costs beyond that. Medians over the last TIMING_WINDOW steps of
    each kind, so a busy machine's outliers do not decide."""

    def __init__(self, update_in_backward: bool = False) -> None:
        self.update_in_backward = update_in_backward
        self.seen = 0
        self.deferred: list[float] = []  # forward-backward of steps without an update
        self.forward: list[float] = []  # forward-backward of updating steps
        self.rest: list[float] = []  # the rest of updating steps

    def add(self, forward_backward: float, rest: float, updated: bool) -> None:
        self.seen += 1
        if self.seen <= TIMING_SKIP:
            return
        if updated:
            self.forward = [*self.forward, forward_backward][-TIMING_WINDOW:]
            self.rest = [*self.rest, rest][-TIMING_WINDOW:]
        else:
            self.deferred = [*self.deferred, forward_backward][-TIMING_WINDOW:]

    def estimate(self) -> tuple[float, float] | None:
        """(t_micro, t_opt) in seconds, or None before three updating steps (and, for an update inside
        backward, three steps without one) were timed."""
        if len(self.rest) < 3:
            return None
        if not self.update_in_backward:
            return statistics.median(self.forward + self.deferred), statistics.median(self.rest)
        if len(self.deferred) < 3:
            return None
        t_micro = statistics.median(self.deferred)
        total = statistics.median([f + r for f, r in zip(self.forward, self.rest, strict=True)])
        return t_micro, max(0.0, total - t_micro)

    def state_dict(self) -> dict:
        return {"seen": self.seen, "deferred": self.deferred, "forward": self.forward, "rest": self.rest}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.deferred = state["seen"], list(state["deferred"])
        self.forward, self.rest = list(state["forward"]), list(state["rest"])


def auto_schedule(micro_batch: int, optimizer: str, layerwise: bool, max_accumulation: int,
                  split_every: int, method: str = "sft") -> str:
    """What `effective_batch_size: auto` will do, for `finetune plan` (the run decides from measurements);
    `method`: training.method (one whose updates take whole batches, as kto's, has no warmup:
    BatchEngine._no_warmup)."""
    spec = optimizer_spec(optimizer)
    follows = "learning rate x " + ("sqrt" if spec.lr_batch_scaling == "sqrt" else "linear") + " of the batch ratio" \
        + (f" (capped at {MAX_LR_FACTOR:g}x)" if spec.lr_batch_scaling == "sqrt" else "") \
        + (", beta2 ** ratio" if spec.uses_beta2 else "")
    if micro_batch > 1 and not layerwise and not method_spec(method).whole_batch:
        start = (f"a batch-size warmup (the critical batch starts near 0 and grows): updates of 1 sequence "
                 f"first, each micro-batch of {micro_batch} run as {micro_batch} updates in a row (once every "
                 f"{split_every} updates two share one, to measure the noise scale); the update batch grows by "
                 f"powers of two while it costs at most {100 * TOKEN_SLACK:g}% more tokens than one sequence at "
                 f"the measured noise scale, until it is the micro-batch (smaller updates run slower per token); "
                 f"then, without accumulation at first, the run")
    else:
        measure = (f"; to measure the noise scale, once every {split_every} micro-batches two share one update"
                   if micro_batch == 1 or layerwise else "")
        why = "a layer-wise optimizer updates inside backward" if layerwise \
            else "kto's reference point is the mean of its batch's answers"
        warmup = f" (no warmup below the micro-batch: {why})" if micro_batch > 1 else ""
        start = f"starts at micro-batch {micro_batch} without accumulation{warmup}{measure}; the run"
    return (f"effective batch auto: {start} "
            f"times its micro-batches (t_micro) and optimizer steps (t_opt) and accumulates k = "
            f"sqrt(t_opt x noise scale / (t_micro x micro-batch tokens)) micro-batches where that saves "
            f">= {100 * MIN_GAIN:g}% of the predicted time to a loss and costs at most {100 * TOKEN_SLACK:g}% more "
            f"tokens than one micro-batch (the run's length is fixed in tokens), ramping up only, at most "
            f"{micro_batch * max_accumulation} sequences; {follows}")


def advise(gns_tokens: float | None, tokens_per_sequence: float, micro_batch: int, batch_used: int,
           learning_rate: float, betas: tuple[float, float], optimizer: str,
           times: tuple[float, float] | None) -> dict:
    """What to use next time, from a run's final noise scale (labelled tokens) and step times (t_micro,
    t_opt): the micro-batch x best_accumulation, or, where the micro-batch alone already costs more than
    TOKEN_SLACK extra tokens next to one sequence, a smaller batch with the micro-batch left to the planner
    (which needs no step times: a run that ended in the batch-size warmup timed none);
    and the learning rate and betas the rules give that batch from the ones used at `batch_used`. As recipe
    keys, so `finetune plan --advice RUN_DIR` can apply them."""
    if not gns_tokens or tokens_per_sequence <= 0:
        return {"reason": "no noise scale was measured (too few steps, or micro-batch 1 without accumulation)"}
    measured = (f"measured noise scale {gns_tokens:.4g} labelled tokens = {gns_tokens / tokens_per_sequence:.3g} "
                f"sequences" + (f", micro-batch {micro_batch} step {1000 * times[0]:.3g} ms, optimizer step "
                                f"{1000 * times[1]:.3g} ms" if times else "") + ": ")
    settings: dict = {}
    largest = token_cap(gns_tokens, tokens_per_sequence)  # sequences per update within the slack of one
    if micro_batch > largest:  # a power of two, so the planner's micro-batches divide it
        batch = 1 << (largest.bit_length() - 1)
        settings["training.micro_batch_size"] = "auto"
        why = (f"micro-batch {micro_batch} costs {100 * token_overhead(micro_batch, gns_tokens / tokens_per_sequence):.3g}% "
               f"more tokens to a loss than one sequence; {batch} sequence(s) per update stay within "
               f"{100 * TOKEN_SLACK:g}% (a smaller micro-batch runs slower per token but wastes none of the run's "
               f"data); ")
    elif times is None:  # a run still in the batch-size warmup times no step
        return {"reason": "the step times were not measured (too few optimizer steps after the warmup)"}
    else:
        t_micro, t_opt = times
        accumulation = best_accumulation(gns_tokens, micro_batch * tokens_per_sequence, t_micro, t_opt, 1,
                                         max(1, largest // micro_batch))
        batch = micro_batch * accumulation
        why = (f"{accumulation} micro-batch(es) per update minimise the time to a loss within "
               f"{100 * TOKEN_SLACK:g}% extra tokens; ")
    rule = scale_for_batch(learning_rate, betas, optimizer, batch_used, batch)
    settings |= {"training.effective_batch_size": batch, "training.gradient_accumulation_steps": "auto",
                 "training.reference_batch_size": batch,
                 "training.learning_rate": float(f"{rule.new_learning_rate:.4g}")}
    if rule.new_betas is not None:
        settings["optimizer.betas"] = [rule.new_betas[0], float(f"{rule.new_betas[1]:.6g}")]
    return {"settings": settings, "reason": measured + why + rule.describe()}
