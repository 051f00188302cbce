"""The after-the-run panels of a run view (Train and Runs tabs): the batch used, the measured noise scale
over time and the advice for next time, with a button that writes the advice into the recipe form; and for a
preference run (dpo, orpo, simpo, cpo, kto) its reward curves and held-out rewards before and after training; for a GRPO
run its reward and completion-length curves, held-out rewards and the latest sampled answers; and the run's
latest `finetune eval` (held-out loss, perplexity, answer matches; base model beside it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from finetune import api
from ui import charts, views
from ui.backend import Backend
from ui.tabs.messages import reported
from ui.tabs.recipe import Form


@dataclass
class RunPanel:
    """The components of one run view's panels; `outputs` in the order `updates` returns them."""

    batch_box: gr.Column
    batch_md: gr.Markdown
    noise_plot: gr.Plot
    advice_btn: gr.Button
    advice_msg: gr.Markdown
    rewards_box: gr.Column
    reward_plot: gr.Plot
    rewards_md: gr.Markdown
    grpo_box: gr.Column
    grpo_plot: gr.Plot
    grpo_md: gr.Markdown
    eval_box: gr.Column
    eval_md: gr.Markdown
    noise_box: gr.Column  # around noise_plot: hidden when no noise scale was measured

    @property
    def outputs(self) -> list[gr.components.Component]:
        return [self.batch_box, self.batch_md, self.noise_plot, self.advice_btn, self.advice_msg, self.rewards_box,
                self.reward_plot, self.rewards_md, self.grpo_box, self.grpo_plot, self.grpo_md, self.eval_box,
                self.eval_md, self.noise_box]


def build(prefix: str) -> RunPanel:
    """The panels, hidden until a run has something to show; `prefix` keeps element ids unique per tab."""
    with gr.Column(visible=False, elem_id=f"{prefix}-batch-panel") as batch_box:
        gr.Markdown("### Batch: what the run used and what to use next time")
        batch_md = gr.Markdown(elem_id=f"{prefix}-batch-summary")
        with gr.Column(elem_id=f"{prefix}-noise-box") as noise_box:
            noise_plot = gr.Plot(label="Measured noise scale and the batch used (labelled tokens)",
                                 elem_id=f"{prefix}-noise-plot")
        advice_btn = gr.Button("Use this advice in the recipe form", elem_id=f"{prefix}-use-advice")
        advice_msg = gr.Markdown(elem_id=f"{prefix}-advice-message")
    with gr.Column(visible=False, elem_id=f"{prefix}-rewards-panel") as rewards_box:
        gr.Markdown("### Preference rewards: chosen against rejected")
        reward_plot = gr.Plot(label="Rewards, margin and accuracy over steps (lines: training; dots: held-out)",
                              elem_id=f"{prefix}-reward-plot")
        rewards_md = gr.Markdown(elem_id=f"{prefix}-rewards-summary")
    with gr.Column(visible=False, elem_id=f"{prefix}-grpo-panel") as grpo_box:
        gr.Markdown("### GRPO: rewards of the model's own answers")
        grpo_plot = gr.Plot(label="Mean reward and completion length over steps (dots: held-out greedy answers)",
                            elem_id=f"{prefix}-grpo-plot")
        grpo_md = gr.Markdown(elem_id=f"{prefix}-grpo-samples")
    with gr.Column(visible=False, elem_id=f"{prefix}-eval-panel") as eval_box:
        gr.Markdown("### Held-out evaluation: base model against the fine-tune (`finetune eval`)")
        eval_md = gr.Markdown(elem_id=f"{prefix}-eval-table")
    return RunPanel(batch_box, batch_md, noise_plot, advice_btn, advice_msg, rewards_box, reward_plot, rewards_md,
                    grpo_box, grpo_plot, grpo_md, eval_box, eval_md, noise_box)


def updates(run: Path | api.RunView | None) -> tuple[Any, ...]:
    """What the panels show for a run directory (RunPanel.outputs order); hidden where it has nothing."""
    files = api.view_of(run) if run else None
    batch = api.run_batch_report(files) if files else None
    rewards = api.run_reward_report(files) if files else None
    measured = bool(batch and batch["noise_series"])  # none measured: no empty chart, the text says why
    if batch is None:
        batch_out = (gr.update(visible=False), "", None, gr.update(visible=False), "")
    else:
        events = [e for e in views.run_events(files.metrics) if e[2] == "batch"]
        batch_out = (gr.update(visible=True), views.batch_markdown(batch, str(files.root)),
                     charts.noise_figure(batch, events) if measured else None,
                     gr.update(visible=bool(batch["advice"].get("settings"))), "")  # a message of another run goes
    rewards_out = ((gr.update(visible=False), None, "") if rewards is None else
                   (gr.update(visible=True), charts.reward_figure(rewards), views.rewards_markdown(rewards)))
    grpo = api.run_grpo_report(files) if files else None
    grpo_out = ((gr.update(visible=False), None, "") if grpo is None else
                (gr.update(visible=True), charts.grpo_figure(grpo), views.grpo_markdown(grpo)))
    evaluation = api.run_evaluation_table(files) if files else None
    return (*batch_out, *rewards_out, *grpo_out, gr.update(visible=evaluation is not None),
            views.evaluation_markdown(evaluation), gr.update(visible=measured))


def wire_advice(panel: RunPanel, backend: Backend, run: gr.Dropdown, form: Form, api_name: str | None = None) -> None:
    """The advice button: the run's advice written over the recipe form (Backend.apply_advice)."""
    widgets = form.widgets
    @reported(1 + len(widgets))
    def use_advice(run_dir, *values):
        message, changed = backend.apply_advice(list(values), run_dir)
        return (message, *[changed.get(i, gr.skip()) for i in range(len(widgets))])

    form.refreshed(panel.advice_btn.click(use_advice, [run, *widgets], [panel.advice_msg, *widgets],
                                          api_name=api_name, api_visibility="public" if api_name else "private"))
