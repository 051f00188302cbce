"""The run view's panels after a run (Train and Runs tabs): the batch used, the noise scale over time and the
advice for next time (issue #14 point 4), and a preference run's reward curves (issue #17 point 4), built from
run directories written with the run's own writers."""

from __future__ import annotations

import pytest

from finetune import api
from finetune.recipe import validate_recipe
from finetune.recipe.load import recipe_to_yaml
from finetune.rundir import RunDir, atomic_write_json, atomic_write_text
from ui import charts, views
from ui.backend import Backend, UISettings
from ui.runs import RunManager
from ui.tabs import run_panel

GNS = [(3, 400.0), (4, 900.0), (5, 1600.0), (6, 2400.0), (7, 3000.0)]  # (step, labelled tokens)
PER_SEQUENCE = 25.0  # labelled tokens per sequence
# The settings of results.json's "advice", as finetune.recipe.batch_rules.advise writes them (recipe keys)
ADVISED = {"training.effective_batch_size": 8, "training.gradient_accumulation_steps": "auto",
           "training.reference_batch_size": 8, "training.learning_rate": 0.001414, "optimizer.betas": [0.9, 0.998]}


def _recipe(tmp_path, name: str, **training) -> dict:
    return {"model": {"path": str(tmp_path / "model")}, "data": {"path": str(tmp_path / "data.jsonl")},
            "training": {"micro_batch_size": 2, "learning_rate": 1e-3, **training},
            "output": {"dir": str(tmp_path / name)}}


def _run(tmp_path, name: str, rows: list[dict], results: dict | None, **training) -> RunDir:
    """A run directory as `finetune run` leaves it: recipe.yaml, metrics.jsonl rows, results.json."""
    run = RunDir(tmp_path / name)
    run.create()
    atomic_write_text(run.recipe, recipe_to_yaml(validate_recipe(_recipe(tmp_path, name, **training))))
    for row in rows:
        run.append_metrics(row)
    if results is not None:
        atomic_write_json(run.results, results)
    return run


def _auto_run(tmp_path) -> RunDir:
    """An `effective_batch_size: auto` run whose accumulation went 2 -> 4 at step 5 (micro-batch 2), with the
    noise scale logged at every step and results.json's batch account and advice (batch_engine.batch_summary)."""
    change = {"event": "batch_changed", "step": 5,
              "from": {"gradient_accumulation_steps": 2, "effective_batch_size": 4},
              "to": {"gradient_accumulation_steps": 4, "effective_batch_size": 8},
              "gns": 1600.0, "learning_rate": 1.414e-3, "beta2": 0.998}
    rows = [{"step": s, "loss": 2.0 / s, "gns": g, "grad_sq": 1.0, "trace_sigma": g} for s, g in GNS[:2]]
    rows += [change] + [{"step": s, "loss": 2.0 / s, "gns": g, "grad_sq": 1.0, "trace_sigma": g} for s, g in GNS[2:]]
    advice = {"settings": ADVISED, "reason": "measured noise scale 3000 labelled tokens = 120 sequences: 8 "
              "sequences per update; batch 8 vs reference 8 sequences: learning rate and beta2 unchanged"}
    results = {"state": "completed", "steps": 7,
               "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 4, "effective_batch_size": 8,
                         "auto": True, "changes": [change]},
               "noise_scale": {"unit": "labelled tokens", "final": GNS[-1][1], "tokens_per_sequence": PER_SEQUENCE,
                               "series": [list(p) for p in GNS]},
               "advice": advice}
    return _run(tmp_path, "auto", rows, results, effective_batch_size="auto")


def test_the_batch_panel_says_the_batch_used_the_noise_scale_the_changes_and_the_advice(tmp_path):
    run = _auto_run(tmp_path)
    report = api.run_batch_report(run.root)
    assert (report["sequences"], report["tokens"], report["gpus"], report["auto"]) == (8, 200, 1, True)
    assert report["noise_series"] == GNS and [c["step"] for c in report["changes"]] == [5]
    settings = report["advice"]["settings"]
    assert settings == ADVISED

    text = views.batch_markdown(report, str(run.root))
    assert "2 per micro-batch × 4 accumulation × 1 GPU = **8 sequences per optimizer step**" in text
    assert "about 200 labelled tokens (25 per sequence)" in text and "effective_batch_size: auto" in text
    assert "3000 labelled tokens ≈ 120 sequences" in text  # the final noise scale, in tokens and sequences
    assert "step 5: 4 → 8 sequences (noise scale 1600 tokens), learning rate 0.00141, beta2 0.998" in text
    assert "**Next time**: an effective batch of **8 sequences** (about 200 labelled tokens), learning rate " \
           "**0.001414**, betas **[0.9, 0.998]**" in text
    assert report["advice"]["reason"] in text  # the rule's own account of why
    assert "`training.effective_batch_size=8`" in text and f"--advice {run.root}" in text

    events = [e for e in views.run_events(run.read_metrics()) if e[2] == "batch"]
    assert events == [(5, "batch 4→8", "batch", "batch changed (gradient_accumulation_steps 2→4, "
                                                 "effective_batch_size 4→8)")]
    ax = charts.noise_figure(report, events).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    noise, batch = lines["measured noise scale"], lines["batch used"]
    assert list(noise.get_xdata()) == [s for s, _ in GNS] and list(noise.get_ydata()) == [g for _, g in GNS]
    assert list(zip(batch.get_xdata(), batch.get_ydata(), strict=True)) == [(0, 100), (5, 100), (5, 200), (7, 200)]
    assert lines["advised for next time (8 seq.)"].get_ydata()[0] == 200  # in tokens, like the noise scale
    assert [line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == ":"] == [5]
    assert {t.get_text() for t in ax.texts} == {"batch 4→8"}


def test_the_batch_panel_says_when_the_run_ended_in_the_warmup_below_the_micro_batch(tmp_path):
    """auto's warmup runs updates of fewer sequences than the micro-batch (finetune/train/sub_updates.py): the
    panel names the update batch, not micro-batch x accumulation."""
    results = {"state": "completed", "steps": 7,
               "batch": {"micro_batch_size": 8, "gradient_accumulation_steps": 1, "effective_batch_size": 2,
                         "update_batch": 2, "auto": True, "changes": []},
               "noise_scale": {"unit": "labelled tokens", "final": 900.0, "tokens_per_sequence": PER_SEQUENCE,
                               "series": []}, "advice": {}}
    run = _run(tmp_path, "warm", [], results, effective_batch_size="auto")
    report = api.run_batch_report(run.root)
    assert (report["sequences"], report["update_batch"]) == (2, 2)
    text = views.batch_markdown(report, str(run.root))
    assert "updates of 2 within micro-batches of 8 (the warmup below the micro-batch) × 1 GPU = " \
           "**2 sequences per optimizer step**" in text


def test_the_batch_panel_is_shown_only_for_a_run_that_accounted_for_its_batch(tmp_path):
    kto = _run(tmp_path, "kto", [{"step": 1, "loss": 0.5, "rewards/chosen": 0.2, "rewards/rejected": -0.1,
                                  "rewards/margins": 0.3, "kl": 0.0}], None, method="kto")
    accuracy = charts.reward_figure(api.run_reward_report(kto.root)).axes[1]
    assert not accuracy.get_lines() and "no accuracy" in accuracy.texts[0].get_text()

    going = _run(tmp_path, "going", [{"step": 1, "loss": 1.0, "gns": 50.0}], None)  # no results.json yet
    several = _run(tmp_path, "several", [{"step": 1, "loss": 1.0}], {"state": "completed", "steps": 1})
    for run in (going, several):
        assert api.run_batch_report(run.root) is None
        box, text, plot, button, message, *_ = run_panel.updates(run.root)
        assert box["visible"] is False and message == "" and button["visible"] is False and text == "" and plot is None
    shown = run_panel.updates(_auto_run(tmp_path).root)
    assert shown[0]["visible"] is True and shown[3]["visible"] is True and "Batch used" in shown[1]
    assert shown[-1]["visible"] is True and shown[2].axes[0].get_lines()  # the measured noise scale, its box shown

    no_advice = {"reason": "no noise scale was measured (too few steps, or micro-batch 1 without accumulation)"}
    results = {"batch": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "effective_batch_size": 1,
                         "auto": False, "changes": []},
               "noise_scale": {"final": None, "tokens_per_sequence": 30.0, "series": []}, "advice": no_advice}
    run = _run(tmp_path, "short", [{"step": 1, "loss": 1.0}], results)
    box, text, plot, button, *_, noise_box = run_panel.updates(run.root)
    assert box["visible"] is True and button["visible"] is False  # nothing to apply
    # no points: no empty chart on a meaningless axis (its box hidden), the text says why there is none
    assert noise_box["visible"] is False and plot is None
    assert "**Measured noise scale**: not measured, so no chart of it: too few steps" in text
    assert f"no advice: {no_advice['reason']}" in text


def test_the_advice_goes_into_the_form_as_plan_advice_applies_it(tmp_path):
    run = _auto_run(tmp_path)
    settings = api.run_batch_report(run.root)["advice"]["settings"]
    recipe_file = tmp_path / "next.yaml"
    atomic_write_text(recipe_file, recipe_to_yaml(validate_recipe(_recipe(tmp_path, "next", micro_batch_size=4))))
    recipe = api.load_recipe(recipe_file)
    advised, keys_set, why = api.apply_advice(recipe, run.root)
    assert advised == api.load_recipe(recipe_file, api.run_advice(run.root)[0])  # what `plan --advice` reads
    assert advised.training.effective_batch_size == 8 and advised.training.micro_batch_size == 4
    assert advised.training.learning_rate == settings["training.learning_rate"] and why in views.batch_markdown(
        api.run_batch_report(run.root))

    backend = Backend(UISettings([tmp_path], tmp_path / "runs"), RunManager(tmp_path / "runs"))
    keys = [s.key for s in backend.specs]
    values = backend.load_yaml(recipe_file.read_text(), "next.yaml")
    message, changed = backend.apply_advice(values, str(run.root))
    assert {keys[i]: v for i, v in changed.items()} == {
        "training.effective_batch_size": "8", "training.gradient_accumulation_steps": "auto",
        "training.reference_batch_size": "8", "training.learning_rate": settings["training.learning_rate"],
        "optimizer.betas": "[0.9, " + str(settings["optimizer.betas"][1]) + "]"}
    assert "`training.effective_batch_size=8`" in message and why in message
    new_values = [changed.get(i, v) for i, v in enumerate(values)]
    assert backend.recipe(new_values) == advised.model_copy()  # the form now holds the advised recipe

    from finetune.errors import FinetuneError, RecipeError

    # a micro-batch pinned above the advised batch would win over the advice: released to auto, and said
    pinned = api.load_recipe(recipe_file, ["training.micro_batch_size=16"])
    released, _, why_pinned = api.apply_advice(pinned, run.root)
    assert released.training.micro_batch_size == "auto"
    assert "training.micro_batch_size 16 is above the advised batch of 8: the advice released" in why_pinned
    pinned_values = backend.load_yaml(recipe_to_yaml(pinned), "pinned.yaml")
    message, changed = backend.apply_advice(pinned_values, str(run.root))
    assert changed[keys.index("training.micro_batch_size")] == "auto" and "released it to auto" in message
    assert "micro_batch_size" not in why

    with pytest.raises(RecipeError, match="must hold a valid recipe") as empty:
        backend.apply_advice([""] * len(values), str(run.root))  # a fresh page: no model, no data
    assert "From a previous run" in empty.value.hint
    with pytest.raises(FinetuneError, match="no batch advice"):
        backend.apply_advice(values, str(_run(tmp_path, "old", [], {"state": "completed"}).root))


PAIRS = {"rewards/chosen": 0.1, "rewards/rejected": -0.2, "rewards/margins": 0.3, "rewards/accuracies": 0.25}


def _preference_run(tmp_path) -> RunDir:
    """A dpo run as finetune/step/preference.py logs it: train rows with rewards, eval rows (the last one
    twice, as run.py evaluates again after the Trainer), and results.json's eval before and after."""
    before = {"eval_loss": 0.6931, **{f"eval_{k}": 0.0 for k in PAIRS}}
    after = {"eval_loss": 0.41, **{f"eval_{k}": 2 * v for k, v in PAIRS.items()}}
    rows = [{"step": 0, **before}]
    for step in (1, 2, 3, 4):
        rows.append({"step": step, "loss": 0.7 - 0.05 * step, **{k: v * step for k, v in PAIRS.items()},
                     "logps/chosen": -60.0, "gns": 10.0})
        if step == 2:
            rows.append({"step": 2, "eval_loss": 0.5, **{f"eval_{k}": v for k, v in PAIRS.items()}})
    rows += [{"step": 4, **after}, {"step": 4, **after}]
    return _run(tmp_path, "dpo", rows, {"state": "completed", "eval_before": before, "eval_after": after},
                method="dpo")


def test_a_preference_run_shows_its_reward_curves_and_the_held_out_rewards_before_and_after(tmp_path):
    run = _preference_run(tmp_path)
    report = api.run_reward_report(run.root)
    margins = report["curves"]["rewards/margins"]
    assert margins["train"] == [(s, pytest.approx(0.3 * s)) for s in (1, 2, 3, 4)]
    assert margins["eval"] == [(0, 0.0), (2, 0.3), (4, 0.6)]  # one held-out point per step
    assert report["before"]["rewards/margins"] == 0.0 and report["after"]["rewards/accuracies"] == 0.5

    fig = charts.reward_figure(report)
    rewards, accuracy = fig.axes
    lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
    for key, label in api.REWARD_KEYS.items():
        assert list(lines[label].get_ydata()) == pytest.approx([PAIRS[key] * s for s in (1, 2, 3, 4)])
        assert list(lines[f"{label}, held-out"].get_xdata()) == [0, 2, 4]
    assert {line.get_label() for line in accuracy.get_lines()} == {"accuracy (chosen > rejected)",
                                                                   "accuracy (chosen > rejected), held-out"}

    text = views.rewards_markdown(report)
    assert "| reward margin | +0.000 | +0.600 |" in text and "| accuracy (chosen > rejected) | 0% | 50% |" in text
    assert "| loss | 0.6931 | 0.4100 |" in text
    updates = run_panel.updates(run.root)
    assert updates[5]["visible"] is True and updates[7] == text

    kto = _run(tmp_path, "kto", [{"step": 1, "loss": 0.5, "rewards/chosen": 0.2, "rewards/rejected": -0.1,
                                  "rewards/margins": 0.3, "kl": 0.0}], None, method="kto")
    accuracy = charts.reward_figure(api.run_reward_report(kto.root)).axes[1]
    assert not accuracy.get_lines() and "no accuracy" in accuracy.texts[0].get_text()

    going = _run(tmp_path, "going", [r for r in run.read_metrics() if r["step"] <= 2], None, method="dpo")
    assert views.rewards_markdown(api.run_reward_report(going.root)) == ""  # curves while it runs, no table yet
    sft = _run(tmp_path, "sft", [{"step": 1, "loss": 1.0, "eval_loss": 1.1}], {"state": "completed"})
    assert api.run_reward_report(sft.root) is None
    assert run_panel.updates(sft.root)[5:8] == ({"visible": False, "__type__": "update"}, None, "")


def test_a_grpo_run_shows_its_reward_curve_held_out_rewards_and_latest_sampled_answers(tmp_path):
    """Rows as finetune/train/grpo.py logs them, completions.jsonl as it writes them (some text that would break
    a markdown table), results.json's held-out rewards before and after."""
    before, after = {"eval_reward": 0.1, "eval_completion_length": 30.0}, {"eval_reward": 0.7, "eval_completion_length": 12.0}
    rows = [{"step": 0, **before, "eval_runtime": 1.0}]
    rows += [{"step": s, "loss": 0.0, "reward": 0.1 * s, "reward_std": 0.2, "completion_length": 30.0 - s,
              "clip_ratio": 0.0} for s in (1, 2, 3)]
    rows.append({"step": 3, **after, "eval_runtime": 1.0})
    run = _run(tmp_path, "grpo", rows, {"state": "completed", "eval_before": before, "eval_after": after})
    run.append_completions([{"step": 1, "where": "d.jsonl:1", "prompt": "p", "completion": "old", "reward": 0.0}])
    run.append_completions([{"step": 3, "where": "d.jsonl:4", "prompt": "p", "completion": "a | b\n*c* <x>",
                             "reward": 1.0}])
    report = api.run_grpo_report(run.root)
    assert report["curves"]["reward"]["train"] == [(1, 0.1), (2, 0.2), (3, pytest.approx(0.3))]
    assert report["curves"]["reward"]["eval"] == [(0, 0.1), (3, 0.7)]
    assert report["before"] == {"reward": 0.1, "completion_length": 30.0} and report["after"]["reward"] == 0.7
    assert [s["completion"] for s in report["samples"]] == ["a | b\n*c* <x>"]  # the last logged step's only
    lines = {line.get_label(): line for ax in charts.grpo_figure(report).axes for line in ax.get_lines()}
    assert list(lines["mean reward"].get_ydata()) == pytest.approx([0.1, 0.2, 0.3])
    assert list(lines["mean reward, held-out (greedy)"].get_xdata()) == [0, 3]
    text = views.grpo_markdown(report)
    assert "| reward | 0.100 | 0.700 |" in text and "Sampled answers of step 3" in text
    assert "| d.jsonl:4 | a &#124; b &#42;c&#42; &lt;x&gt; | 1.000 |" in text  # one row, nothing rendered
    panel = run_panel.updates(run.root)
    assert panel[8]["visible"] is True and panel[10] == text and panel[5]["visible"] is False  # not preference
    sft = _run(tmp_path, "sft", [{"step": 1, "loss": 1.0}], {"state": "completed"})
    assert api.run_grpo_report(sft.root) is None and run_panel.updates(sft.root)[8]["visible"] is False


def test_the_latest_finetune_eval_shows_base_and_run_side_by_side(tmp_path):
    run = _run(tmp_path, "sft", [{"step": 1, "loss": 1.0}], {"state": "completed"})
    assert run_panel.updates(run.root)[11:13] == ({"visible": False, "__type__": "update"}, "")
    models = [{"label": "base model", "loss": 2.5, "perplexity": 12.18, "loss_tokens": 40,
               "exact": {"matched": 0, "of": 4}, "contains": {"matched": 1, "of": 4}, "numeric": None},
              {"label": "sft", "loss": 0.5, "perplexity": 1.65, "loss_tokens": 40,
               "exact": {"matched": 3, "of": 4}, "contains": {"matched": 4, "of": 4}, "numeric": None}]
    atomic_write_json(run.evaluation, {"data": "/data/held_out.jsonl", "records": 5, "with_expected_answer": 4,
                                       "models": models, "answers": []})  # an older version's file
    assert "\n5 examples kept of `/data/held_out.jsonl`, 4 with" in "\n" + run_panel.updates(run.root)[12]
    atomic_write_json(run.evaluation, {"data": "/data/held_out.jsonl", "records_read": 6, "examples_kept": 5,
                                       "with_expected_answer": 4, "models": models, "answers": []})
    box, table = run_panel.updates(run.root)[11:13]
    assert box["visible"] is True
    assert "6 records read, 5 examples kept of `/data/held_out.jsonl`, 4 with an expected answer" in table
    assert "| model | loss | perplexity | exact | contains | numeric |" in table
    assert "| base model | 2.5000 | 12.18 | 0/4 | 1/4 | - |\n| sft | 0.5000 | 1.65 | 3/4 | 4/4 | - |" in table


def test_the_history_eval_loss_column_reads_the_runs_finetune_eval(tmp_path):
    """`finetune eval` writes evaluation.json (one model entry per model, the run's labelled with its folder's
    name, last); the Runs tab's eval-loss column shows the run's own entry, not the base model's or a compared
    run's, and says where it came from; before an eval, the loss training logged on its validation split."""
    run = _run(tmp_path, "sft", [{"step": 1, "loss": 1.0}, {"step": 1, "eval_loss": 0.9}], {"state": "completed"})
    assert views.history_rows([str(run.root)])[0][3:5] == ["1.0000", "0.9000"]
    models = [{"label": "base model", "loss": 2.5, "perplexity": 12.18},
              {"label": "other-run", "loss": 0.7, "perplexity": 2.01},
              {"label": "sft", "loss": 0.4321, "perplexity": 1.54}]
    atomic_write_json(run.evaluation, {"data": "/data/held_out.jsonl", "records_read": 6, "examples_kept": 5,
                                       "with_expected_answer": 4, "models": models, "answers": []})
    assert views.history_rows([str(run.root)])[0][4] == "0.4321 (finetune eval)"
    bare = _run(tmp_path, "bare", [{"step": 1, "loss": 1.0}], {"state": "completed"})
    atomic_write_json(bare.evaluation, {"models": [{"label": "base model", "loss": 2.5}, {"label": "bare"}]})
    assert views.history_rows([str(bare.root)])[0][4] == ""  # a damaged entry (no loss) is no loss


def _count_reads(monkeypatch, folder) -> dict[str, int]:
    """File name -> times a file of `folder` is opened from now on (Path.read_text/read_bytes/open and open())."""
    import builtins
    import collections
    import os
    from pathlib import Path

    opened: dict[str, int] = collections.Counter()
    path_open, plain_open = Path.open, builtins.open

    def counted(file) -> None:
        if isinstance(file, (str, os.PathLike)) and Path(file).parent == folder:
            opened[Path(file).name] += 1

    def open_path(self, *args, **kwargs):
        counted(self)
        return path_open(self, *args, **kwargs)

    def open_plain(file, *args, **kwargs):
        counted(file)
        return plain_open(file, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_path)
    monkeypatch.setattr(builtins, "open", open_plain)
    return opened


def test_one_redraw_of_the_train_tab_reads_each_run_file_once(tmp_path, monkeypatch):
    """Every timer tick redraws the selected run: status line, curves, memory bars, the seen-length note and the
    batch and reward panels all come from one reading of each run file (they used to read metrics.jsonl up to
    six times and plan.json four)."""
    from types import SimpleNamespace

    import finetune.plan
    from ui.tabs import train

    results = {**_auto_run(tmp_path).read_results(), **_preference_run(tmp_path).read_results()}
    rows = _preference_run(tmp_path / "again").read_metrics()
    rows[-1]["peak_memory_breakdown"] = {"weights": 3 << 20, "activations": 1 << 20}
    run = _run(tmp_path, "live", rows, results, method="dpo")
    atomic_write_json(run.plan, {"peak_bytes": 8 << 20, "budget_bytes": 16 << 20, "device": "cpu",
                                 "breakdown": {"weights": 3 << 20, "activations": 5 << 20}})
    run.write_status("running", step=4, max_steps=8, longest_sequence_tokens=26)
    run.log_line("step 4")
    # the re-plan at the longest sequence seen is the planner's business; here only whether its input is read
    monkeypatch.setattr(finetune.plan, "predict", lambda recipe, **_: SimpleNamespace(
        peak_bytes=5 << 20, breakdown={"weights": 3 << 20, "activations": 2 << 20}))
    backend = Backend(UISettings([tmp_path], tmp_path / "runs"), RunManager(tmp_path / "runs"))

    opened = _count_reads(monkeypatch, run.root)
    status, plots, log, _, seen = train.redraw(backend, str(run.root), None)
    assert dict(opened) == {name: 1 for name in ("status.json", "metrics.jsonl", "plan.json", "results.json",
                                                 "recipe.yaml", "train.log", "evaluation.json")}
    explained, loss, timeline, lr, memory, batch_box, batch_md, noise, *_, rewards_box, reward_plot, rewards_md = \
        plots[:-6]  # the last six: the GRPO and the evaluation panels, the noise chart's box
    assert "data-step='4'" in status and "8.00 MiB" in status and "step 4" in log  # predicted peak
    assert "longest sequence in the data is 26 tokens" in explained and "5.00 MiB" in explained
    assert [t.get_text() for t in memory.axes[0].get_xticklabels()] == ["predicted", "predicted at 26 tokens",
                                                                         "measured"]
    assert batch_box["visible"] and "Batch used" in batch_md and rewards_box["visible"]
    assert "| reward margin | +0.000 | +0.600 |" in rewards_md

    opened.clear()  # the next tick, nothing new: the status line is drawn again, the plots are kept
    status, plots, *_ = train.redraw(backend, str(run.root), seen)
    assert plots is None and dict(opened) == {name: 1 for name in ("status.json", "metrics.jsonl", "plan.json",
                                                                   "train.log")}
