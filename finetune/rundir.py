"""The run directory contract: every file of a run named once, written atomically, read back tolerantly.

Training writes a run directory; the CLI, `generate`/`export`, the UI and the benchmarks read it, all through
this module, so a file is renamed or a reader fixed in one place. It imports only the standard library and
finetune.errors: every layer may use it. A crash never leaves half a file behind (writes go to a temp file that
is renamed over the target), and readers accept what a live or crashed run leaves: a missing file, a file being
replaced, a metrics line still being written.

Why one module of ~600 lines: that is its point, every file of a run in one place.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError

RECIPE = "recipe.yaml"  # also the name the UI gives a recipe it offers for download
MARKER = ".finetune-run"  # written into a run directory the tool created; --overwrite deletes nothing else
LOCK = ".finetune-lock"  # flock'ed by the one process writing the run (RunDir.lock); only its holder deletes it
HOLDER = "pid {pid} ({action})"  # what a lock's holder writes into the lock file (RunDir.lock, held_runs)
LOCK_WAIT_S = 0.5  # how long taking the lock waits out a reader's momentary probe (RunDir.locked_by)
EXPORT_MARKER = ".finetune-export"  # written into an export folder: a later export may replace only such a folder
TAIL_BYTES = 65536  # a log tail reads at most this much from the end of the file

# metrics.jsonl keys of a preference run (a preference training.method; kto logs no accuracy), each with the
# name plots give it: finetune/step/preference.py logs them, loss.png (finetune/train/plots.py) and the UI
# (finetune.api.run_reward_report) draw them. Evaluation rows carry the same keys behind EVAL_PREFIX.
REWARD_CHOSEN, REWARD_REJECTED = "rewards/chosen", "rewards/rejected"
REWARD_MARGIN, REWARD_ACCURACY = "rewards/margins", "rewards/accuracies"
REWARD_KEYS = {REWARD_CHOSEN: "chosen reward", REWARD_REJECTED: "rejected reward", REWARD_MARGIN: "reward margin",
               REWARD_ACCURACY: "accuracy (chosen > rejected)"}
EVAL_PREFIX = "eval_"  # evaluation metrics' prefix in log rows
# a run that stopped learning (finetune/train/reporting.py CollapseWatch): the metrics.jsonl event row the curves
# mark, and the status.json field the run view shows
COLLAPSED_EVENT, TRAINING_WARNING = "training_collapsed", "training_warning"


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temp file in the same folder, fsync, then rename over the target. The file gets the mode any
    other file of the run gets (0666 less the umask), not mkstemp's owner-only 0600: a runs folder shared by
    several users (a Docker volume, a team's server) stays readable as the rest of its files are."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def overwrite_in_place(path: Path, text: str) -> bool:
    """Write a small text over an existing file without a temp copy (a full disk refuses new blocks, not the
    ones a file holds); False when the file is missing or even that fails. Not atomic: the fallback only."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return False
    try:
        data = text.encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def replace_dir(tmp: Path, target: Path) -> None:
    """Swap a fully written folder into place (the old one is removed only after the new one exists); the
    old one is moved aside under a name no user folder has (finetune.publish.swap_in)."""
    from finetune.publish import swap_in

    swap_in(tmp, target)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file's object, or None while it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class Rows(list):
    """Rows read from a JSON-lines file; `skipped` counts the lines that were no usable row (bad bytes, bad
    JSON, a row of the wrong shape): a damaged file is read for what it still holds, never a traceback."""

    skipped: int = 0


def read_jsonl(path: Path, usable: Callable[[dict[str, Any]], bool] = lambda row: True) -> Rows:
    """Every object line of a JSON-lines file that `usable` accepts; a torn last line (a crash, or a write in
    progress) is skipped without being counted."""
    rows = Rows()
    try:
        data = path.read_bytes()
    except OSError:
        return rows
    lines = data.split(b"\n")  # the last is b"" after a final newline, else a line still being written
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # bad bytes (UnicodeDecodeError) and bad JSON alike
            row = None
        if isinstance(row, dict) and usable(row):
            rows.append(row)
        elif number < len(lines):
            rows.skipped += 1
    return rows


def is_eval_row(row: dict[str, Any]) -> bool:
    """A log row of an evaluation (held-out loss, or a GRPO run's held-out rewards), not of training."""
    return any(k.startswith(EVAL_PREFIX) for k in row)


def is_number(value: Any) -> bool:
    """A JSON number (int or float, not a bool): what tolerant readers compute with."""
    return isinstance(value, int | float) and not isinstance(value, bool)


# metrics.jsonl keys whose values the curves and summaries compute with: a number (or null) or the row is skipped
METRIC_NUMBERS = ("epoch", "elapsed_s", "loss", "learning_rate", "grad_norm", "tokens_per_second", "tokens_seen",
                  "peak_memory_bytes", f"{EVAL_PREFIX}loss", *REWARD_KEYS, *(EVAL_PREFIX + k for k in REWARD_KEYS))


def metrics_row_usable(row: dict[str, Any]) -> bool:
    """A metrics.jsonl row readers can use: an integer step, and numbers where numbers are computed with."""
    step = row.get("step")
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0 and all(
        row.get(k) is None or is_number(row[k]) for k in METRIC_NUMBERS)


# status.json fields readers compute with, and the type each must have (a field of another type is dropped)
STATUS_TYPES: dict[str, type | tuple[type, ...]] = {
    "state": str, "step": int, "max_steps": int, "pid": int, "eta_s": (int, float), "error": str}


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


class RunLock:
    """An exclusive flock on a run directory's lock file, held until `release()` or the end of the process:
    the kernel drops it however the process ends, so a crash or a kill -9 leaves no stale lock. `made`: the run
    directory whose lock file this lock created; released while that folder holds no run (an export or a
    --resume refused on a folder of the user's), the file goes too, so a refusal leaves the folder as it was."""

    def __init__(self, fd: int | None, made: RunDir | None = None):
        self._fd = fd
        self._made = made

    def release(self) -> None:
        if self._fd is None:
            return
        made = self._made
        if made is not None and not made.exists() and made._holds_lock_file(self._fd):
            made.lock_file.unlink(missing_ok=True)  # still ours: only a holder deletes its file (waiters retry)
        os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _in_use(root: Path, holder: str, action: str) -> FinetuneError:
    return FinetuneError(f"{action}: {root} is in use by {holder}; one process at a time may write a run directory",
                         hint="wait for it to end or stop it, or choose another folder (--set output.dir=runs/NEW)")


def _holder(fd: int) -> str:
    """What the holder wrote into the lock file after taking it ('pid 123 (finetune run)')."""
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", errors="replace").strip()
    except OSError:
        text = ""
    return text or "another process"


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
    def completions(self) -> Path:
        """training.method grpo: a few sampled completions per logged step (prompt, completion, reward)."""
        return self.root / "completions.jsonl"

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
    def data_fingerprint(self) -> Path:
        """What decided the run's examples (finetune.data.fingerprint); --resume refuses other data."""
        return self.root / "data_fingerprint.json"

    @property
    def data_stats(self) -> Path:
        """Every count of the data the run trained on (records, kept, cut and dropped with where, tokens)."""
        return self.root / "data_stats.json"

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
    def evaluation(self) -> Path:
        """`finetune eval`: held-out loss, perplexity and answer matches of the base model, this run and the
        runs compared with it (finetune.evaluate)."""
        return self.root / "evaluation.json"

    @property
    def marker(self) -> Path:
        return self.root / MARKER

    @property
    def lock_file(self) -> Path:
        return self.root / LOCK

    # -- what a run directory is --------------------------------------------------------------------
    def exists(self) -> bool:
        """Whether the folder holds a run (or a run's first file): a new run must not start in it."""
        return self.root.is_dir() and any(p.exists() for p in (self.status, self.metrics, self.recipe))

    def has_adapter(self) -> bool:
        """Whether a trained adapter or full model was saved (generate, chat and export need one)."""
        return (self.adapter / "adapter_config.json").is_file() or (self.adapter / "config.json").is_file()

    def lock(self, action: str, create: bool = False) -> RunLock:
        """Become the one process that writes this run directory (a run, a resume, an export), before
        anything is checked or written in it; refused at once, naming the holder's pid, while another holds
        it. `create` makes the folder first (a new run); else a missing or read-only folder is not locked
        (there is nothing a writer could share)."""
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                if create:
                    self.root.mkdir(parents=True, exist_ok=True)
                fd, made = self._open_lock_file()
            except OSError as exc:
                if create:
                    raise _cannot_create(self.root, exc) from None
                if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS):
                    return RunLock(None)
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = _holder(fd)
                    os.close(fd)
                    raise _in_use(self.root, holder, action) from None
                os.close(fd)
                time.sleep(0.02)
                continue
            if self._holds_lock_file(fd):
                break
            os.close(fd)  # the holder deleted the lock file as it ended (discard_untrained): open the new one
        try:  # who holds it, for the refusal a second process prints (best effort: a full disk may refuse)
            os.ftruncate(fd, 0)
            os.pwrite(fd, (HOLDER.format(pid=os.getpid(), action=action) + "\n").encode(), 0)
        except OSError:
            pass
        return RunLock(fd, made=self if made else None)

    def _open_lock_file(self) -> tuple[int, bool]:
        """(descriptor, whether this call created the file): a lock file made here is removed on release
        while the folder holds no run (RunLock)."""
        while True:
            try:
                return os.open(self.lock_file, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), True
            except FileExistsError:
                pass
            try:
                return os.open(self.lock_file, os.O_RDWR | os.O_CLOEXEC), False
            except FileNotFoundError:  # its holder deleted it as it ended: create it
                continue

    def _holds_lock_file(self, fd: int) -> bool:
        """Whether `fd` is still the file at lock_file's path (a lock on a deleted one keeps nobody out)."""
        try:
            return os.path.samestat(os.fstat(fd), os.stat(self.lock_file))
        except OSError:
            return False

    def locked_by(self) -> str | None:
        """Who holds the run directory ('pid 123 (finetune run)'), or None: the UI and the launcher refuse a
        start at once. A shared probe, dropped at once (lock() waits such probes out)."""
        try:
            fd = os.open(self.lock_file, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            return _holder(fd)
        finally:
            os.close(fd)

    def refuse_if_locked(self, action: str) -> None:
        """Raise the refusal lock() would give, without taking the lock (the process that will write starts
        later: the UI's queue, the launcher's torchrun)."""
        holder = self.locked_by()
        if holder is not None:
            raise _in_use(self.root, holder, action)

    def _empty(self) -> bool:
        """Whether the folder holds nothing but (maybe) the lock file."""
        return not any(p.name != LOCK for p in self.root.iterdir())

    def create(self) -> None:
        """Make the folder a run directory: marked only if the tool created it or found it empty (but for the
        lock file), so a folder that already held the user's files can never later be deleted by --overwrite."""
        try:
            if not self.root.exists() or self._empty():
                self.root.mkdir(parents=True, exist_ok=True)
                atomic_write_text(self.marker, "created by finetune; `finetune run --overwrite` may delete it\n")
        except OSError as exc:
            raise _cannot_create(self.root, exc) from None

    def remove(self) -> None:
        """--overwrite: delete the run directory's contents, only if it carries the marker and is no folder that
        holds the user's work (the working directory or a parent of it, home, /, a mount point). The folder and
        its lock file stay: the caller holds the lock (a new lock file would let a second process in). A folder
        that holds nothing else (the lock just made it) has nothing to delete."""
        if self._empty():
            return
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
        for path in target.iterdir():
            if path.name == LOCK:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()

    def discard_untrained(self) -> bool:
        """Delete a run directory in which nothing was trained (no step in status.json, no metrics row,
        checkpoint or adapter): a run that failed or was stopped before its first step leaves no folder that
        blocks the next `finetune run` or shows in the run, chat and resume lists. Only a folder the tool made
        (`remove`'s rules); returns whether it was deleted."""
        trained = self.metrics.is_file() and self.metrics.stat().st_size > 0 or self.has_adapter() \
            or self.checkpoints.is_dir() and any(self.checkpoints.iterdir()) or self.read_status().get("step", 0) > 0
        if trained or not self.marker.is_file():
            return False
        try:
            self.remove()
            (self.root / LOCK).unlink(missing_ok=True)  # the run is over: no writer left to keep out
            self.root.rmdir()
        except (FinetuneError, OSError):
            return False
        return True

    # -- writers (training) -------------------------------------------------------------------------
    def append_metrics(self, row: dict) -> None:
        _append_lines(self.metrics, [row])

    def append_completions(self, rows: list[dict]) -> None:
        _append_lines(self.completions, rows)

    def truncate_metrics(self, after_step: int) -> int:
        """On resume, drop rows logged after the checkpoint so each step appears once (and the lines that
        were no usable row: returns how many); the sampled completions likewise."""
        rows = self.read_metrics()
        _write_lines(self.metrics, [r for r in rows if r["step"] <= after_step])
        if self.completions.is_file():
            _write_lines(self.completions, [r for r in self.read_completions() if r["step"] <= after_step])
        return rows.skipped

    def write_status(self, state: str, **fields: Any) -> None:
        """Replace status.json atomically; on a full disk (no room for the temp copy) write over the existing
        file in place, whose blocks are already allocated, so how the run ended is still recorded."""
        data = {"state": state, "pid": os.getpid(), "updated": time.time(), **fields}
        text = json.dumps(data, indent=2, default=str) + "\n"
        try:
            atomic_write_text(self.status, text)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not overwrite_in_place(self.status, text):
                raise

    def log_line(self, text: str) -> None:
        with self.log.open("a") as f:
            f.write(time.strftime("%H:%M:%S ") + text + "\n")

    # -- readers (CLI, UI, benchmarks) --------------------------------------------------------------
    def read_status(self) -> dict[str, Any]:
        """The live status (state, step, max_steps, eta_s, pid, error); {} before the run wrote one. A field of
        the wrong type (a damaged file) is left out."""
        data = read_json(self.status) or {}
        return {k: v for k, v in data.items()
                if k not in STATUS_TYPES or (isinstance(v, STATUS_TYPES[k]) and not isinstance(v, bool))}

    def read_completions(self) -> Rows:
        """The sampled completions of a GRPO run (rows with an integer step), in order."""
        return read_jsonl(self.completions, lambda row: isinstance(row.get("step"), int)
                          and not isinstance(row.get("step"), bool))

    def read_metrics(self) -> Rows:
        """Every usable logged row (train and eval rows mixed, in order); `.skipped` counts damaged lines (a
        line still being written is skipped, not counted)."""
        return read_jsonl(self.metrics, metrics_row_usable)

    def read_recipe_text(self) -> str | None:
        """recipe.yaml as text for showing (bad bytes replaced), None while the run has none."""
        try:
            return self.recipe.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None

    def read_plan(self) -> dict[str, Any] | None:
        """The memory plan as saved by the run (Plan.to_json), or None without one."""
        return read_json(self.plan)

    def read_results(self) -> dict[str, Any] | None:
        """The end-of-run summary (state, steps, losses, data stats), or None before the run ended."""
        return read_json(self.results)

    def read_evaluation(self) -> dict[str, Any] | None:
        """The latest `finetune eval` results, or None before one ran."""
        return read_json(self.evaluation)

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log, lines)


def _cannot_create(root: Path, exc: OSError) -> FinetuneError:
    return FinetuneError(f"output.dir: cannot create the run directory {root}: {exc.strerror or exc}",
                         hint="choose a folder you can write to, e.g. --set output.dir=runs/NEW")


def find_runs(folder: Path, extra: Iterable[Path] = ()) -> list[Path]:
    """Run directories in `folder` and its subfolders (hidden ones skipped) plus those of `extra`, newest first."""
    found: set[Path] = {Path(p).resolve() for p in extra if RunDir(p).exists()}
    if folder.is_dir():
        for candidate in [*folder.iterdir(), *folder.glob("*/*")]:
            if not candidate.name.startswith(".") and RunDir(candidate).exists():
                found.add(candidate.resolve())
    return sorted(found, key=_last_written, reverse=True)


@dataclass(frozen=True)
class HeldRun:
    """A run directory a live process holds (RunDir.lock): its holder as written in the lock file, its pid and
    action ('finetune run', 'finetune export', ...) where the holder wrote them."""

    root: Path
    holder: str
    pid: int | None
    action: str | None


def held_runs(folders: Iterable[Path]) -> list[HeldRun]:
    """The run directories in `folders` (as find_runs finds them) that a process holds right now: what a
    run, a resume or an export leaves is a lock the kernel drops when it ends, so a held lock is a live
    process, whoever started it (the UI tells a terminal's `finetune run` by this)."""
    found = {p for folder in folders for p in find_runs(Path(folder))}
    pattern = re.escape(HOLDER).replace(r"\{pid\}", r"(\d+)").replace(r"\{action\}", "(.+)")
    out = []
    for root in sorted(found):
        holder = RunDir(root).locked_by()
        if holder is not None:
            parsed = re.fullmatch(pattern, holder)
            out.append(HeldRun(root, holder, int(parsed[1]) if parsed else None, parsed[2] if parsed else None))
    return out


def _last_written(path: Path) -> float:
    """The newest mtime of the run's files; a live run renames temporaries away meanwhile, so a file that is
    gone by the time it is looked at is passed over. The lock file is no run file: an export (which writes its
    pid there) does not make an old run the newest."""
    times = [path.stat().st_mtime]
    for f in path.iterdir():
        if f.name == LOCK:
            continue
        try:
            times.append(f.stat().st_mtime)
        except OSError:
            continue
    return max(times)


def _append_lines(path: Path, rows: list[dict]) -> None:
    """JSON lines appended and synced (a crash loses at most the line being written, which readers skip)."""
    with path.open("a") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))
        f.flush()
        os.fsync(f.fileno())


def _write_lines(path: Path, rows: list[dict]) -> None:
    """Replace a JSON-lines file atomically."""
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
