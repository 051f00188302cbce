"""Checkpoints that are either complete or ignored: written in a staging folder, marked, then renamed.

A kill or a full disk during a save leaves at most `checkpoints/.staging/`, which `--resume` removes; a
`checkpoint-N` folder counts only with its completeness marker and its train state
(finetune/train/train_state.py writes both). Before resuming, every pickled file of the chosen checkpoint is
read with torch's weights-only loader, so a damaged or hostile file is named and skipped. Checkpoints of
versions that trained through transformers.Trainer (a trainer_state.json, no train state) are passed over
with that reason.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from finetune.console import console
from finetune.errors import FinetuneError
from finetune.rundir import RunDir, replace_dir

if TYPE_CHECKING:
    from finetune.recipe.schema import Recipe

COMPLETE = ".complete"  # written last inside a checkpoint folder, before the rename that publishes it
STAGING = ".staging"
TRAIN_STATE = "train_state.pt"  # weights, optimizer, scheduler, loop and policies (train_state.py)
OLD_FORMAT = "trainer_state.json"  # what checkpoints of the transformers.Trainer versions hold instead
FAULT_ENV = "FINETUNE_FAULT_CHECKPOINT"  # test hook, see checkpoint_fault()
_NAME = re.compile(r"checkpoint-(\d+)$")


@dataclass(frozen=True)
class Checkpoints:
    """What `--resume` found: the checkpoint to continue from, and what it passed over (with reasons)."""

    newest: Path | None
    skipped: list[str]


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE).is_file()


def numbered(root: Path) -> list[Path]:
    """checkpoint-N folders, highest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)), reverse=True)


def step_of(folder: str | Path) -> int:
    return int(_NAME.match(Path(folder).name).group(1))


def unreadable_file(folder: Path) -> str | None:
    """The first file of a checkpoint that cannot be read safely (why, in a few words), or None: pickles
    through torch's weights-only loader, safetensors through their header."""
    import torch
    from safetensors import safe_open

    from finetune.optim import register_safe_globals

    register_safe_globals()  # exactly what resuming allows: GaLore/APOLLO projectors
    for path in sorted(folder.iterdir()):
        try:
            if path.suffix in (".pt", ".pth", ".bin"):
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            elif path.suffix == ".safetensors":
                with safe_open(path, framework="pt") as f:
                    f.keys()
        except Exception as exc:  # noqa: BLE001 - any failure makes the file unusable; the reason is reported
            reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            return f"{path.name}: {reason}"
    return None


def find_resumable(root: Path) -> Checkpoints:
    """The newest complete, readable checkpoint; partial staging folders are removed, partial or damaged ones
    passed over (with the reason) so the previous complete one resumes."""
    skipped = []
    staging = root / STAGING
    if staging.exists():
        for partial in sorted(staging.iterdir()):
            if (partial / COMPLETE).is_file() and not (root / partial.name).exists():
                partial.rename(root / partial.name)  # complete, killed just before its rename: publish it
                continue
            skipped.append(f"{partial.name} (partial: interrupted while being written; removed)")
        shutil.rmtree(staging, ignore_errors=True)
    for folder in numbered(root):
        if (folder / OLD_FORMAT).is_file() and not (folder / TRAIN_STATE).is_file():
            skipped.append(f"{folder.name} (written by a version of finetune that trained through "
                           "transformers.Trainer; resume it with that version, or start again)")
            continue
        if not is_complete(folder):
            skipped.append(f"{folder.name} (partial: no {COMPLETE} marker)")
            continue
        if not (folder / TRAIN_STATE).is_file():  # complete once, damaged since (a file deleted)
            skipped.append(f"{folder.name} (damaged: no {TRAIN_STATE})")
            continue
        bad = unreadable_file(folder)
        if bad:
            skipped.append(f"{folder.name} (refused to load {bad})")
            continue
        return Checkpoints(folder, skipped)
    return Checkpoints(None, skipped)


def stage(root: Path) -> Path:
    """An empty staging folder for the next save (a leftover of an interrupted save is removed)."""
    staging = root / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish(staged: Path, final: Path) -> None:
    """Mark the staged checkpoint complete, make it durable, and rename it into place."""
    marker = staged / COMPLETE
    with marker.open("w") as f:
        f.write(f"{time.time()}\n")
        f.flush()
        os.fsync(f.fileno())
    for path in staged.iterdir():
        if path.is_file():
            _fsync(path)
    if final.exists():  # a Ctrl-C save at the step of a periodic save: the new one replaces it
        replace_dir(staged, final)  # the old one stays until the new one is in place
    else:
        staged.rename(final)
    _fsync(final.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_fault(staged: Path, step: int) -> None:
    """Fault injection for tests: FINETUNE_FAULT_CHECKPOINT=hang@N or enospc@N acts at step N's save,
    after the train state is written and before the marker.

    `hang` creates `FAULT_HANG` in the staging folder and sleeps (a test kills the process there);
    `enospc` raises the OSError a full disk raises. Unset in normal use.
    """
    spec = os.environ.get(FAULT_ENV, "")
    kind, _, at = spec.partition("@")
    if not kind or (at and int(at) != step):
        return
    if kind == "hang":
        (staged / "FAULT_HANG").touch()
        while True:
            time.sleep(1)
    if kind == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(staged / "rng_state.pth"))


def report_skipped(skipped: list[str]) -> None:
    for line in skipped:
        console.print(f"[yellow]--resume: skipped checkpoint {line}")


def check_output_dir(recipe: Recipe, resume: bool, overwrite: bool) -> None:
    """A new run must not start in a folder that holds one (checked again by `finetune run --gpus N` before
    it starts any process)."""
    run = RunDir(Path(recipe.output.dir))
    if not resume and not overwrite and (run.status.exists() or numbered(run.checkpoints)):
        raise FinetuneError(
            f"output.dir {run.root} already holds a run",
            hint="pass --resume to continue it, --overwrite to start over, or --set output.dir=runs/NEW")
