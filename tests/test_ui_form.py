"""The recipe form is generated from the schema and reads back exactly the recipe it shows."""

from __future__ import annotations

import pytest

from finetune import api
from finetune.errors import RecipeError
from finetune.recipe import validate_recipe
from finetune.recipe.init_from import resolve_init_from
from finetune.recipe.load import iter_fields, load_recipe_text
from ui.form import dict_to_values, form_specs, from_widget, values_to_dict

SPECS = form_specs()
BY_KEY = {s.key: s for s in SPECS}


def _values(recipe: dict) -> list:
    return dict_to_values(SPECS, validate_recipe(recipe).model_dump(mode="python"))


def test_every_schema_key_has_a_widget_with_its_description():
    keys = [key for key, _, is_section in iter_fields() if not is_section]
    assert [s.key for s in SPECS] == keys
    assert all(s.description for s in SPECS)


@pytest.mark.parametrize(("key", "kind"), [
    ("model.dtype", "dropdown"), ("model.trust_remote_code", "checkbox"), ("adapter.r", "number"),
    ("training.micro_batch_size", "dropdown"), ("memory.activation_checkpointing", "dropdown"),
    ("memory.gpu_memory", "bytes"), ("adapter.target_modules", "yaml"), ("training.max_steps", "yaml"),
    ("data.chat_template", "text"), ("training.eval_steps", "yaml")])
def test_widget_kinds_follow_the_types(key, kind):
    assert BY_KEY[key].kind == kind


def test_choices_include_auto_and_null_where_the_schema_allows_them():
    assert [c for c, _ in BY_KEY["quantization.bits"].choices] == ["4", "8", "auto", "null"]
    assert BY_KEY["training.micro_batch_size"].custom  # an int may be typed beside "auto"
    assert [c for c, _ in BY_KEY["memory.chunked_loss"].choices] == ["true", "false", "auto"]


def test_form_round_trip_keeps_every_value():
    recipe = {
        "model": {"path": "models/x", "dtype": "bf16"},
        "quantization": {"bits": None},
        "adapter": {"type": "dora", "r": 8, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]},
        "data": {"path": "d.jsonl", "validation_split": 0.1, "chat_template": "{{ messages }}", "max_samples": 50},
        "training": {"max_steps": 30, "micro_batch_size": "auto", "gradient_accumulation_steps": 4,
                     "effective_batch_size": 16, "eval_steps": 10, "max_grad_norm": None},
        "memory": {"gpu_memory": "12GiB", "offload": "disk", "chunked_loss": True},
        "optimizer": {"name": "apollo_mini", "betas": [0.9, 0.95], "rank": 1, "proj_type": "left"},
        "output": {"dir": "runs/x"},
    }
    expected = validate_recipe(recipe)
    values = _values(recipe)
    assert values[[s.key for s in SPECS].index("memory.gpu_memory")] == "12GiB"
    assert validate_recipe(values_to_dict(SPECS, values)) == expected


def test_empty_widgets_mean_null_or_default_and_required_keys_are_named():
    values = _values({"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "training": {"max_steps": 5}})
    keys = [s.key for s in SPECS]
    values[keys.index("training.max_steps")] = ""
    values[keys.index("model.path")] = "  "
    data = values_to_dict(SPECS, values)
    assert data["training"]["max_steps"] is None  # empty nullable field: null
    assert "path" not in data["model"]
    with pytest.raises(RecipeError) as err:
        validate_recipe(data, "form")
    assert any("missing required key model.path" in p for p in err.value.problems)


@pytest.mark.parametrize(("key", "placeholder"), [
    ("model.path", "required"),
    ("training.max_steps", "empty: trains for epochs"),  # the description's "null trains for `epochs`"
    ("training.eval_steps", "empty: at the end"),
    ("training.max_grad_norm", "empty: disables clipping"),
    ("memory.offload_dir", "empty: <output.dir>/offload"),
    ("data.chat_template", "empty: the tokenizer's"),
    ("data.system_prompt", "empty: none"),  # nothing said about null: nothing is added
    ("output.dir", "empty: the default, runs/run"),  # not nullable: left out, so the default applies
    ("memory.gpu_memory_margin", "empty: the default, 512 MiB")])
def test_each_text_box_says_what_leaving_it_empty_means(key, placeholder):
    assert BY_KEY[key].placeholder == placeholder


def test_no_text_box_is_left_with_a_placeholder_in_the_forms_own_words():
    """Every optional text box's placeholder comes from its schema entry, not a generic "empty = null"."""
    shown = {s.key: s.placeholder for s in SPECS if s.kind in ("text", "bytes", "yaml")}
    assert all(p == "required" or p.startswith("empty: ") and "null" not in p for p in shown.values()), shown
    assert all(len(p) <= 60 for p in shown.values()), shown  # one short line in a one-line box


def test_bad_values_are_reported_per_key():
    values = _values({"model": {"path": "m"}, "data": {"path": "d.jsonl"}})
    keys = [s.key for s in SPECS]
    values[keys.index("training.micro_batch_size")] = "zero"
    values[keys.index("memory.gpu_memory")] = "12 bananas"
    with pytest.raises(RecipeError) as err:
        validate_recipe(values_to_dict(SPECS, values), "form")
    text = "\n".join(err.value.problems)
    assert "training.micro_batch_size" in text and "memory.gpu_memory" in text


def test_typed_values_in_a_dropdown_are_read_as_yaml():
    assert from_widget(BY_KEY["training.micro_batch_size"], "8") == 8
    assert from_widget(BY_KEY["quantization.bits"], "null") is None
    assert from_widget(BY_KEY["memory.activation_checkpointing"], "false") is False


def test_every_field_shows_its_default_and_whether_the_planner_decides_it():
    from finetune.recipe.settings import table

    planned = {s.key for s in table()}
    for spec in SPECS:
        assert "Default: " in spec.info, spec.key
        assert ("Planner-decided when auto" in spec.info) == (spec.key in planned), spec.key
    assert BY_KEY["memory.chunked_loss"].info.endswith("Default: auto. Planner-decided when auto (the default).")
    assert "Default: 512MiB." in BY_KEY["memory.gpu_memory_margin"].info
    assert "Default: none (required)." in BY_KEY["model.path"].info


def _adapter_run(folder, model_dir, **shape) -> None:
    """A finished run directory whose adapter/ has `shape` (LoRA config keys); weights are not read by the plan."""
    import json

    from finetune.recipe.load import recipe_to_yaml
    from finetune.rundir import RunDir, atomic_write_text

    run = RunDir(folder)
    run.create()
    atomic_write_text(run.recipe, recipe_to_yaml(validate_recipe(
        {"model": {"path": str(model_dir)}, "data": {"path": "d.jsonl"}, "output": {"dir": str(folder)}})))
    run.adapter.mkdir()
    config = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"], **shape}
    (run.adapter / "adapter_config.json").write_text(json.dumps(config))
    (run.adapter / "adapter_model.safetensors").write_bytes(b"")


def test_a_form_starting_from_an_adapter_takes_its_shape_unless_the_user_set_one(tmp_path, tiny_model_dir,
                                                                               monkeypatch):
    """adapter.init_from: the form's untouched defaults (r 16, alpha 32, lora, all-linear...) are not sent, so the
    adapter's own shape (r 8 here) is planned; a shape key the user changed is sent and refused if it differs."""
    from run_support import sums_data

    from tests.ui_support import form_values, set_value
    from ui.backend import Backend, UISettings
    from ui.runs import RunManager

    _adapter_run(tmp_path / "sft", tiny_model_dir, r=8, lora_alpha=8, use_dora=True)
    backend = Backend(UISettings([tmp_path, tiny_model_dir], tmp_path / "runs"), RunManager(tmp_path / "runs"))
    values = form_values({"model": {"path": str(tiny_model_dir)}, "data": {"path": str(tmp_path / "d.jsonl")},
                          "training": {"method": "sft", "max_steps": 5}, "output": {"dir": str(tmp_path / "next")}})
    assert backend.recipe(values).adapter.r == 16  # the form shows the schema's defaults
    values = set_value(values, "adapter.init_from", str(tmp_path / "sft"))
    adapter = resolve_init_from(backend.recipe(values)).adapter
    assert (adapter.type, adapter.r, adapter.alpha, adapter.target_modules) == ("dora", 8, 8.0, ["q_proj", "v_proj"])
    plan = backend.plan(values, "8 GB card (RTX 4060)")
    assert plan["fits"] and plan["breakdown"]["trainable_weights"] > 0
    assert plan["chosen_automatically"]["memory.chunked_loss"] == plan["settings"]["chunked_loss"]  # auto default
    # what fits per GPU size re-plans copies of the recipe (one GPU size that fits nothing: two plans)
    assert api.plan_gpu_sizes(backend.checked_recipe(values), sizes_gb=(0,), ladder=(256,))["sizes"][0][
        "longest_context"] is None
    queued = []  # Start writes the recipe a `finetune run` process reads; so does the download button
    monkeypatch.setattr(backend.manager, "submit", lambda recipe, run_dir: queued.append(recipe))
    with pytest.raises(RecipeError, match="data.path .*d.jsonl' does not exist"):  # api.preflight: nothing queued
        backend.start(values)
    assert queued == []
    sums_data(tmp_path / "d.jsonl", 4)
    backend.start(values)
    for text in (queued[0].read_text(), backend.recipe_text(values)):
        assert resolve_init_from(load_recipe_text(text)).adapter.r == 8

    changed = set_value(values, "adapter.r", 4)  # the user's own value is the user's: refused, naming the key
    with pytest.raises(RecipeError) as err:
        resolve_init_from(backend.recipe(changed))
    assert any("adapter.r: the recipe sets 4, the adapter has 8" in p for p in err.value.problems)


def test_recipe_problems_carry_key_and_code_and_read_as_before():
    """Each problem is its line as before (a str) with the recipe key and a code the UI acts on."""
    data = {"model": {}, "data": {"path": "d.jsonl", "bogus": 1},
            "training": {"micro_batch_size": "zero", "learning_rate": -1.0}}
    with pytest.raises(RecipeError) as err:
        validate_recipe(data, "form")
    found = {(p.key, p.code) for p in err.value.problems}
    assert {("model.path", "missing"), ("data.bogus", "unknown_key"), ("training.learning_rate", "value")} <= found
    assert ("training.micro_batch_size", "value") in found  # an int or `auto`: one problem, the branches joined
    missing = next(p for p in err.value.problems if p.code == "missing")
    assert missing == "form: missing required key model.path" and str(missing) in str(err.value)
    with pytest.raises(RecipeError) as err:
        load_recipe_text("model:\n  path: m\n  path: n\ndata:\n  'a b': 1\n", "r.yaml")
    assert [(p, p.key, p.code) for p in err.value.problems] == [
        ("r.yaml:3: model.path: duplicate key (also on line 2); the recipe must give it once", "model.path",
         "duplicate"),
        ("r.yaml:5: data: key 'a b' is not a recipe key; keys are names of letters, digits and _ (see `finetune "
         "keys`)", "data", "key_name")]


def test_a_fresh_form_shows_the_first_steps_through_the_problem_code(tmp_path):
    """Only required keys missing: the Recipe tab shows the next step; anything else wrong: the error."""
    from finetune.errors import RecipeProblem
    from ui.tabs.messages import first_steps
    from ui.tabs.recipe import FIRST_STEPS

    values = _values({"model": {"path": "m"}, "data": {"path": "d.jsonl"}})
    keys = [s.key for s in SPECS]
    values[keys.index("model.path")] = values[keys.index("data.path")] = ""
    with pytest.raises(RecipeError) as fresh:
        validate_recipe(values_to_dict(SPECS, values), "form")
    assert {p.code for p in fresh.value.problems} == {"missing"}
    assert first_steps(fresh.value, FIRST_STEPS) == FIRST_STEPS
    values[keys.index("training.micro_batch_size")] = "zero"
    with pytest.raises(RecipeError) as wrong:
        validate_recipe(values_to_dict(SPECS, values), "form")
    assert first_steps(wrong.value, FIRST_STEPS) is None
    # the code decides, not the words: a value problem that quotes the phrase is still an error to show
    quoted = RecipeProblem("form: data.path: 'missing required key' is no file", "data.path", "value")
    assert first_steps(RecipeError("form is not a valid recipe (1 problem(s)):", [quoted]), FIRST_STEPS) is None


def test_the_basic_form_shows_the_schemas_basic_keys_and_folds_every_other_key_away(tmp_path):
    """The loaded-recipe page was ~5,200 px of schema keys: the schema's BASIC keys stay in view, every other key
    is inside the closed "Advanced settings" accordion (one closed accordion per section within it)."""
    import gradio as gr

    from finetune.recipe.schema import BASIC
    from ui.backend import Backend, UISettings
    from ui.layout import build_app
    from ui.runs import RunManager

    assert set(BASIC) <= set(BY_KEY)  # a renamed key cannot leave the basic form silently
    assert {"model.path", "data.path", "training.method", "training.max_steps", "training.learning_rate",
            "memory.gpu_memory", "adapter.type"} <= set(BASIC)
    manager = RunManager(tmp_path / "runs")
    try:
        demo = build_app(Backend(UISettings([tmp_path], tmp_path / "runs"), manager))
    finally:
        manager.close()

    def inside(block) -> list:
        children = getattr(block, "children", []) or []
        return [*children, *(b for c in children for b in inside(c))]

    (advanced,) = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "advanced"]
    assert isinstance(advanced, gr.Accordion) and advanced.open is False
    folded = {b.elem_id for b in inside(advanced) if (b.elem_id or "").startswith("field-")}
    fields = {b.elem_id for b in demo.blocks.values() if (getattr(b, "elem_id", None) or "").startswith("field-")}
    basic = {BY_KEY[k].elem_id for k in BASIC}
    assert basic <= fields and not basic & folded and folded == fields - basic
    sections = [b for b in inside(advanced) if isinstance(b, gr.Accordion)]
    assert sections and all(s.open is False for s in sections)
