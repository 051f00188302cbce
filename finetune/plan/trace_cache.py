"""A disk cache of the planner's meta-device facts (step traces, parameter tables, model shapes).

Why: tracing a step on `meta` costs 0.1-2 s per model cut and setting, and a plan with every key on `auto`
needs a dozen; re-planning mid-run or on every UI change must take well under a second. The facts depend
only on the model config, the settings that change the trace and the code that runs it, so they are keyed
by all of those: the arguments, the torch / transformers / peft versions and a hash of finetune's own
source (a changed step, tracker or layer wrapper invalidates every entry).

More in docs/planner.md, "The trace cache (finetune/plan/trace_cache.py)".
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, TypeVar

import finetune
from finetune.rundir import atomic_write_text

T = TypeVar("T")
FORMAT = 1  # bump when the stored layout changes
MAX_ENTRIES = 4096  # ~5 KB each: at most ~20 MB of cache


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    """Library versions and a hash of finetune's source: what a cached trace depends on besides its key."""
    out = {}
    for name in ("torch", "transformers", "peft"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "none"
    digest = hashlib.sha256()
    root = Path(finetune.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    out["finetune"] = f"{finetune.__version__}+{digest.hexdigest()[:16]}"
    return out


def cache_folder() -> Path:
    """Where entries live (the project's cache dir; FINETUNE_CACHE overrides)."""
    from finetune.units import cache_dir

    return cache_dir() / "traces"


def entry_path(kind: str, key: Any) -> Path:
    """The file of the entry `kind` with `key` (any JSON-serialisable value) under the current versions."""
    text = json.dumps({"format": FORMAT, "kind": kind, "key": key, "versions": versions()}, sort_keys=True,
                      default=str)
    return cache_folder() / f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def _read(path: Path) -> Any:
    try:
        value = json.loads(path.read_text())["value"]
        os.utime(path)  # recently used: kept by _evict
        return value
    except (OSError, ValueError, KeyError, TypeError):
        return None


_room: dict[Path, int] = {}  # by folder: entries this process may still write before it scans it again


def _write(path: Path, value: Any) -> None:
    """Atomic (a reader sees all or nothing); a read-only or full cache folder only costs speed."""
    try:
        atomic_write_text(path, json.dumps({"value": value}))
        folder = path.parent
        room = _room.get(folder, 0) - 1  # a process's first write scans: it knows nothing of the folder yet
        if room < 0:
            room = MAX_ENTRIES - _evict(folder, MAX_ENTRIES, MAX_ENTRIES - MAX_ENTRIES // 8)
        _room[folder] = room
    except OSError:
        pass


def _evict(folder: Path, limit: int, keep: int) -> int:
    """Over `limit` entries: delete all but the `keep` most recently used (another process may delete one
    first). Returns how many entries are left."""
    entries = [e for e in os.scandir(folder) if e.name.endswith(".json") and e.is_file()]
    if len(entries) <= limit:
        return len(entries)
    entries.sort(key=lambda e: e.stat().st_mtime_ns, reverse=True)
    for entry in entries[keep:]:
        Path(entry.path).unlink(missing_ok=True)
    return keep


def cached(kind: str, key: Any, compute: Callable[[], T], encode: Callable[[T], Any],
           decode: Callable[[Any], T]) -> T:
    """`compute()` once per key and versions, then from disk. A stored value that does not decode is a miss."""
    path = entry_path(kind, key)
    stored = _read(path)
    if stored is not None:
        try:
            return decode(stored)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            pass
    value = compute()
    _write(path, encode(value))
    return value
