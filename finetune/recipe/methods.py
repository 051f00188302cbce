"""The training method registry: one spec per recipe `training.method`, the one list everything else reads.

The schema takes its method names, their description, which training.* keys apply to which method and
whether a method needs the reference model from here; `finetune.data.build` builds the data kind a method
declares; `finetune.step.preference` runs the loss it names; the training loop calls the objective its
factory makes (`objective`, finetune/train/objectives.py: a loss over collated batches unless the method
brings its own, as GRPO does); the planner and the batch engine read its geometry hooks. This module imports no torch (the schema, at the bottom of the import graph, imports it): a
loss is named as "module:function" and imported only when a step computes it.

More in docs/architecture.md, "Training method entries (finetune/recipe/methods.py)".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

# What finetune.data.build makes of the data: sft sequences, chosen + rejected pairs, labelled single answers
# (kto), or prompts the model answers itself (finetune.data.prompts).
DataKind = Literal["sft", "pair", "kto", "prompt"]
DATA_KINDS: tuple[str, ...] = ("sft", "pair", "kto", "prompt")


@dataclass(frozen=True)
class Knob:
    """A training.* key only one method uses, declared in its entry: its default (whose type is the key's type),
    bounds and description (docs/recipe.md, the UI form). The schema turns it into the field."""

    default: float | int | bool | str
    description: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None


@dataclass(frozen=True)
class MethodSpec:
    """Everything the tool knows about one training method."""

    name: str  # the recipe's training.method value
    summary: str  # a few words for the training.method description (docs/recipe.md)
    data_kind: DataKind
    loss: str  # "module:function": the method's loss (pairwise signature above for data kind "pair")
    objective: str = "finetune.train.objectives:loss_objective"  # "module:function": its Objective's factory
    rows_per_example: int = 1  # sequences one example puts in a batch (a pair: chosen, then rejected)
    reference: bool = False  # the loss compares against the reference model (training.reference_free drops it)
    keys: tuple[str, ...] = ()  # shared training.* fields of the schema that apply only to the methods naming them
    knobs: Mapping[str, Knob] = field(default_factory=dict, hash=False)  # training.* keys of this method alone
    packing: str | None = None  # why data.packing cannot be used (None: it can)
    whole_batch: str | None = None  # why an update cannot be smaller than a loader batch (no batch warmup)
    generates: bool = False  # samples its own answers each step: the planner prices generation windows

    @property
    def preference(self) -> bool:
        """A loss over answers' sequence log-probabilities (finetune.step.preference's step)."""
        return self.data_kind in ("pair", "kto")


_WHOLE_ANSWERS = "preference losses compare whole answers"

METHODS: tuple[MethodSpec, ...] = (
    MethodSpec("sft", "sft (supervised)", "sft", "finetune.memory.chunked_loss:causal_lm_loss"),
    MethodSpec("dpo", "dpo (pairs, against the reference model)", "pair", "finetune.step.preference:dpo_loss",
               rows_per_example=2, reference=True,
               keys=("beta", "loss_type", "reference_free", "label_smoothing", "precompute_reference"),
               packing=_WHOLE_ANSWERS),
    MethodSpec("orpo", "orpo (pairs, reference-free, adds the NLL of the chosen answer)", "pair",
               "finetune.step.preference:orpo_loss", rows_per_example=2, keys=("beta",), packing=_WHOLE_ANSWERS),
    MethodSpec("simpo", "simpo (pairs, reference-free: length-averaged log-probabilities, a target margin)",
               "pair", "finetune.step.preference:simpo_loss", rows_per_example=2,
               keys=("beta", "label_smoothing"), packing=_WHOLE_ANSWERS,
               knobs={"simpo_gamma": Knob(0.5, "simpo only: the target reward margin by which the chosen answer's "
                                          "reward must beat the rejected one's.", ge=0, le=1e3)}),
    MethodSpec("cpo", "cpo (pairs, reference-free: a sigmoid loss on the log-probability margin plus the NLL of "
               "the chosen answer)", "pair", "finetune.step.preference:cpo_loss", rows_per_example=2,
               keys=("beta", "label_smoothing"), packing=_WHOLE_ANSWERS,
               knobs={"cpo_alpha": Knob(1.0, "cpo only: weight of the NLL of the chosen answer (behaviour cloning) "
                                        "added to the preference loss; 0: the sigmoid term alone.", ge=0, le=1e3)}),
    MethodSpec("kto", "kto (single answers labelled good or bad)", "kto", "finetune.step.preference:kto_loss",
               reference=True, keys=("beta", "precompute_reference"),
               knobs={"desirable_weight": Knob(1.0, "kto only: loss weight of good answers.", gt=0, le=1e3),
                      "undesirable_weight": Knob(1.0, "kto only: loss weight of bad answers.", gt=0, le=1e3)},
               packing=_WHOLE_ANSWERS,
               whole_batch="kto's reference point is the mean of its batch's answers: a batch of one learns nothing"),
    MethodSpec("grpo", "grpo (reinforcement learning from rewards on the model's own answers to prompts; its keys "
               "are in the grpo section; docs/rl.md)", "prompt", "finetune.rl.grpo_loss:grpo_loss",
               objective="finetune.train.grpo:grpo_objective",
               packing="GRPO generates from one prompt at a time", generates=True),
)

_BY_NAME = {m.name: m for m in METHODS}


def method_names() -> tuple[str, ...]:
    """The training.method values, in the table's order."""
    return tuple(_BY_NAME)


def method_spec(name: str) -> MethodSpec:
    """The spec of a training.method; a KeyError naming the known ones for any other name (the schema
    refuses unknown methods, so inside a run this cannot happen)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown training.method {name!r}; known: {', '.join(_BY_NAME)}") from None


def method_keys(methods: tuple[MethodSpec, ...] = METHODS) -> dict[str, tuple[str, ...]]:
    """training.* key -> the methods it applies to, shared keys and knobs alike (the keys no method names apply
    to all)."""
    keys: dict[str, tuple[str, ...]] = {}
    for spec in methods:
        for key in (*spec.keys, *spec.knobs):
            keys[key] = (*keys.get(key, ()), spec.name)
    return keys


def method_knobs(methods: tuple[MethodSpec, ...] = METHODS) -> dict[str, Knob]:
    """The knobs the entries declare, in the table's order (the schema's training.* fields of one method)."""
    knobs: dict[str, Knob] = {}
    for spec in methods:
        for name, knob in spec.knobs.items():
            if name in knobs:
                raise ValueError(f"training.{name} is declared by two methods; a shared key is a schema field "
                                 "that each method names in `keys`")
            knobs[name] = knob
    return knobs


def method_description(methods: tuple[MethodSpec, ...] = METHODS) -> str:
    """The training.method description (docs/recipe.md, the UI form)."""
    return "; ".join(m.summary for m in methods) + "."


def uses_reference(method: str, reference_free: bool = False) -> bool:
    """Whether the method's loss compares against the reference model (the base, adapter switched off)."""
    return method_spec(method).reference and not reference_free
