"""One writer per run directory: a second run, resume, --overwrite or export on a folder that a live process
holds is refused at once naming its pid, with real concurrent processes; a killed holder leaves no lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_run import ROOT, _recipe_dict, _write_recipe

from finetune import api
from finetune.errors import FinetuneError
from finetune.rundir import MARKER, RunDir, read_jsonl
from finetune.train.checkpoints import FAULT_ENV, STAGING

HOLD = "import sys, time; from finetune.rundir import RunDir; l = RunDir(sys.argv[1]).lock('holder test'); " \
       "print('held', flush=True); time.sleep(600)"


def _holder(folder: Path) -> subprocess.Popen:
    """A process that holds `folder`'s lock until killed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_lock_is_exclusive_names_the_holder_and_dies_with_it(tmp_path):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    proc = _holder(run.root)
    try:
        assert run.locked_by() == f"pid {proc.pid} (holder test)"
        started = time.monotonic()
        with pytest.raises(FinetuneError, match=rf"finetune export: .*run is in use by pid {proc.pid} \(holder test\)"):
            run.lock("finetune export")
        assert time.monotonic() - started < 5  # refused at once, not queued behind the holder
        with pytest.raises(FinetuneError, match=f"start a run: .* pid {proc.pid}"):
            run.refuse_if_locked("start a run")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert run.locked_by() is None  # the kernel dropped it with the process: no stale lock after a crash
    with run.lock("finetune run"):
        assert run.locked_by() == f"pid {os.getpid()} (finetune run)"
    assert run.locked_by() is None


def test_export_of_a_locked_run_is_refused(tmp_path):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    with run.lock("finetune run"), pytest.raises(FinetuneError, match="finetune export: .* is in use by pid"):
        api.export(run.root, tmp_path / "out")
    assert not (tmp_path / "out").exists()



def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_export_and_resume_refused_on_a_folder_of_the_users_leave_it_as_it_was(tmp_path, tiny_model_dir, capsys):
    """A refusal must not leave the lock file it took in a folder that holds no run."""
    from finetune.cli import main

    folder = tmp_path / "mine"
    (folder / "notes").mkdir(parents=True)
    (folder / "notes" / "a.txt").write_text("keep")
    before = _listing(folder)
    assert main(["export", str(folder), "--out", str(tmp_path / "out")]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    assert _listing(folder) == before and not (tmp_path / "out").exists()
    recipe = _write_recipe(tmp_path, _recipe_dict(tmp_path, tiny_model_dir, output={"dir": str(folder)}), "r")
    assert main(["run", str(recipe), "--resume"]) == 2  # a usage error, as export's refusal above
    assert "no checkpoint to resume from" in capsys.readouterr().err
    assert _listing(folder) == before


def test_a_lock_file_made_for_a_run_stays_and_one_that_was_there_is_kept(tmp_path):
    """Only the lock file a lock itself made is removed, and only while the folder holds no run."""
    run = RunDir(tmp_path / "run")
    with run.lock("finetune run", create=True):
        run.write_status("planning")
    assert run.lock_file.is_file()  # a run directory keeps its lock file
    other = RunDir(tmp_path / "other")
    other.root.mkdir()
    other.lock_file.write_text("")
    with other.lock("finetune export"):
        pass
    assert other.lock_file.is_file()  # not made by this lock: left as found


def _finetune(args: list[str], **env: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen([sys.executable, "-m", "finetune", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.2)


def _race(args: list[str], hang_at: int, checkpoints: Path) -> tuple[subprocess.Popen, str]:
    """Start two `finetune run ARGS` at once, both told to hang at step `hang_at`'s checkpoint: the one that
    got the lock reaches the hang, the other must have been refused. Returns (the holder, the refusal)."""
    procs = [_finetune(args, **{FAULT_ENV: f"hang@{hang_at}"}) for _ in range(2)]
    refused = None
    deadline = time.time() + 300
    while refused is None:
        assert time.time() < deadline
        for proc in procs:
            if proc.poll() is not None:
                refused = proc
        time.sleep(0.2)
    holder = next(p for p in procs if p is not refused)
    _wait_for(checkpoints / STAGING / f"checkpoint-{hang_at}" / "FAULT_HANG", [holder])
    _, err = refused.communicate(timeout=60)
    assert refused.returncode == 1, err
    return holder, err


def test_two_runs_on_one_folder_one_trains_the_other_is_refused(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    recipe = _write_recipe(tmp_path, _recipe_dict(tmp_path, tiny_model_dir, training={"max_steps": 6},
                                                  output={"save_steps": 2}), "r")
    user_file = run_dir / "from-before.txt"
    run_dir.mkdir()
    (run_dir / MARKER).write_text("")  # a marked run directory that --overwrite may clear
    user_file.write_text("x")
    for args, hang_at in ((["run", str(recipe), "--overwrite"], 4), (["run", str(recipe), "--resume"], 6)):
        holder, err = _race(args, hang_at, run_dir / "checkpoints")
        assert f"is in use by pid {holder.pid} (finetune run" in " ".join(err.split()), err
        assert "Traceback" not in err
        if "--overwrite" in args:  # a folder a live run holds is not deleted: its staged checkpoint stays
            overwrite = _finetune(args)
            _, err = overwrite.communicate(timeout=300)
            assert overwrite.returncode == 1 and f"pid {holder.pid}" in err, err
            assert (run_dir / "checkpoints" / STAGING / f"checkpoint-{hang_at}" / "FAULT_HANG").exists()
        holder.send_signal(signal.SIGKILL)  # a crash: its lock goes with it
        holder.wait()
    assert not user_file.exists()  # the first --overwrite (the holder's) did clear the folder
    finish = _finetune(["run", str(recipe), "--resume"])
    _, err = finish.communicate(timeout=300)
    assert finish.returncode == 0, err
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # every step once: no second writer
    assert not [p.name for p in (run_dir / "checkpoints").iterdir() if ".old-" in p.name]


def test_ui_refuses_start_resume_and_export_of_a_held_folder(tmp_path, tiny_model_dir):
    from tests.ui_support import form_values
    from ui.backend import Backend, UISettings
    from ui.runs import RunManager

    run_dir = tmp_path / "held"
    run_dir.mkdir()
    backend = Backend(UISettings([tmp_path, tiny_model_dir], tmp_path / "runs"), RunManager(tmp_path / "runs"))
    values = form_values({"model": {"path": str(tiny_model_dir)}, "data": {"path": str(tmp_path / "d.jsonl")},
                          "output": {"dir": str(run_dir)}})
    proc = _holder(run_dir)
    try:
        for action, call in (("start a run", lambda: backend.start(values)),
                             ("resume", lambda: backend.resume(str(run_dir))),
                             ("export", lambda: list(backend.export(str(run_dir), str(tmp_path / "out"))))):
            with pytest.raises(FinetuneError, match=f"{action}: .* is in use by pid {proc.pid}"):
                call()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert backend.manager.jobs() == [] and not (tmp_path / "out").exists()


def test_overwrite_of_a_folder_that_does_not_exist_yet_starts_the_run(tmp_path, tiny_model_dir):
    """The lock makes the folder before --overwrite looks at it: holding only the lock file, it is new."""
    from finetune.cli import main

    recipe = _write_recipe(tmp_path, _recipe_dict(tmp_path, tiny_model_dir, training={"max_steps": 1}), "r")
    assert main(["run", str(recipe), "--overwrite"]) == 0
    assert (tmp_path / "run" / MARKER).is_file() and RunDir(tmp_path / "run").has_adapter()


def test_a_lock_file_deleted_by_its_ending_holder_is_not_the_one_a_waiter_gets(tmp_path):
    """discard_untrained deletes the lock file just before its holder releases it: a process waiting on the old
    file must lock the new one, or a third process could lock that one beside it."""
    import threading

    run = RunDir(tmp_path / "run")
    first = run.lock("finetune run", create=True)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(run.lock("finetune run --resume", create=True)))
    waiter.start()
    time.sleep(0.1)  # the waiter holds the old file open and retries its flock
    run.lock_file.unlink()
    first.release()
    waiter.join()
    with got[0]:
        assert run.locked_by() == f"pid {os.getpid()} (finetune run --resume)"
        with pytest.raises(FinetuneError, match="is in use by"):
            run.lock("finetune export")


def test_a_run_that_failed_after_unlogged_steps_keeps_its_folder(tmp_path, tiny_model_dir, monkeypatch):
    """With logging_steps 5 a run that fails at step 3 has no metrics row and no checkpoint, but it trained:
    its folder and its error stay (only a run that trained nothing is removed)."""
    from finetune.recipe import validate_recipe
    from finetune.train.loop import TrainLoop
    from finetune.train.run import run

    step = TrainLoop.forward_backward

    def failing(self, *args, **kwargs):
        if self.state.step >= 2:
            raise RuntimeError("injected failure in step 3")
        return step(self, *args, **kwargs)

    monkeypatch.setattr(TrainLoop, "forward_backward", failing)
    recipe = validate_recipe(_recipe_dict(tmp_path, tiny_model_dir, training={"max_steps": 8, "logging_steps": 5}))
    with pytest.raises(RuntimeError, match="injected failure"):
        run(recipe)
    status = RunDir(tmp_path / "run").read_status()
    assert status["state"] == "failed" and "injected failure in step 3" in status["error"]
    assert not (tmp_path / "run" / "metrics.jsonl").is_file() or read_jsonl(tmp_path / "run" / "metrics.jsonl") == []
