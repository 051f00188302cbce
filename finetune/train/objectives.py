"""The training methods' objectives (`finetune.train.policy.Objective`): what the loop calls, blind, for each
forward/backward, for held-out evaluation and for a training row's metrics.

Each `MethodSpec` in finetune/recipe/methods.py names its objective's factory, "module:function" taking
`(config: RunConfig, context: MethodContext)`; `make_objective` builds the one a run's method names. SFT and
the preference methods (dpo, orpo, simpo, cpo, kto: the loss the registry names, through
`finetune.step.preference`) are one class here, a loss over collated batches (`LossObjective`); GRPO's is its
loop policy (finetune/train/grpo.py: `grpo_objective`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from finetune.recipe.reference import resolve
from finetune.recipe.resolved import RunConfig
from finetune.rundir import EVAL_PREFIX, RunDir
from finetune.step.preference import Metrics, PreferenceLoss, metric_means
from finetune.step.training_step import compute_loss, forward_backward
from finetune.train.policy import Objective, Part

if TYPE_CHECKING:
    from finetune.train.loop import TrainLoop


@dataclass(frozen=True)
class MethodContext:
    """What an objective may need beyond the recipe: the tokenizer (GRPO decodes and scores its answers) and
    the run directory (GRPO writes its sampled answers there; None without one, and on ranks other than 0)."""

    tokenizer: Any = None
    run_dir: RunDir | None = None


def make_objective(config: RunConfig, context: MethodContext = MethodContext()) -> Objective:
    """The objective of the run's training.method, by the factory its registry entry names."""
    factory: Callable[[RunConfig, MethodContext], Objective] = resolve(config.recipe.training.spec.objective)
    return factory(config, context)


class LossObjective:
    """A loss over collated batches: the causal-LM loss (sft), or the preference loss of the method
    (`preference`), finetune.step.training_step's forward/backward with the loop's memory savers. Metrics (a
    preference loss's rewards and margins, a MoE router's aux_loss) are summed over micro-batches and logged
    as means."""

    def __init__(self, preference: PreferenceLoss | None):
        self.preference = preference
        self.evaluates_before = preference is not None  # the rewards before training, for results.json
        self._metrics: dict[str, Metrics] = {"train": {}, "eval": {}}

    def forward_backward(self, loop: TrainLoop, part: Part) -> torch.Tensor:
        batch = part.batch
        return forward_backward(
            loop.model, batch, accumulation=part.count, num_items_in_batch=part.num_items,
            chunked_loss=loop.memory.chunked_loss and batch.labels is not None, autocast=loop.accelerator.autocast,
            offload=loop.memory.offload, backward=lambda loss: loop.backward(part.scaled(loss)),
            preference=self.preference, metrics=self._metrics["train"])

    def training_metrics(self, loop: TrainLoop) -> dict[str, float]:
        values = metric_means(self._metrics["train"])
        self._metrics["train"] = {}
        return values

    def evaluate(self, loop: TrainLoop) -> dict[str, float]:
        """The held-out loss (and a preference method's rewards, margins, accuracy), over every process: per
        loss token for sft (each micro-batch's mean weighted by its labelled tokens, as `finetune eval` and
        perplexity count it), per example for a preference method (its loss is one per pair)."""
        loop.model.eval()
        losses, counts = [], []
        b = loop.geometry.part_rows
        data = loop.data.eval
        indices = list(range(len(data)))[loop.rank::loop.processes] if loop.processes > 1 else range(len(data))
        indices = list(indices)
        self._metrics["eval"] = {}  # an evaluation stopped midway left its part
        with torch.no_grad(), loop.evaluation_progress(len(indices), "held-out examples") as advance:
            for i in range(0, len(indices), b):
                batch = loop.collate([data[j] for j in indices[i:i + b]])
                with loop.accelerator.autocast():
                    loss = compute_loss(loop.model, batch, chunked_loss=loop.memory.chunked_loss
                                        and batch.labels is not None, preference=self.preference,
                                        metrics=self._metrics["eval"])
                rows = len(indices[i:i + b])
                weight = rows if self.preference is not None or batch.labels is None else \
                    int((batch.labels[..., 1:] != -100).sum())
                losses.append(loss.detach().float() * weight)
                counts.append(weight)
                advance(rows)
        loop.model.train()
        total = torch.stack(losses).sum() if losses else torch.tensor(0.0, device=loop.accelerator.device)
        count = torch.tensor(float(sum(counts)), device=total.device)
        if loop.processes > 1:
            total = loop.accelerator.gather(total.reshape(1)).sum()
            count = loop.accelerator.gather(count.reshape(1)).sum()
        metrics = {f"{EVAL_PREFIX}loss": float(total / count.clamp(min=1))}
        if self.preference is not None:
            metrics.update(metric_means(self._metrics["eval"], EVAL_PREFIX))
        self._metrics["eval"] = {}
        return metrics


def loss_objective(config: RunConfig, context: MethodContext) -> LossObjective:
    """sft's and the preference methods' objective (the method's loss from its registry entry)."""
    return LossObjective(PreferenceLoss.of(config.recipe.training, fused=config.settings.kernels == "liger"))
