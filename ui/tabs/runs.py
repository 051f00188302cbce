"""Runs tab: the history of run directories, their loss curves overlaid, and one run's view: its batch and
the advice for next time, its rewards (preference runs), its recipe, and export."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import gradio as gr

from finetune import api
from finetune.errors import FinetuneError, UsageError
from finetune.export.gguf import TYPES as GGUF_TYPES
from finetune.rundir import RunDir
from ui import charts
from ui.backend import Backend
from ui.tabs import run_panel
from ui.tabs.messages import problems_markdown, reported
from ui.tabs.recipe import Form

HISTORY_HEADERS = ["run", "state", "step", "loss", "eval loss", "tokens/s", "peak memory"]


@dataclass
class RunsTab:
    """The parts the page refreshes with the list of runs (when the tab opens or Refresh is pressed)."""

    tab: gr.Tab
    refresh_btn: gr.Button
    history: gr.Dataframe
    compare: gr.CheckboxGroup
    recipe_run: gr.Dropdown


EXPORT_FORMATS = ["safetensors", *(f"gguf {t}" for t in GGUF_TYPES)]


def export_view(backend: Backend, run_dir: str, out_dir: str, fmt: str = "safetensors",
                ollama: bool = False) -> Iterator[str]:
    """The export's progress as a checklist (a step is ticked when the next one starts), then where the
    merged model went. `fmt`: one of EXPORT_FORMATS ("gguf q8_0": one GGUF file of that type)."""
    steps: list[str] = []
    gguf = api.GGUFOptions(fmt.split()[1], ollama) if fmt.startswith("gguf ") else None
    try:
        if ollama and gguf is None:  # as `finetune export --ollama` without --format gguf: said, not ignored
            raise UsageError(f"an Ollama Modelfile needs a GGUF file: the format {fmt} writes none",
                             hint="pick a gguf format, or untick Ollama Modelfile")
        for event in backend.export(run_dir, out_dir, gguf=gguf):
            if not isinstance(event, api.ExportStep):  # waiting for the GPU
                yield f"Export queued: {event}."
                continue
            steps.append(str(event))
            yield "**Exporting...**\n" + "\n".join(f"- {'done' if i < len(steps) - 1 else 'now'}: {s}"
                                                      for i, s in enumerate(steps))
        out = backend.run_path(out_dir, must_exist=True)
    except FinetuneError as exc:
        yield problems_markdown(exc)
        return
    if gguf is None:
        use = f"Load it with `AutoModelForCausalLM.from_pretrained(\"{out}\")`."
    else:
        use = f"Run it with `llama-cli -m {next(out.glob('*.gguf'), out)}`" + (
            f", or make it an Ollama model with `{api.ollama_command(out)}`." if gguf.ollama else ".")
    yield f"**merged model saved to {out}**\n" + "\n".join(f"- done: {s}" for s in steps) + f"\n\n{use}"


def ollama_box(fmt: str) -> dict:
    """The Ollama checkbox follows the format: usable for a GGUF format, unticked and greyed out otherwise."""
    if fmt.startswith("gguf "):
        return gr.update(interactive=True)
    return gr.update(interactive=False, value=False)


def build(backend: Backend, form: Form) -> RunsTab:
    """The Runs tab; its refresh button is wired by the page, which also updates the Chat tab's run list.
    `form`: the recipe form, which the advice button writes into."""
    with gr.Tab("Runs", id="runs") as tab:
        refresh_btn = gr.Button("Refresh", elem_id="refresh-runs")
        history = gr.Dataframe(headers=HISTORY_HEADERS, interactive=False, elem_id="history")
        compare = gr.CheckboxGroup(label="Overlay loss curves", elem_id="compare")
        overlay = gr.Plot(label="Loss of the selected runs", elem_id="overlay-plot")
        with gr.Row():
            recipe_run = gr.Dropdown(label="Run", allow_custom_value=True, elem_id="history-run")
            export_dir = gr.Textbox(label="Export merged model to", elem_id="export-dir")
            export_format = gr.Dropdown(EXPORT_FORMATS, value="safetensors", label="Format", elem_id="export-format",
                                        info="GGUF for llama.cpp and Ollama; k-quants: llama-quantize an f16 file")
            export_ollama = gr.Checkbox(label="Ollama Modelfile (GGUF)", elem_id="export-ollama", interactive=False)
            export_btn = gr.Button("Export (merge and save)", elem_id="export")
        export_msg = gr.Markdown(elem_id="export-message")
        panel = run_panel.build("runs")
        run_recipe = gr.Code(language="yaml", label="The run's resolved recipe", interactive=False, max_lines=30)

    def overlay_view(selected):
        try:
            paths = [backend.run_path(d) for d in selected or []]
        except FinetuneError as exc:  # the output is a plot: the message goes to the page as an alert
            raise gr.Error(str(exc)) from None
        return charts.loss_figure({p.name: RunDir(p).read_metrics() for p in paths}, "loss of the selected runs",
                                  by_run=True)

    compare.change(overlay_view, compare, overlay, api_name="overlay")
    recipe_run.change(reported(1)(backend.run_recipe), recipe_run, run_recipe, api_visibility="private")

    def run_view(run_dir):
        try:
            path = backend.run_path(run_dir) if run_dir else None
        except FinetuneError:  # the recipe view beside it says why
            path = None
        return run_panel.updates(path)

    recipe_run.change(run_view, recipe_run, panel.outputs, api_name="run_view")
    run_panel.wire_advice(panel, backend, recipe_run, form)

    def export(run_dir, out_dir, fmt="safetensors", ollama=False):  # a generator: the page streams the progress
        yield from export_view(backend, run_dir, out_dir, fmt, ollama)

    export_format.change(ollama_box, export_format, export_ollama, api_visibility="private")
    export_btn.click(export, [recipe_run, export_dir, export_format, export_ollama], export_msg, api_name="export")
    return RunsTab(tab, refresh_btn, history, compare, recipe_run)
