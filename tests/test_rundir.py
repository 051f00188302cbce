"""The run directory contract: readers accept what a live or crashed run leaves, and only finetune/rundir.py
names a run's files."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
from run_support import SAMPLE_DATA

from finetune.rundir import EXPORT_MARKER, MARKER, RunDir, find_runs, read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def test_metrics_reader_skips_a_torn_last_line_and_rows_that_are_not_objects(tmp_path):
    run = RunDir(tmp_path)
    run.append_metrics({"step": 1, "loss": 2.0})
    run.append_metrics({"step": 2, "loss": 1.5})
    with run.metrics.open("a") as f:
        f.write('[1, 2]\n{"step": 3, "lo')  # a JSON line that is no row, then a crash mid-write
    assert run.read_metrics() == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]


def test_resume_truncation_keeps_complete_rows_up_to_the_checkpoint(tmp_path):
    run = RunDir(tmp_path)
    for step in (1, 2, 3, 4):
        run.append_metrics({"step": step, "loss": 1.0 / step})
    with run.metrics.open("a") as f:
        f.write('{"step": 5, "lo')
    run.truncate_metrics(after_step=2)
    assert [r["step"] for r in run.read_metrics()] == [1, 2]
    assert run.metrics.read_text().endswith("\n"), "the next appended row starts on its own line"


def test_readers_of_a_run_that_wrote_nothing_yet(tmp_path):
    run = RunDir(tmp_path / "never-started")
    assert run.read_status() == {} and run.read_metrics() == []
    assert run.read_plan() is None and run.read_results() is None and run.log_tail() == ""
    assert not run.exists() and not run.has_adapter()
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_a_half_written_or_foreign_json_file_reads_as_absent(tmp_path):
    run = RunDir(tmp_path)
    run.status.write_text('{"state": "runn')
    run.results.write_text("[1, 2, 3]")
    assert run.read_status() == {} and run.read_results() is None
    run.write_status("running", step=3, max_steps=10)
    status = run.read_status()
    assert (status["state"], status["step"], status["pid"]) == ("running", 3, os.getpid())


def test_log_tail_returns_the_newest_lines(tmp_path):
    run = RunDir(tmp_path)
    for i in range(50):
        run.log_line(f"line {i}")
    tail = run.log_tail(3).splitlines()
    assert [line.split(" ", 1)[1] for line in tail] == ["line 47", "line 48", "line 49"]


def test_find_runs_lists_run_directories_newest_first(tmp_path):
    old, new, nested = tmp_path / "old", tmp_path / "new", tmp_path / "group" / "inner"
    RunDir(old).write_status("completed")
    RunDir(new).write_status("running")
    nested.mkdir(parents=True)
    RunDir(nested).append_metrics({"step": 1})
    os.utime(RunDir(old).status, (1, 1))
    (tmp_path / "not-a-run").mkdir()
    RunDir(tmp_path / ".hidden").write_status("running")
    extra = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    RunDir(extra).write_status("queued")
    found = find_runs(tmp_path, [extra, tmp_path / "not-a-run"])
    assert set(found) == {old.resolve(), new.resolve(), nested.resolve(), extra.resolve()}
    assert found[-1] == old.resolve()


def _run_file_names() -> tuple[set[str], set[str]]:
    """(file names, folder names) of a run, read from the contract itself so a new file is covered at once."""
    run = RunDir(Path("run"))
    paths = [getattr(run, name) for name, attr in vars(RunDir).items() if isinstance(attr, property)]
    names = {p.name for p in paths} | {MARKER, EXPORT_MARKER}
    folders = {"adapter", "checkpoints", "offload"}
    assert folders <= names, "the folders this test checks are named by the contract"
    return names - folders, folders


def test_find_runs_passes_over_a_file_that_vanishes_while_listing(tmp_path, monkeypatch):
    # A live run renames its temporaries away between listing the folder and stat()-ing each file.
    run = RunDir(tmp_path / "live")
    run.create()
    run.write_status("running")
    temporary = run.root / ".status.json.tmp123"
    temporary.write_text("{}")
    plain_stat, seen = Path.stat, []

    def racing_stat(self, *args, **kwargs):
        if self == temporary:
            seen.append(1)
            if len(seen) > 1:  # listed (and checked) first, renamed away before its mtime is read
                raise FileNotFoundError(2, "No such file or directory", str(self))
        return plain_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", racing_stat)
    assert find_runs(tmp_path) == [run.root.resolve()]


def test_only_the_contract_spells_a_run_file_name():
    """A run file's name in a string anywhere else (or a run folder joined with `/`) is a second copy that
    drifts: read and write through finetune.rundir instead."""
    files, folders = _run_file_names()
    offenders = []
    sources = [p for d in ("finetune", "ui") for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(sources) > 20
    for path in sources:
        if path == ROOT / "finetune" / "rundir.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in files:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
            if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant)
                    and node.right.value in folders):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: / {node.right.value!r}")
    assert not offenders, "run file names outside finetune/rundir.py:\n" + "\n".join(offenders)


MODEL = str(ROOT / "tests" / "fixtures" / "configs" / "llama-3.1-8b.json")


@pytest.fixture
def recipe_file(tmp_path) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps({"model": {"path": MODEL}, "data": {"path": SAMPLE_DATA},  # plan's preflight checks both
                                "output": {"dir": str(tmp_path / "run")}}))
    return path


def test_cli_plan_asks_finetune_api_and_prints_its_answer(monkeypatch, recipe_file, capsys):
    from finetune import api
    from finetune.cli import main

    calls = []

    class FakePlan:
        fits = False

        def to_json(self) -> str:
            return '{"fits": false, "from": "api"}'

    def fake_plan(recipe, *, gpu_memory=None, device=None):
        calls.append((recipe.training.max_steps, gpu_memory, device))
        return FakePlan()

    monkeypatch.setattr(api, "plan", fake_plan)
    args = ["plan", str(recipe_file), "--set", "training.max_steps=7", "--gpu-memory", "8GiB", "--device", "cpu"]
    assert main([*args, "--json"]) == 1, "nothing fits: exit code 1"
    assert calls == [(7, "8GiB", "cpu")]
    assert json.loads(capsys.readouterr().out) == {"fits": False, "from": "api"}


def test_cli_measure_asks_finetune_api_and_prints_its_answer(monkeypatch, recipe_file, capsys):
    from finetune import api
    from finetune.cli import main

    calls = []

    def fake_measure(recipe, *, steps=2):
        calls.append((recipe.model.path, steps))
        return {"device": "cpu", "peak_bytes": 3 * 2**20, "breakdown": {"weights": 2 * 2**20, "activations": 2**20}}

    monkeypatch.setattr(api, "measure", fake_measure)
    assert main(["measure", str(recipe_file), "--steps", "3"]) == 0
    assert calls == [(MODEL, 3)]
    out = capsys.readouterr().out
    assert "measured peak on cpu" in out and "3.00 MiB" in out
    assert main(["measure", str(recipe_file), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_bytes"] == 3 * 2**20 and calls[-1] == (MODEL, 2)


def _damaged_run(root: Path) -> RunDir:
    """A run whose files were damaged on disk: bad bytes, a row of the wrong shape, a status of wrong types."""
    run = RunDir(root)
    root.mkdir(exist_ok=True)
    run.append_metrics({"step": 1, "loss": 2.0})
    with run.metrics.open("ab") as f:
        f.write(b'{"step": 2, "loss": 1.\xff\xfe}\n')  # bad bytes
        f.write(b'{"step": "x"}\n{"step": 3, "loss": "high"}\n{"step": true}\n' + b"[" * 5000 + b"\n")
    run.append_metrics({"step": 4, "loss": 1.0})
    run.status.write_text(json.dumps({"state": "running", "step": "x", "max_steps": None, "eta_s": "soon"}))
    run.recipe.write_bytes(b"model:\n  path: caf\xe9\n")
    return run


def test_damaged_run_files_are_read_for_what_they_hold_and_the_damage_counted(tmp_path):
    run = _damaged_run(tmp_path)
    rows = run.read_metrics()
    assert rows == [{"step": 1, "loss": 2.0}, {"step": 4, "loss": 1.0}] and rows.skipped == 5
    assert run.read_status() == {"state": "running"}
    assert run.read_recipe_text() == "model:\n  path: caf\ufffd\n"
    assert run.truncate_metrics(after_step=1) == 5
    assert run.read_metrics() == [{"step": 1, "loss": 2.0}] and run.read_metrics().skipped == 0
    assert read_jsonl(tmp_path / "missing.jsonl") == [] and read_jsonl(tmp_path / "missing.jsonl").skipped == 0


def test_status_is_written_in_place_when_the_disk_has_no_room_for_a_temp_copy(tmp_path, monkeypatch):
    import errno

    run = RunDir(tmp_path)
    run.write_status("running", step=3)
    real_open = os.open

    def no_space(path, flags, *args, **kwargs):  # a full disk: no new file, the blocks a file holds are writable
        if flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, flags, *args, **kwargs)
    monkeypatch.setattr(os, "open", no_space)
    run.write_status("failed", error="OSError: [Errno 28] No space left on device")
    assert run.read_status()["state"] == "failed" and "No space" in run.read_status()["error"]
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]
    with pytest.raises(OSError):  # nothing to write over: the caller says so on screen
        RunDir(tmp_path / "new").write_status("failed")


def test_an_export_does_not_make_an_old_run_the_newest(tmp_path):
    old, new = RunDir(tmp_path / "old"), RunDir(tmp_path / "new")
    for run, when in ((old, 1000), (new, 2000)):
        with run.lock("finetune run", create=True):  # a run writes its files while it holds the lock
            run.write_status("completed")
        for f in run.root.iterdir():
            os.utime(f, (when, when))
        os.utime(run.root, (when, when))
    old.lock("finetune export").release()  # writes its pid into old's lock file now
    assert find_runs(tmp_path) == [new.root.resolve(), old.root.resolve()]


def test_atomically_written_files_get_the_mode_of_any_other_file(tmp_path):
    """A runs folder shared by several users (a Docker volume) stays readable: plan.json, status.json and the
    other atomically written files get 0666 less the umask, like a plain file, not the temp file's 0600."""
    import os
    import stat

    from finetune.rundir import atomic_write_json

    previous = os.umask(0o022)
    try:
        atomic_write_json(tmp_path / "plan.json", {"peak_bytes": 1})
        (tmp_path / "plain.txt").write_text("x")
    finally:
        os.umask(previous)
    mode = stat.S_IMODE((tmp_path / "plan.json").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left
