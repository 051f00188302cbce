"""Offload files a killed process left behind (SIGKILL, the OOM killer): the next writer in that folder removes
exactly those (ours, owner gone), keeps a live process's and the user's files, and its free-space check counts
the room they took."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from finetune.memory import offload_disk
from finetune.memory.offload_disk import OffloadDirError, check_offload_dir, pid_space, with_margin
from finetune.memory.weight_store import EXPERTS, WEIGHTS, tier_files

Usage = namedtuple("Usage", "total used free")  # shutil.disk_usage's answer

# A process writing offload files as finetune does: weights and experts through the weight store's files, an
# activation through the disk tier; then it waits to be killed (or ended).
WRITER = r"""
import sys, time, torch
from pathlib import Path
from finetune.memory.offload_disk import DiskTier
from finetune.memory.offload_tier import TierSetup
from finetune.memory.weight_store import EXPERTS, WEIGHTS, tier_files

shared, own = Path(sys.argv[1]), Path(sys.argv[2])
weights = tier_files(WEIGHTS, "disk", 0, None, shared, 1 << 20)
weights.write(0, "q_proj.weight", torch.ones(1 << 18))  # 1 MiB
experts = tier_files(EXPERTS, "disk", 0, None, shared, 1 << 20)
experts.write(1, "experts.w1", torch.ones(1024))
tier = DiskTier(TierSetup(None, shared, None))
flat = torch.ones(4096, dtype=torch.uint8)
held = tier.store(flat, torch.empty_like(flat, device="meta"), flat.numel())
tier.drain()  # the write is done; the file stays while `held` lives
streamed = tier_files(WEIGHTS, "disk", 0, None, own, 1 << 20)  # a folder it makes (missing until now)
streamed.write(0, "q_proj.weight", torch.ones(1024))
print("ready", flush=True)
time.sleep(600)
"""


def _writer(shared: Path, own: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(shared), str(own)], stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout.readline().strip() == "ready", "the writer process failed: see its stderr"
    return proc


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} if folder.exists() else set()


def _of(names: set[str], pid: int) -> set[str]:
    return {n for n in names if f"-{pid}-" in n}


def test_a_killed_writers_files_and_folders_go_a_live_ones_and_the_users_stay(tmp_path, monkeypatch, capsys):
    shared = tmp_path / "ssd"
    shared.mkdir()
    (shared / "notes.txt").write_text("the user's")
    (shared / "ft-weights-readme.bin").write_text("ours by prefix, but no pid: not ours")
    # a writer on another machine sharing the folder (NFS), or in another container: its pid means nothing here
    elsewhere = shared / f"ft-weights-{'0' * 8}-{2 ** 22 + 1}-0123abcd-0-w.bin"
    elsewhere.write_bytes(b"\0" * 100)
    killed, alive = _writer(shared, tmp_path / "run-a" / "offload"), _writer(shared, tmp_path / "run-b" / "offload")
    try:
        # pid reuse: a file named for the live writer's pid but written before that process started
        reused = shared / f"ft-act-{pid_space()}-{alive.pid}-0123abcd-0.bin"
        reused.write_bytes(b"\0" * 100)
        os.utime(reused, (time.time() - 3600, time.time() - 3600))
        before = _names(shared)
        dead = _of(before, killed.pid)
        assert len(dead) == 3 and len(_of(before, alive.pid)) == 4  # weights, experts, activation (+ reused)
        dead_bytes = sum((shared / n).stat().st_size for n in dead) + reused.stat().st_size

        # a disk of the files' size: free is what they leave of it; the check needs the margin alone
        capacity = with_margin(0) + sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()) - dead_bytes // 2

        def disk_usage(path):
            used = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
            return Usage(capacity, used, capacity - used)

        monkeypatch.setattr(offload_disk.shutil, "disk_usage", disk_usage)
        with pytest.raises(OffloadDirError, match="free but disk offload needs"):
            check_offload_dir(shared, 0)  # the owner lives: its files stay, the disk is too full
        assert _names(shared) == before - {reused.name}
        assert "ended without cleaning up" in capsys.readouterr().err  # the reused pid's file went already

        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert check_offload_dir(shared, 0) == shared  # room now
        assert _names(shared) == before - dead - {reused.name}, "exactly the killed process's files go"
        assert _of(_names(shared), alive.pid) and {"notes.txt", "ft-weights-readme.bin"} <= _names(shared)
        assert elsewhere.exists(), "a file written in another pid space is never judged by its pid here"
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "offload: removed 3 files" in err and f"(pid {killed.pid})" in err
        assert str(shared) in err

        # the store creation in the folder the killed writer made: its file and the folders it made go first,
        # then the store makes them again (and removes them when it closes)
        own = tmp_path / "run-a" / "offload"
        assert len(_of(_names(own), killed.pid)) == 1  # its weight file, named with the folders it made
        files = tier_files(WEIGHTS, "disk", 0, None, own, 0)
        assert _of(_names(own), killed.pid) == set()
        files.write(0, "w", torch.ones(8))
        files.remove()
        assert not (tmp_path / "run-a").exists(), "the folders the killed writer made are gone with it"
        assert len(_of(_names(tmp_path / "run-b" / "offload"), alive.pid)) == 1  # a live writer's own folder
    finally:
        for proc in (killed, alive):
            proc.kill()
            proc.wait()


def test_a_terminated_writers_files_go_and_the_checking_process_keeps_its_own(tmp_path, capsys):
    proc = _writer(tmp_path / "ssd", tmp_path / "own")  # it makes ssd/ (its files' names say so)
    proc.terminate()  # SIGTERM without a handler ends Python as a kill does: no finalizer runs
    proc.wait()
    store = tier_files(EXPERTS, "disk", 0, None, tmp_path / "ssd", 0)
    store.write(0, "w", torch.ones(8))
    kept = {f"{store.prefix}0-w.bin"}
    assert "-made1-" in store.prefix, "the folder made again, by the store"
    assert _names(tmp_path / "ssd") == kept, "the writer's go"
    assert f"offload: removed 3 files (1.01 MiB) left in {tmp_path / 'ssd'}" in capsys.readouterr().err
    assert check_offload_dir(tmp_path / "ssd", 0) and _names(tmp_path / "ssd") == kept, "its own files stay"
    store.remove()
    assert not (tmp_path / "ssd").exists()


def test_the_planner_counts_a_killed_runs_files_as_room_and_leaves_them(tmp_path, monkeypatch):
    """`finetune plan` prices the offload folder's free space with what a killed run left there (the run
    removes it before writing), and removes nothing itself."""
    from finetune import api
    from finetune.recipe import validate_recipe

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    folder = tmp_path / "offload"
    folder.mkdir()
    left = folder / f"ft-weights-{pid_space()}-{ended.pid}-0123abcd-0-layer.bin"
    with open(left, "wb") as f:
        f.truncate(8 << 20)
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(real_usage(p).total, 0, 64 << 20))
    config = Path(__file__).parent / "fixtures" / "configs" / "llama-3.1-8b.json"
    recipe = validate_recipe({"model": {"path": str(config)}, "data": {"path": "d.jsonl"},
                              "memory": {"offload": "disk", "offload_dir": str(folder)}})
    plan = api.plan(recipe, gpu_memory="24GiB")
    assert any("in memory.offload_dir, 72.00 MiB free" in c.reason for c in plan.rejected), plan.rejected
    assert left.exists()


def test_a_left_file_that_cannot_be_removed_stays_and_the_rest_go(tmp_path, monkeypatch, capsys):
    """Another user's file (a shared folder): not ours to remove; the check goes on and counts the others."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    theirs, ours = (tmp_path / f"ft-act-{pid_space()}-{ended.pid}-0123abcd-{i}.bin" for i in (0, 1))
    theirs.write_bytes(b"\0" * 10)
    ours.write_bytes(b"\0" * 10)
    real_unlink = Path.unlink

    def unlink(path, missing_ok=False):
        if path == theirs:
            raise PermissionError(13, "Permission denied", str(path))
        real_unlink(path, missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    assert check_offload_dir(tmp_path, 0) == tmp_path
    assert theirs.exists() and not ours.exists()
    assert f"offload: removed 1 file (10 B) left in {tmp_path} by a run" in capsys.readouterr().err
