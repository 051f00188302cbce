"""The training method registry (finetune/recipe/methods.py): every entry has what docs/architecture.md's "How
to add a training method" list says, and everything that names methods reads the registry."""

from __future__ import annotations

import inspect

import pytest
from pydantic import ValidationError

from finetune.data.build import data_kind
from finetune.recipe.methods import (
    DATA_KINDS,
    METHODS,
    Knob,
    MethodSpec,
    method_knobs,
    method_names,
    method_spec,
)
from finetune.recipe.reference import resolve
from finetune.recipe.schema import Recipe, TrainingConfig, training_config
from finetune.step.preference import PreferenceLoss
from ui.form import form_specs

BASE = {"model": {"path": "m"}, "data": {"path": "d.jsonl", "batching": "random"}}


@pytest.mark.parametrize("spec", METHODS, ids=lambda s: s.name)
def test_every_entry_has_what_the_how_to_add_list_says(spec):
    """Its data kind is one finetune.data.build makes, its loss imports, its keys are training.* fields (and,
    for a preference method, knobs its loss receives), and a training section of it validates."""
    assert spec.data_kind in DATA_KINDS and data_kind(spec.name) == spec.data_kind
    assert callable(resolve(spec.loss)), spec.loss
    assert set(spec.keys) <= set(TrainingConfig.model_fields) - set(method_knobs()), spec.keys  # shared fields
    assert {key: TrainingConfig.model_fields[key].default for key in spec.knobs} == \
        {key: knob.default for key, knob in spec.knobs.items()}
    if spec.preference:  # the loss receives every key of the method, the recipe's value or the default
        loss = PreferenceLoss(spec.name)
        assert {key: getattr(loss, key) for key in (*spec.keys, *spec.knobs)} == \
            {key: TrainingConfig.model_fields[key].default for key in (*spec.keys, *spec.knobs)}
        assert len(inspect.signature(resolve(spec.loss)).parameters) == (4 if spec.data_kind == "kto" else 7)
        assert spec.rows_per_example == (2 if spec.data_kind == "pair" else 1)
    training = TrainingConfig.model_validate({"method": spec.name})
    assert training.spec is spec and training.uses_reference == spec.reference


@pytest.mark.parametrize("spec", METHODS, ids=lambda s: s.name)
def test_every_entry_names_an_objective_factory_the_loop_can_call_blind(spec):
    """The factory takes (config, context); for a loss over collated batches it makes an Objective whose
    preference loss is the method's (GRPO's, which needs rewards and a tokenizer, trains in test_grpo_run)."""
    from finetune.recipe import validate_recipe
    from finetune.recipe.resolved import resolve as resolve_config
    from finetune.train.objectives import MethodContext, make_objective

    factory = resolve(spec.objective)
    assert list(inspect.signature(factory).parameters) == ["config", "context"]
    if spec.generates:
        return
    config = resolve_config(validate_recipe({
        **BASE, "training": {"method": spec.name, "micro_batch_size": 1, "gradient_accumulation_steps": 1},
        "memory": {"activation_checkpointing": False, "chunked_loss": False, "tiled_mlp": False}}))
    objective = make_objective(config, MethodContext())
    assert all(callable(getattr(objective, name)) for name in ("forward_backward", "evaluate", "training_metrics"))
    assert objective.evaluates_before == spec.preference
    assert objective.preference is None if not spec.preference else objective.preference.method == spec.name


def test_unknown_method_is_refused_naming_the_known_ones():
    with pytest.raises(ValidationError) as raised:
        Recipe.model_validate({**BASE, "training": {"method": "ppo"}})
    assert all(f"'{name}'" in str(raised.value) for name in method_names())
    with pytest.raises(KeyError, match="unknown training.method 'ppo'; known: sft, dpo"):
        method_spec("ppo")
    with pytest.raises(KeyError, match="ppo"):  # the data build cannot fall back to sft-shaped data
        data_kind("ppo")


def test_form_dropdown_and_key_checks_come_from_the_registry():
    method = next(s for s in form_specs() if s.key == "training.method")
    assert tuple(v for _, v in method.choices) == method_names()
    for spec in METHODS:  # a key of one method set for a method that does not name it is refused
        for key in (*spec.keys, *spec.knobs):
            others = [m.name for m in METHODS if key not in m.keys and key not in m.knobs]
            field = TrainingConfig.model_fields[key]
            value = (not field.default) if isinstance(field.default, bool) else \
                "ipo" if key == "loss_type" else field.default / 2 or 0.25
            with pytest.raises(ValidationError, match=f"training.{key}"):
                Recipe.model_validate({**BASE, "training": {"method": others[0], key: value}})


def test_a_knob_declared_in_one_entry_is_a_training_key_of_that_method_only():
    """A throwaway registry: its method's knob becomes a bounded training.* field with its default and
    description, set for that method it validates, set for another it is refused naming the key, and the
    loss of a recipe carries its value (no schema, loss or form edit)."""
    toy = MethodSpec("toy", "toy (a test's method)", "pair", "finetune.step.preference:dpo_loss",
                     rows_per_example=2, keys=("beta",),
                     knobs={"toy_margin": Knob(0.25, "toy only: a margin.", ge=0, le=2)})
    section = training_config((*METHODS, toy))
    field = section.model_fields["toy_margin"]
    assert (field.default, field.description) == (0.25, "toy only: a margin.")
    assert section.model_validate({"method": "toy", "toy_margin": 1.5}).toy_margin == 1.5
    assert section.model_validate({"method": "toy"}).toy_margin == 0.25
    with pytest.raises(ValidationError, match="training.toy_margin: applies only to toy, not dpo; remove it"):
        section.model_validate({"method": "dpo", "toy_margin": 1.5})
    with pytest.raises(ValidationError, match="less than or equal to 2"):
        section.model_validate({"method": "toy", "toy_margin": 3})
    assert "toy_margin" not in TrainingConfig.model_fields  # the registry's own section is untouched
    with pytest.raises(ValidationError):
        TrainingConfig.model_validate({"method": "toy"})


def test_a_knob_two_entries_declare_is_refused():
    """A key two methods use is a shared schema field named in `keys`, not declared twice."""
    knob = {"twin": Knob(1.0, "a twin knob.")}
    twins = tuple(MethodSpec(name, name, "sft", "finetune.memory.chunked_loss:causal_lm_loss", knobs=knob)
                  for name in ("a", "b"))
    with pytest.raises(ValueError, match="training.twin is declared by two methods"):
        training_config(twins)


def test_a_preference_loss_reads_the_recipes_knobs():
    """`PreferenceLoss.of` takes every knob from the recipe (a method's own and the shared ones); an unknown
    knob is refused."""
    loss = PreferenceLoss.of(TrainingConfig.model_validate({"method": "kto", "desirable_weight": 2.0, "beta": 0.3}))
    assert (loss.method, loss.desirable_weight, loss.undesirable_weight, loss.beta) == ("kto", 2.0, 1.0, 0.3)
    with pytest.raises(TypeError, match="not a training method's knob: gamma"):
        PreferenceLoss("simpo", gamma=1.0)
