"""The disk tier of activation offload: background writes, reverse-order read-ahead, no file left behind.
Also what every writer under memory.offload_dir shares (activations here, the weight store's files): the check
before writing (`check_offload_dir`), the names of finetune's files and the folders it makes (`OffloadFolder`),
and the removal of files a killed run left there (`reclaim_left_behind`).

Each offloaded activation becomes one file in `offload_dir`. Writes run on background threads behind a
bounded queue (the forward blocks only when the disk falls that far behind); reads are started ahead of
need during backward and delete the file as soon as its bytes are in memory. `DiskTier.drain` at the end of
a step removes every file of it (exceptions, Ctrl-C, a backward that never ran), after the threads have let
go.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import re
import shutil
import socket
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from finetune.console import console
from finetune.errors import FinetuneError
from finetune.memory.offload_cpu import STEP_ENDED, DeviceCopy, HostPool, Mover, byte_view, host_view
from finetune.units import format_bytes

if TYPE_CHECKING:
    from finetune.memory.offload_tier import TierSetup

# The names of finetune's files under an offload folder start with one of these, then the pid space the writer
# runs in (`pid_space`), its pid and a random tag (`OffloadFolder.prefix`): how a later run tells a killed run's
# files from a live one's and from the user's.
WEIGHTS_PREFIX, EXPERTS_PREFIX, ACTIVATIONS_PREFIX = "ft-weights-", "ft-experts-", "ft-act-"
_KINDS = "|".join(re.escape(p) for p in (WEIGHTS_PREFIX, EXPERTS_PREFIX, ACTIVATIONS_PREFIX))
_OURS = re.compile(rf"\.?(?:{_KINDS})([0-9a-f]{{8}})-(\d+)-[0-9a-f]{{8}}-(?:made(\d+)-)?")


@functools.cache
def pid_space() -> str:
    """8 hex digits naming the pids this process sees: its host's name and its pid namespace (a container has
    its own). Only files written in this same space are judged by their pid, so a live writer on another machine
    sharing the folder (NFS) or in another container mounting it is never taken for a dead one. Stable across
    reboots of one machine (its name and the first pid namespace stay), so a crashed run's files are still found."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # no /proc (macOS): the host's name alone
        namespace = ""
    return hashlib.sha1(f"{socket.gethostname()}|{namespace}".encode()).hexdigest()[:8]
CLOCK_SLACK_S = 2.0  # a process's start time (psutil) against a file's mtime: both clocks, ~1 s resolution
DISK_MARGIN = 0.10  # free space asked for on top of the predicted bytes
DISK_MARGIN_MIN = 256 << 20


OFFLOAD_DIR_HINT = ("Set memory.offload_dir to a folder on a disk with enough free space (ideally an NVMe "
                    "SSD), raise memory.offload_cpu_limit, or use memory.offload: cpu or none.")


class OffloadDirError(FinetuneError):
    """`memory.offload_dir` cannot hold the offloaded activations (or experts): the recipe's folder, exit 2."""

    exit_code = 2


def with_margin(nbytes: int) -> int:
    """The free space asked for to write `nbytes` there (the planner's check and the run's alike)."""
    return int(nbytes + max(DISK_MARGIN * nbytes, DISK_MARGIN_MIN))


def check_offload_dir(path: str | Path, needed_bytes: int, what: str = "of activations per step",
                      hint: str = OFFLOAD_DIR_HINT) -> Path:
    """Before training: `path` must be a writable directory (or one that can be made) with `needed_bytes`
    (`what`) plus a margin free.

    First removes what a killed run left there (`reclaim_left_behind`), so its room counts. Makes nothing: a
    missing folder is checked through its nearest existing parent, and made by the writer, which removes it
    again when it ends empty (`OffloadFolder`). Raises `OffloadDirError` saying which directory, how much is
    needed and free, and how to fix it.
    """
    path = Path(path).expanduser().absolute()
    reclaim_left_behind(path)
    try:
        existing = path
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise NotADirectoryError(0, f"{existing} is a file, not a folder")
        probe = existing / f".{OffloadFolder(existing, ACTIVATIONS_PREFIX).prefix}probe"
        probe.write_bytes(b"\0" * 4096)
        probe.unlink()
        free = shutil.disk_usage(existing).free
    except OSError as exc:
        raise OffloadDirError(f"memory.offload_dir {path} is not writable: {exc.strerror or exc}",
                              hint=hint) from None
    needed = with_margin(needed_bytes)
    if free < needed:
        raise OffloadDirError(
            f"memory.offload_dir {path} has {format_bytes(free)} free but disk offload needs "
            f"{format_bytes(needed)} ({format_bytes(needed_bytes)} {what} plus a margin)",
            hint=hint)
    return path


class OffloadFolder:
    """Where one writer (a weight store, the activations' disk tier) puts its files: their names' `prefix` (the
    kind's, this process's pid, a random tag, and `made<count>-` where it makes that many folders, so that after
    a kill `reclaim_left_behind` removes them too) and the folders it makes, removed again by `close` once
    empty."""

    def __init__(self, directory: Path, kind: str):
        self.directory = Path(directory)
        self.made = missing_folders(self.directory)
        made = f"made{len(self.made)}-" if self.made else ""
        self.prefix = f"{kind}{pid_space()}-{os.getpid()}-{uuid.uuid4().hex[:8]}-{made}"

    def make(self) -> None:
        """The folder, made where missing."""
        self.directory.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        """Remove the folders this made while they are empty (the writer removed its files)."""
        remove_empty(self.made)


def _owner_gone(pid: int, written: float) -> bool:
    """Whether the process that wrote a file at `written` (its mtime) has ended: no process `pid`, or one that
    started after the file was written (the pid reused)."""
    import psutil

    if pid == os.getpid():
        return False
    try:
        process = psutil.Process(pid)
        return process.status() == psutil.STATUS_ZOMBIE or process.create_time() > written + CLOCK_SLACK_S
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # e.g. another user's process we may not inspect: assume it lives
        return False


def left_behind(directory: str | Path) -> list[tuple[Path, int, int]]:
    """(path, bytes, owner pid) of finetune's files in `directory` whose writer has ended without removing them
    (killed: SIGKILL, the OOM killer); nothing else there (the user's files, a live run's) is listed."""
    try:
        entries = list(os.scandir(directory))
    except OSError:  # no such folder (yet), or one we may not read: nothing of ours to reclaim
        return []
    found = []
    for entry in entries:
        match = _OURS.match(entry.name)
        try:
            if match is None or match[1] != pid_space() or not entry.is_file(follow_symlinks=False):
                continue
            stat = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if _owner_gone(int(match[2]), stat.st_mtime):
            found.append((Path(entry.path), stat.st_size, int(match[2])))
    return found


def reclaim_left_behind(directory: str | Path) -> None:
    """Remove what killed runs left in `directory` (`left_behind`), and the folders they made there once empty;
    one line says what went. Called before writing there (`check_offload_dir`). A file that cannot be removed
    (another user's) stays, and the check that follows counts it as taken."""
    directory = Path(directory)
    removed = []
    for path, size, pid in left_behind(directory):
        try:
            path.unlink()
        except OSError:  # gone already (another run reclaiming), or not ours to remove
            continue
        removed.append((path, size, pid))
    if not removed:
        return
    made = max(int(_OURS.match(path.name)[3] or 0) for path, _, _ in removed)  # the folders their writers made
    remove_empty([directory, *directory.parents][:made])
    freed, pids = sum(size for _, size, _ in removed), sorted({pid for _, _, pid in removed})
    owners = f"a run that ended without cleaning up (pid {pids[0]})" if len(pids) == 1 else \
        f"runs that ended without cleaning up (pids {', '.join(map(str, pids))})"
    console.print(f"offload: removed {len(removed)} file{'s' * (len(removed) != 1)} ({format_bytes(freed)}) left "
                  f"in {directory} by {owners}", markup=False, highlight=False)


def missing_folders(path: Path) -> list[Path]:
    """The folders of `path` that do not exist yet, deepest first: what a writer that makes them removes again
    (`OffloadFolder`), so an offload folder the recipe named but nothing had made is not left behind."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_empty(folders: list[Path]) -> None:
    """Remove `folders` (deepest first) while each is empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def write_tensor_file(path: Path, data: torch.Tensor) -> None:
    view = memoryview(byte_view(data).numpy())
    with open(path, "wb", buffering=0) as f:
        done = 0
        while done < len(view):
            done += f.write(view[done:])


def read_tensor_file(path: Path, into: torch.Tensor) -> None:
    view = memoryview(byte_view(into).numpy())
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise OSError(f"activation offload file {path} is truncated")
            done += n


class DiskFile:
    """One activation on disk: written in the background, read back ahead of need, then deleted.

    After the read the bytes stay in host memory (the device copy is made from them) until autograd drops
    the handle, which it does right after use unless the graph is retained for another backward.
    """

    def __init__(self, tier: DiskTier, tensor: torch.Tensor, layout: torch.Tensor, nbytes: int):
        self.tier = tier
        self.layout = layout
        self.nbytes = nbytes
        self.path = tier.new_path()
        self._read: Future | None = None
        self._host: torch.Tensor | None = None
        self._released = False
        self._staging = self._buffer = None
        mover = tier.mover
        self.device = DeviceCopy(mover) if mover is not None else None
        if mover is not None:  # stage through a pinned buffer, the copy ordered by an event
            self._staging = tier.pool.acquire(nbytes)
            source = host_view(self._staging, layout)
            event = self._staged = mover.to_host(tensor, source)
        else:
            # Write straight from the activation when it is exactly its storage, else from a dense copy
            # (a view would drag its whole base along).
            event = None
            owns = (tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == nbytes
                    and tensor.stride() == layout.stride())
            source = tensor if owns else host_view(torch.empty(nbytes, dtype=torch.uint8), layout).copy_(tensor)
        self._write = tier.submit_write(nbytes, self._do_write, source, event)

    def _do_write(self, source: torch.Tensor, event: Any) -> None:
        if event is not None:
            self.tier.mover.wait_host(event)
        write_tensor_file(self.path, source)
        if self._staging is not None:
            self.tier.pool.release(self._staging)
            self._staging = None

    def fetch(self) -> None:
        """Start reading the file back (read-ahead); the destination is allocated by the caller's thread."""
        if self._read is not None or self._host is not None or self._released:
            return
        pool = self.tier.pool
        buffer = pool.acquire(self.nbytes) if pool is not None else torch.empty(self.nbytes, dtype=torch.uint8)
        self._buffer = buffer
        self._read = self.tier.submit_read(self._do_read, buffer)

    def _do_read(self, buffer: torch.Tensor) -> torch.Tensor:
        self._write.result()
        read_tensor_file(self.path, buffer[:self.nbytes])
        self.tier.remove(self.path, read=self.nbytes)
        host = host_view(buffer, self.layout)
        if self.device is not None:
            self.device.start(host)  # the device copy overlaps with the compute thread too
        return host

    def get(self) -> torch.Tensor:
        if self._released:
            raise RuntimeError(STEP_ENDED)
        if self._host is None:
            self.fetch()
            try:
                self._host = self._read.result()
            except OSError as exc:  # e.g. the disk filled up after the preflight check
                raise OffloadDirError(f"activation offload to {self.tier.directory} failed: {exc}",
                                      hint=OFFLOAD_DIR_HINT) from exc
            self._read = None
        return self._host if self.device is None else self.device.get(self._host)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        pool = self.tier.pool
        if pool is not None:  # hand pinned buffers back once the copies touching them are done
            if self._host is not None:
                pool.release(self._buffer, self.device.event)
            elif self._read is not None:
                self._read.add_done_callback(lambda _: pool.release(self._buffer, self.device.event))
        self._host = None
        if self._write.cancel():
            self.tier.end_write(self.nbytes)
            if self._staging is not None:
                pool.release(self._staging, self._staged)
        self.tier.forget(self)


class DiskTier:
    """The `disk` offload tier (an `OffloadTier`): files under `setup.directory`, two writer and two reader
    threads, at most `max_pending` unwritten bytes (always at least one tensor)."""

    def __init__(self, setup: TierSetup, max_pending: int = 256 << 20, threads: int = 2):
        if setup.directory is None:
            raise ValueError("activation offload to disk needs an offload_dir")
        self.folder = OffloadFolder(Path(setup.directory), ACTIVATIONS_PREFIX)  # its folders removed by close() once empty
        self.directory = self.folder.directory
        self.mover: Mover | None = setup.mover
        self.pool = HostPool(self.mover) if self.mover is not None else None
        self._writers = ThreadPoolExecutor(threads, thread_name_prefix="ft-offload-write")
        self._readers = ThreadPoolExecutor(threads, thread_name_prefix="ft-offload-read")
        self.max_pending = max_pending
        self._pending = 0
        self._written = threading.Condition()
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._live: set[DiskFile] = set()
        self._reading: set[DiskFile] = set()  # released while a read-ahead may still run
        self._paths: set[Path] = set()
        self.bytes_written = 0
        self.bytes_read = 0

    def new_path(self) -> Path:
        path = self.directory / f"{self.folder.prefix}{next(self._counter)}.bin"
        with self._lock:
            self._paths.add(path)
        return path

    def store(self, tensor: torch.Tensor, layout: torch.Tensor, nbytes: int) -> DiskFile:
        self.folder.make()
        with self._written:  # the bounded queue: wait while too many bytes are still to be written
            self._written.wait_for(lambda: self._pending == 0 or self._pending + nbytes <= self.max_pending)
            self._pending += nbytes
        try:
            item = DiskFile(self, tensor, layout, nbytes)
        except BaseException:
            self.end_write(nbytes)
            raise
        with self._lock:
            self._live.add(item)
            self.bytes_written += nbytes
        return item

    def submit_write(self, nbytes: int, fn, *args) -> Future:
        """Run fn(*args) on a writer thread; its `nbytes` leave the bounded queue when it ends."""
        def run():
            try:
                fn(*args)
            finally:
                self.end_write(nbytes)
        return self._writers.submit(run)

    def end_write(self, nbytes: int) -> None:
        with self._written:
            self._pending -= nbytes
            self._written.notify_all()

    def _wait_writes(self) -> None:
        """Block until every submitted write has finished or been cancelled."""
        with self._written:
            self._written.wait_for(lambda: self._pending == 0)

    def submit_read(self, fn, *args) -> Future:
        return self._readers.submit(fn, *args)

    def remove(self, path: Path, read: int = 0) -> None:
        path.unlink(missing_ok=True)
        with self._lock:
            self._paths.discard(path)
            self.bytes_read += read

    def forget(self, item: DiskFile) -> None:
        """`item` was released: delete its file now if no thread can still touch it, else at `drain`."""
        with self._lock:
            self._live.discard(item)
            if item._read is not None:
                self._reading.add(item)
        # A file whose write is still running is removed by drain (or by its reader), not here.
        if item._write.done():
            self.remove(item.path)

    def drain(self) -> None:
        """Wait for every write, and for the reads of released files; delete every file no live copy needs.

        Mid-step this only waits (live copies keep their files); at the end of a step (normal or not, every
        copy released) the directory is left as found.
        """
        # Wait for every write, also of items released while still writing: a path deleted before its
        # writer created the file would leave that file behind.
        self._wait_writes()
        with self._lock:
            reading, self._reading = self._reading, set()
        for item in reading:
            item._read.cancel() or item._read.exception()
        with self._lock:
            needed = {item.path for item in self._live}
            stale = [path for path in self._paths if path not in needed]
        for path in stale:
            self.remove(path)

    def close(self) -> None:
        """End of training: release what is still held, delete every file, stop the threads."""
        with self._lock:
            live = list(self._live)
        for item in live:
            item.release()
        self.drain()
        self._writers.shutdown(wait=True, cancel_futures=True)
        self._readers.shutdown(wait=True, cancel_futures=True)
        self.folder.close()
