"""`finetune export` is published whole (finetune.publish): stopped with SIGTERM at each of its steps, or killed
outright between the two renames of the swap, it leaves no temporary behind for good and the earlier export
intact (or the new one complete)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from finetune.publish import PAUSE_ENV, Interrupted, publishing, recover
from tests.run_support import sums_data, tiny_lora_recipe

ROOT = Path(__file__).resolve().parent.parent
POINTS = ["export:1", "export:2", "export:3", "export:4", "publish:swap"]


def _contents(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def _export(run: Path, out: Path, pause: str) -> subprocess.Popen:
    """`finetune export` in its own process, stopped at `pause` (it says so on stderr)."""
    env = {**os.environ, PAUSE_ENV: pause, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "finetune", "export", str(run), "--out", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if line.strip() == f"paused at {pause}":
            return proc
    proc.wait()
    raise AssertionError(f"export ended (exit {proc.returncode}) before pausing at {pause}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir) -> tuple[Path, Path, dict[str, str]]:
    """A finished one-step run, and an earlier export of it with its files' hashes."""
    from finetune.cli import main

    root = tmp_path_factory.mktemp("export")
    recipe = tiny_lora_recipe(tiny_model_dir, sums_data(root / "data.jsonl", 8), root / "run",
                              {"training": {"max_steps": 1}})
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["run", str(root / "recipe.yaml")]) == 0
    earlier = root / "earlier"
    assert main(["export", str(root / "run"), "--out", str(earlier)]) == 0
    return root / "run", earlier, _contents(earlier)


@pytest.mark.parametrize("point", POINTS)
def test_sigterm_at_each_step_keeps_the_earlier_export(trained, tmp_path, point):
    import shutil

    run, earlier, hashes = trained
    out = tmp_path / "merged"
    shutil.copytree(earlier, out)
    proc = _export(run, out, point)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    message = [line for line in (stdout + stderr).splitlines() if "SIGTERM" in line]
    assert message == [f"error: stopped by SIGTERM: the unfinished copy was removed, {out} is as it was"]
    assert "Traceback" not in stderr
    assert _leftovers(out) == [] and _contents(out) == hashes


def test_sigterm_without_an_earlier_export_leaves_nothing(trained, tmp_path):
    run, _, _ = trained
    out = tmp_path / "merged"
    proc = _export(run, out, "export:3")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert not out.exists() and _leftovers(out) == []


def test_killed_between_the_renames_the_next_export_restores_the_earlier_one(trained, tmp_path):
    """SIGKILL runs no cleanup: the target is gone and the earlier export sits aside; the next export's start
    renames it back and deletes the dead process's half."""
    import shutil

    run, earlier, hashes = trained
    out = tmp_path / "merged"
    shutil.copytree(earlier, out)
    proc = _export(run, out, "publish:swap")
    proc.kill()
    proc.communicate(timeout=60)
    assert not out.exists() and [n.split("-")[0] for n in _leftovers(out)] == [".merged.old", ".merged.tmp"]
    proc = _export(run, out, "export:1")  # the start of the next export has settled the leftovers
    assert _leftovers(out) == [n for n in _leftovers(out) if f"-{proc.pid}-" in n]
    assert _contents(out) == hashes
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT
    assert _leftovers(out) == [] and _contents(out) == hashes


def test_publishing_a_file_swaps_it_in_or_leaves_the_earlier_one(tmp_path):
    target = tmp_path / "model.gguf"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), publishing(target, folder=False) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer failed")
    assert target.read_bytes() == b"old" and _leftovers(target) == []
    with publishing(target, folder=False) as tmp:
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and _leftovers(target) == []


def test_recover_settles_only_dead_processes_leftovers(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    target = tmp_path / "out"
    for name in (f".out.old-{dead}-1f", f".out.tmp-{dead}-2e", f".out.tmp-{os.getpid()}-3d", ".out.tmp-abc",
                 "out.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text(name)
    recover(target)  # target missing: the dead process's old copy is renamed back
    assert (target / "f").read_text() == f".out.old-{dead}-1f"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["out", f".out.tmp-{os.getpid()}-3d", ".out.tmp-abc", "out.tmp"]), "a live process's and others' kept"


def test_interrupted_is_a_one_line_user_error():
    error = Interrupted("stopped by SIGTERM: x", signal.SIGTERM)
    assert str(error) == "stopped by SIGTERM: x" and error.exit_code == 143
