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


def test_a_plan_far_below_its_budget_is_drawn_on_an_axis_scaled_to_it():
    """862 MiB on a 20 GiB card: on a 20 GiB axis the bars would be slivers. The axis fits the bars (MiB), each
    large segment carries its size, and the budget is named in the legend with the share the plan takes."""
    mib = 1 << 20
    plan = {"weights": 300 * mib, "trainable_weights": 20 * mib, "gradients": 20 * mib, "optimizer_state": 40 * mib,
            "activations": 350 * mib, "logits_and_loss": 100 * mib, "other": 32 * mib}
    ax = charts.memory_figure([("chosen plan", plan)], 20 * GIB).axes[0]
    assert ax.get_ylabel() == "MiB" and ax.get_ylim()[1] == pytest.approx(862 * 1.1)
    assert all(len(line.get_ydata()) == 0 for line in ax.get_lines())  # no budget line far above the bars
    assert {"300.00 MiB", "350.00 MiB", "100.00 MiB", "862.00 MiB"} <= {t.get_text() for t in ax.texts}
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "budget 20.00 GiB, above\nthis axis: the tallest bar\nis 4% of it" in legend
    near = charts.memory_figure([("chosen plan", plan)], 1200 * mib).axes[0]  # a budget near the bars: drawn
    assert [line.get_ydata()[0] for line in near.get_lines()] == pytest.approx([1200 / 1024])


def test_plan_text_and_option_rows():
    text = views.plan_markdown(PLAN)
    assert "FITS" in text and "7.00 GiB" in text and "8.00 GiB" in text and "`micro_batch_size=2`" in text
    rows = views.option_rows(PLAN)
    assert rows == [["alternative", "5.00 GiB", "", "", "activation_checkpointing=False"],
                    ["rejected", "11.00 GiB", "", "peak 11 GiB exceeds the 8 GiB budget", "micro_batch_size=8"]]


def test_plan_text_says_what_the_peak_is_for_its_notes_and_the_settings_that_would_fit():
    fits = views.plan_markdown({**PLAN, "planned_for": "for the data's longest example (75 tokens; data.max_seq_len "
                                "256)", "notes": ["planned for data.max_seq_len 256 (an upper bound): why"]})
    assert "The peak is for the data's longest example (75 tokens; data.max_seq_len 256)." in fits
    assert "Note: planned for data.max_seq_len 256 (an upper bound): why" in fits
    fix = 'memory.offload_experts: auto fits (the planner picks "cpu"): peak 10.69 GiB, 6,164 tokens/s predicted'
    text = views.plan_markdown({**PLAN, "fits": False, "min_budget_bytes": 18 * GIB, "fix_lines": [fix]})
    assert "DOES NOT FIT" in text and f"`{fix}`" in text


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



def test_run_events_become_labelled_markers_on_the_curves():
    rows = [{"step": 1, "loss": 2.0}, {"event": "checkpoint_saved", "step": 2},
            {"event": "oom_recovered", "step": 2, "oom_step": 3, "from": {"micro_batch_size": 4},
             "to": {"micro_batch_size": 2}},
            {"event": "oom_recovered", "step": 5, "oom_step": 6, "from": {"activation_checkpointing": False},
             "to": {"activation_checkpointing": True}}]
    events = views.run_events(rows)
    assert events == [(2, "checkpoint", "checkpoint", "checkpoint saved"),
                      (3, "OOM recovered, batch changed", "batch",
                       "OOM recovered, batch changed (micro_batch_size 4→2)"),
                      (6, "OOM recovered", "oom", "OOM recovered (activation_checkpointing False→True)")]
    assert "step 3: OOM recovered, batch changed (micro_batch_size 4→2)" in views.events_markdown(events)
    for fig in (charts.loss_figure({"run": rows}, events=events), charts.timeline_figure(rows, 5 * GIB, events)):
        for ax in fig.axes:
            assert [line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == ":"] == [2, 3, 6]
            assert {t.get_text() for t in ax.texts} >= {label for _, label, _, _ in events}


def test_timeline_shows_speed_and_memory_against_the_plan():
    rows = [{"step": s, "tokens_per_second": 100.0 * s, "peak_memory_bytes": GIB + s} for s in (1, 2, 3)]
    fig = charts.timeline_figure(rows, 2 * GIB, seen_peak=1.5 * GIB)
    speed, mem = fig.axes
    assert list(speed.get_lines()[0].get_ydata()) == [100.0, 200.0, 300.0]
    levels = sorted(line.get_ydata()[0] for line in mem.get_lines())
    assert levels[-2:] == [1.5, 2.0]  # the plan at the longest sequence seen, and at max_seq_len (GiB)


def test_seen_length_explains_a_measured_peak_far_below_the_plan():
    text = views.seen_length_markdown({"longest": 26, "max_seq_len": 1024, "peak_bytes": 2 << 20,
                                       "planned_peak_bytes": 20 << 20, "breakdown": {}}, 1.6 * (1 << 20))
    assert "shorter than max_seq_len" in text and "26 tokens" in text and "1,024" in text
    assert "20.00 MiB" in text and "2.00 MiB" in text and "1.60 MiB" in text
    assert views.seen_length_markdown(None, 1) == ""


def test_memory_bars_label_each_component_with_its_size():
    fig = charts.memory_figure(views.plan_bars(PLAN), PLAN["budget_bytes"])
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert {"3.00 GiB", "2.00 GiB"} <= texts  # weights and activations segments of the chosen plan


SWEEP = {"max_seq_len": 4096, "model_max_context": 131072, "sizes": [
    {"gpu_gb": 8, "longest_context": 5120, "largest_micro_batch": 1, "recipe_fits": True},
    {"gpu_gb": 16, "longest_context": 92928, "largest_micro_batch": 16, "recipe_fits": True},
    {"gpu_gb": 80, "longest_context": None, "largest_micro_batch": None, "recipe_fits": False}]}


def test_context_chart_marks_the_chosen_gpu_and_plan():
    fig = charts.context_figure(SWEEP, 16, chosen_micro_batch=8)
    ctx, mbs = fig.axes
    assert [round(p.get_height()) for p in ctx.patches] == [5120, 92928, 0]
    colors = [p.get_facecolor() for p in ctx.patches]
    assert colors[1] != colors[0] == colors[2]  # the chosen GPU stands out
    stars = [line for line in ctx.get_lines() + mbs.get_lines() if line.get_marker() == "*"]
    assert [(s.get_xdata()[0], s.get_ydata()[0]) for s in stars] == [(1, 4096), (1, 8)]
    assert {"5,120", "92,928", "none"} <= {t.get_text() for t in ctx.texts}
    text = views.sweep_markdown(SWEEP)
    assert "| 16 GB | 92,928 | 16 | yes |" in text and "| 80 GB | none | none | no |" in text
    assert "131,072" in text


def test_identical_gpu_sizes_say_the_same_plan_fits_every_size():
    """A small recipe fits the smallest card with the model's longest context and the most micro-batches tried:
    six identical pairs of bars, which the chart and the text say are the same plan, nothing to trade."""
    rows = [{"gpu_gb": gb, "longest_context": 8192, "largest_micro_batch": 32, "recipe_fits": True}
            for gb in (8, 12, 16, 24, 48, 80)]
    sweep = {"max_seq_len": 2048, "model_max_context": 8192, "micro_batch_cap": 32, "sizes": rows}
    note = views.same_everywhere(sweep)
    assert note == "the same plan fits every size from 8 GB: nothing to trade"
    assert note in charts.context_figure(sweep, 16, 8, note)._suptitle.get_text()
    text = views.sweep_markdown(sweep)
    assert text.startswith("**The same plan fits every size from 8 GB: nothing to trade.** Each size trains "
                           "contexts up to 8,192 tokens and micro-batch 32 (the most tried) at 2,048 tokens")
    assert views.same_everywhere(SWEEP) is None and not views.sweep_markdown(SWEEP).startswith("**")
    too_big = {**sweep, "sizes": [{**r, "longest_context": None, "largest_micro_batch": None, "recipe_fits": False}
                                  for r in rows]}
    assert views.same_everywhere(too_big) is None  # the same on every size, but nothing fits: no plan to praise


def test_a_micro_batch_at_the_searchs_cap_is_called_the_most_tried():
    """32 at every size from 8 to 80 GB reads as a fact about the GPUs unless it says it is the search's cap."""
    sweep = {**SWEEP, "micro_batch_cap": 32, "sizes": [{**r, "largest_micro_batch": mb} for r, mb in
                                                       zip(SWEEP["sizes"], (1, 32, 32), strict=True)]}
    text = views.sweep_markdown(sweep)
    assert "| 8 GB | 5,120 | 1 | yes |" in text and "| 16 GB | 92,928 | 32 (the most tried) | yes |" in text
    assert "up to 32" in text and "a larger one may fit too" in text
    mbs = charts.context_figure(sweep, 16).axes[1]
    assert [t.get_text() for t in mbs.texts] == ["1", "32+", "32+"] and "the most tried: 32" in mbs.get_title()
    assert "most tried" not in views.sweep_markdown({**SWEEP, "micro_batch_cap": 32})  # 16 is below the cap


def test_plan_text_gives_the_speed_as_an_estimate_with_its_basis():
    from finetune.api import speed_estimate

    plan = {**PLAN, "device": "cuda", "tokens_per_s": 3.0e8}
    text = views.plan_markdown({**plan, "speed": speed_estimate(plan)})
    assert "over 100,000 tokens/s" in text and "RTX 4090" in text and "300,000,000" not in text


def _shown_labels(fig, ax) -> list[str]:
    """The y tick labels drawn inside the axis range, major and minor."""
    fig.canvas.draw()
    low, high = ax.get_ylim()
    ticks = [*zip(ax.get_yticks(), ax.get_yticklabels(), strict=True),
             *zip(ax.get_yticks(minor=True), ax.get_yticklabels(minor=True), strict=True)]
    return [label.get_text() for value, label in ticks if low <= value <= high and label.get_text()]


@pytest.mark.parametrize("low, high", [(52_000, 56_000), (210_000, 240_000), (52_000, 52_600), (1100, 1340)])
def test_noise_scale_axis_labels_are_distinct(low, high):
    """A noise scale within one decade above 10,000 used to label every tick 5e+04."""
    rows = [{"step": s, "loss": 2.0, "gns": low + (high - low) * s / 40} for s in range(1, 41)]
    report = {"noise_series": [(r["step"], r["gns"]) for r in rows], "tokens_per_sequence": 0, "gpus": 1,
              "changes": [], "sequences": 8, "advice": {}}
    for fig in (charts.loss_figure({"run": rows}), charts.noise_figure(report)):
        labels = _shown_labels(fig, fig.axes[-1])
        assert len(labels) >= 2 and len(set(labels)) == len(labels), labels
        assert not any("e+" in label for label in labels), labels


def test_tokens_per_second_stay_inside_the_chart():
    rows = [{"step": s, "tokens_per_second": 436.0 if s == 1 else 300.0, "peak_memory_bytes": GIB} for s in range(1, 7)]
    speed = charts.timeline_figure(rows, 2 * GIB).axes[0]
    low, high = speed.get_ylim()
    assert low == 0 and high > 436 * 1.05  # the fastest point is not drawn on (under) the frame


def test_titles_stay_below_the_panel_label_band():
    """gr.Plot lays its label over the figure's top-left corner: no axes or title may reach into that band."""
    rows = [{"step": s, "loss": 1.0, "tokens_per_second": 10.0, "peak_memory_bytes": GIB} for s in (1, 2)]
    for fig in (charts.memory_figure(views.plan_bars(PLAN), PLAN["budget_bytes"], title="peak memory (budget 8 GiB)"),
                charts.loss_figure({"run": rows}), charts.timeline_figure(rows, GIB)):
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        renderer = FigureCanvasAgg(fig).get_renderer()
        fig.draw(renderer)
        band_bottom = fig.bbox.height - charts.LABEL_BAND * fig.dpi
        for ax in fig.axes:
            assert ax.get_tightbbox(renderer).y1 <= band_bottom + 1, ax.get_title()


def test_one_damaged_run_never_hides_the_others(tmp_path):
    from tests.test_rundir import _damaged_run

    good = RunDir(tmp_path / "good")
    good.root.mkdir()
    good.append_metrics({"step": 1, "loss": 2.0})
    good.write_status("completed", step=1, max_steps=1)
    damaged = _damaged_run(tmp_path / "damaged")
    rows = views.history_rows([str(good.root), str(damaged.root)])
    assert [r[:3] for r in rows] == [[str(good.root), "completed", "1 / 1"], [str(damaged.root), "running", "4 / ?"]]
    charts.loss_figure({p.root.name: p.read_metrics() for p in (good, damaged)}, by_run=True)
    html = views.status_html(damaged.root, "running")
    assert "data-step='4'" in html and "warning: 5 damaged line(s) of metrics.jsonl skipped" in html
    assert "warning" not in views.status_html(good.root, "completed")


def test_a_run_recipe_with_bad_bytes_is_shown_and_refused_in_one_line(tmp_path):
    from finetune.errors import RecipeError
    from tests.test_rundir import _damaged_run
    from ui.backend import Backend, UISettings
    from ui.runs import RunManager

    run = _damaged_run(tmp_path / "damaged")
    backend = Backend(UISettings([tmp_path], tmp_path / "runs"), RunManager(tmp_path / "runs"))
    assert backend.run_recipe(str(run.root)) == "model:\n  path: caf\ufffd\n"
    with pytest.raises(RecipeError, match=r"recipe.yaml:2: not UTF-8 text \(byte 0xe9"):
        backend.load_run_recipe(str(run.root))


def test_the_plan_names_each_value_chosen_automatically_and_a_cpu_estimate_its_measured_figures():
    from finetune.api import speed_estimate

    plan = {**PLAN, "device": "cpu", "tokens_per_s": 26.4, "figures_measured": True,
            "device_figures": {"flops": 22e9, "half_tokens": 6.0, "mem_bw": 6.7e9},
            "chosen_automatically": {"training.micro_batch_size": 2, "memory.chunked_loss": False}}
    text = views.plan_markdown({**plan, "speed": speed_estimate(plan)})
    assert "`training.micro_batch_size=2`, `memory.chunked_loss=false`" in text
    assert "about 26 tokens/s" in text and "measured on this machine's CPU (22 GFLOP/s, 7 GB/s)" in text


def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


@pytest.mark.parametrize("figure", [
    lambda: charts.loss_figure({"run": []}),
    lambda: charts.lr_figure([{"step": 1, "loss": 2.0}]),  # a row without a learning rate draws nothing
    lambda: charts.timeline_figure([], None),
], ids=["loss", "learning-rate", "timeline"])
def test_an_empty_chart_says_no_data_yet_instead_of_drawing_a_made_up_axis(figure):
    """Before a run logs anything its charts show a grey "no data yet" and no ticks, not matplotlib's -0.04..0.04."""
    fig = figure()
    empty = [ax for ax in fig.axes if charts.NO_DATA in _texts(ax)]
    assert empty, [_texts(ax) for ax in fig.axes]
    for ax in fig.axes:
        assert list(ax.get_xticks()) == [] and list(ax.get_yticks()) == [], ax.get_title()


def test_a_chart_with_data_keeps_its_axes_and_no_empty_note():
    rows = [{"step": s, "loss": 2.0 / s, "learning_rate": 1e-4, "tokens_per_second": 10.0, "peak_memory_bytes": GIB}
            for s in (1, 2, 3)]
    for fig in (charts.loss_figure({"run": rows}), charts.lr_figure(rows), charts.timeline_figure(rows, GIB)):
        for ax in fig.axes:
            assert charts.NO_DATA not in _texts(ax) and len(ax.get_yticks()) > 1


def test_an_overlay_of_no_runs_says_so():
    assert "no run selected" in _texts(charts.loss_figure({}, by_run=True).axes[0])
