"""The UI's download folders (the recipe a page saves): one folder per server process, one subfolder per page
session. A session's folder goes when its page closes (gradio's unload event, `Downloads.forget`), the whole
folder when the server exits, and what a killed server left when the next one starts: each server holds an
flock on its folder's OWNER file while it lives, so a folder whose lock can be taken has no server left.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "finetune-ui-"
OWNER = ".owner"


class Downloads:
    """This server's download folder under `parent` (the system's temporary folder by default)."""

    def __init__(self, parent: Path | None = None) -> None:
        parent = Path(parent or tempfile.gettempdir())
        remove_stale(parent)
        self.root = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
        self._owner = _own(self.root)
        atexit.register(shutil.rmtree, self.root, True)

    def folder(self, session: str | None) -> Path:
        """The page session's own folder (made if new), so no session is handed another's file; without a
        session a fresh folder each time."""
        if not session:
            return Path(tempfile.mkdtemp(dir=self.root))
        folder = self._session_folder(session)
        folder.mkdir(exist_ok=True)
        return folder

    def forget(self, session: str | None) -> None:
        """The page closed: delete its folder (its files were downloaded or never will be)."""
        if session:
            shutil.rmtree(self._session_folder(session), ignore_errors=True)

    def _session_folder(self, session: str) -> Path:
        return self.root / hashlib.sha256(session.encode()).hexdigest()[:24]


def _own(root: Path) -> int:
    """Lock `root` for this process's lifetime: the lock file is locked under a temporary name and then
    renamed to OWNER, so a sweep never sees an OWNER that is not yet locked."""
    staged = root / f"{OWNER}.new"
    fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.replace(staged, root / OWNER)
    return fd


def remove_stale(parent: Path) -> list[Path]:
    """Delete the download folders under `parent` whose server is gone (their OWNER lock is free); a folder
    without an OWNER (one being made, or of another program) is left alone. Returns those deleted."""
    removed = []
    for folder in parent.glob(f"{PREFIX}*"):
        try:
            fd = os.open(folder / OWNER, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its server still runs (or the lock cannot be had): keep it
            continue
        else:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(fd)
    return removed
