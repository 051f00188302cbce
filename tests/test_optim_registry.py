"""The optimizer registry is the one list: the schema's names, checks and descriptions, factories, planner."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing

import pytest
from pydantic import ValidationError

from finetune.errors import RecipeError
from finetune.recipe import optimizers as registry
from finetune.recipe.load import load_recipe_text
from finetune.recipe.reference import resolve
from finetune.recipe.schema import OptimizerConfig, Recipe

RECIPE = "model:\n  path: m\ndata:\n  path: d.jsonl\n"


def test_the_schema_accepts_exactly_the_registered_names():
    accepted = set(typing.get_args(OptimizerConfig.model_fields["name"].annotation))
    assert accepted == {*registry.optimizer_names(), "auto"}
    description = OptimizerConfig.model_fields["name"].description
    assert all(f"{name} (" in description for name in registry.optimizer_names())


def test_a_misspelled_name_lists_the_valid_ones():
    with pytest.raises(RecipeError) as err:
        load_recipe_text(RECIPE + "optimizer:\n  name: mu0n\n", "r.yaml")
    text = str(err.value) + " ".join(getattr(err.value, "problems", []) or [])
    assert "r.yaml:6: optimizer.name" in text
    assert all(f"'{name}'" in text for name in registry.optimizer_names())


def test_every_reference_resolves_and_every_low_rank_preset_gives_a_rank():
    for spec in registry.SPECS:
        assert callable(resolve(spec.factory)) and callable(resolve(spec.state)), spec.name
        assert spec.own_params is None or callable(resolve(spec.own_params))
        assert spec.low_rank is None or spec.low_rank.rank(4096) >= 1
    with pytest.raises(ValueError, match="valid names: adamw, adamw_8bit"):
        registry.optimizer_spec("adam")


def test_recipes_validate_without_importing_torch_or_the_optimizer_package():
    code = ("import sys; from finetune.recipe.load import load_recipe_text; "
            f"load_recipe_text({RECIPE + 'optimizer: {name: muon}'!r}); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('finetune.optim')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_keys_for_other_optimizers_are_refused_by_what_the_registry_says():
    with pytest.raises(ValidationError, match=r"optimizer.rank: applies only to apollo, apollo_mini, galore and "
                                              r"galore_8bit, not muon"):
        OptimizerConfig(name="muon", rank=4)
    with pytest.raises(ValidationError, match="optimizer.momentum: applies only to sgd, not muon"):
        OptimizerConfig(name="muon", momentum=0.9)
    OptimizerConfig(name="auto", rank=4, momentum=0.9)  # the planner may pick any optimizer


def test_adapter_and_layerwise_rules_come_from_the_spec(monkeypatch):
    """A spec that trains only full weights and has no layer-wise mode is refused up front, naming the keys."""
    strict = dataclasses.replace(registry.optimizer_spec("muon"), adapters=("full",), layerwise=False)
    monkeypatch.setitem(registry._BY_NAME, "muon", strict)
    data = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "optimizer": {"name": "muon", "layerwise": True}}
    with pytest.raises(ValidationError) as err:
        Recipe.model_validate(data)
    assert "optimizer muon trains only adapter.type full, not lora" in str(err.value)
    assert "optimizer.layerwise: muon has no layer-wise mode" in str(err.value)
    Recipe.model_validate({**data, "adapter": {"type": "full"}, "quantization": {"bits": None},
                           "optimizer": {"name": "muon"}})


def test_the_planners_auto_choices_are_the_registrys():
    from finetune.plan.search import AUTO_OPTIMIZERS

    assert AUTO_OPTIMIZERS == {s.name: s.auto_preference for s in registry.SPECS if s.auto_preference}
    assert list(AUTO_OPTIMIZERS) == ["adamw", "adamw_8bit", "apollo_mini"]
