"""`finetune run --resume` on data other than the run started on is refused, naming what changed (exit code 2):
records appended, replaced, shuffled, shrunk, answers edited, another tokenizer, another max_seq_len.
Unchanged data resumes; --allow-data-change resumes on the new data and records the change."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from finetune.cli import main
from finetune.rundir import RunDir, read_jsonl
from tests.run_support import sums_data, tiny_lora_recipe

RECORDS = 16


def _rewrite(path: Path, change: Callable[[list[dict]], list[dict]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in change(read_jsonl(path))))


def _edit_answers(rows: list[dict]) -> list[dict]:
    rows[3]["messages"][1]["content"] = "It is nine, I think."
    return rows


def _other_records(rows: list[dict]) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Name colour {i}."},
                          {"role": "assistant", "content": "Blue."}]} for i in range(len(rows))]


# name -> (how the data file changes, recipe overrides, the reason the refusal names)
CHANGES: dict[str, tuple[Callable[[list[dict]], list[dict]] | None, dict, str]] = {
    "appended": (lambda rows: rows + rows[:3], {}, f"records {RECORDS} -> {RECORDS + 3}"),
    "replaced": (_other_records, {}, "record content changed"),
    "shuffled": (lambda rows: random.Random(0).sample(rows, len(rows)), {}, "the same records in another order"),
    "shrunk": (lambda rows: rows[:10], {}, f"records {RECORDS} -> 10"),
    "answer edited": (_edit_answers, {}, "record content changed"),
    "max_seq_len": (None, {"data": {"max_seq_len": 48}}, "data.max_seq_len 64 -> 48"),
    "seed": (None, {"training": {"seed": 7}}, "training.seed 42 -> 7"),
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir) -> Path:
    """A two-step run with a checkpoint at step 2, its data and recipe beside it."""
    root = tmp_path_factory.mktemp("fingerprint")
    recipe = tiny_lora_recipe(tiny_model_dir, sums_data(root / "data.jsonl", RECORDS), root / "run",
                              {"training": {"max_steps": 2}, "output": {"save_steps": 2}})
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["run", str(root / "recipe.yaml")]) == 0
    saved = json.loads(RunDir(root / "run").data_fingerprint.read_text())
    assert saved["records"] == RECORDS and saved["max_seq_len"] == 64
    return root


def _copy(finished: Path, tmp_path: Path, **sections: dict) -> Path:
    """The finished run, its data and its recipe copied to tmp_path, the recipe resuming to step 3 there."""
    shutil.copytree(finished / "run", tmp_path / "run")
    shutil.copy(finished / "data.jsonl", tmp_path / "data.jsonl")
    recipe = yaml.safe_load((finished / "recipe.yaml").read_text())
    recipe["data"]["path"], recipe["output"]["dir"] = str(tmp_path / "data.jsonl"), str(tmp_path / "run")
    recipe["training"]["max_steps"] = 3
    for section, values in sections.items():
        recipe[section] = {**recipe[section], **values}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return tmp_path / "recipe.yaml"


def _trained_steps(run: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("name", CHANGES)
def test_resume_on_changed_data_is_refused_naming_the_change(finished, tmp_path, capsys, name):
    change, overrides, reason = CHANGES[name]
    recipe = _copy(finished, tmp_path, **overrides)
    if change is not None:
        _rewrite(tmp_path / "data.jsonl", change)
    run = RunDir(tmp_path / "run")
    kept = {path: path.read_bytes() for path in (run.recipe, run.plan, run.data_fingerprint)}
    assert main(["run", str(recipe), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--resume: the data (" in err and "differs from what" in err and reason in err, err
    assert "--allow-data-change" in err and "Traceback" not in err
    assert _trained_steps(run.root) == [1, 2], "nothing was trained on the other data"
    assert {path: path.read_bytes() for path in kept} == kept, "the run's recipe, plan and fingerprint are kept"


def test_resume_with_another_tokenizer_is_refused(finished, tmp_path, capsys, tiny_model_dir):
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(model)
    recipe = _copy(finished, tmp_path, model={"path": str(model)})
    assert main(["run", str(recipe), "--resume"]) == 2
    assert f"tokenizer changed ({tiny_model_dir} -> {model})" in capsys.readouterr().err


def test_unchanged_data_resumes(finished, tmp_path, capsys):
    recipe = _copy(finished, tmp_path)
    (tmp_path / "data.jsonl").touch()  # a newer mtime, the same records: still the same data
    assert main(["run", str(recipe), "--resume"]) == 0
    assert "resuming from" in capsys.readouterr().err
    assert _trained_steps(tmp_path / "run") == [1, 2, 3]


def test_allow_data_change_resumes_on_the_new_data_and_records_it(finished, tmp_path, capsys):
    recipe = _copy(finished, tmp_path)
    _rewrite(tmp_path / "data.jsonl", lambda rows: rows[:10])
    assert main(["run", str(recipe), "--resume", "--allow-data-change"]) == 0
    assert f"resuming on changed data: records {RECORDS} -> 10" in capsys.readouterr().err
    run = RunDir(tmp_path / "run")
    assert _trained_steps(run.root) == [1, 2, 3]
    assert f"records {RECORDS} -> 10" in run.log.read_text()
    assert json.loads(run.data_fingerprint.read_text())["records"] == 10, "the new data is what it resumes on now"


def test_a_run_saved_without_a_fingerprint_resumes_and_gets_one(finished, tmp_path):
    recipe = _copy(finished, tmp_path)
    RunDir(tmp_path / "run").data_fingerprint.unlink()
    assert main(["run", str(recipe), "--resume"]) == 0
    assert json.loads(RunDir(tmp_path / "run").data_fingerprint.read_text())["records"] == RECORDS


def test_a_refused_resume_leaves_the_run_in_its_state_with_the_reason(finished, tmp_path, capsys):
    recipe = _copy(finished, tmp_path)
    _rewrite(tmp_path / "data.jsonl", lambda rows: rows[:10])
    run = RunDir(tmp_path / "run")
    before = run.read_status()
    assert main(["run", str(recipe), "--resume"]) == 2
    status = run.read_status()
    assert status["state"] == before["state"] == "completed", "a refused resume is no failed run"
    assert status["step"] == before["step"] == 2
    assert status["error"].startswith("resume refused: --resume: the data (") and "records 16 -> 10" in status["error"]
    assert "resume refused" in run.log.read_text()
