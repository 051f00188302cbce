"""Train tab: start, stop and resume runs, and a live view of one run re-read from its run directory."""

from __future__ import annotations

import html
from typing import Any

import gradio as gr

from finetune import api
from finetune.errors import FinetuneError
from ui import charts, views
from ui.backend import Backend
from ui.tabs import run_panel
from ui.tabs.messages import reported
from ui.tabs.recipe import Form

LOG_LINES = 8  # lines of train.log shown
FAILED_LOG_LINES = 30  # lines of the process output added when a run failed


def build(backend: Backend, form: Form, timer: gr.Timer) -> gr.Dropdown:
    """The Train tab: queue the form's recipe; every `timer` tick refresh the selected run. Returns the run picker."""
    with gr.Tab("Train", id="train"):
        with gr.Row():
            start_btn = gr.Button("Start training", variant="primary", elem_id="start")
            stop_btn = gr.Button("Stop (saves a checkpoint)", variant="stop", elem_id="stop")
            resume_btn = gr.Button("Resume", elem_id="resume")
            allow_change = gr.Checkbox(False, label="Resume even if the data changed", elem_id="allow-data-change",
                                       info="otherwise a resume on other records, tokenizer or max_seq_len is refused")
        run_sel = gr.Dropdown(label="Run", allow_custom_value=True, elem_id="run-select")
        train_msg = gr.Markdown(elem_id="train-message")
        status = gr.HTML(elem_id="status")
        seen_md = gr.Markdown(elem_id="seen-length")
        with gr.Row():
            loss_plot = gr.Plot(label="Loss, with the run's events marked", elem_id="loss-plot")
            timeline_plot = gr.Plot(label="Tokens/s and memory over time: measured against the plan",
                                    elem_id="timeline-plot")
        with gr.Row():
            mem_plot = gr.Plot(label="Peak memory by component: measured against predicted", elem_id="memory-plot")
            lr_plot = gr.Plot(label="Learning rate", elem_id="lr-plot")
        panel = run_panel.build("train")  # shown once the run has written results.json (and rewards)
        log_box = gr.Textbox(label="Log tail (newest last)", lines=14, max_lines=14, interactive=False,
                             autoscroll=True, elem_id="log-tail")
        queue_md = gr.Markdown(elem_id="queue")
        seen = gr.State(None)  # (run, rows, results) last drawn: plots are redrawn only when that changes
        unseen = gr.State(None)  # a run picked anew is drawn at once

    def run_choices(selected: str | None = None):
        dirs = backend.run_dirs()
        return gr.update(choices=dirs, value=selected or backend.current_run())

    @reported(2)
    def start(*values):
        run_dir = backend.start(values)
        return f"Queued {run_dir}.", run_choices(str(run_dir))

    start_btn.click(start, form.widgets, [train_msg, run_sel], api_name="start")

    @reported(2)
    def resume(run_dir, allow_data_change=False):
        path = backend.resume(run_dir, allow_data_change)
        return f"Resuming {path} from its newest checkpoint.", run_choices(str(path))

    resume_btn.click(resume, [run_sel, allow_change], [train_msg, run_sel], api_name="resume")
    stop_btn.click(reported(1)(backend.stop), run_sel, train_msg, api_name="stop")

    skipped = (gr.skip(),) * (5 + len(panel.outputs))

    def refresh(run_dir, last):
        status_view, plots, log, queue, sig = redraw(backend, run_dir, last)
        return status_view, *(plots or skipped), log, queue, sig

    outputs = [status, seen_md, loss_plot, timeline_plot, lr_plot, mem_plot, *panel.outputs, log_box, queue_md, seen]
    timer.tick(refresh, [run_sel, seen], outputs, api_name="refresh", show_progress="hidden")
    run_sel.change(refresh, [run_sel, unseen], outputs, show_progress="hidden", api_visibility="private")
    run_panel.wire_advice(panel, backend, run_sel, form, api_name="use_advice")
    return run_sel


def redraw(backend: Backend, run_dir: str | None, last: tuple | None
           ) -> tuple[str, tuple[Any, ...] | None, str, str, tuple | None]:
    """One refresh of the selected run: (status HTML, the explanations, plots and run panels or None when the run
    has logged nothing new since `last`, log tail, queue, the signature to pass as `last` next time). Each run
    file is read once (api.RunView), however many views show it."""
    queue = views.queue_markdown(backend.manager, backend.outside_runs())
    if not run_dir:
        return "<div id='run-status'>No run yet: start one above.</div>", None, "", queue, last
    try:
        path = backend.run_path(run_dir, must_exist=False)
    except FinetuneError as exc:
        return f"<div id='run-status'>{html.escape(str(exc))}</div>", None, "", queue, last
    files = api.RunView(path)
    state = backend.manager.run_state(path, files.status)
    log = files.run.log_tail(LOG_LINES) or backend.manager.process_log(path, LOG_LINES)
    if state.startswith("failed"):
        log += "\n--- process output ---\n" + backend.manager.process_log(path, FAILED_LOG_LINES)
    rows = files.metrics
    sig = (run_dir, len(rows), files.run.results.is_file())  # results.json comes last: the batch panel
    plots = None
    if sig != last:
        seen_plan = backend.seen_length_plan(files)
        bars, budget = views.measured_bars(files, seen_plan)
        events = views.run_events(rows)
        measured = views.last_value(rows, "peak_memory_bytes")  # since the last re-plan (OOM recovery)
        explained = [views.events_markdown(events), views.seen_length_markdown(seen_plan, measured)]
        plots = ("\n\n".join(t for t in explained if t),
                 charts.loss_figure({path.name: rows}, events=events),
                 charts.timeline_figure(rows, (files.plan or {}).get("peak_bytes"), events,
                                        seen_plan and seen_plan["peak_bytes"]),
                 charts.lr_figure(rows),
                 charts.memory_figure(bars, None, title=f"peak memory (budget {views.size(budget)})")
                 if bars else None,  # a budget line would flatten the bars the page compares
                 *run_panel.updates(files))
    return views.status_html(files, state), plots, log, queue, sig
