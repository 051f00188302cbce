"""The run directory: every file written atomically, so a crash never leaves half a file behind."""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError

MARKER = ".finetune-run"  # written into a run directory the tool created; --overwrite deletes nothing else


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temp file in the same folder, fsync, then rename over the target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def replace_dir(tmp: Path, target: Path) -> None:
    """Swap a fully written folder into place (the old one is removed only after the new one exists).

    The old one is moved aside under a name no user folder has, so nothing beside `target` is touched."""
    old = target.with_name(f".{target.name}.old-{os.getpid()}-{time.time_ns()}") if target.exists() else None
    if old is not None:
        target.rename(old)
    tmp.rename(target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_jsonl(path: Path) -> list[dict]:
    """Read metrics; a torn last line (crash mid-write) is ignored."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


@dataclass(frozen=True)
class RunDir:
    """Paths of one run; see docs/run-directory in the README."""

    root: Path

    @property
    def recipe(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def status(self) -> Path:
        return self.root / "status.json"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    @property
    def env(self) -> Path:
        return self.root / "env.json"

    @property
    def adapter(self) -> Path:
        return self.root / "adapter"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def results(self) -> Path:
        return self.root / "results.json"

    @property
    def marker(self) -> Path:
        return self.root / MARKER

    def create(self) -> None:
        """Make the folder a run directory: marked only if the tool created it or found it empty, so a
        folder that already held the user's files can never later be deleted by --overwrite."""
        try:
            if not self.root.exists() or not any(self.root.iterdir()):
                self.root.mkdir(parents=True, exist_ok=True)
                atomic_write_text(self.marker, "created by finetune; `finetune run --overwrite` may delete it\n")
        except OSError as exc:
            raise FinetuneError(f"output.dir: cannot create the run directory {self.root}: {exc.strerror or exc}",
                                hint="choose a folder you can write to, e.g. --set output.dir=runs/NEW") from None

    def remove(self) -> None:
        """--overwrite: delete the run directory, only if it carries the marker and is no folder that holds
        the user's work (the working directory or a parent of it, home, /, a mount point)."""
        target = self.root.resolve()
        cwd, home = Path.cwd().resolve(), Path.home().resolve()
        why = None
        if cwd == target or cwd.is_relative_to(target):
            why = "it is the working directory or a parent of it"
        elif target == home or home.is_relative_to(target):
            why = "it is the home folder or a parent of it"
        elif os.path.ismount(target):
            why = "it is a mount point"
        elif not self.marker.is_file():
            why = f"it is not a run directory created by finetune (no {MARKER} file)"
        if why:
            raise FinetuneError(f"--overwrite: refusing to delete output.dir {self.root} ({target}): {why}",
                                hint="set output.dir to a new folder (e.g. --set output.dir=runs/NEW), or "
                                     "delete the folder yourself if you are sure")
        shutil.rmtree(target)

    def append_metrics(self, row: dict) -> None:
        with self.metrics.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def truncate_metrics(self, after_step: int) -> None:
        """On resume, drop rows logged after the checkpoint so each step appears once."""
        rows = [r for r in read_jsonl(self.metrics) if r.get("step", 0) <= after_step]
        atomic_write_text(self.metrics, "".join(json.dumps(r) + "\n" for r in rows))

    def write_status(self, state: str, **fields: Any) -> None:
        data = {"state": state, "pid": os.getpid(), "updated": time.time(), **fields}
        atomic_write_json(self.status, data)

    def read_status(self) -> dict:
        try:
            return json.loads(self.status.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def log_line(self, text: str) -> None:
        with self.log.open("a") as f:
            f.write(time.strftime("%H:%M:%S ") + text + "\n")


def environment_summary() -> dict:
    """Versions and device, so a result can be reproduced and compared."""
    import importlib.metadata as md

    import torch

    versions = {}
    for pkg in ("finetune", "torch", "transformers", "peft", "trl", "accelerate", "datasets", "bitsandbytes"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    env = {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
           "packages": versions, "cuda": torch.version.cuda, "device": "cpu"}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device="cuda", gpu=props.name, gpu_memory_bytes=props.total_memory)
    return env
