"""The page: recipe form, data preview, memory plan, training monitor, run history, chat and export.

Every handler reports user mistakes as a message on the page (never a traceback), and every view of a run
is re-read from its run directory, so a reload or a second browser sees the same state.
"""

from __future__ import annotations

import functools
import html
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gradio as gr

from finetune.errors import FinetuneError
from ui import charts, rundir, views
from ui.backend import Backend, problems_markdown
from ui.form import FieldSpec, sections
from ui.paths import allowed_path, data_files, store_upload

REFRESH_S = 2.0
HISTORY_HEADERS = ["run", "state", "step", "loss", "eval loss", "tokens/s", "peak memory"]
CSS = "#run-status progress { height: 1.2em }"


def _reported(n_outputs: int, message_at: int = 0) -> Callable:
    """Wrap a handler so a FinetuneError becomes a message in output `message_at`, others left unchanged."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args: Any) -> Any:
            try:
                return fn(*args)
            except FinetuneError as exc:
                out = [gr.skip()] * n_outputs
                out[message_at] = problems_markdown(exc)
                return tuple(out) if n_outputs > 1 else out[0]
        return inner
    return wrap


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


def build_app(backend: Backend) -> gr.Blocks:
    """The whole UI, bound to one backend (allowed folders, runs folder, run queue)."""
    keys = [s.key for s in backend.specs]
    with gr.Blocks(title="finetune") as demo:
        gr.Markdown("# finetune\nBuild a recipe, check it fits your GPU, train, watch, and chat with the result.")
        with gr.Tabs():
            with gr.Tab("Recipe", id="recipe"):
                with gr.Row():
                    recipe_upload = gr.File(label="Load a recipe YAML", file_types=[".yaml", ".yml"],
                                            elem_id="recipe-upload", scale=2, height=140)
                    with gr.Column(scale=1):
                        save_btn = gr.Button("Save form as recipe YAML", elem_id="save-recipe")
                        recipe_file = gr.File(label="recipe.yaml", interactive=False, elem_id="recipe-file",
                                              height=90)
                recipe_msg = gr.Markdown(elem_id="recipe-problems")
                widgets = _form(backend)
                recipe_yaml = gr.Code(language="yaml", label="Recipe YAML: exactly what `finetune run` reads",
                                      interactive=False, elem_id="recipe-yaml")
            with gr.Tab("Data", id="data"):
                gr.Markdown("Pick a dataset on the server (inside the allowed folders) or upload one; the "
                            "preview tokenizes with the recipe's model and highlights tokens that carry loss.")
                with gr.Row():
                    server_file = gr.Dropdown(choices=data_files(backend.settings.allow_dirs), allow_custom_value=True,
                                              label="Server file", elem_id="server-file", scale=3)
                    use_file_btn = gr.Button("Use this file", elem_id="use-file", scale=1)
                data_upload = gr.File(label="Upload a dataset (.json, .jsonl, .csv, .parquet)", elem_id="data-upload",
                                      height=140)
                preview_btn = gr.Button("Preview data", elem_id="preview-data")
                data_msg = gr.Markdown(elem_id="data-message")
                examples = [gr.HighlightedText(label=f"example {i + 1}", color_map={"loss": "#f4a261"},
                                               show_legend=True, show_inline_category=False, combine_adjacent=True,
                                               elem_id=f"example-{i}") for i in range(3)]
            with gr.Tab("Memory", id="memory") as memory_tab:
                with gr.Row():
                    gpus = backend.gpu_choices()
                    gpu = gr.Dropdown(choices=gpus, value=gpus[0], label="GPU", elem_id="gpu", scale=3)
                    plan_btn = gr.Button("Plan", elem_id="plan", scale=1)
                plan_msg = gr.Markdown(elem_id="plan-message")
                plan_plot = gr.Plot(label="Predicted memory against the budget", elem_id="plan-plot")
                plan_table = gr.Dataframe(headers=views.OPTION_HEADERS,
                                          label="Alternatives and rejected options", interactive=False)
            with gr.Tab("Train", id="train"):
                with gr.Row():
                    start_btn = gr.Button("Start training", variant="primary", elem_id="start")
                    stop_btn = gr.Button("Stop (saves a checkpoint)", variant="stop", elem_id="stop")
                    resume_btn = gr.Button("Resume", elem_id="resume")
                run_sel = gr.Dropdown(label="Run", allow_custom_value=True, elem_id="run-select")
                train_msg = gr.Markdown(elem_id="train-message")
                status = gr.HTML(elem_id="status")
                with gr.Row():
                    loss_plot = gr.Plot(label="Loss", elem_id="loss-plot")
                    lr_plot = gr.Plot(label="Learning rate", elem_id="lr-plot")
                mem_plot = gr.Plot(label="Peak memory: measured against predicted", elem_id="memory-plot")
                log_box = gr.Textbox(label="Log tail (newest last)", lines=14, max_lines=14, interactive=False,
                                     autoscroll=True, elem_id="log-tail")
                queue_md = gr.Markdown(elem_id="queue")
                seen = gr.State(None)
            with gr.Tab("Runs", id="runs"):
                refresh_btn = gr.Button("Refresh", elem_id="refresh-runs")
                history = gr.Dataframe(headers=HISTORY_HEADERS, interactive=False, elem_id="history")
                compare = gr.CheckboxGroup(label="Overlay loss curves", elem_id="compare")
                overlay = gr.Plot(label="Loss of the selected runs", elem_id="overlay-plot")
                with gr.Row():
                    recipe_run = gr.Dropdown(label="Run", allow_custom_value=True, elem_id="history-run")
                    export_dir = gr.Textbox(label="Export merged model to", elem_id="export-dir")
                    export_btn = gr.Button("Export (merge and save)", elem_id="export")
                export_msg = gr.Markdown(elem_id="export-message")
                run_recipe = gr.Code(language="yaml", label="The run's resolved recipe", interactive=False, max_lines=30)
            with gr.Tab("Chat", id="chat"):
                with gr.Row():
                    chat_run = gr.Dropdown(label="Run (adapter)", allow_custom_value=True, elem_id="chat-run", scale=3)
                    max_new = gr.Slider(8, 1024, value=128, step=8, label="max new tokens", scale=1)
                with gr.Row():
                    tuned_bot = gr.Chatbot(label="fine-tuned (base + adapter)", height=320, elem_id="chat-tuned")
                    base_bot = gr.Chatbot(label="base model", height=320, elem_id="chat-base")
                with gr.Row():
                    prompt = gr.Textbox(label="Prompt", scale=4, elem_id="chat-prompt")
                    send_btn = gr.Button("Send to both", variant="primary", scale=1, elem_id="chat-send")
                chat_msg = gr.Markdown(elem_id="chat-message")
        timer = gr.Timer(REFRESH_S)
        saved_form = gr.BrowserState(None, storage_key="finetune-form")  # the form survives a page reload

        # -- recipe --------------------------------------------------------------------------------------
        def load_file(path: str | None):
            if not path:
                return (gr.skip(), *[gr.skip()] * len(widgets))
            name, values = backend.load_upload(path)
            return (f"Loaded {name}.", *values)

        recipe_upload.upload(_reported(1 + len(widgets))(load_file), recipe_upload, [recipe_msg, *widgets],
                             api_name="load_recipe")

        @_reported(2)
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

        @_reported(2)
        def save(*values):
            path, text = backend.recipe_file(values)
            return "", str(path)

        save_btn.click(save, widgets, [recipe_msg, recipe_file], api_name="save_recipe")

        # -- data ----------------------------------------------------------------------------------------
        data_path = widgets[keys.index("data.path")]

        def with_data_path(values, path):
            values = list(values)
            values[keys.index("data.path")] = str(path)
            return values

        def show_preview(values) -> tuple:
            found, bad = backend.preview(values)
            shown = [[(tok, "loss" if loss else None) for tok, loss in ex["tokens"]] for ex in found]
            shown += [[]] * (3 - len(shown))
            return (views.preview_markdown(found, bad), *shown[:3])

        @_reported(5)
        def use_server_file(path, *values):
            chosen = allowed_path(path, backend.settings.allow_dirs, "data file", must_exist=True)
            try:
                msg, *shown = show_preview(with_data_path(values, chosen))
            except FinetuneError as exc:
                msg, shown = problems_markdown(exc), [gr.skip()] * 3
            return (msg, str(chosen), *shown)

        use_file_btn.click(use_server_file, [server_file, *widgets], [data_msg, data_path, *examples],
                           api_name="use_server_file")

        @_reported(5)
        def uploaded(path, *values):
            if not path:
                return (gr.skip(),) * 5
            stored = store_upload(path, backend.settings.runs_dir / "uploads")
            try:
                msg, *shown = show_preview(with_data_path(values, stored))
            except FinetuneError as exc:
                stored.unlink(missing_ok=True)
                raise FinetuneError(f"{Path(path).name} was refused: it is not a dataset this recipe can read",
                                    [str(exc)]) from None
            return (msg, str(stored), *shown)

        data_upload.upload(uploaded, [data_upload, *widgets], [data_msg, data_path, *examples], api_name="upload_data")
        preview_btn.click(_reported(4)(lambda *v: show_preview(v)), widgets, [data_msg, *examples],
                          api_name="preview_data")

        # -- memory --------------------------------------------------------------------------------------
        @_reported(3)
        def plan(*args):
            result = backend.plan(args[:-1], args[-1])
            return (views.plan_markdown(result), charts.memory_figure(views.plan_bars(result), result.get("budget_bytes")),
                    views.option_rows(result))

        plan_btn.click(plan, [*widgets, gpu], [plan_msg, plan_plot, plan_table], api_name="plan")
        # The form lives on another tab: planning when this tab opens shows the current settings, without
        # re-planning on every keystroke.
        gr.on([memory_tab.select, gpu.change], plan, [*widgets, gpu], [plan_msg, plan_plot, plan_table],
              trigger_mode="always_last", api_visibility="private")


        # -- train ---------------------------------------------------------------------------------------
        def run_choices(selected: str | None = None):
            dirs = backend.run_dirs()
            return gr.update(choices=dirs, value=selected or backend.current_run())

        @_reported(2)
        def start(*values):
            run_dir = backend.start(values)
            return f"Queued {run_dir}.", run_choices(str(run_dir))

        start_btn.click(start, widgets, [train_msg, run_sel], api_name="start")

        @_reported(2)
        def resume(run_dir):
            path = backend.resume(run_dir)
            return f"Resuming {path} from its newest checkpoint.", run_choices(str(path))

        resume_btn.click(resume, run_sel, [train_msg, run_sel], api_name="resume")
        stop_btn.click(_reported(1)(backend.stop), run_sel, train_msg, api_name="stop")

        def refresh(run_dir, last):
            queue = views.queue_markdown(backend.manager)
            if not run_dir:
                return "<div id='run-status'>No run yet: start one above.</div>", *(gr.skip(),) * 3, "", queue, last
            try:
                path = backend.run_path(run_dir, must_exist=False)
            except FinetuneError as exc:
                return f"<div id='run-status'>{html.escape(str(exc))}</div>", *(gr.skip(),) * 3, "", queue, last
            state = backend.manager.run_state(path)
            log = rundir.tail(path / "train.log", 8) or backend.manager.process_log(path, 8)
            if state.startswith("failed"):
                log += "\n--- process output ---\n" + backend.manager.process_log(path, 30)
            rows = rundir.read_metrics(path)
            sig = (run_dir, len(rows))
            if sig == last:
                plots = (gr.skip(),) * 3
            else:
                bars, budget = views.measured_bars(path)
                plots = (charts.loss_figure({path.name: rows}), charts.lr_figure(rows),
                         charts.memory_figure(bars, None, title=f"peak memory (budget {views.size(budget)})")
                         if bars else None)  # a budget line would flatten the bars the page compares
            return views.status_html(path, state), *plots, log, queue, sig

        timer.tick(refresh, [run_sel, seen], [status, loss_plot, lr_plot, mem_plot, log_box, queue_md, seen],
                   api_name="refresh", show_progress="hidden")
        run_sel.change(refresh, [run_sel, gr.State(None)], [status, loss_plot, lr_plot, mem_plot, log_box, queue_md, seen],
                       show_progress="hidden", api_visibility="private")

        # -- runs, export, chat ----------------------------------------------------------------------------
        def history_view():
            dirs = backend.run_dirs()
            return (views.history_rows(dirs), gr.update(choices=dirs), gr.update(choices=dirs),
                    gr.update(choices=dirs))

        refresh_btn.click(history_view, None, [history, compare, recipe_run, chat_run], api_name="history")
        def overlay_view(selected):
            try:
                paths = [backend.run_path(d) for d in selected or []]
            except FinetuneError as exc:  # the output is a plot: the message goes to the page as an alert
                raise gr.Error(str(exc)) from None
            return charts.loss_figure({p.name: rundir.read_metrics(p) for p in paths}, "loss of the selected runs", by_run=True)

        compare.change(overlay_view, compare, overlay, api_name="overlay")
        recipe_run.change(_reported(1)(backend.run_recipe), recipe_run, run_recipe, api_visibility="private")
        export_btn.click(_reported(1)(backend.export), [recipe_run, export_dir], export_msg, api_name="export")

        @_reported(4, message_at=3)
        def chat(run_dir, text, tokens, tuned_hist, base_hist):
            if not text or not text.strip():
                raise FinetuneError("type a prompt first")
            tuned, base = backend.chat(run_dir, text, int(tokens))
            user = {"role": "user", "content": text}
            return ("", [*tuned_hist, user, {"role": "assistant", "content": tuned}],
                    [*base_hist, user, {"role": "assistant", "content": base}], "")

        chat_inputs = [chat_run, prompt, max_new, tuned_bot, base_bot]
        send_btn.click(chat, chat_inputs, [prompt, tuned_bot, base_bot, chat_msg], api_name="chat")
        prompt.submit(chat, chat_inputs, [prompt, tuned_bot, base_bot, chat_msg], api_visibility="private")

        def on_load():
            current = backend.current_run()
            dirs = backend.run_dirs()
            return (gr.update(choices=dirs, value=current), *history_view(),
                    gr.update(choices=data_files(backend.settings.allow_dirs)))

        demo.load(on_load, None, [run_sel, history, compare, recipe_run, chat_run, server_file],
                  api_visibility="private")
        demo.load(show_yaml, widgets, [recipe_msg, recipe_yaml], api_visibility="private")
    return demo
