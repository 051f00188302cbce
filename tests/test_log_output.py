"""Output a log can read: with the output going to a file (nohup, docker logs, CI), training progress is plain
lines written as it goes (no carriage-return bar that reaches the log only at the end), the data line is a
short summary with every count in the run directory; library warnings no user can act on are filtered, and a
warning raised from our own code fails the tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from run_support import sums_data, tiny_lora_recipe

import finetune.console
from finetune.console import ProgressLines, progress_bar
from finetune.rundir import RunDir
from finetune.units import format_number

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^\d\d:\d\d:\d\d train (\d+)/(\d+) \(\d+%\) loss [\d.]+ +[\d,]+ tok/s +elapsed [\d:]+ +eta [\d:]+$")


def test_off_a_terminal_progress_is_a_line_each_tenth_printed_at_once(capsys):
    bar = progress_bar("train", info=True)
    assert isinstance(bar, ProgressLines)  # pytest's captured stderr is no terminal
    task = bar.add_task("train", total=50, completed=0, info="")
    seen = []
    for step in range(1, 51):
        bar.update(task, completed=step)  # the step's end: no line yet, its loss is not known
        assert capsys.readouterr().err == ""
        bar.update(task, info=f"loss {1 / step:.4f}  100 tok/s")  # its logged row: a line when a tenth is done
        if out := capsys.readouterr().err:
            seen.append(out)
    bar.stop()
    assert capsys.readouterr().err == ""  # the last line came with the last step
    steps = [int(re.search(r"train (\d+)/50", line).group(1)) for line in seen]
    assert steps == list(range(5, 51, 5)), seen
    assert all(line.count("\n") == 1 and "\r" not in line for line in seen)
    assert re.search(r"^\d\d:\d\d:\d\d train 50/50 \(100%\) loss 0.0200  100 tok/s  elapsed 0:00:0\d  eta 0:00:00$",
                     seen[-1].strip()), seen[-1]


def test_off_a_terminal_a_slow_task_prints_after_line_seconds_and_at_its_end(capsys, monkeypatch):
    monkeypatch.setattr(finetune.console, "LINE_SECONDS", 0.0)  # every update is "30 s later"
    with progress_bar("reference pass") as bar:
        task = bar.add_task("reference", total=1000)
        bar.update(task, advance=3)
        assert "reference pass 3/1000 (0%)" in capsys.readouterr().err
    monkeypatch.setattr(finetune.console, "LINE_SECONDS", 3600.0)
    with progress_bar("reference pass") as bar:
        task = bar.add_task("reference", total=1000)
        bar.update(task, advance=7)
        assert capsys.readouterr().err == ""
    assert "reference pass 7/1000 (1%)" in capsys.readouterr().err  # the end says where it stopped


def test_a_run_logged_to_a_file_shows_progress_lines_and_a_short_data_line(tmp_path, tiny_model_dir):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_lora_recipe(tiny_model_dir, sums_data(tmp_path / "data.jsonl", 24),
                                                      tmp_path / "run", {"training": {"max_steps": 20}})))
    log = tmp_path / "run.log"
    with log.open("w") as out:  # as `finetune run recipe.yaml > run.log 2>&1`
        proc = subprocess.run([sys.executable, "-m", "finetune", "run", str(recipe)], stdout=out,
                              stderr=subprocess.STDOUT, cwd=ROOT, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "\r" not in text
    lines = text.splitlines()
    done = next(i for i, line in enumerate(lines) if line.startswith("done: 20 steps"))
    progress = [(i, int(m.group(1))) for i, line in enumerate(lines) if (m := LINE.match(line))]
    assert [step for _, step in progress] == list(range(2, 21, 2)), text  # a line per tenth of the steps
    assert all(i < done for i, _ in progress)
    data = next(line for line in lines if line.startswith("data: "))
    run = RunDir(tmp_path / "run")
    assert data == f"data: 24 messages records: 24 kept, 0 cut, 0 dropped, " \
                   f"{json.loads(run.data_stats.read_text())['train_tokens']:,} tokens to train on " \
                   f"(every count: {run.data_stats})"
    stats = json.loads(run.data_stats.read_text())
    assert stats["records"] == 24 and stats["overlong_at"] == [] and stats["max_example_tokens"] > 0
    assert "Warning" not in text  # peft's read of transformers' deprecated is_gradient_checkpointing: filtered
    logged = [line for line in run.log.read_text().splitlines() if " step=" in line]
    values = [v for line in logged for v in re.findall(r"=(-?\d[^ ]*)", line)]
    assert logged and all(len(v) <= 10 for v in values), logged  # train.log: numbers people read
    assert any(re.search(r" learning_rate=\d\.\d{3}e-0\d ", line) for line in logged), logged


@pytest.mark.parametrize(("value", "shown"), [
    (0.0007252766679155447, "7.253e-04"), (1.23456789, "1.235"), (1234.567, "1234.6"), (0.0123456, "0.01235"),
    (2.0, "2"), (5e6, "5.000e+06"), (0.0, "0.0"), (12, "12"), ("x", "x"), (None, "None"), (True, "True")])
def test_a_logged_number_is_written_in_four_significant_figures(value, shown):
    assert format_number(value) == shown


def test_a_new_warning_from_our_own_code_fails_and_library_noise_is_filtered(tiny_model_dir):
    with pytest.raises(UserWarning, match="something new"):  # pyproject's filterwarnings
        warnings.warn_explicit("something new", UserWarning, "finetune/x.py", 1, module="finetune.x")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with warnings.catch_warnings(record=True) as seen:  # the filters in force, recording what passes them
        get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
        warnings.warn_explicit("a library's own", UserWarning, "lib.py", 1, module="somelib")
    assert [str(w.message) for w in seen] == ["a library's own"]  # the rest still show
