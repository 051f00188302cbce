"""Recipe tab: start from something (a ready recipe, a recipe file, a previous run), the basic form (the
schema's BASIC keys, the GPU and a goal) and every other key folded under "Advanced settings", one section each,
generated from the schema."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gradio as gr

from finetune.errors import RecipeError
from finetune.recipe.goals import GOALS, SUMMARIES
from finetune.recipe.schema import BASIC
from finetune.rundir import RECIPE
from ui.backend import Backend
from ui.form import FieldSpec, sections
from ui.tabs.messages import first_steps, reported

YAML_LINES = 24  # the recipe's YAML (over 100 lines) scrolls inside a box of this many lines
KEEP = "keep the recipe's values"
FIRST_STEPS = "Choose a ready recipe above, or give the model and the data file in the basics."
POINT_AT = "Point at a ready recipe (or move to it with the keyboard) to read what it does."
# Each ready recipe's chip carries its description before it is picked: as its tooltip (title), and in the
# caption below the chips while the pointer or the keyboard is on it (its first sentence). Gradio's Radio
# has no per-choice hint, so the page adds them, again whenever it redraws the chips.
DESCRIBE_CHIPS = """() => {
  const said = DESCRIPTIONS, root = document.getElementById('gallery-pick');
  const caption = document.getElementById('gallery-caption');
  if (!root || !caption) return;
  const describe = () => root.querySelectorAll('label').forEach(label => {
    const text = said[label.innerText.trim()];
    if (text && label.title !== text) label.title = text;
  });
  const show = event => {
    const label = event.target.closest && event.target.closest('#gallery-pick label');
    if (!label || !label.title) return;
    const first = label.title.match(/^.*?[.!?](?=\\s|$)/);
    caption.textContent = label.innerText.trim() + ': ' + (first ? first[0] : label.title);
  };
  describe();
  new MutationObserver(describe).observe(root, {childList: true, subtree: true});
  root.addEventListener('mouseover', show);
  root.addEventListener('focusin', show);
}"""


def _widget(spec: FieldSpec, value: Any, label: str | None = None) -> gr.components.Component:
    common = dict(value=value, label=label or spec.name, info=spec.info, elem_id=spec.elem_id, interactive=True)
    if spec.kind == "checkbox":
        return gr.Checkbox(**common)
    if spec.kind == "number":
        return gr.Number(precision=0 if spec.integer else None, step=spec.step, **common)
    if spec.kind == "dropdown":
        return gr.Dropdown(choices=[c[0] for c in spec.choices], allow_custom_value=spec.custom, **common)
    return gr.Textbox(placeholder=spec.placeholder, max_lines=1, **common)


def _defaults(backend: Backend) -> dict[str, Any]:
    """Widget values of the schema's defaults, output.dir in runs, required keys (no default) empty."""
    initial = {"model": {"path": "required"}, "data": {"path": "required"},
               "output": {"dir": str(backend.settings.runs_dir / "run")}}
    values = backend.load_yaml(json.dumps(initial), "defaults")
    return {s.key: "" if s.required else v for s, v in zip(backend.specs, values, strict=True)}


def _rows(specs: list[FieldSpec], defaults: dict[str, Any], labels: dict[str, str] | None = None
          ) -> dict[str, gr.components.Component]:
    """One widget per key, three to a row."""
    out = {}
    for start in range(0, len(specs), 3):
        with gr.Row():
            for s in specs[start:start + 3]:
                out[s.key] = _widget(s, defaults[s.key], f"{labels[s.key]} ({s.key})" if labels else None)
    return out


def _advanced(backend: Backend, defaults: dict[str, Any]) -> dict[str, gr.components.Component]:
    """Every key not in the basic form, under one closed "Advanced settings" accordion: one closed accordion per
    recipe section inside it, one widget per key in schema order."""
    out = {}
    with gr.Accordion("Advanced settings", open=False, elem_id="advanced"):
        gr.Markdown("Every other recipe key, by section; each has a sensible default.")
        for section, description in sections():
            specs = [s for s in backend.specs if s.section == section and s.key not in BASIC]
            if specs:
                with gr.Accordion(f"{section} — {description}" if description else section, open=False,
                                  elem_id=f"section-{section}"):
                    out.update(_rows(specs, defaults))
    return out


@dataclass(frozen=True)
class Form:
    """The recipe form: its widgets in spec order (which the other tabs read) and `refreshed`, which a handler
    that writes into them chains after itself so the YAML view and the copy kept for a page reload follow.

    A load writes dozens of widgets at once; were the views refreshed on each widget's `change`, the page would
    queue one refresh per widget (seen: 40 for a ready recipe, the YAML seconds to a minute behind on a loaded
    machine), so the views follow the user's edits and the one refresh each writer chains after itself."""

    widgets: list[gr.components.Component]
    refreshed: Callable[[Any], Any]


def build(demo: gr.Blocks, backend: Backend) -> tuple[Form, gr.Dropdown, gr.Dropdown]:
    """The Recipe tab; returns the form, the basic form's GPU picker (kept in step with the Memory tab's) and
    the previous-run picker (filled with the runs)."""
    keys = [s.key for s in backend.specs]
    by_key = {s.key: s for s in backend.specs}
    gallery = backend.gallery()
    with gr.Tab("Recipe", id="recipe"):
        gr.Markdown("**Start from something**: a ready recipe, a recipe file, or a previous run. Then set the "
                    "basics; everything else has a sensible default under *Advanced settings*.")
        with gr.Row():
            with gr.Column(scale=3, elem_id="gallery"):
                pick = gr.Radio(choices=[(r["title"], r["path"]) for r in gallery], label="Ready recipes",
                                elem_id="gallery-pick")
                gr.HTML(f"<div id='gallery-caption'>{POINT_AT}</div>", elem_id="gallery-hover")
                pick_info = gr.Markdown(elem_id="gallery-info")
                use_btn = gr.Button("Use this recipe", variant="primary", elem_id="gallery-use")
            with gr.Column(scale=2):
                recipe_upload = gr.File(label="Open a recipe file (YAML)", file_types=[".yaml", ".yml"],
                                        elem_id="recipe-upload", height=110)
                prev_run = gr.Dropdown(label="From a previous run", allow_custom_value=True, elem_id="previous-run")
                prev_btn = gr.Button("Load that run's recipe", elem_id="previous-run-load")
        # Two boxes: what was loaded stays in view while the YAML refresh the load triggers clears the problems
        notice = gr.Markdown(elem_id="recipe-notice")
        recipe_msg = gr.Markdown(elem_id="recipe-problems")
        defaults = _defaults(backend)
        with gr.Group(elem_id="basics"):
            gr.Markdown("### Basics")
            with gr.Row():
                # Filled when the page opens (after login): the list names server folders
                model_pick = gr.Dropdown(choices=[], value=None, label="Pick a local model",
                                         info="Model folders and .gguf files in the allowed folders, models "
                                              "installed packages ship, the Hugging Face cache's; or type any "
                                              "path or hub id in model.path.", elem_id="model-pick")
                gpus = backend.gpu_choices()
                gpu = gr.Dropdown(choices=gpus, value=gpus[0], label="GPU",
                                  info="The card the Memory tab plans for; a run uses the GPU's free memory "
                                       "(memory.gpu_memory).", elem_id="basic-gpu")
                goal = gr.Dropdown(choices=[KEEP, *GOALS], value=KEEP, label="Goal",
                                   info="Sets the few keys a goal is about: "
                                        + "; ".join(f"{g}: {text}" for g, text in SUMMARIES.items()) + ".",
                                   elem_id="goal")
            basic = _rows([by_key[k] for k in BASIC], defaults, BASIC)
        advanced = _advanced(backend, defaults)
        widgets = [{**basic, **advanced}[k] for k in keys]
        with gr.Row():
            save_btn = gr.Button("Save form as recipe YAML", elem_id="save-recipe", scale=1)
            recipe_file = gr.File(label=RECIPE, interactive=False, elem_id="recipe-file", height=70, scale=2)
        recipe_yaml = gr.Code(language="yaml", label="Recipe YAML: exactly what `finetune run` reads",
                              interactive=False, elem_id="recipe-yaml", max_lines=YAML_LINES)
        saved_form = gr.BrowserState(None, storage_key="finetune-form")  # the form survives a page reload

    @reported(2)
    def show_yaml(*values):
        try:
            return "", backend.recipe_text(values)
        except RecipeError as exc:  # a fresh page: no model or data yet is a next step, not an error
            if (notice := first_steps(exc, FIRST_STEPS)) is not None:
                return notice, ""
            raise

    def remember(*values):
        return dict(zip(keys, values, strict=True))

    def kept(event: Any) -> Any:
        return event.then(remember, widgets, saved_form, trigger_mode="always_last", api_visibility="private")

    def refreshed(event: Any) -> Any:
        return kept(event.then(show_yaml, widgets, [recipe_msg, recipe_yaml], trigger_mode="always_last",
                               api_visibility="private"))

    # The user's edits: a text box's `change` (a paste fires no `input`; gradio merges the text boxes' changes
    # into one refresh), the other kinds' `input`, which fires for the user only: their `change` fires once per
    # widget a load writes, unmerged (gradio 6.31), which queued dozens of refreshes; a load refreshes once.
    edits = [w.change if isinstance(w, gr.Textbox) else w.input for w in widgets]
    kept(gr.on(edits, show_yaml, widgets, [recipe_msg, recipe_yaml], trigger_mode="always_last",
               api_visibility="private"))

    demo.load(lambda: gr.update(choices=backend.model_choices()), None, model_pick, api_name="local_models")
    # model.path is a text box: its own change refreshes the YAML view and the copy kept for a reload
    model_pick.input(lambda chosen: chosen or gr.skip(), model_pick, basic["model.path"], api_visibility="private")

    descriptions = {r["path"]: r["description"] for r in gallery}
    pick.change(lambda p: descriptions.get(p, ""), pick, pick_info, api_visibility="private")
    demo.load(None, js=DESCRIBE_CHIPS.replace("DESCRIPTIONS", json.dumps({r["title"]: r["description"]
                                                                           for r in gallery})))

    @reported(1 + len(widgets))
    def use_gallery(path):
        title, values = backend.load_gallery(path)
        return (f"Loaded the ready recipe: {title}", *values)

    refreshed(use_btn.click(use_gallery, pick, [notice, *widgets], api_name="use_gallery_recipe"))

    @reported(1 + len(widgets))
    def use_run(run_dir):
        run, values = backend.load_run_recipe(run_dir)
        return (f"Loaded the recipe of {run}, with a new output.dir for the new run.", *values)

    refreshed(prev_btn.click(use_run, prev_run, [notice, *widgets], api_name="use_run_recipe"))

    def load_file(path: str | None):
        if not path:
            return (gr.skip(), *[gr.skip()] * len(widgets))
        name, values = backend.load_upload(path)
        return (f"Loaded {name}.", *values)

    refreshed(recipe_upload.upload(reported(1 + len(widgets))(load_file), recipe_upload, [notice, *widgets],
                                   api_name="load_recipe"))

    def apply_goal(chosen):
        if chosen not in GOALS:
            return [gr.skip()] * len(widgets)
        updates = backend.goal_updates(chosen)
        return [updates.get(i, gr.skip()) for i in range(len(widgets))]

    refreshed(goal.input(apply_goal, goal, widgets, api_name="apply_goal"))

    def restore(saved):
        if not isinstance(saved, dict) or set(saved) != set(keys):  # nothing saved, or another schema
            return [gr.skip()] * len(widgets)
        return [saved[k] for k in keys]

    refreshed(demo.load(restore, saved_form, widgets, api_visibility="private"))

    @reported(2)
    def save(request: gr.Request, *values):
        return "", str(backend.recipe_file(values, request.session_hash if request else None))

    save_btn.click(save, widgets, [recipe_msg, recipe_file], api_name="save_recipe")
    return Form(widgets, refreshed), gpu, prev_run
