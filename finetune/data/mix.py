"""Several data files as one dataset: data.path as a list, each file read on its own and mixed by the seed.

More in docs/training.md, "How the mix is made (finetune/data/mix.py)".
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections import Counter
from dataclasses import dataclass

from finetune.data.read import ReadResult, Record, read_records
from finetune.errors import RecipeError
from finetune.recipe.schema import MAX_REPEAT, DataConfig, DataFile


@dataclass
class FileRead:
    """One file of the data: its recipe key (`data.path[1]`), its entry and the records as read."""

    key: str
    entry: DataFile
    read: ReadResult


def read_files(cfg: DataConfig) -> list[FileRead]:
    """Every file of `cfg` read, in recipe order; a missing or unreadable one is named by its recipe key, and
    RecipeError for a file listed twice or a `records:` over MAX_REPEAT times what its file holds."""
    files = [FileRead(key, entry, read_records(entry.path, key))
             for key, entry in zip(cfg.file_keys(), cfg.files(), strict=True)]
    seen: dict[tuple[int, int], FileRead] = {}
    for f in files:
        stat = os.stat(f.entry.path)
        first = seen.setdefault((stat.st_dev, stat.st_ino), f)
        if first is not f:
            raise RecipeError(f"{f.key} ({f.entry.path}) is the same file as {first.key} ({first.entry.path}), "
                              "so its records would be mixed in twice",
                              hint=f"list it once, with {first.key}.records or .weight to take more of it")
        held = len(f.read.records)
        if f.entry.records is not None and f.entry.records > MAX_REPEAT * held:
            raise RecipeError(f"{f.key}.records: {f.entry.records:,} is over {MAX_REPEAT} times the {held:,} "
                              f"records {f.entry.path} holds (each copy is held in memory)",
                              hint=f"ask for at most {MAX_REPEAT * held:,}, or train more epochs "
                                   "(training.epochs) to see the records more often")
    return files


def data_folders(cfg: DataConfig) -> list[str]:
    """The folder of each file (a save_to_disk folder's parent), where its records' relative image paths
    are read from."""
    return [os.path.dirname(os.path.abspath(entry.path)) for entry in cfg.files()]


def is_mix(cfg: DataConfig) -> bool:
    """Whether data.path is a list (mixed and shuffled), not one path read as it is."""
    return not isinstance(cfg.path, str)


def amounts(files: list[FileRead]) -> list[int]:
    """How many records each file gives the mix (see the module docstring)."""
    held = [len(f.read.records) for f in files]
    out = [f.entry.records if f.entry.records is not None else n for f, n in zip(files, held, strict=True)]
    weighted = [i for i, f in enumerate(files) if f.entry.weight is not None]
    if weighted:  # shares relative to the largest weight: no sum of weights to overflow
        top = max(files[i].entry.weight for i in weighted)
        share = {i: files[i].entry.weight / top for i in weighted}
        # the largest weighted part that repeats no record (a share that underflows to 0 takes 1 record)
        size = min(held[i] / share[i] for i in weighted if share[i] > 0)
        for i in weighted:
            out[i] = min(held[i], max(1, round(size * share[i])))
    return out


def _take(records: list[Record], n: int, rng: random.Random) -> list[Record]:
    """n records of one file: whole copies while n exceeds it, then a seeded sample in file order."""
    whole, rest = divmod(n, len(records))
    picked = sorted(rng.sample(range(len(records)), rest))
    return records * whole + [records[i] for i in picked]


def mixed_records(cfg: DataConfig, files: list[FileRead], seed: int) -> list[Record]:
    """The records training reads, each tagged with its file's index: one plain path's records as they are;
    a list's taken per `amounts` and shuffled together by the seed."""
    if not is_mix(cfg):
        return files[0].read.records
    out: list[Record] = []
    for i, (f, n) in enumerate(zip(files, amounts(files), strict=True)):
        taken = _take(f.read.records, n, random.Random(f"{seed}:mix:{i}"))
        out += [dataclasses.replace(r, file=i) for r in taken]
    random.Random(f"{seed}:mix").shuffle(out)
    return out


def repeated(files: list[FileRead]) -> list[str]:
    """One warning line per file whose records are repeated to reach its `records:` count."""
    return [f"{f.entry.path}: its {len(f.read.records)} records repeated to make {n} ({f.key}.records)"
            for f, n in zip(files, amounts(files), strict=True) if n > len(f.read.records)]


def file_stats(files: list[FileRead], formats: list[str], used: list[Record], kept: list[int],
               left_out: Counter[int]) -> list[dict[str, object]]:
    """`DataBundle.stats["files"]`, one entry per file: path, format, records (as read, lines that did not
    parse included), used (taken into the mix, repeats counted, after data.max_samples), kept (examples built
    from them, by file index in `kept`) and dropped (`left_out`: malformed, too long, nothing to train on)."""
    taken = Counter(r.file for r in used)
    made = Counter(kept)
    return [{"path": f.entry.path, "format": fmt, "records": f.read.total,
             "used": taken[i], "kept": made[i], "dropped": left_out[i]}
            for i, (f, fmt) in enumerate(zip(files, formats, strict=True))]
