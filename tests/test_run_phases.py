"""A run's long phases besides training (a preference method's reference pass, the held-out evaluation before
training, the final evaluation) say what they do and show progress in a piped log before they end; Ctrl-C
during them stops after a checkpoint (or, training complete, keeps the adapter; nothing trained yet, leaves
nothing), skips the final evaluation and prints how to go on; a second Ctrl-C still prints the resume command."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
import yaml

import finetune.console
import finetune.train.reference_pass
import finetune.train.reporting
from finetune.cli import main
from finetune.rundir import RunDir, read_jsonl
from tests.run_support import sums_data, tiny_lora_recipe
from tests.test_grpo_run import _recipe as grpo_recipe


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _sft(tmp_path: Path, model: Path, **training) -> Path:
    """40 chat records, half held out: a 20-example evaluation in 10 micro-batches of 2."""
    recipe = tiny_lora_recipe(model, sums_data(tmp_path / "data.jsonl", 40), tmp_path / "run",
                              {"data": {"validation_split": 0.5},
                               "training": {"max_steps": 3, "micro_batch_size": 2, "gradient_accumulation_steps": 1,
                                            **training},
                               "output": {"save_steps": 100}})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _ctrl_c_during(monkeypatch, label: str, times: int = 1) -> None:
    """Press Ctrl-C (a real SIGINT to this process, `times` in a row) as the phase `label` first reports
    progress."""
    real = finetune.console.progress_bar

    def progress_bar(name: str, info: bool = False):
        bar = real(name, info)
        if name == label:
            update = bar.update

            def interrupted(*args, **kwargs):
                update(*args, **kwargs)
                bar.update = update  # the first report only
                for _ in range(times):
                    signal.raise_signal(signal.SIGINT)
            bar.update = interrupted
        return bar

    monkeypatch.setattr(finetune.console, "progress_bar", progress_bar)
    monkeypatch.setattr(finetune.train.reporting, "progress_bar", progress_bar)
    monkeypatch.setattr(finetune.train.reference_pass, "progress_bar", progress_bar)


def _progress(err: str, label: str) -> list[tuple[int, int]]:
    """(done, total) of each piped progress line of the phase `label`, in order."""
    return [(int(a), int(b)) for a, b in re.findall(rf"^\d\d:\d\d:\d\d {re.escape(label)} (\d+)/(\d+) ", err, re.M)]


def test_the_final_evaluation_says_what_it_does_and_shows_progress_before_it_ends(tmp_path, tiny_model_dir, capsys):
    assert main(["run", str(_sft(tmp_path, tiny_model_dir))]) == 0
    err = capsys.readouterr().err
    assert "final evaluation: 20 held-out examples" in err
    lines = _progress(err, "final evaluation")
    assert lines[-1] == (20, 20) and any(done < 20 for done, _ in lines), err
    assert err.index("final evaluation: 20") < err.index("final evaluation 2/20") < err.index("done: 3 steps")


def test_grpo_scoring_before_training_says_what_it_does_and_shows_progress_before_it_ends(tmp_path, tiny_model_dir,
                                                                                           capsys):
    path = grpo_recipe(tmp_path, tiny_model_dir, max_steps=1)
    assert main(["run", str(path), "--set", "grpo.generation_batch_size=2"]) == 0
    err = capsys.readouterr().err
    held_out = json.loads((tmp_path / "run" / "results.json").read_text())["data"]["eval_prompts"]
    start = f"held-out evaluation before training: {held_out} held-out prompts, greedy answers of at most 8 tokens"
    assert start in err
    lines = _progress(err, "held-out evaluation before training")
    assert lines[-1] == (held_out, held_out) and any(done < held_out for done, _ in lines), err
    assert err.index(start) < err.index("train 1/1")  # before the first step


def test_ctrl_c_in_training_saves_skips_the_final_evaluation_and_prints_the_resume_command(
        tmp_path, tiny_model_dir, monkeypatch, capsys):
    path = _sft(tmp_path, tiny_model_dir)
    _ctrl_c_during(monkeypatch, "train")
    assert main(["run", str(path), "--set", "training.learning_rate=0.001"]) == 130
    err = capsys.readouterr().err
    assert f"stopped at step 1; continue with: finetune run {path} --set=training.learning_rate=0.001 --resume" in err
    assert "final evaluation:" not in err and "Traceback" not in err
    assert "final evaluation skipped (stop requested); the resumed run evaluates at its end" in err
    assert "finetune eval" not in err  # it refuses a run without its adapter
    run = RunDir(tmp_path / "run")
    assert (run.checkpoints / "checkpoint-1").is_dir() and not run.adapter.exists()
    assert not any("eval_loss" in row for row in read_jsonl(run.metrics))


def test_ctrl_c_in_an_evaluation_during_training_saves_that_step_and_prints_the_resume_command(
        tmp_path, tiny_model_dir, monkeypatch, capsys):
    path = _sft(tmp_path, tiny_model_dir, eval_steps=1)
    _ctrl_c_during(monkeypatch, "evaluation at step 1")
    assert main(["run", str(path)]) == 130
    err = capsys.readouterr().err
    assert "evaluation at step 1: 20 held-out examples" in err and _progress(err, "evaluation at step 1")[-1][0] < 20
    assert f"stopped at step 1; continue with: finetune run {path} --resume" in err and "Traceback" not in err
    run = RunDir(tmp_path / "run")
    assert [p.name for p in run.checkpoints.iterdir()] == ["checkpoint-1"] and not run.adapter.exists()
    assert not any("eval_loss" in row for row in read_jsonl(run.metrics))  # no row from a stopped evaluation


def test_ctrl_c_in_the_final_evaluation_keeps_the_adapter_and_says_how_to_evaluate(tmp_path, tiny_model_dir,
                                                                                    monkeypatch, capsys):
    _ctrl_c_during(monkeypatch, "final evaluation")
    assert main(["run", str(_sft(tmp_path, tiny_model_dir))]) == 0  # training was complete
    err = capsys.readouterr().err
    run = RunDir(tmp_path / "run")
    # its held-out records are the split, which `finetune eval` makes again without --data
    hint = f"final evaluation skipped (stop requested); measure the run later with: finetune eval {run.root}"
    assert f"{hint}\n" in err and "--data" not in err
    assert _progress(err, "final evaluation")[-1][0] < 20  # it stopped early
    assert (run.adapter / "adapter_model.safetensors").is_file() and run.read_status()["state"] == "completed"
    assert not any("eval_loss" in row for row in read_jsonl(run.metrics))


def test_a_second_ctrl_c_still_prints_the_resume_command_and_the_resume_finishes(tmp_path, tiny_model_dir,
                                                                                 monkeypatch, capsys):
    path = _sft(tmp_path, tiny_model_dir)
    _ctrl_c_during(monkeypatch, "final evaluation", times=2)
    assert main(["run", str(path)]) == 130
    err = capsys.readouterr().err
    assert f"interrupted; checkpoint-3 is kept, continue with: finetune run {path} --resume" in " ".join(err.split())
    assert "Traceback" not in err and RunDir(tmp_path / "run").read_status()["state"] == "stopped"
    monkeypatch.undo()
    assert main(["run", str(path), "--resume"]) == 0
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_ctrl_c_in_the_scoring_before_training_stops_there_and_leaves_nothing(tmp_path, tiny_model_dir,
                                                                              monkeypatch, capsys):
    """Nothing trained yet: the scoring ends at its next part, the run's folder is removed (nothing to resume),
    exit 130 without a resume command; the same command starts again."""
    path = grpo_recipe(tmp_path, tiny_model_dir, max_steps=1)
    _ctrl_c_during(monkeypatch, "held-out evaluation before training")
    assert main(["run", str(path), "--set", "grpo.generation_batch_size=2"]) == 130
    err = capsys.readouterr().err
    assert f"nothing was trained; removed {tmp_path / 'run'}" in err and "interrupted" in err
    assert "--resume" not in err and "Traceback" not in err and "train 1/1" not in err
    assert not (tmp_path / "run").exists()


def _dpo(tmp_path: Path, model: Path) -> Path:
    """24 preference pairs, a quarter held out, the reference log-probabilities computed before training."""
    from tests.test_preference_train import _pairs

    recipe = tiny_lora_recipe(model, _pairs(tmp_path / "pairs.jsonl"), tmp_path / "run",
                              {"data": {"validation_split": 0.25},
                               "training": {"method": "dpo", "precompute_reference": True, "max_steps": 1,
                                            "micro_batch_size": 2, "gradient_accumulation_steps": 1},
                               "output": {"save_steps": 100}})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_dpo_reference_pass_and_scoring_before_training_show_progress_before_training(tmp_path, tiny_model_dir,
                                                                                      capsys):
    """Preference methods' quiet phases before step 1: the reference pass over every record (18 trained, 6 held
    out), then the held-out scoring, each with progress lines in a piped log before the first step."""
    assert main(["run", str(_dpo(tmp_path, tiny_model_dir))]) == 0
    err = capsys.readouterr().err
    for label, total in (("reference pass", 24), ("held-out evaluation before training", 6)):
        lines = _progress(err, label)
        assert lines[-1] == (total, total) and any(done < total for done, _ in lines), err
        assert err.index(f"{label} {lines[0][0]}/{total}") < err.index("train 1/1"), err
    assert err.index("reference pass: 24 examples") < err.index("held-out evaluation before training: 6 held-out "
                                                                "examples") < err.index("train 1/1")


def test_ctrl_c_in_the_final_evaluation_of_a_preference_run_names_the_eval_command(
        tmp_path, tiny_model_dir, monkeypatch, capsys):
    """A dpo run's held-out split is pairs, which `finetune eval` measures as pairs: the command needs no --data."""
    _ctrl_c_during(monkeypatch, "final evaluation")
    assert main(["run", str(_dpo(tmp_path, tiny_model_dir))]) == 0
    err = capsys.readouterr().err
    assert (f"final evaluation skipped (stop requested); measure the run later with: finetune eval "
            f"{tmp_path / 'run'}\n") in err


def test_ctrl_c_in_the_reference_pass_stops_there_and_leaves_nothing(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """Nothing trained yet: the pass ends at its next micro-batch, nothing is written, exit 130 without a resume
    command."""
    path = _dpo(tmp_path, tiny_model_dir)
    _ctrl_c_during(monkeypatch, "reference pass")
    assert main(["run", str(path)]) == 130
    err = capsys.readouterr().err
    assert "stopped during the reference pass: nothing saved" in err and "interrupted" in err
    assert _progress(err, "reference pass")[-1][0] < 24  # it stopped early
    assert "--resume" not in err and "Traceback" not in err and "held-out evaluation before training" not in err
    assert not (tmp_path / "run").exists()
