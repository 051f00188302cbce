"""What the page shows from planner output and run directories."""

from __future__ import annotations

import json

import pytest

from finetune.rundir import RunDir
from ui import charts, views

GIB = 1 << 30
PLAN = {
    "peak_bytes": 7 * GIB, "budget_bytes": 8 * GIB, "fits": True,
    "breakdown": {"weights": 3 * GIB, "trainable_weights": GIB // 4, "gradients": GIB // 4, "optimizer_state": GIB // 2,
                  "activations": 2 * GIB, "logits_and_loss": GIB // 2, "other": GIB // 2},
    "settings": {"micro_batch_size": 2, "activation_checkpointing": True},
    "alternatives": [{"settings": {"micro_batch_size": 2, "activation_checkpointing": False}, "peak_bytes": 5 * GIB,
                      "breakdown": {"weights": 3 * GIB, "activations": 2 * GIB}}],
    "rejected": [{"settings": {"micro_batch_size": 8}, "peak_bytes": 11 * GIB, "fits": False,
                  "reason": "peak 11 GiB exceeds the 8 GiB budget"}],
}


def test_memory_chart_stacks_the_breakdown_against_the_budget():
    bars = views.plan_bars(PLAN)
    assert [name for name, _ in bars] == ["chosen plan", "activation_checkpointing=False"]
    fig = charts.memory_figure(bars, PLAN["budget_bytes"])
    ax = fig.axes[0]
    tops = {}
    for patch in ax.patches:  # stacked: each bar's segments end at its total
        x = round(patch.get_x() + patch.get_width() / 2)
        tops[x] = max(tops.get(x, 0), patch.get_y() + patch.get_height())
    assert tops == pytest.approx({0: 7.0, 1: 5.0})
    assert [line.get_ydata()[0] for line in ax.get_lines()] == [8.0]  # the budget line, in GiB


def test_plan_text_and_option_rows():
    text = views.plan_markdown(PLAN)
    assert "FITS" in text and "7.00 GiB" in text and "8.00 GiB" in text and "`micro_batch_size=2`" in text
    rows = views.option_rows(PLAN)
    assert rows == [["alternative", "5.00 GiB", "", "activation_checkpointing=False", ""],
                    ["rejected", "11.00 GiB", "", "micro_batch_size=8", "peak 11 GiB exceeds the 8 GiB budget"]]


def test_run_dir_reader_skips_a_torn_line_and_summarises(tmp_path):
    rows = [{"step": 1, "loss": 2.0, "learning_rate": 1e-4, "peak_memory_bytes": 100},
            {"step": 2, "loss": 1.5, "learning_rate": 2e-4, "peak_memory_bytes": 300},
            {"step": 2, "eval_loss": 1.7}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "lo')
    (tmp_path / "status.json").write_text(json.dumps({"state": "running", "step": 2, "max_steps": 4, "eta_s": 75}))
    assert len(RunDir(tmp_path).read_metrics()) == 3
    s = views.summary(tmp_path)
    assert (s["state"], s["loss"], s["eval_loss"], s["peak_memory_bytes"]) == ("running", 1.5, 1.7, 300)
    html = views.status_html(tmp_path, "running")
    assert "data-step='2'" in html and "2 / 4" in html and "1m 15s" in html and "value='50.0'" in html


def test_measured_memory_is_set_beside_the_prediction(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    (tmp_path / "metrics.jsonl").write_text(json.dumps(
        {"step": 1, "loss": 1.0, "peak_memory_breakdown": {"weights": 3 * GIB, "activations": 3 * GIB}}) + "\n")
    bars, budget = views.measured_bars(tmp_path)
    assert [name for name, _ in bars] == ["predicted", "measured"] and budget == 8 * GIB
    assert sum(bars[1][1].values()) == 6 * GIB

