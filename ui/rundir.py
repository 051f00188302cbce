"""Read a run directory the core writes (status.json, metrics.jsonl, plan.json, train.log, recipe.yaml).

Everything the UI shows about a run comes from these files, never from state held in the page, so a
reloaded browser or a restarted UI shows the same live state.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

RUN_FILES = ("status.json", "metrics.jsonl", "recipe.yaml")


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file's object, or None while it is missing or half-written."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every complete line of metrics.jsonl (a line still being written is skipped)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
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


def read_status(run_dir: Path) -> dict[str, Any]:
    return read_json(run_dir / "status.json") or {}


def read_plan(run_dir: Path) -> dict[str, Any] | None:
    return read_json(run_dir / "plan.json")


def tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a text file ('' if missing); reads at most the last 64 KiB."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - 65536))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return last_lines(text, lines)


def last_lines(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in RUN_FILES)


def find_run_dirs(runs_dir: Path, extra: Iterable[Path] = ()) -> list[Path]:
    """Run directories under `runs_dir` (two levels deep) plus `extra`, newest first."""
    found: set[Path] = {p.resolve() for p in extra if is_run_dir(p)}
    if runs_dir.is_dir():
        for candidate in [*runs_dir.iterdir(), *runs_dir.glob("*/*")]:
            if not candidate.name.startswith(".") and is_run_dir(candidate):
                found.add(candidate.resolve())
    return sorted(found, key=_mtime, reverse=True)


def _mtime(path: Path) -> float:
    return max((f.stat().st_mtime for f in path.iterdir() if f.is_file()), default=path.stat().st_mtime)


def last_value(rows: list[dict[str, Any]], key: str) -> Any:
    """The most recent logged value of `key` (metrics rows mix train and eval lines)."""
    for row in reversed(rows):
        if row.get(key) is not None:
            return row[key]
    return None


def summary(run_dir: Path) -> dict[str, Any]:
    """One row of the run history: state, progress and final metrics."""
    status = read_status(run_dir)
    rows = read_metrics(run_dir)
    peaks = [r["peak_memory_bytes"] for r in rows if r.get("peak_memory_bytes")]
    return {
        "run": str(run_dir),
        "state": status.get("state", "unknown"),
        "step": status.get("step", last_value(rows, "step")),
        "max_steps": status.get("max_steps"),
        "loss": last_value(rows, "loss"),
        "eval_loss": last_value(rows, "eval_loss"),
        "tokens_per_second": last_value(rows, "tokens_per_second"),
        "peak_memory_bytes": max(peaks) if peaks else None,
    }
