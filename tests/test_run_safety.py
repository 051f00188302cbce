"""The run directory under faults and careless input: --overwrite deletes only what the tool created,
checkpoints survive kill -9 and a full disk, a hostile pickle is refused, divergence stops the run."""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_run import ROOT, _recipe_dict, _write_recipe

from finetune.cli import main
from finetune.errors import ModelLoadError
from finetune.rundir import MARKER, read_jsonl
from finetune.train.checkpoints import COMPLETE, FAULT_ENV, STAGING, find_resumable, unreadable_file


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}


def _status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


# -- --overwrite --------------------------------------------------------------------------------------------

def _user_folder(folder: Path) -> dict[str, str]:
    """A folder that holds the user's work, recipe included (what `output.dir: .` used to delete)."""
    (folder / "sub").mkdir(parents=True, exist_ok=True)
    files = {"recipe.yaml": "model: {path: x}\n", "notes.txt": "mine\n", "status.json": "{}\n"}
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


@pytest.mark.parametrize("where, reason", [
    (".", "the working directory or a parent of it"),
    ("..", "the working directory or a parent of it"),
    ("home", "the home folder or a parent of it"),
    ("not-a-run", "not a run directory created by finetune"),
])
def test_overwrite_refuses_folders_the_tool_did_not_create(tmp_path, tiny_model_dir, monkeypatch, capsys, where,
                                                           reason):
    work = tmp_path / "work"
    files = _user_folder(work)
    # Each case reaches its own reason: only "." and ".." run from inside the user's folder.
    monkeypatch.chdir(work / "sub" if where == ".." else work if where == "." else tmp_path)
    monkeypatch.setenv("HOME", str(work if where == "home" else tmp_path / "elsewhere"))
    out_dir = where if where in (".", "..") else str(work)
    recipe_path = _write_recipe(tmp_path, _recipe_dict(tmp_path, tiny_model_dir, output={"dir": out_dir}), "r")

    code = main(["run", str(recipe_path), "--overwrite"])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert "refusing to delete" in err and reason in " ".join(err.split()), err
    assert {p.name: p.read_text() for p in work.iterdir() if p.name in files} == files


def test_empty_output_dir_is_refused_by_the_schema(tmp_path, tiny_model_dir, capsys):
    recipe_path = _write_recipe(tmp_path, _recipe_dict(tmp_path, tiny_model_dir, output={"dir": ""}), "r")
    assert main(["run", str(recipe_path), "--overwrite"]) == 2
    assert "output.dir" in capsys.readouterr().err


def test_overwrite_removes_a_marked_run_directory(tmp_path, tiny_model_dir, capsys):
    run_dir = tmp_path / "run"
    recipe_path = _write_recipe(tmp_path, _recipe_dict(tmp_path, tiny_model_dir, training={"max_steps": 1}), "r")
    assert main(["run", str(recipe_path)]) == 0
    assert (run_dir / MARKER).is_file()
    (run_dir / "leftover.txt").write_text("from the first run")
    assert main(["run", str(recipe_path), "--overwrite"]) == 0
    assert not (run_dir / "leftover.txt").exists() and (run_dir / MARKER).is_file()
    # A folder that already held files when the run started is never marked, so never deletable.
    user = tmp_path / "user"
    _user_folder(user)
    (user / "status.json").unlink()
    assert main(["run", str(recipe_path), "--set", f"output.dir={user}"]) == 0
    assert not (user / MARKER).exists()
    assert main(["run", str(recipe_path), "--set", f"output.dir={user}", "--overwrite"]) == 1
    assert (user / "notes.txt").read_text() == "mine\n"


# -- checkpoints under kill -9 and a full disk ----------------------------------------------------------------

def _checkpoint_recipe(tmp_path: Path, tiny_model_dir: Path, name: str) -> dict:
    return _recipe_dict(tmp_path, tiny_model_dir, training={"max_steps": 6, "learning_rate": 3e-3},
                        output={"dir": str(tmp_path / name), "save_steps": 2, "save_total_limit": 3})


def test_kill_during_checkpoint_write_then_resume_matches_uninterrupted(tmp_path, tiny_model_dir, capsys):
    assert main(["run", str(_write_recipe(tmp_path, _checkpoint_recipe(tmp_path, tiny_model_dir, "straight"),
                                          "straight"))]) == 0
    reference = _losses(tmp_path / "straight")

    recipe_path = _write_recipe(tmp_path, _checkpoint_recipe(tmp_path, tiny_model_dir, "killed"), "killed")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", FAULT_ENV: "hang@4"}
    proc = subprocess.Popen([sys.executable, "-m", "finetune", "run", str(recipe_path)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    checkpoints = tmp_path / "killed" / "checkpoints"
    hang = checkpoints / STAGING / "checkpoint-4" / "FAULT_HANG"
    deadline = time.time() + 240
    while not hang.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert (checkpoints / STAGING / "checkpoint-4" / "train_state.pt").is_file()  # killed mid-write
    assert (checkpoints / "checkpoint-2" / COMPLETE).is_file() and not (checkpoints / "checkpoint-4").exists()
    # A checkpoint-N folder without its marker (as an older version left after a kill) is passed over too.
    (checkpoints / "checkpoint-5").mkdir()
    (checkpoints / "checkpoint-5" / "adapter_model.safetensors").write_bytes(b"torn")

    assert main(["run", str(recipe_path), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "skipped checkpoint checkpoint-4 (partial" in err and "skipped checkpoint checkpoint-5 (partial" in err
    assert "checkpoint-2" in err
    assert not (checkpoints / STAGING).exists()
    resumed = _losses(tmp_path / "killed")
    assert sorted(resumed) == list(range(1, 7))
    for step in range(3, 7):
        assert resumed[step] == reference[step], f"step {step}"


def test_disk_full_during_checkpoint_fails_cleanly_and_keeps_the_previous(tmp_path, tiny_model_dir, monkeypatch,
                                                                        capsys):
    recipe_path = _write_recipe(tmp_path, _checkpoint_recipe(tmp_path, tiny_model_dir, "full"), "full")
    run_dir, checkpoints = tmp_path / "full", tmp_path / "full" / "checkpoints"
    monkeypatch.setenv(FAULT_ENV, "enospc@4")
    code = main(["run", str(recipe_path)])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert "No space left on device" in err and "checkpoint-2 is kept" in err, err
    assert _status(run_dir)["state"] == "failed"
    assert [p.name for p in checkpoints.iterdir()] == ["checkpoint-2"]  # no partial folder left behind
    assert not (run_dir / "adapter").exists()

    monkeypatch.delenv(FAULT_ENV)
    assert main(["run", str(recipe_path), "--resume"]) == 0
    assert "resuming from" in capsys.readouterr().err
    assert _status(run_dir)["state"] == "completed" and sorted(_losses(run_dir)) == list(range(1, 7))


def test_disk_full_during_a_step_still_records_the_failed_status(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """The disk fills at step 3: the metrics row, the temp copy of every atomic write and train.log all fail
    with ENOSPC; status.json is still rewritten (in place) to say the run failed and why."""
    import errno

    from finetune.rundir import RunDir

    full = []

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    append, real_open, log_line = RunDir.append_metrics, os.open, RunDir.log_line

    def append_until_full(self, row):
        if row.get("step") == 3:
            full.append(True)
        if full:
            no_space()
        append(self, row)
    monkeypatch.setattr(RunDir, "append_metrics", append_until_full)
    # no new file once the disk is full (the atomic writes' temporaries); the blocks a file holds stay writable
    monkeypatch.setattr(os, "open", lambda path, flags, *a, **k: no_space() if full and flags & os.O_CREAT
                        else real_open(path, flags, *a, **k))
    monkeypatch.setattr(RunDir, "log_line", lambda self, text: no_space() if full else log_line(self, text))
    recipe_path = _write_recipe(tmp_path, _checkpoint_recipe(tmp_path, tiny_model_dir, "full"), "full")
    code = main(["run", str(recipe_path)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1 and "Traceback" not in err and "No space left on device" in err, err
    status = _status(tmp_path / "full")
    assert status["state"] == "failed" and "No space left on device" in status["error"], status
    assert "could not record the end of the run in" in err and "train.log" in err  # the log could not be kept


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 448 KiB filesystem: room for the run files and one checkpoint of the tiny model, not two."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=448k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (the fault-injection test above covers the same path)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_real_full_disk_during_checkpoint(tmp_path, tiny_model_dir, small_tmpfs, capsys):
    recipe = _checkpoint_recipe(tmp_path, tiny_model_dir, "unused")
    recipe["output"]["dir"] = str(small_tmpfs / "run")
    recipe_path = _write_recipe(tmp_path, recipe, "tmpfs")
    code = main(["run", str(recipe_path)])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err and "No space left on device" in err, err
    assert _status(small_tmpfs / "run")["state"] == "failed"
    assert [p.name for p in (small_tmpfs / "run" / "checkpoints").iterdir()] == ["checkpoint-2"]
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_tmpfs)], check=True)  # space freed
    assert main(["run", str(recipe_path), "--resume"]) == 0
    assert _status(small_tmpfs / "run")["state"] == "completed"


class _Exploit:
    """Unpickling this runs os.mkdir: proof of code execution if it ever happens."""

    def __init__(self, target: Path):
        self.target = str(target)

    def __reduce__(self):
        return os.mkdir, (self.target,)


def test_resume_refuses_a_malicious_pickle_and_falls_back(tmp_path, tiny_model_dir, capsys):
    recipe = _checkpoint_recipe(tmp_path, tiny_model_dir, "hostile")
    recipe["training"]["max_steps"] = 4
    recipe_path = _write_recipe(tmp_path, recipe, "hostile")
    assert main(["run", str(recipe_path)]) == 0
    checkpoints = tmp_path / "hostile" / "checkpoints"
    pwned = tmp_path / "pwned"
    (checkpoints / "checkpoint-4" / "rng_state.pth").write_bytes(pickle.dumps(_Exploit(pwned)))

    assert main(["run", str(recipe_path), "--resume", "--set", "training.max_steps=6"]) == 0
    err = capsys.readouterr().err
    assert not pwned.exists(), "the pickle ran code"
    assert "skipped checkpoint checkpoint-4 (refused to load rng_state.pth" in err, err
    assert "Traceback" not in err
    assert _status(tmp_path / "hostile")["state"] == "completed"
    assert not unreadable_file(checkpoints / "checkpoint-4")  # rewritten by the resumed run


def test_resume_falls_back_past_a_damaged_checkpoint_and_reads_damaged_metrics(tmp_path, tiny_model_dir, capsys):
    """A checkpoint that was complete and lost its train_state.pt since, and a metrics.jsonl with bad bytes
    and a row of the wrong shape: --resume says what it passed over and continues from checkpoint-2."""
    recipe = _checkpoint_recipe(tmp_path, tiny_model_dir, "damaged")
    recipe["training"]["max_steps"] = 4
    recipe_path = _write_recipe(tmp_path, recipe, "damaged")
    assert main(["run", str(recipe_path)]) == 0
    run_dir = tmp_path / "damaged"
    (run_dir / "checkpoints" / "checkpoint-4" / "train_state.pt").unlink()
    with (run_dir / "metrics.jsonl").open("ab") as f:
        f.write(b'{"step": 1, "loss": \xff}\n{"step": "x"}\n')
    capsys.readouterr()

    assert main(["run", str(recipe_path), "--resume", "--set", "training.max_steps=6"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "skipped checkpoint checkpoint-4 (damaged: no train_state.pt)" in err, err
    assert "resuming from" in err and "checkpoint-2" in err and "dropped 2 damaged line(s)" in err
    assert "Traceback" not in err
    assert sorted(_losses(run_dir)) == list(range(1, 7))
    assert len([r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]) == 6  # each step once


def test_resume_skips_every_damaged_file_and_publishes_a_staged_complete_checkpoint(tmp_path):
    """Each file the resume loads is checked (pickles weights-only, safetensors headers, the train state); a
    checkpoint of the transformers.Trainer versions is passed over with that reason; a complete checkpoint
    killed just before its rename is published instead of removed."""
    from safetensors.torch import save_file

    def checkpoint(folder: Path) -> Path:
        folder.mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, folder / "adapter_model.safetensors")
        torch.save({"format": 2, "optimizer": {"state": {}}}, folder / "train_state.pt")
        torch.save({"cpu": torch.zeros(2)}, folder / "rng_state_0.pth")
        (folder / COMPLETE).write_text("")
        return folder

    root = tmp_path / "checkpoints"
    checkpoint(root / "checkpoint-2")
    (checkpoint(root / "checkpoint-4") / "adapter_model.safetensors").write_bytes(b"\x08\x00garbage")
    (checkpoint(root / "checkpoint-6") / "train_state.pt").write_bytes(b"PK\x03\x04 torn")
    (checkpoint(root / "checkpoint-8") / "adapter_model.bin").write_bytes(pickle.dumps(_Exploit(tmp_path / "pwned")))
    (checkpoint(root / "checkpoint-9") / "train_state.pt").unlink()  # complete once, damaged since
    old = checkpoint(root / "checkpoint-10")  # the transformers.Trainer layout: no train state
    (old / "train_state.pt").unlink()
    (old / "trainer_state.json").write_text("{}")
    found = find_resumable(root)
    assert found.newest == root / "checkpoint-2" and not (tmp_path / "pwned").exists()
    assert found.skipped.pop(0).startswith("checkpoint-10 (written by a version of finetune that trained through "
                                           "transformers.Trainer")
    assert found.skipped.pop(0) == "checkpoint-9 (damaged: no train_state.pt)"
    assert [line.split(" ")[0] for line in found.skipped] == ["checkpoint-8", "checkpoint-6", "checkpoint-4"]
    assert "adapter_model.bin" in found.skipped[0] and "train_state.pt" in found.skipped[1]
    assert "adapter_model.safetensors" in found.skipped[2]
    shutil.rmtree(old)

    checkpoint(root / STAGING / "checkpoint-10")  # complete, killed between its marker and its rename
    (root / STAGING / "checkpoint-12").mkdir()  # partial
    found = find_resumable(root)
    assert found.newest == root / "checkpoint-10" and not (root / STAGING).exists()
    assert found.skipped[0].startswith("checkpoint-12 (partial")


# -- divergence ------------------------------------------------------------------------------------------

def test_divergence_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, tiny_model_dir, capsys,
                                                                      monkeypatch):
    # The schema refuses the learning rates that overflow a tiny model for real (learning_rate <= 1), so the
    # overflow is made here: from the second optimizer step on (one micro-batch per step), the loss of the one
    # training step (finetune.step.training_step) is scaled by inf, as an fp16/bf16 overflow would make it, and its
    # backward fills the gradients with NaN.
    from finetune.step import training_step as step

    plain, calls = step.compute_loss, []

    def overflowing(model, inputs, *args, **kwargs):
        calls.append(inputs["input_ids"].device.type != "meta")  # the planner traces this step on meta too
        loss = plain(model, inputs, *args, **kwargs)
        return loss * math.inf if sum(calls) >= 2 else loss

    monkeypatch.setattr(step, "compute_loss", overflowing)
    recipe = _recipe_dict(tmp_path, tiny_model_dir, training={"max_steps": 6},
                          output={"save_steps": 1, "save_total_limit": 5})
    code = main(["run", str(_write_recipe(tmp_path, recipe, "diverge"))])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert "training diverged at step 2: the training loss is NaN or inf" in err and "learning_rate" in err, err
    run_dir = tmp_path / "run"
    status = _status(run_dir)
    assert status["state"] == "failed" and "diverged" in status["error"]
    assert not (run_dir / "adapter").exists() and not (run_dir / "results.json").exists()
    # The CPU memory tracker's dispatch mode is left behind an error too (else it tracks the process's later ops).
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    for folder in (run_dir / "checkpoints").glob("checkpoint-*"):  # every saved state is finite
        weights = load_file(folder / "adapter_model.safetensors")
        assert all(torch.isfinite(t).all() for t in weights.values()), folder.name


# -- model folders --------------------------------------------------------------------------------------------

def test_tokenizer_with_custom_code_is_a_clear_error(tmp_path, tiny_model_dir):
    from finetune.model.load import load_tokenizer
    from finetune.recipe.schema import ModelConfig
    from finetune.testing import make_tiny_model_dir

    folder = make_tiny_model_dir(tmp_path / "custom")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenization_evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    with pytest.raises(ModelLoadError) as info:
        load_tokenizer(folder, ModelConfig(path=str(folder)))
    assert "tokenizer" in str(info.value) and "needs custom code" in str(info.value)
    assert "model.trust_remote_code: true" in str(info.value)
    assert not (tmp_path / "ran").exists()
