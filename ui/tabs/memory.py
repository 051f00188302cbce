"""Memory tab: the planner's verdict for the form's recipe on a chosen GPU, as bars and a table of options."""

from __future__ import annotations

import gradio as gr

from ui import charts, views
from ui.backend import Backend
from ui.tabs.messages import reported


def build(backend: Backend, widgets: list[gr.components.Component]) -> None:
    """The Memory tab over the form `widgets`; it plans again whenever it opens or the GPU changes."""
    with gr.Tab("Memory", id="memory") as memory_tab:
        with gr.Row():
            gpus = backend.gpu_choices()
            gpu = gr.Dropdown(choices=gpus, value=gpus[0], label="GPU", elem_id="gpu", scale=3)
            plan_btn = gr.Button("Plan", elem_id="plan", scale=1)
        plan_msg = gr.Markdown(elem_id="plan-message")
        plan_plot = gr.Plot(label="Predicted memory against the budget", elem_id="plan-plot")
        plan_table = gr.Dataframe(headers=views.OPTION_HEADERS,
                                  label="Alternatives and rejected options", interactive=False)

    @reported(3)
    def plan(*args):
        result = backend.plan(args[:-1], args[-1])
        return (views.plan_markdown(result), charts.memory_figure(views.plan_bars(result), result.get("budget_bytes")),
                views.option_rows(result))

    plan_btn.click(plan, [*widgets, gpu], [plan_msg, plan_plot, plan_table], api_name="plan")
    # The form lives on another tab: planning when this tab opens shows the current settings, without
    # re-planning on every keystroke.
    gr.on([memory_tab.select, gpu.change], plan, [*widgets, gpu], [plan_msg, plan_plot, plan_table],
          trigger_mode="always_last", api_visibility="private")
