"""A run that stops learning (gradient norm 0, or a flat loss) is reported: on screen, as a metrics.jsonl event,
in status.json and on the UI's run view; a run that learns is not."""

from __future__ import annotations

import json

from test_run import _recipe_dict, _write_recipe

from finetune.cli import main
from finetune.rundir import COLLAPSED_EVENT, RunDir
from finetune.train.reporting import FLAT_STEPS, CollapseWatch
from ui import views


def test_collapse_watch_needs_repeated_evidence():
    watch = CollapseWatch()
    assert watch.observe(1, 2.0, 0.0) is None and watch.observe(2, 1.9, 1.5) is None  # one zero norm: no word
    assert [watch.observe(s, 1.5, 0.0) for s in (3, 4)] == [None, None]
    assert "step 5: the gradient norm has been 0" in watch.observe(5, 1.5, 0.0)
    assert watch.observe(6, 1.5, 0.0) is None  # said once
    flat = CollapseWatch()
    assert [flat.observe(s, 3.25, 0.5) for s in range(1, FLAT_STEPS)] == [None] * (FLAT_STEPS - 1)
    assert "the loss has stayed at 3.25" in flat.observe(FLAT_STEPS, 3.25, 0.5)
    learning = CollapseWatch()
    assert all(learning.observe(s, 2.0 - s * 1e-3, 0.1) is None for s in range(1, 50))


def _run(tmp_path, tiny_model_dir, name: str, **changes) -> tuple[RunDir, int]:
    recipe = _recipe_dict(tmp_path, tiny_model_dir, output={"dir": str(tmp_path / name)}, **changes)
    recipe["training"]["max_steps"] = 8
    return RunDir(tmp_path / name), main(["run", str(_write_recipe(tmp_path, recipe, name))])


def test_a_collapsed_run_is_reported_and_a_learning_run_is_not(tmp_path, tiny_model_dir, capsys):
    collapsed, code = _run(tmp_path, tiny_model_dir, "collapsed", adapter={"alpha": 1e6},
                              training={"learning_rate": 1.0, "max_grad_norm": None})
    err = " ".join(capsys.readouterr().err.split())
    assert code == 0 and "warning: training collapsed at step" in err, err
    events = [r for r in collapsed.read_metrics() if r.get("event") == COLLAPSED_EVENT]
    assert len(events) == 1 and "no longer learn" in events[0]["detail"]
    status = json.loads(collapsed.status.read_text())
    assert status["state"] == "completed" and status["training_warning"] == events[0]["detail"]
    assert "warning: training collapsed" in views.status_html(collapsed.root, "completed")
    assert (events[0]["step"], "collapsed", "warning", events[0]["detail"]) in views.run_events(
        collapsed.read_metrics())

    learning, code = _run(tmp_path, tiny_model_dir, "learning", training={"learning_rate": 1e-2})
    assert code == 0 and "training collapsed" not in capsys.readouterr().err
    assert len([r for r in learning.read_metrics() if "loss" in r]) == 8
    assert not [r for r in learning.read_metrics() if r.get("event") == COLLAPSED_EVENT]
    assert "training_warning" not in json.loads(learning.status.read_text())
    assert "warning" not in views.status_html(learning.root, "completed")
