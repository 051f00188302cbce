"""Recipe tab: the form (one widget per recipe key), load and save a recipe YAML, and the YAML it makes."""

from __future__ import annotations

import json
from typing import Any

import gradio as gr

from finetune.rundir import RECIPE
from ui.backend import Backend
from ui.form import FieldSpec, sections
from ui.tabs.messages import reported


def _widget(spec: FieldSpec, value: Any) -> gr.components.Component:
    common = dict(value=value, label=spec.name, info=spec.description, elem_id=spec.elem_id, interactive=True)
    if spec.kind == "checkbox":
        return gr.Checkbox(**common)
    if spec.kind == "number":
        return gr.Number(precision=0 if spec.integer else None, **common)
    if spec.kind == "dropdown":
        return gr.Dropdown(choices=[c[0] for c in spec.choices], allow_custom_value=spec.custom, **common)
    placeholder = "required" if spec.required else ("empty = null" if spec.nullable else "empty = default")
    return gr.Textbox(placeholder=placeholder, max_lines=1, **common)


def _form(backend: Backend) -> list[gr.components.Component]:
    """One accordion per recipe section, one widget per key, in schema order; defaults shown, output.dir in runs,
    required keys (which have no default) empty."""
    initial = {"model": {"path": "required"}, "data": {"path": "required"},
               "output": {"dir": str(backend.settings.runs_dir / "run")}}
    values = backend.load_yaml(json.dumps(initial), "defaults")
    defaults = {s: "" if s.required else v for s, v in zip(backend.specs, values, strict=True)}
    widgets = []
    for section, description in sections():
        specs = [s for s in backend.specs if s.section == section]
        with gr.Accordion(f"{section} — {description}" if description else section,
                          open=section in ("model", "data", "training"), elem_id=f"section-{section}"):
            for start in range(0, len(specs), 3):
                with gr.Row():
                    widgets.extend(_widget(s, defaults[s]) for s in specs[start:start + 3])
    return widgets


def build(demo: gr.Blocks, backend: Backend) -> list[gr.components.Component]:
    """The Recipe tab; returns the form's widgets (in spec order), which the other tabs read."""
    keys = [s.key for s in backend.specs]
    with gr.Tab("Recipe", id="recipe"):
        with gr.Row():
            recipe_upload = gr.File(label="Load a recipe YAML", file_types=[".yaml", ".yml"],
                                    elem_id="recipe-upload", scale=2, height=140)
            with gr.Column(scale=1):
                save_btn = gr.Button("Save form as recipe YAML", elem_id="save-recipe")
                recipe_file = gr.File(label=RECIPE, interactive=False, elem_id="recipe-file", height=90)
        recipe_msg = gr.Markdown(elem_id="recipe-problems")
        widgets = _form(backend)
        recipe_yaml = gr.Code(language="yaml", label="Recipe YAML: exactly what `finetune run` reads",
                              interactive=False, elem_id="recipe-yaml")
        saved_form = gr.BrowserState(None, storage_key="finetune-form")  # the form survives a page reload

    def load_file(path: str | None):
        if not path:
            return (gr.skip(), *[gr.skip()] * len(widgets))
        name, values = backend.load_upload(path)
        return (f"Loaded {name}.", *values)

    recipe_upload.upload(reported(1 + len(widgets))(load_file), recipe_upload, [recipe_msg, *widgets],
                         api_name="load_recipe")

    @reported(2)
    def show_yaml(*values):
        return "", backend.recipe_file(values)[1]

    gr.on([w.change for w in widgets], show_yaml, widgets, [recipe_msg, recipe_yaml], trigger_mode="always_last",
          api_visibility="private")

    def remember(*values):
        return dict(zip(keys, values, strict=True))

    def restore(saved):
        if not isinstance(saved, dict) or set(saved) != set(keys):  # nothing saved, or another schema
            return [gr.skip()] * len(widgets)
        return [saved[k] for k in keys]

    gr.on([w.change for w in widgets], remember, widgets, saved_form, trigger_mode="always_last",
          api_visibility="private")
    demo.load(restore, saved_form, widgets, api_visibility="private")

    @reported(2)
    def save(*values):
        path, text = backend.recipe_file(values)
        return "", str(path)

    save_btn.click(save, widgets, [recipe_msg, recipe_file], api_name="save_recipe")
    demo.load(show_yaml, widgets, [recipe_msg, recipe_yaml], api_visibility="private")
    return widgets
