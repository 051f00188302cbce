"""The run queue: one training process at a time, the rest queued, and a restarted UI still knows them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from finetune.rundir import RunDir
from tests.ui_support import tiny_recipe, wait_for, write_dataset, write_recipe
from ui.runs import Job, RunManager


def test_queue_survives_a_restart_and_runs_one_at_a_time(tmp_path, tiny_model_dir):
    data = write_dataset(tmp_path / "data.jsonl")
    runs = tmp_path / "runs"
    long_run = write_recipe(tmp_path / "a.yaml", tiny_recipe(tiny_model_dir, data, runs / "a", max_steps=100_000))
    broken = tiny_recipe(tiny_model_dir, data, runs / "b")
    broken["model"]["path"] = str(tmp_path / "no-such-model")
    broken = write_recipe(tmp_path / "b.yaml", broken)

    first = RunManager(runs, poll_s=0.3).start()
    a = first.submit(long_run, runs / "a")
    b = first.submit(broken, runs / "b")
    c = first.submit(broken, runs / "c")
    assert [j.state for j in first.jobs()] == ["running", "queued", "queued"]
    assert first.run_state(runs / "b") == "queued (position 1)"
    assert "removed" in first.stop(runs / "c")
    wait_for(lambda: RunDir(runs / "a").read_metrics(), 180, "the first run's first metrics")
    first.close()  # the UI goes away; its training process does not

    second = RunManager(runs, poll_s=0.3)  # a restarted UI reads the queue file
    states = {j.id: j.state for j in second.jobs()}
    assert states == {a.id: "running", b.id: "queued", c.id: "cancelled"}
    second.poll()
    assert second.job_for(runs / "a").state == "running", "the adopted process is still alive"
    assert second.run_state(runs / "a") == "running"
    second.stop(runs / "a")
    second.start()
    wait_for(lambda: second.job_for(runs / "b").state == "exited", 180, "the queued run to start and end")
    assert RunDir(runs / "a").read_status()["state"] == "stopped"
    assert list((runs / "a" / "checkpoints").glob("checkpoint-*"))
    # model.path no-such-model: refused before the run directory is made (finetune.api.preflight)
    assert second.run_state(runs / "b") == "failed (process exited with code 2)"
    assert "no-such-model" in second.process_log(runs / "b") and not (runs / "b").exists()
    assert not (runs / "c").exists()
    second.close()


def test_a_run_that_dies_without_updating_its_status_shows_as_failed(tmp_path):
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / "status.json").write_text('{"state": "running", "pid": 1, "step": 3}')
    recipe = tmp_path / "r.yaml"
    recipe.write_text("not: a recipe\n")
    manager = RunManager(tmp_path / "runs", poll_s=0.2).start()
    manager.submit(recipe, run, resume=True)  # the CLI exits at once: the recipe is invalid
    wait_for(lambda: manager.job_for(run).state == "exited", 60, "the process to exit")
    assert manager.run_state(run).startswith("failed (process exited with code 2")
    assert "not a valid recipe" in manager.process_log(run)
    assert Path(manager.job_for(run).log).is_file()
    manager.close()



def test_the_queue_line_of_a_finished_run_whose_process_is_exiting_says_so_like_its_status(tmp_path):
    """The run wrote "completed" and its process is still on its way out: the queue line says what the run view
    says, not "running" beside it; once the process is gone the GPU is free."""
    from ui import views

    runs = tmp_path / "runs"
    run = runs / "done"
    run.mkdir(parents=True)
    exiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "finetune"])  # "finetune" in its
    try:  # command line: a process an earlier UI started (RunManager._alive)
        (run / "status.json").write_text(json.dumps({"state": "completed", "pid": exiting.pid, "step": 6}))
        job = Job(id="j1", run_dir=str(run.resolve()), recipe=str(tmp_path / "r.yaml"), state="running", pid=exiting.pid)
        (runs / ".ui").mkdir()
        (runs / ".ui" / "queue.json").write_text(json.dumps([asdict(job)]))
        manager = RunManager(runs)
        assert manager.run_state(run) == "completed, process exiting"
        assert views.queue_markdown(manager) == f"- **completed, process exiting**: `{run.resolve()}`"
    finally:
        exiting.kill()
        exiting.wait()
    manager.poll()
    assert views.queue_markdown(manager).startswith("GPU free") and manager.run_state(run) == "completed"


def test_a_resume_allowed_on_changed_data_passes_the_flag():
    """The Train tab's "Resume even if the data changed" reaches `finetune run --allow-data-change`."""
    plain = Job(id="a", run_dir="/runs/a", recipe="/runs/a/recipe.yaml", resume=True)
    allowed = Job(id="b", run_dir="/runs/b", recipe="/runs/b/recipe.yaml", resume=True, allow_data_change=True)
    assert "--allow-data-change" not in plain.command()
    assert allowed.command()[-3:] == ["--set", "output.dir=/runs/b", "--allow-data-change"]
    assert Job(**asdict(allowed)) == allowed, "kept in the queue file"


_POPEN = subprocess.Popen


def _fake_export(monkeypatch, lines: list[str], code: int) -> list[list[str]]:
    """`finetune export` replaced by a process that prints `lines` (stdout) and exits with `code`."""
    import ui.backend

    commands: list[list[str]] = []

    def popen(cmd, **kwargs):
        commands.append(cmd)
        script = f"import sys\nfor line in {lines!r}: print(line, flush=True)\nsys.exit({code})"
        return _POPEN([sys.executable, "-c", script], **kwargs)

    monkeypatch.setattr(ui.backend.subprocess, "Popen", popen)
    return commands


def test_the_runs_tab_shows_the_export_steps_from_its_json_progress(tmp_path, monkeypatch):
    from finetune.api import ExportStep
    from ui.backend import Backend, UISettings
    from ui.tabs.runs import export_view

    backend = Backend(UISettings([tmp_path], tmp_path / "runs"), RunManager(tmp_path / "runs"))
    run, out = tmp_path / "run", tmp_path / "out"
    monkeypatch.setattr(backend, "checked_run", lambda run_dir: run)
    steps = [ExportStep(1, 2, "loading the base model", "m"), ExportStep(2, 2, "saving the merged model", "x")]
    commands = _fake_export(monkeypatch, ["a library's warning", *(s.to_json() for s in steps),
                                          ExportStep.done_line(out)], 0)
    out.mkdir()
    shown = list(export_view(backend, str(run), str(out)))
    assert commands[0][-2:] == ["--progress", "json"]
    assert shown[0] == "**Exporting...**\n- now: [1/2] loading the base model: m"
    assert shown[1].endswith("- done: [1/2] loading the base model: m\n- now: [2/2] saving the merged model: x")
    assert shown[-1].startswith(f"**merged model saved to {out}**\n- done: [1/2]") and "warning" not in shown[-1]

    _fake_export(monkeypatch, [steps[0].to_json(), "Traceback-free noise",
                               ExportStep.error_line("export: out already exists", 2)], 2)
    failed = list(export_view(backend, str(run), str(out)))[-1]
    assert "export failed (exit code 2)" in failed and "export: out already exists" in failed
    assert "noise" not in failed  # the error the export reported, not the stream's last lines


def test_the_ollama_box_follows_the_format_and_is_never_ignored(tmp_path, monkeypatch):
    """Ticked with safetensors (which writes no GGUF for a Modelfile) the export is refused before any process
    starts; the page greys the box out for safetensors."""
    from ui.backend import Backend, UISettings
    from ui.tabs.runs import export_view, ollama_box

    backend = Backend(UISettings([tmp_path], tmp_path / "runs"), RunManager(tmp_path / "runs"))
    monkeypatch.setattr(backend, "checked_run", lambda run_dir: tmp_path / "run")
    commands = _fake_export(monkeypatch, [], 0)
    shown = list(export_view(backend, str(tmp_path / "run"), str(tmp_path / "out"), "safetensors", True))
    assert shown == ["**an Ollama Modelfile needs a GGUF file: the format safetensors writes none**\n\n"
                     "pick a gguf format, or untick Ollama Modelfile"]
    assert commands == []
    assert ollama_box("safetensors") == {"__type__": "update", "interactive": False, "value": False}
    assert ollama_box("gguf q8_0") == {"__type__": "update", "interactive": True}


def test_a_queued_run_another_process_holds_shows_as_refused_with_the_locks_message(tmp_path, monkeypatch):
    """Held when its turn comes: not started, "refused: ... in use by pid N", and the queue moves on. Taken by
    another process after its start (its process exits refused): the same, not "failed"."""
    import os

    held, free = tmp_path / "runs" / "held", tmp_path / "runs" / "free"
    for run in (held, free):
        run.mkdir(parents=True)
        (run / "status.json").write_text('{"state": "stopped", "step": 3}')
    recipe = tmp_path / "r.yaml"
    recipe.write_text("not: a recipe\n")  # a started process exits at once
    manager = RunManager(tmp_path / "runs", poll_s=0.2)
    with RunDir(held).lock("finetune run --resume"):
        manager.submit(recipe, held, resume=True)
        manager.submit(recipe, free, resume=True)
        refused, started = manager.job_for(held), manager.job_for(free)
        assert (refused.state, refused.pid, started.state) == ("refused", None, "running")
        assert manager.run_state(held) == (f"refused: finetune run --resume: {held} is in use by pid {os.getpid()} "
                                           "(finetune run --resume); one process at a time may write a run directory")
    assert manager.job_for(held).refused == refused.refused  # kept in the queue file
    wait_for(lambda: manager.poll() or manager.job_for(free).state == "exited", 60, "the process to exit")

    slow = tmp_path / "slow.yaml"
    slow.write_text("")
    monkeypatch.setattr(Job, "command", lambda job: [sys.executable, "-c", "import time; time.sleep(1); exit(1)"])
    manager.submit(slow, held, resume=True)
    assert manager.job_for(held).state == "running"
    with RunDir(held).lock("finetune export"):  # taken while its process starts: that process is refused
        wait_for(lambda: manager.poll() or manager.job_for(held).state != "running", 60, "the process to exit")
        assert manager.run_state(held).startswith(f"refused: finetune run --resume: {held} is in use by pid")
    manager.close()


def test_python_rewards_are_refused_unless_the_server_allows_them(tmp_path, tiny_model_dir, monkeypatch):
    """A GRPO recipe with a kind python reward (trusted in the recipe) is code run on the server: the UI queues
    it only when started with --allow-python-rewards, and only from a file inside the allowed folders; a relative
    file is the server's working directory's, queued with its absolute path; built-in rewards always go."""
    import pytest

    from finetune.errors import FinetuneError
    from tests.ui_support import form_values
    from ui.app import build_parser
    from ui.backend import Backend, UISettings

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "answer": 2}\n' * 4)
    recipe = {"model": {"path": str(tiny_model_dir)}, "data": {"path": str(data), "max_seq_len": 64},
              "training": {"method": "grpo", "max_steps": 1}, "output": {"dir": str(tmp_path / "runs" / "g")},
              "grpo": {"max_completion_length": 8, "trust_python_code": True,
                       "rewards": [{"kind": "answer"}, {"kind": "python", "function": f"{tmp_path / 'r.py'}:score"}]}}
    (tmp_path / "r.py").write_text("def score(prompts, completions, **fields):\n    return [0.0] * len(prompts)\n")

    queued: list[Path] = []

    def backend(allowed: bool) -> Backend:
        manager = RunManager(tmp_path / "runs")
        manager.submit = lambda path, *args, **kw: queued.append(path)  # the queued recipe file, not run here
        return Backend(UISettings([tmp_path, tiny_model_dir], tmp_path / "runs", allow_python_rewards=allowed), manager)

    with pytest.raises(FinetuneError) as refused:
        backend(False).start(form_values(recipe))
    assert "grpo.rewards[1]: kind python runs code from a file on this server" in refused.value.message
    assert "--allow-python-rewards" in refused.value.hint and not (tmp_path / "runs" / "g").exists()
    assert backend(True).start(form_values(recipe)) == (tmp_path / "runs" / "g").resolve()
    monkeypatch.chdir(tmp_path)
    relative = {**recipe, "output": {"dir": str(tmp_path / "runs" / "r")},
                "grpo": {**recipe["grpo"], "rewards": [{"kind": "python", "function": "r.py:score"}]}}
    assert backend(True).start(form_values(relative)) == (tmp_path / "runs" / "r").resolve()
    assert f"function: {(tmp_path / 'r.py').resolve()}:score" in queued[-1].read_text()
    outside = {**relative, "grpo": {**relative["grpo"], "rewards": [{"kind": "python", "function": "/etc/r.py:f"}]}}
    with pytest.raises(FinetuneError) as refused:
        backend(True).start(form_values(outside))
    assert "grpo.rewards[0].function" in str(refused.value) and not (tmp_path / "runs" / "o").exists()
    built_in = {**recipe, "grpo": {**recipe["grpo"], "rewards": [{"kind": "answer"}]}}
    assert backend(False).start(form_values({**built_in, "output": {"dir": str(tmp_path / "runs" / "b")}}))
    assert build_parser().parse_args(["--allow-python-rewards"]).allow_python_rewards is True
    assert build_parser().parse_args([]).allow_python_rewards is False


OUTSIDE_RUN = """
import os, sys, time
from pathlib import Path
from finetune.rundir import RunDir
if os.fork():  # the parent exits at once: the holder is nobody's child here, like a run typed in a terminal
    os._exit(0)
run = RunDir(Path(sys.argv[1]))
with run.lock("finetune run", create=True):
    run.write_status("running", step=3, max_steps=100)
    deadline = time.monotonic() + 60
    while not Path(sys.argv[2]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def test_a_run_started_outside_the_ui_shows_the_gpu_as_busy_with_its_folder_and_pid(tmp_path):
    """`finetune run` typed in a terminal holds its run directory's lock: the queue line names it, not "GPU free";
    the UI's own locks (its process and children) are not outside runs; when the outside run ends, the GPU is free."""
    from ui import views

    runs, done = tmp_path / "runs", tmp_path / "done"
    manager = RunManager(runs, poll_s=0.2)
    assert views.queue_markdown(manager, manager.outside_runs([runs])).startswith("GPU free")
    subprocess.run([sys.executable, "-c", OUTSIDE_RUN, str(runs / "cli-run"), str(done)], check=True, timeout=60)
    try:
        wait_for(lambda: manager.outside_runs([runs]), 60, "the outside run to take its lock")
        (held,) = manager.outside_runs([tmp_path])  # found under an allowed folder too (runs/<name>)
        assert held.pid != os.getpid() and held.root == (runs / "cli-run").resolve()
        text = views.queue_markdown(manager, manager.outside_runs([runs]))
        assert text == f"- **busy**: a run started outside this UI is training (`{held.root}`, pid {held.pid})"
        with RunDir(runs / "mine").lock("finetune export", create=True):  # this process's own lock: not outside
            (runs / "mine" / "status.json").write_text('{"state": "completed"}')
            assert [h.root.name for h in manager.outside_runs([runs])] == ["cli-run"]
    finally:
        done.touch()
    wait_for(lambda: not manager.outside_runs([runs]), 60, "the outside run to end")
    assert views.queue_markdown(manager, []).startswith("GPU free")
    manager.close()
