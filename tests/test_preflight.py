"""Errors in seconds: `validate`, `plan` and `run` check the recipe's paths and parse the data file before any
model loads (finetune.api.preflight); a run that fails before its first step leaves no run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from run_support import sums_data, tiny_lora_recipe

from finetune import api
from finetune.cli import main
from finetune.errors import FinetuneError, RecipeError
from finetune.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]


def write_recipe(tmp_path: Path, model: str | Path, data: Path, *overrides: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tiny_lora_recipe(model, data, tmp_path / "run", *overrides)))  # model as given
    return path


@pytest.fixture
def no_model(monkeypatch):
    """Planning or training fails the test: preflight must have stopped the command before either."""
    import finetune.plan
    import finetune.train.run

    def loaded(*args, **kwargs):
        raise AssertionError("planned or loaded a model before the preflight refused the recipe")

    monkeypatch.setattr(finetune.train.run, "run", loaded)
    monkeypatch.setattr(finetune.plan, "predict", loaded)


def test_a_missing_data_file_is_exit_2_in_seconds_with_no_run_directory(tmp_path, tiny_model_dir):
    missing = tmp_path / "nowhere" / "train.jsonl"
    recipe = write_recipe(tmp_path, tiny_model_dir, missing)
    for command in ("validate", "plan", "run"):
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "finetune", command, str(recipe)], capture_output=True,
                              text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.monotonic() - start
        assert proc.returncode == 2, (command, proc.stderr)
        assert f"data.path '{missing}' does not exist" in proc.stderr.replace("\n", ""), command
        assert "Traceback" not in proc.stderr
        assert wall < 3, f"{command} took {wall:.1f} s to report a missing data file"
    assert not (tmp_path / "run").exists()


def test_a_missing_data_file_is_reported_before_torch_is_imported(tmp_path, tiny_model_dir):
    """What keeps the refusal in a fraction of a second, on a loaded machine too: no command imports torch
    (about 1.5 s) before the preflight (the planner's torch-free modules once imported it through
    finetune.plan's package)."""
    recipe = write_recipe(tmp_path, tiny_model_dir, tmp_path / "nowhere" / "train.jsonl")
    for command in ("validate", "plan", "run"):
        code = (f"import sys\nfrom finetune.cli import main\nrc = main([{command!r}, {str(recipe)!r}])\n"
                "print('torch' in sys.modules)\nsys.exit(rc)")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 2 and proc.stdout.strip() == "False", (command, proc.stdout, proc.stderr)


def test_a_broken_data_line_is_named_before_any_model_loads(tmp_path, tiny_model_dir, no_model, capsys):
    data = sums_data(tmp_path / "data.jsonl", 6)
    lines = data.read_text().splitlines()
    lines[2] = lines[2][:-5]  # cut short: not JSON any more
    data.write_text("\n".join(lines) + "\n")
    recipe = write_recipe(tmp_path, tiny_model_dir, data)
    for command in ("validate", "plan", "run"):
        assert main([command, str(recipe)]) == 3, command
        err = capsys.readouterr().err.replace("\n", "")
        assert f"{data}:3: not valid JSON" in err and "Traceback" not in err, command
    assert not (tmp_path / "run").exists()
    # A record of the wrong shape too, and for the method trained: pairs for dpo.
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                    + json.dumps({"messages": [{"role": "robot", "content": "hi"}]}) + "\n")
    with pytest.raises(FinetuneError, match=rf"{data}:2: messages\[0\]: unknown role 'robot'"):
        api.run(api.load_recipe(recipe))
    with pytest.raises(FinetuneError, match="training.method dpo needs preference data"):
        api.preflight(api.load_recipe(recipe, ["training.method=dpo", "data.on_bad_record=skip"]))


def test_validate_says_what_the_data_holds(tmp_path, tiny_model_dir, capsys):
    recipe = write_recipe(tmp_path, tiny_model_dir, sums_data(tmp_path / "data.jsonl", 7))
    assert main(["validate", str(recipe)]) == 0
    out = capsys.readouterr()
    assert "7 messages records" in out.out and "valid recipe" not in out.err  # the result is stdout's


@pytest.mark.parametrize("path", ["./no-such-model", "../no/such-model", "/no/such/model", "~/no-such-model",
                                  "models/no/such", "no-such-model.gguf", "models/model.safetensors"])
def test_a_missing_local_model_path_says_so_without_the_network(tmp_path, path, no_model, capsys):
    recipe = write_recipe(tmp_path, path, sums_data(tmp_path / "data.jsonl", 4))
    for command in ("validate", "plan", "run"):
        assert main([command, str(recipe)]) == 2, command
        err = capsys.readouterr().err.replace("\n", "")
        assert f"model.path: {path!r} does not exist (a local path" in err, command
        assert not any(word in err.lower() for word in ("network", "internet", "connection", "download")), err
    with pytest.raises(RecipeError, match="does not exist"):
        from finetune.model.source import resolve_model_path

        resolve_model_path(path)


def test_existing_paths_pass_the_model_check(tmp_path, tiny_model_dir, monkeypatch):
    from finetune.model.source import check_model_path, looks_local

    assert not looks_local("HuggingFaceTB/SmolLM2-135M-Instruct") and looks_local("a/b/c")
    check_model_path(str(tiny_model_dir))
    monkeypatch.chdir(tiny_model_dir.parent)
    check_model_path(f"./{tiny_model_dir.name}")


def fake_hub_cache(hf_home: Path, repo_id: str, config: Path) -> None:
    """The layout huggingface_hub's cache keeps a downloaded model in: refs/main names the snapshot folder."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text(config.read_text())


def test_an_uncached_hub_id_offline_is_one_line_with_the_ways_forward_in_seconds(tmp_path, tiny_model_dir):
    """It used to pass `validate`, make `plan` print the hub client's connection error and fail `run` after
    the model load began (exit 4)."""
    hf_home = tmp_path / "hf"
    recipe = write_recipe(tmp_path, "someone/not-cached", sums_data(tmp_path / "data.jsonl", 4))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_HOME": str(hf_home)}
    for command in ("validate", "plan", "run"):
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "finetune", command, str(recipe)], capture_output=True,
                              text=True, cwd=ROOT, env=env)
        wall = time.monotonic() - start
        assert proc.returncode == 2, (command, proc.stderr)
        line = " ".join(proc.stderr.split())
        assert "'someone/not-cached' is not in the local Hugging Face cache and the hub is offline" in line, command
        assert all(way in line for way in ("go online once", "a local model folder", "config.json")), line
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert wall < 3, f"{command} took {wall:.1f} s to refuse an uncached hub id"
    assert not (tmp_path / "run").exists()
    # The same id once cached (its config.json in huggingface_hub's cache layout) passes.
    fake_hub_cache(hf_home, "someone/not-cached", tiny_model_dir / "config.json")
    proc = subprocess.run([sys.executable, "-m", "finetune", "validate", str(recipe)], capture_output=True,
                          text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0 and "is a valid recipe" in proc.stdout, proc.stderr


def test_a_run_that_fails_before_its_first_step_leaves_no_run_directory(tmp_path, tiny_model_dir, monkeypatch):
    import finetune.model.load
    import finetune.train.run

    def no_weights(*args, **kwargs):
        raise FinetuneError("the weights do not load")

    monkeypatch.setattr(finetune.model.load, "load_model", no_weights)
    recipe = api.load_recipe(write_recipe(tmp_path, tiny_model_dir, sums_data(tmp_path / "data.jsonl", 4)))
    with pytest.raises(FinetuneError, match="the weights do not load"):
        api.run(recipe)
    assert not (tmp_path / "run").exists()  # nothing blocks the next run or shows in the run lists
    # A folder with something trained in it stays, with its failure recorded.
    run = RunDir(tmp_path / "run")
    run.create()
    run.append_metrics({"step": 1, "loss": 2.0})
    finetune.train.run._record_end(run, "failed", FinetuneError("later"))
    assert run.read_status()["state"] == "failed"


@pytest.mark.parametrize("key,value,cause,fix", [
    ("training.compile", True, "needs a C++ compiler", "set training.compile: false"),
    ("memory.kernels", "liger", "Liger's Triton kernels run on CUDA GPUs", "set memory.kernels: none"),
])
def test_compile_or_liger_where_they_cannot_run_are_refused_before_any_model_loads(
        tmp_path, tiny_model_dir, no_model, monkeypatch, capsys, key, value, cause, fix):
    """training.compile without a C++ compiler (the CPU's inductor backend builds C++), memory.kernels: liger
    without a CUDA GPU: one line naming the key, exit 2, before anything loads; the same recipe passes where
    they can run."""
    import torch

    import finetune.model.kernels

    section, field = key.split(".")
    recipe = write_recipe(tmp_path, tiny_model_dir, sums_data(tmp_path / "d.jsonl", 4), {section: {field: value}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(finetune.model.kernels, "cxx_compiler", lambda: None)
    for command in ("validate", "plan", "run"):
        start = time.monotonic()
        assert main([command, str(recipe)]) == 2, command
        err = " ".join(capsys.readouterr().err.split())
        assert f"{key}: " in err and cause in err, (command, err)
        assert fix in err and "Traceback" not in err
        assert time.monotonic() - start < 5, command
    assert not (tmp_path / "run").exists()
    monkeypatch.setattr(finetune.model.kernels, "cxx_compiler", lambda: "g++")
    monkeypatch.setattr(finetune.model.kernels, "liger_installed", lambda: True)
    monkeypatch.setattr(finetune.model.kernels, "liger_function", lambda model_type: print)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine where both run: the recipe is fine
    assert main(["validate", str(recipe)]) == 0
