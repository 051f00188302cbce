"""The run directory contract: every file of a run named once, written atomically, read back tolerantly.

Training writes a run directory; the CLI, `generate`/`export`, the UI and the benchmarks read it, all through
this module, so a file is renamed or a reader fixed in one place. It imports only the standard library and
finetune.errors: every layer may use it. A crash never leaves half a file behind (writes go to a temp file that
is renamed over the target), and readers accept what a live or crashed run leaves: a missing file, a file being
replaced, a metrics line still being written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError

RECIPE = "recipe.yaml"  # also the name the UI gives a recipe it offers for download
MARKER = ".finetune-run"  # written into a run directory the tool created; --overwrite deletes nothing else
EXPORT_MARKER = ".finetune-export"  # written into an export folder: a later export may replace only such a folder
TAIL_BYTES = 65536  # a log tail reads at most this much from the end of the file

# metrics.jsonl keys of a preference run (training.method dpo, orpo, kto; kto logs no accuracy), each with the
# name plots give it: finetune/memory/preference.py logs them, loss.png (finetune/train/plots.py) and the UI
# (finetune.api.run_reward_report) draw them. Evaluation rows carry the same keys behind EVAL_PREFIX.
REWARD_CHOSEN, REWARD_REJECTED = "rewards/chosen", "rewards/rejected"
REWARD_MARGIN, REWARD_ACCURACY = "rewards/margins", "rewards/accuracies"
REWARD_KEYS = {REWARD_CHOSEN: "chosen reward", REWARD_REJECTED: "rejected reward", REWARD_MARGIN: "reward margin",
               REWARD_ACCURACY: "accuracy (chosen > rejected)"}
EVAL_PREFIX = "eval_"  # the Trainer's evaluation prefix (metric_key_prefix "eval")


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


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file's object, or None while it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every object line of a JSON-lines file; a torn line (crash or a write in progress) is skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a text file ('' if missing), reading at most TAIL_BYTES from its end."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - TAIL_BYTES))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class RunDir:
    """One run directory: the path of each of its files, its writers and its readers."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def recipe(self) -> Path:
        """The recipe as run, `auto` keys resolved (resume and generate read it back)."""
        return self.root / RECIPE

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def plan_plot(self) -> Path:
        return self.root / "plan.png"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def loss_plot(self) -> Path:
        return self.root / "loss.png"

    @property
    def status(self) -> Path:
        return self.root / "status.json"

    @property
    def results(self) -> Path:
        return self.root / "results.json"

    @property
    def recovered(self) -> Path:
        """Settings that OOM recoveries chose (finetune.train.recovery); --resume keeps them."""
        return self.root / "oom_recovery.json"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    @property
    def env(self) -> Path:
        return self.root / "env.json"

    @property
    def adapter(self) -> Path:
        """The trained adapter (or full model) with its tokenizer; present once a run completed."""
        return self.root / "adapter"

    @property
    def adapter_staging(self) -> Path:
        """Where the adapter is written before it is renamed to `adapter`."""
        return self.root / ".adapter.tmp"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def offload(self) -> Path:
        """The disk offload tier's folder when memory.offload_dir is unset."""
        return self.root / "offload"

    @property
    def reference_logps(self) -> Path:
        """training.precompute_reference: the reference log-probabilities of every example (--resume reads them)."""
        return self.root / "reference_logps.json"

    @property
    def marker(self) -> Path:
        return self.root / MARKER

    # -- what a run directory is --------------------------------------------------------------------
    def exists(self) -> bool:
        """Whether the folder holds a run (or a run's first file): a new run must not start in it."""
        return self.root.is_dir() and any(p.exists() for p in (self.status, self.metrics, self.recipe))

    def has_adapter(self) -> bool:
        """Whether a trained adapter or full model was saved (generate, chat and export need one)."""
        return (self.adapter / "adapter_config.json").is_file() or (self.adapter / "config.json").is_file()

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

    def discard_untrained(self) -> bool:
        """Delete a run directory in which nothing was trained (no metrics row, checkpoint or adapter): a run
        that failed or was stopped before its first step leaves no folder that blocks the next `finetune run`
        or shows in the run, chat and resume lists. Only a folder the tool made (`remove`'s rules); returns
        whether it was deleted."""
        trained = self.metrics.is_file() and self.metrics.stat().st_size > 0 or self.has_adapter() \
            or self.checkpoints.is_dir() and any(self.checkpoints.iterdir())
        if trained or not self.marker.is_file():
            return False
        try:
            self.remove()
        except (FinetuneError, OSError):
            return False
        return True

    # -- writers (training) -------------------------------------------------------------------------
    def append_metrics(self, row: dict) -> None:
        with self.metrics.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def truncate_metrics(self, after_step: int) -> None:
        """On resume, drop rows logged after the checkpoint so each step appears once."""
        rows = [r for r in self.read_metrics() if r.get("step", 0) <= after_step]
        atomic_write_text(self.metrics, "".join(json.dumps(r) + "\n" for r in rows))

    def write_status(self, state: str, **fields: Any) -> None:
        data = {"state": state, "pid": os.getpid(), "updated": time.time(), **fields}
        atomic_write_json(self.status, data)

    def log_line(self, text: str) -> None:
        with self.log.open("a") as f:
            f.write(time.strftime("%H:%M:%S ") + text + "\n")

    # -- readers (CLI, UI, benchmarks) --------------------------------------------------------------
    def read_status(self) -> dict[str, Any]:
        """The live status (state, step, max_steps, eta_s, pid, error); {} before the run wrote one."""
        return read_json(self.status) or {}

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every logged row (train and eval rows mixed, in order); a line still being written is skipped."""
        return read_jsonl(self.metrics)

    def read_plan(self) -> dict[str, Any] | None:
        """The memory plan as saved by the run (Plan.to_json), or None without one."""
        return read_json(self.plan)

    def read_results(self) -> dict[str, Any] | None:
        """The end-of-run summary (state, steps, losses, data stats), or None before the run ended."""
        return read_json(self.results)

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log, lines)


def find_runs(folder: Path, extra: Iterable[Path] = ()) -> list[Path]:
    """Run directories in `folder` and its subfolders (hidden ones skipped) plus those of `extra`, newest first."""
    found: set[Path] = {Path(p).resolve() for p in extra if RunDir(p).exists()}
    if folder.is_dir():
        for candidate in [*folder.iterdir(), *folder.glob("*/*")]:
            if not candidate.name.startswith(".") and RunDir(candidate).exists():
                found.add(candidate.resolve())
    return sorted(found, key=_last_written, reverse=True)


def _last_written(path: Path) -> float:
    """The newest mtime of the run's files; a live run renames temporaries away meanwhile, so a file that is
    gone by the time it is looked at is passed over."""
    times = [path.stat().st_mtime]
    for f in path.iterdir():
        try:
            times.append(f.stat().st_mtime)
        except OSError:
            continue
    return max(times)
