"""The planner-decided settings are one table (finetune.recipe.settings) that the schema's `auto` keys, the
search, Plan.apply and resume all go through; units, dtypes and the cache folder are defined once."""

from __future__ import annotations

import dataclasses
import typing
from types import SimpleNamespace

import pydantic
import pytest

from finetune.plan.search import Plan, _choices, auto_values
from finetune.recipe import settings as table_module
from finetune.recipe.schema import Recipe
from finetune.recipe.section import _leaf_types
from finetune.recipe.settings import Settings, auto_keys, read_settings, table, write_settings
from finetune.units import DTYPES, cache_dir, dtype_name, torch_dtype

# `auto` keys that the planner does not decide, and who does.
NOT_PLANNED = {
    "model.dtype": "the loader, from the GPU (finetune.units.dtype_name)",
    "model.attn_implementation": "the loader, from the family, the device and data.packing (finetune.model.attention)",
    "data.format": "the reader, from the first records",
    "memory.gpu_memory": "the budget: the GPU's free memory",
    "training.effective_batch_size": "the run, from the measured noise scale (finetune.train.batch_engine)",
}
# Follows the micro-batch (keeps training.effective_batch_size) instead of being searched.
FOLLOWS = {"gradient_accumulation_steps"}


def _recipe(**sections) -> Recipe:
    return Recipe.model_validate({"model": {"path": "m"}, "data": {"path": "d.jsonl"}, **sections})


def _field(key: str):
    section, name = key.split(".")
    return Recipe.model_fields[section].annotation.model_fields[name]


def _auto_able(key: str) -> bool:
    return "auto" in _leaf_types(_field(key).annotation)


def _schema_keys() -> list[str]:
    return [f"{section}.{name}" for section, info in Recipe.model_fields.items()
            for name in info.annotation.model_fields]


def _other_value(key: str, current: object) -> object:
    """A valid value for `key` other than `current` and `auto`, from the field's type (so new rows need none)."""
    leaves = _leaf_types(_field(key).annotation)
    options = [v for v in leaves if not isinstance(v, type) and v != "auto"]
    options += [True, False] if bool in leaves else []
    options += [current + 1] if int in leaves and isinstance(current, int) and not isinstance(current, bool) else []
    options += [None] if type(None) in leaves else []
    options += [1 << 20, 1] if int in leaves and current == "auto" else []  # a large one, or a small bounded one
    accepts = pydantic.TypeAdapter(_field(key).annotation)
    return next(v for v in options if v != current and _valid(accepts, v))


def _valid(accepts: pydantic.TypeAdapter, value: object) -> bool:
    try:
        accepts.validate_python(value)
    except pydantic.ValidationError:
        return False
    return True


def test_every_auto_key_of_the_schema_is_planned_or_said_to_be_someone_elses():
    auto_able = {k for k in _schema_keys() if _auto_able(k)}
    planned = {s.key for s in table() if _auto_able(s.key)}
    assert auto_able - set(NOT_PLANNED) == planned, "add the key to finetune.recipe.settings.Settings"
    assert {s.key for s in table()} <= set(_schema_keys())
    sections: dict[str, dict[str, str]] = {}
    for key in planned:
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = "auto"
    sections["distributed"]["gpus"] = 2  # distributed.strategy is planned only with several processes
    sections["data"]["path"] = "d.jsonl"
    everything_auto = _recipe(**sections)
    generating = {"grpo.generation_batch_size"}  # planned only with training.method grpo
    images = {"data.max_pixels"}  # planned only for a vision-language model
    streaming = {"memory.offload_weights", "memory.offload_weights_ahead",  # one process only (gpus is 2)
                 "memory.offload_weights_resident"}
    assert set(auto_keys(everything_auto)) == planned - generating - images - streaming


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_search_has_choices_for_every_searched_setting_and_each_is_a_valid_recipe_value(device):
    recipe = _recipe()
    searched = {s.name for s in table() if _auto_able(s.key)} - FOLLOWS
    choices = auto_values(recipe, device)
    assert set(choices) == searched
    for name, values in choices.items():
        assert values, name
        for value in values:
            assert read_settings(write_settings(recipe, {name: value}))[name] == value


@pytest.mark.parametrize("row", table(), ids=lambda s: s.name)
def test_each_setting_round_trips_through_the_recipe(row):
    base = _recipe(adapter={"type": "lora"})
    value = _other_value(row.key, read_settings(base)[row.name])
    changed = write_settings(base, {row.name: value})
    section, name = row.key.split(".")
    assert getattr(getattr(changed, section), name) == value
    assert read_settings(changed) == {**read_settings(base), row.name: value}
    assert write_settings(base, read_settings(changed)) == changed  # recipe -> settings -> recipe


def test_a_concrete_settings_row_round_trips():
    chosen = Settings(micro_batch_size=4, gradient_accumulation_steps=2, activation_checkpointing=False,
                      checkpoint_every_n_layers=2, offload="disk", chunked_loss=True, bits=8, optimizer="sgd",
                      tiled_mlp=True, max_pixels=1 << 20)
    recipe = write_settings(_recipe(), dataclasses.asdict(chosen))
    assert Settings(**read_settings(recipe)) == chosen
    assert auto_keys(recipe) == []


def test_the_search_enumerates_the_auto_values_of_exactly_the_auto_settings():
    recipe = _recipe(training={"micro_batch_size": "auto", "gradient_accumulation_steps": "auto",
                               "effective_batch_size": 8},
                     memory={"offload": "auto", "chunked_loss": False, "tiled_mlp": "auto"})
    spec = SimpleNamespace(device="cuda", seq_len=4096, tiled_mlp_tokens=1024, num_layers=4)
    found = _choices(recipe, spec)
    auto = auto_values(recipe, "cuda")
    for name in ("micro_batch_size", "offload", "tiled_mlp"):
        assert {getattr(s, name) for s in found} == set(auto[name])
    assert {s.chunked_loss for s in found} == {False}
    assert all(s.micro_batch_size * s.gradient_accumulation_steps >= 8 for s in found)
    assert len(found) == len(auto["micro_batch_size"]) * len(auto["offload"]) * len(auto["tiled_mlp"])


def _fake_plan(settings: dict) -> Plan:
    return Plan(device="cpu", settings=settings, peak_bytes=1, breakdown={}, budget_bytes=2**30, fits=True,
                tokens_per_s=1.0)


def test_a_new_row_reaches_plan_apply_and_resume(monkeypatch):
    """A row added to the table is written by Plan.apply and kept on resume with no other change."""
    from finetune.train.run import keep_resolved

    @dataclasses.dataclass(frozen=True)
    class Wider(Settings):
        dtype: str = table_module._setting("model.dtype", "dtype", default="fp32")

    chosen = dataclasses.asdict(Settings(1, 1, True, 1, "none", False, None, "adamw"))
    recipe = _recipe(model={"path": "m", "dtype": "auto"})
    saved = _recipe(model={"path": "m", "dtype": "bf16"})
    assert _fake_plan({**chosen, "dtype": "fp16"}).apply(recipe).recipe.model.dtype == "auto"
    assert keep_resolved(recipe, saved).model.dtype == "auto"

    monkeypatch.setattr(table_module, "Settings", Wider)
    assert "model.dtype" in auto_keys(recipe)
    assert _fake_plan({**chosen, "dtype": "fp16"}).apply(recipe).recipe.model.dtype == "fp16"
    assert keep_resolved(recipe, saved).model.dtype == "bf16"


def test_plan_apply_fills_the_budget_and_keeps_what_the_planner_does_not_decide():
    chosen = dataclasses.asdict(Settings(2, 4, False, 1, "cpu", True, None, "sgd", True))
    recipe = _recipe(training={"micro_batch_size": "auto", "learning_rate": 0.01}, memory={"gpu_memory_margin": 0})
    applied = _fake_plan(chosen).apply(recipe).recipe
    # one process: no strategy is written; sft: no generation batch; a text model: no image budget; no weight
    # streaming (offload_weights none): neither its read-ahead nor its resident layers
    assert read_settings(applied) == {**chosen, "strategy": "auto", "generation_batch_size": "auto", "max_pixels": "auto",
                                      "offload_weights_ahead": "auto", "offload_weights_resident": "auto"}
    assert applied.memory.gpu_memory == 2**30 and applied.training.learning_rate == 0.01
    explicit = recipe.model_copy(update={"memory": recipe.memory.model_copy(update={"gpu_memory": 5 * 2**30})})
    assert _fake_plan(chosen).apply(explicit).recipe.memory.gpu_memory == 5 * 2**30


def test_dtype_table_matches_the_schema_and_torch():
    assert set(typing.get_args(_field("model.dtype").annotation)) - {"auto"} == set(DTYPES)
    for name, dtype in DTYPES.items():
        assert torch_dtype(name).itemsize == dtype.bytes
    assert [dtype_name("auto", "cpu"), dtype_name("auto", "cuda"), dtype_name("auto", "cuda", False)] == \
        ["fp32", "bf16", "fp16"]
    assert dtype_name("fp16", "cpu") == "fp16"


def test_one_cache_folder(monkeypatch, tmp_path):
    from finetune.memory.bandwidth import cache_path

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path and cache_path().parent == tmp_path
    monkeypatch.setenv("FINETUNE_CACHE", "")  # empty: the default, not the working directory
    assert cache_dir().name == "finetune" and cache_dir().is_absolute()


def test_a_plan_that_cannot_be_made_stops_the_run_unless_skipped_on_purpose(monkeypatch):
    """A planner failure stops the run with one line that names the switch; `memory.plan: false` trains without a
    plan when only chunked_loss/tiled_mlp are auto (their plain value is always correct); any other auto key
    needs the plan and is a clear error."""
    from types import SimpleNamespace

    from finetune.errors import FinetuneError, RecipeError
    from finetune.train import run as run_module

    def unplannable(recipe):
        raise RuntimeError("unknown architecture")

    monkeypatch.setattr(run_module, "predict", unplannable)
    monkeypatch.setattr(run_module, "data_for_run", lambda recipe: SimpleNamespace(read=None))  # no data here
    kept = []  # the data the plan read, handed to the build
    with pytest.raises(FinetuneError, match="cannot make the memory plan: RuntimeError: unknown architecture") as err:
        run_module._plan(_recipe(memory={"chunked_loss": "auto", "tiled_mlp": "auto"}), kept.append)
    assert "--no-plan" in str(err.value)
    plan, resolved = run_module._plan(_recipe(memory={"chunked_loss": "auto", "tiled_mlp": "auto", "plan": False}),
                                           kept.append)
    assert plan is None and auto_keys(resolved) == []
    assert (resolved.memory.chunked_loss, resolved.memory.tiled_mlp) == (False, False)
    with pytest.raises(RecipeError, match="training.micro_batch_size"):
        run_module._plan(_recipe(training={"micro_batch_size": "auto"}, memory={"plan": False}), kept.append)
