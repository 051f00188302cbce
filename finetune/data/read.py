"""Read dataset files into records that remember where they came from.

Supported inputs: a JSON file (an array of records, an object whose values are records, or an object with one
key holding the array, e.g. `{"data": [...]}`; a `.json` file holding JSON Lines is read as JSONL), a JSONL
file (one record a line; blank lines are ignored), CSV (a header row, every cell read as text), Parquet, or a
folder written by `datasets.Dataset.save_to_disk` (a `DatasetDict` must have a `train` split).

Every record carries `where`, a location for error messages: `data.jsonl:17` (1-based line number) for JSON
Lines and `data.json record 5` (0-based index, as in `records[5]`) for everything else. A JSON Lines line
that does not parse is returned as a problem, not raised, so that `on_bad_record: skip` can skip it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import DataError

SUFFIXES = (".json", ".jsonl", ".ndjson", ".csv", ".parquet")
_EXPECTED = "expected a .json, .jsonl, .csv or .parquet file, or a folder written by datasets' save_to_disk"


@dataclass(frozen=True)
class Record:
    """One raw record and where it is in its file."""

    where: str
    value: Any


@dataclass
class ReadResult:
    """Records in file order plus the locations of lines that could not be parsed at all."""

    records: list[Record]
    problems: list[str]


def read_records(path: str | Path) -> ReadResult:
    """Read every record of a dataset file or save_to_disk folder; raise DataError if it is not a dataset."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data.path {str(path)!r} does not exist", hint=_EXPECTED)
    if path.is_dir():
        result = _read_saved_dataset(path)
    else:
        suffix = path.suffix.lower()
        if suffix not in SUFFIXES:
            raise DataError(f"{path}: unsupported file type {suffix or '(no suffix)'!r}", hint=_EXPECTED)
        if path.stat().st_size == 0:
            raise DataError(f"{path} is empty", hint=_EXPECTED)
        reader = {".json": _read_json, ".jsonl": _read_jsonl, ".ndjson": _read_jsonl,
                  ".csv": _read_csv, ".parquet": _read_parquet}[suffix]
        result = reader(path)
    if not result.records and not result.problems:
        raise DataError(f"{path} contains no records", hint=_EXPECTED)
    return result


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        head = path.read_bytes()[:8]
        raise DataError(f"{path} is not a UTF-8 text file (it starts with bytes {head!r})", hint=_EXPECTED) from exc


def _read_json(path: Path) -> ReadResult:
    text = _text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # several JSON values: the file is JSON Lines with a .json name
            return _parse_jsonl(path, text)
        raise DataError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})",
                        hint="a .json dataset is an array of records, e.g. [{\"text\": \"...\"}]") from exc
    if isinstance(data, dict):
        values = list(data.values())
        if len(values) == 1 and isinstance(values[0], list):  # {"data": [...]} or {"train": [...]}
            key = next(iter(data))
            return ReadResult([Record(f"{path} {key}[{i}]", v) for i, v in enumerate(values[0])], [])
        if values and all(isinstance(v, dict) for v in values):  # {"id1": {...}, "id2": {...}}
            return ReadResult([Record(f"{path} record {k!r}", v) for k, v in data.items()], [])
    if not isinstance(data, list):
        raise DataError(
            f"{path}: the top-level JSON value is a {type(data).__name__}, not a list of records",
            hint="a .json dataset is an array of records such as [{\"instruction\": ..., \"output\": ...}], "
                 "or an object whose values are records")
    return ReadResult([Record(f"{path} record {i}", v) for i, v in enumerate(data)], [])


def _read_jsonl(path: Path) -> ReadResult:
    return _parse_jsonl(path, _text(path))


def _parse_jsonl(path: Path, text: str) -> ReadResult:
    records, problems = [], []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(Record(f"{path}:{lineno}", json.loads(line)))
        except json.JSONDecodeError as exc:
            problems.append(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                            "expected one JSON object per line")
    if not records and problems:
        listed = problems[:3] + ([f"... and {len(problems) - 3} more"] if len(problems) > 3 else [])
        raise DataError(f"{path} has no valid JSON Lines record", problems=listed, hint=_EXPECTED)
    return ReadResult(records, problems)


def _read_csv(path: Path) -> ReadResult:
    import pandas as pd

    _text(path)  # a clear error for binary files before pandas guesses
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise DataError(f"{path}: not a readable CSV file ({exc})", hint="CSV needs a header row naming the fields") from exc
    return ReadResult([Record(f"{path} record {i}", row) for i, row in enumerate(frame.to_dict("records"))], [])


def _read_parquet(path: Path) -> ReadResult:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path} is not a readable Parquet file ({exc})", hint=_EXPECTED) from exc
    return ReadResult([Record(f"{path} record {i}", row) for i, row in enumerate(rows)], [])


def _read_saved_dataset(path: Path) -> ReadResult:
    import datasets

    try:
        data = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise DataError(f"{path} is a folder but not one written by datasets' save_to_disk ({exc})",
                        hint=_EXPECTED) from exc
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise DataError(f"{path} holds splits {sorted(data)} but no 'train' split",
                            hint="save the training split, or a DatasetDict with a 'train' split")
        data = data["train"]
    return ReadResult([Record(f"{path} record {i}", row) for i, row in enumerate(data)], [])
