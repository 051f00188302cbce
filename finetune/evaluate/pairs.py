"""Held-out preference pairs measured for `finetune eval` of a preference run (training.method dpo, orpo, simpo,
cpo): per model, how often it gives the chosen answer the higher log-probability, the method's implicit reward
(accuracy and margin, as training logs them: TRL's `rewards/accuracies`, `rewards/margins`), the method's loss,
and the chosen answers' NLL per token. The log-probabilities and the method's formula are the training step's
(finetune.step.preference); the reference, where the method uses one, is the base model with the adapters
off. docs/export.md, "Preference runs"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from finetune.rundir import REWARD_ACCURACY, REWARD_MARGIN
from finetune.step.preference import (
    Metrics,
    PreferenceLoss,
    metric_means,
    objective_of,
    reference_logps,
    sequence_logps,
)


def pair_measures(model: Any, examples: Any, collate: Callable[[list[dict]], Any], loss: PreferenceLoss, *,
                  is_base: bool) -> dict[str, Any]:
    """The measures of `model` on tokenized pairs (chosen_/rejected_ input_ids and labels), one pair per
    forward (no padding between pairs). `is_base`: the model is the base itself, its own reference: its
    implicit reward, where the method's is relative to a reference, is 0 by definition and left out (None); so
    are the reward and loss of a full fine-tune (`--compare`d) where the method's reference is the base: it has
    no adapter to switch off."""
    import torch

    metrics: Metrics = {}
    total = chosen_logps = margin = 0.0
    chosen_tokens = prefers = 0
    with torch.no_grad():
        for example in examples:
            inputs = dict(collate([example]).to(model.device))
            logps, counts = sequence_logps(model, inputs, chunked=True)
            if not loss.uses_reference:
                ref = torch.zeros_like(logps)
            elif is_base or not hasattr(model, "disable_adapter"):
                ref = logps
            else:
                ref = reference_logps(model, inputs, chunked=True)  # the base: adapters off (reference_model)
            total += float(objective_of(loss, logps.float(), ref.float(), counts, metrics=metrics))
            (pc, pr), (cc, _) = logps.float().tolist(), counts.tolist()
            chosen_logps += pc
            chosen_tokens += cc
            margin += pc - pr
            prefers += pc > pr
    n = len(examples)
    means = metric_means(metrics)
    relative = loss.uses_reference and is_base
    unknown = loss.uses_reference and not is_base and not hasattr(model, "disable_adapter")  # no reference here
    return {"pairs": n, "loss": None if unknown else total / max(n, 1),
            "prefers_chosen": prefers / max(n, 1), "logp_margin": margin / max(n, 1),
            "reward_accuracy": None if relative or unknown else means.get(REWARD_ACCURACY),
            "reward_margin": None if relative or unknown else means.get(REWARD_MARGIN),
            "chosen_nll": -chosen_logps / max(chosen_tokens, 1), "chosen_tokens": chosen_tokens}
