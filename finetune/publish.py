"""Publish a folder or a file all at once: written beside the target under a temporary name, swapped in complete.

An export of a real model is gigabytes and minutes of work, so a stop must neither leave the half-written copy
behind for good nor lose the earlier export. `publishing(target)` yields a temporary path
`.NAME.tmp-PID-RANDOM` in the target's folder; when the block ends normally the earlier target is renamed
aside to `.NAME.old-PID-NS`, the new one renamed in, and the old one deleted. SIGTERM and SIGINT during the
block stop it with `Interrupted` (a one-line `FinetuneError`, exit code 128 + signal), after the temporaries
are removed and the earlier target is back in place. A process killed outright (SIGKILL, power loss) leaves
its temporaries under names that carry its process id: the next `publishing` of the same target (or
`recover`) removes those of dead processes and, when the target is missing, renames the old one back.

Test switch: FINETUNE_FAULT_PAUSE=POINT stops the process at `pause_point(POINT)` (it prints "paused at
POINT" on stderr and sleeps), so a test can signal it there; POINT `publish:swap` is between the two renames.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from finetune.errors import FinetuneError

PAUSE_ENV = "FINETUNE_FAULT_PAUSE"


class Interrupted(FinetuneError):
    """A publish stopped by SIGTERM/SIGINT, its temporaries removed."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class _Signalled(BaseException):
    """Raised by the signal handler: a BaseException, so no library's `except Exception` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def pause_point(point: str) -> None:
    """FINETUNE_FAULT_PAUSE=POINT (tests): announce the point on stderr and wait here to be signalled."""
    if os.environ.get(PAUSE_ENV) == point:
        print(f"paused at {point}", file=sys.stderr, flush=True)
        while True:
            time.sleep(1)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _leftovers(target: Path) -> Iterator[tuple[str, int, Path]]:
    """("tmp" | "old", process id, path) of every temporary of `target` in its folder."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(tmp|old)-(\d+)-[0-9a-f]+")
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return
    for path in entries:
        match = pattern.fullmatch(path.name)
        if match:
            yield match.group(1), int(match.group(2)), path


def recover(target: Path, pid: int | None = None) -> None:
    """Settle what an ended publish of `target` left: its half-written copy is deleted; its earlier target is
    renamed back when the target is missing (a stop between the two renames), else deleted. Without `pid`,
    the leftovers of every process that is no longer running; with it, only that process's."""
    for kind, owner, path in sorted(_leftovers(target), key=lambda item: item[0]):  # "old" before "tmp"
        settled = owner == pid if pid is not None else not _alive(owner)
        if not settled:
            continue
        if kind == "old" and not os.path.lexists(target):
            os.rename(path, target)
        else:
            _remove(path)


def swap_in(new: Path, target: Path) -> None:
    """Rename the complete `new` to `target`; an earlier target is moved aside first and deleted after, so
    at every moment one of them is whole (`recover` renames it back if a kill came between the renames)."""
    old = target.with_name(f".{target.name}.old-{os.getpid()}-{time.time_ns():x}")
    try:
        if os.path.lexists(target):
            os.rename(target, old)
        pause_point("publish:swap")
        os.rename(new, target)
    except BaseException:
        if os.path.lexists(old) and not os.path.lexists(target):
            os.rename(old, target)
        raise
    _remove(old)


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM/SIGINT raise `_Signalled` once in the main thread (a second one while cleaning is ignored)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = []

    def handle(signum, frame):
        if not raised:
            raised.append(signum)
            raise _Signalled(signum)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def publishing(target: str | Path, *, folder: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `target` (an empty folder, or a file name to write when folder=False)
    and swap it in when the block ends normally. On any error or SIGTERM/SIGINT the temporary is removed and
    the earlier target, if any, stays; the leftovers of earlier publishes killed outright are settled first."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    with _signals_raise():
        new = None  # the written copy's inode: a rename keeps it, so it tells whether the swap happened
        try:
            try:
                if folder:
                    tmp.mkdir()
                yield tmp
                new = os.lstat(tmp).st_ino
                swap_in(tmp, target)
            finally:
                recover(target, os.getpid())
        except _Signalled as stop:
            recover(target, os.getpid())  # a signal may have cut the first one short
            if new is not None and os.path.lexists(target) and os.lstat(target).st_ino == new:
                state = f"the new {target} is complete"
            else:
                state = f"the unfinished copy was removed, {target} is as it was"
            raise Interrupted(f"stopped by {signal.Signals(stop.signum).name}: {state}", stop.signum) from None
