"""Memory tab: what fits at a glance (longest context and largest micro-batch per GPU size), then the
planner's verdict for the form's recipe on the chosen GPU: bars by component, speed estimate, options."""

from __future__ import annotations

import gradio as gr

from finetune.errors import RecipeError
from ui import charts, views
from ui.backend import Backend
from ui.tabs.messages import first_steps, reported

FIRST_STEPS = ("No recipe yet: choose a ready recipe in the Recipe tab (or give the model and the data file "
               "there), and its plan shows here.")


def build(backend: Backend, widgets: list[gr.components.Component], basic_gpu: gr.Dropdown) -> None:
    """The Memory tab over the form `widgets`; it plans again whenever it opens or the GPU changes (here or
    in the Recipe tab's basics, `basic_gpu`, which it keeps in step)."""
    with gr.Tab("Memory", id="memory") as memory_tab:
        with gr.Row():
            gpus = backend.gpu_choices()
            gpu = gr.Dropdown(choices=gpus, value=gpus[0], label="GPU to plan for", elem_id="gpu", scale=3)
            plan_btn = gr.Button("Plan", elem_id="plan", scale=1)
        plan_msg = gr.Markdown(elem_id="plan-message")
        context_plot = gr.Plot(label="What fits on each GPU size: longest context and largest micro-batch",
                               elem_id="context-plot")
        context_msg = gr.Markdown(elem_id="context-message")
        plan_plot = gr.Plot(label="Predicted memory by component against the budget", elem_id="plan-plot")
        plan_table = gr.Dataframe(headers=views.OPTION_HEADERS, label="Alternatives and rejected options, with why",
                                  interactive=False, elem_id="plan-options")
        last_plan = gr.State(None)  # the chosen plan's micro-batch, starred on the context chart

    @reported(4)
    def plan(*args):
        try:
            result = backend.plan(args[:-1], args[-1])
        except RecipeError as exc:  # no recipe chosen yet: one hint, and no chart, table or second message
            if (hint := first_steps(exc, FIRST_STEPS)) is None:
                raise
            return hint, None, [], None
        mb = (result.get("settings") or {}).get("micro_batch_size")
        return (views.plan_markdown(result), charts.memory_figure(views.plan_bars(result), result.get("budget_bytes")),
                views.option_rows(result), mb)

    @reported(2, message_at=1)
    def sweep(*args):
        *values, choice, mb = args
        try:
            result = backend.gpu_sweep(values)
        except RecipeError as exc:  # the plan's message above says what to do first
            if first_steps(exc, FIRST_STEPS) is None:
                raise
            return None, ""
        return (charts.context_figure(result, backend.gpu_gb(choice), mb, views.same_everywhere(result)),
                views.sweep_markdown(result))

    plan_out = [plan_msg, plan_plot, plan_table, last_plan]
    plan_btn.click(plan, [*widgets, gpu], plan_out, api_name="plan").then(
        sweep, [*widgets, gpu, last_plan], [context_plot, context_msg], api_name="gpu_sizes")
    # The form lives on another tab: planning when this tab opens shows the current settings, without
    # re-planning on every keystroke. The sweep over GPU sizes follows the plan (it takes longer, once).
    gr.on([memory_tab.select, gpu.change], plan, [*widgets, gpu], plan_out, trigger_mode="always_last",
          api_visibility="private").then(sweep, [*widgets, gpu, last_plan], [context_plot, context_msg],
                                          api_visibility="private")
    basic_gpu.input(lambda g: g, basic_gpu, gpu, api_visibility="private")
    gpu.input(lambda g: g, gpu, basic_gpu, api_visibility="private")
