"""The training method registry (finetune/recipe/methods.py): every entry has what docs/architecture.md's "How
to add a training method" list says, and everything that names methods reads the registry."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from pydantic import ValidationError

from finetune.data.build import data_kind
from finetune.memory.preference import PreferenceLoss
from finetune.recipe.methods import DATA_KINDS, METHODS, method_names, method_spec
from finetune.recipe.reference import resolve
from finetune.recipe.schema import Recipe, TrainingConfig
from ui.form import form_specs

BASE = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}}


@pytest.mark.parametrize("spec", METHODS, ids=lambda s: s.name)
def test_every_entry_has_what_the_how_to_add_list_says(spec):
    """Its data kind is one finetune.data.build makes, its loss imports, its keys are training.* fields (and,
    for a preference method, knobs its loss receives), and a training section of it validates."""
    assert spec.data_kind in DATA_KINDS and data_kind(spec.name) == spec.data_kind
    assert callable(resolve(spec.loss)), spec.loss
    assert set(spec.keys) <= set(TrainingConfig.model_fields), spec.keys
    if spec.preference:
        knobs = {f.name: f.default for f in dataclasses.fields(PreferenceLoss)}  # the loss's own defaults
        assert {key: knobs.get(key) for key in spec.keys} == \
            {key: TrainingConfig.model_fields[key].default for key in spec.keys}
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
        for key in spec.keys:
            others = [m.name for m in METHODS if key not in m.keys]
            field = TrainingConfig.model_fields[key]
            value = (not field.default) if isinstance(field.default, bool) else \
                "ipo" if key == "loss_type" else field.default / 2 or 0.25
            with pytest.raises(ValidationError, match=f"training.{key}"):
                Recipe.model_validate({**BASE, "training": {"method": others[0], key: value}})
