"""Read dataset files into records that remember where they came from.

Supported inputs: a JSON file (an array of records, an object whose values are records, or an object with one
key holding the array, e.g. `{"data": [...]}`; a `.json` file holding JSON Lines is read as JSONL), a JSONL
file (one record a line; blank lines are ignored), CSV (a header row, every cell read as text), Parquet, or a
folder written by `datasets.Dataset.save_to_disk` (a `DatasetDict` must have a `train` split; its `Image`
columns are read as their stored `{"bytes", "path"}`, not decoded).

More in docs/training.md, "Reading record files (finetune/data/read.py)".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import DataError, RecipeError

SUFFIXES = (".json", ".jsonl", ".ndjson", ".csv", ".parquet")
_BINARY_PROBE = 1024  # a NUL byte in the first line of the first KiB marks a binary file
_LONGEST_INT = 4301  # digits: one more than Python's default int-str conversion limit
_DEEPEST = 200  # nesting a record never needs; deeper JSON is where the reader's recursion limit is hit
_EXPECTED = "expected a .json, .jsonl, .csv or .parquet file, or a folder written by datasets' save_to_disk"


@dataclass(frozen=True)
class Record:
    """One raw record and where it is in its file."""

    where: str
    value: Any
    file: int = 0  # the index of its file in data.path when that is a list (finetune.data.mix)


@dataclass
class ReadResult:
    """Records in file order plus the locations of lines that could not be parsed at all."""

    records: list[Record]
    problems: list[str]

    @property
    def total(self) -> int:
        """The records as the file counts them: those read and the lines that did not parse."""
        return len(self.records) + len(self.problems)


def read_records(path: str | Path, key: str = "data.path") -> ReadResult:
    """Read every record of a dataset file or save_to_disk folder; raise DataError if it is not a dataset.
    `key`: the recipe key that names the file (`data.path[1]` in a list), for the message when it is missing."""
    path = Path(path)
    if not path.exists():
        raise RecipeError(f"{key} {str(path)!r} does not exist", hint=_EXPECTED)  # the recipe's mistake: exit 2
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
    if not result.records:
        listed = result.problems[:3] + ([f"... and {len(result.problems) - 3} more"] if len(result.problems) > 3 else [])
        raise DataError(f"{path} has no readable record", problems=listed, hint=_EXPECTED)
    return result


def _text(path: Path) -> str:
    """The file's text; bytes that are not UTF-8 become lone surrogates (reported per record), BOM removed."""
    data = path.read_bytes()
    head = data[:_BINARY_PROBE]
    try:
        head[:4].decode("utf-8")
        binary = b"\x00" in head.split(b"\n", 1)[0]  # UTF-16, most binary formats; a later NUL is a line's
    except UnicodeDecodeError as exc:
        binary = exc.reason != "unexpected end of data"  # not a character cut by the 4-byte probe
    if binary:
        raise DataError(f"{path}:1: not a UTF-8 text file (it starts with bytes {data[:8]!r})",
                        hint=f"save it as UTF-8 text; {_EXPECTED}")
    return data.decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")


def loads_json(text: str) -> Any:
    """json.loads, with values Python cannot hold (a 5,000-digit number, nesting past the recursion limit)
    raised as UnparsableJSON instead of a ValueError or RecursionError from deep inside."""
    try:
        return json.loads(text)
    except RecursionError:
        raise UnparsableJSON("nested too deeply to read (lists or objects inside each other hundreds of levels deep)"
                          ) from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # an integer literal over sys.get_int_max_str_digits() digits
        raise UnparsableJSON(f"a number too long to read ({str(exc).split(':')[0]})") from None


class UnparsableJSON(ValueError):
    """Valid JSON syntax that Python cannot turn into values."""


_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]|[\]}]|\n|\d{' + str(_LONGEST_INT) + ',}')


def _line_of(text: str) -> int:
    """The 1-based line of the first too-long number or of the first bracket nested past the reader's limit."""
    depth, line = 0, 1
    for match in _JSON_TOKENS.finditer(text):
        token = match.group()
        if token == "\n":
            line += 1
        elif token in "[{":
            depth += 1
            if depth > _DEEPEST:
                return line
        elif token in "]}":
            depth -= 1
        elif token[0] != '"':
            return line
    return line


def _read_json(path: Path) -> ReadResult:
    text = _text(path)
    try:
        data = loads_json(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # several JSON values: the file is JSON Lines with a .json name
            return _parse_jsonl(path, text)
        raise DataError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})",
                        hint="a .json dataset is an array of records, e.g. [{\"text\": \"...\"}]") from exc
    except UnparsableJSON as exc:
        raise DataError(f"{path}:{_line_of(text)}: {exc}",
                        hint="fix that value, or store the dataset as JSON Lines to skip such records "
                             "with data.on_bad_record: skip") from None
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
            records.append(Record(f"{path}:{lineno}", loads_json(line)))
        except json.JSONDecodeError as exc:
            problems.append(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                            "expected one JSON object per line")
        except UnparsableJSON as exc:
            problems.append(f"{path}:{lineno}: {exc}")
    return ReadResult(records, problems)


def _read_csv(path: Path) -> ReadResult:
    """CSV with a header row, every cell text; a row with the wrong number of cells is a problem of its line.

    Python's csv module, not pandas: pandas re-encodes the text and so cannot carry a bad byte to its record.
    """
    import csv
    import io

    csv.field_size_limit(2**31 - 1)  # the default 128 KiB limit refuses long answers
    reader = csv.reader(io.StringIO(_text(path), newline=""))
    records, problems = [], []
    try:
        header = next(reader, None)
        if header is not None and len(set(header)) < len(header):
            twice = sorted({name for name in header if header.count(name) > 1})
            raise DataError(f"{path}:1: the header row names column(s) {twice} more than once",
                            hint="CSV needs a header row naming each field once")
        rows = (row for row in reader if any(cell.strip() for cell in row))  # blank lines are not records
        for i, row in enumerate(rows):
            if len(row) != len(header):
                problems.append(f"{path} record {i} (line {reader.line_num}): {len(row)} cells where the header "
                                f"has {len(header)}")
            else:
                records.append(Record(f"{path} record {i}", dict(zip(header, row, strict=True))))
    except csv.Error as exc:
        raise DataError(f"{path}:{reader.line_num}: not a readable CSV file ({exc})",
                        hint="CSV needs a header row naming the fields") from exc
    return ReadResult(records, problems)


def _read_parquet(path: Path) -> ReadResult:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise DataError(f"{path} is not a readable Parquet file ({exc})", hint=_EXPECTED) from exc
    return ReadResult([Record(f"{path} record {i}", row) for i, row in enumerate(rows)], [])


def _holds_images(feature: Any) -> bool:
    """Whether a datasets feature (or a dict or list of them) has an Image feature in it."""
    import datasets

    if isinstance(feature, datasets.Image):
        return True
    if isinstance(feature, dict):
        return any(_holds_images(f) for f in feature.values())
    if isinstance(feature, (list, tuple)):
        return any(_holds_images(f) for f in feature)
    inner = getattr(feature, "feature", None)  # List, Sequence, LargeList
    return inner is not None and _holds_images(inner)


def _read_saved_dataset(path: Path) -> ReadResult:
    """Rows of a save_to_disk folder; a damaged folder (missing or cut shard, bad JSON metadata) is named."""
    import datasets
    import pyarrow as pa

    damaged = (OSError, ValueError, TypeError, LookupError, pa.ArrowException)  # what datasets lets through
    try:
        data = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise DataError(f"{path} is a folder but not one written by datasets' save_to_disk, or one with files "
                        f"missing ({exc})",
                        hint=_EXPECTED) from exc
    except damaged as exc:
        raise DataError(f"{path}: a damaged save_to_disk folder ({type(exc).__name__}: {exc})",
                        hint="save the dataset again, or export it to JSONL or Parquet") from exc
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise DataError(f"{path} holds splits {sorted(data)} but no 'train' split",
                            hint="save the training split, or a DatasetDict with a 'train' split")
        data = data["train"]
    records = []
    try:  # images as their stored {"bytes", "path"}, not decoded: the data build checks and reads them
        for i, row in enumerate(data.data.to_pylist() if _holds_images(data.features) else data):
            records.append(Record(f"{path} record {i}", row))
    except damaged as exc:
        raise DataError(f"{path} record {len(records)}: cannot be read from this save_to_disk folder "
                        f"({type(exc).__name__}: {exc})",
                        hint="save the dataset again, or export it to JSONL or Parquet") from exc
    return ReadResult(records, [])
