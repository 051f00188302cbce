"""What the builds of every data kind share (`finetune.data.build` for sequences, pairs and labelled examples,
`finetune.data.prompts` for prompts): the bundle training takes, the seeded sample and validation split, and
the refusal of malformed records with its short list of them."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from finetune.data.formats import Example
from finetune.data.mix import FileRead, is_mix
from finetune.data.read import Record
from finetune.errors import DataError
from finetune.recipe.schema import DataConfig

MAX_LISTED_PROBLEMS = 10


class Placed(Protocol):
    """An item prepared from a record: where the record is (file index in data.path, location)."""

    where: str
    file: int


P = TypeVar("P", bound=Placed)


@dataclass
class DataBundle:
    """What training needs from the data: datasets, a collator and counts for logs and the planner."""

    train: Any  # datasets.Dataset: input_ids, labels (+ position_ids when packed; preference: finetune.data.build)
    eval: Any | None
    stats: dict[str, Any]
    collator: Callable[[list[dict[str, Any]]], dict[str, Any]]
    fingerprint: dict[str, Any] = field(default_factory=dict)  # what decides the examples (finetune.data.fingerprint); --resume compares it
    warnings: list[str] = field(default_factory=list)  # records left out, one line each kind, for the run log
    # the records data.validation_split held out, each once with its normalised example, in the data's order:
    # what `finetune eval` without --data matches answers on
    held_out: list[tuple[Record, Example]] = field(default_factory=list)

    def summary(self) -> str:
        """The counts people read first, in one short line: records read (format), examples kept, examples
        cut to fit, records dropped (malformed, overlong, nothing to train on) and tokens to train on; `stats`
        holds them all (the run directory's data_stats.json)."""
        s = self.stats
        kept = s.get("train_examples", s.get("train_prompts", 0)) + s.get("eval_examples", s.get("eval_prompts", 0))
        dropped = s.get("bad_records_skipped", 0) + s.get("dropped_overlong", 0) + s.get("dropped_no_loss", 0)
        tokens = f", {s['train_tokens']:,} tokens to train on" if "train_tokens" in s else ""
        tokens += f" ({s['images']:,} images in {s['image_records']:,} records)" if "images" in s else ""
        return (f"{s['records']:,} {s['format']} records: {kept:,} kept, {s.get('truncated', 0):,} cut, {dropped:,} "
                f"dropped{tokens}")


def _sample(records: list[Record], max_samples: int | None, seed: int) -> list[Record]:
    """A seeded random subset of max_samples records, kept in file order."""
    if max_samples is None or max_samples >= len(records):
        return records
    keep = sorted(random.Random(f"{seed}:max_samples").sample(range(len(records)), max_samples))
    return [records[i] for i in keep]


def checked(cfg: DataConfig, files: list[FileRead], formats: list[str], fmt: str,
            bad: list[list[str]]) -> dict[str, Any]:
    """`check_records`' answer from each file's problem lines (`bad`, by file), after refusing what
    on_bad_record refuses."""
    problems = [p for lines in bad for p in lines]
    records = sum(f.read.total for f in files)
    _refuse_bad(cfg, fmt, problems, records - len(problems))
    out: dict[str, Any] = {"format": fmt, "records": records, "bad_records": len(problems)}
    if is_mix(cfg):
        out["files"] = [{"path": f.entry.path, "format": file_format, "records": f.read.total, "bad_records": len(lines)}
                        for f, file_format, lines in zip(files, formats, bad, strict=True)]
    return out


def _refuse_bad(cfg: DataConfig, fmt: str, problems: list[str], usable: int) -> None:
    """Stop on malformed records (on_bad_record: error), and when no record is usable."""
    if problems and cfg.on_bad_record == "error":
        raise DataError(f"{cfg.label()}: {len(problems)} malformed record(s) for format {fmt}",
                        problems=_listed(problems),
                        hint="fix them, or set data.on_bad_record: skip to skip and count them")
    if not usable:
        raise DataError(f"{cfg.label()}: no usable records ({len(problems)} malformed were skipped)",
                        problems=_listed(problems))


def _listed(problems: list[str]) -> list[str]:
    listed = problems[:MAX_LISTED_PROBLEMS]
    if len(problems) > len(listed):
        listed.append(f"... and {len(problems) - len(listed)} more")
    return listed


def _split(path: str, items: list[P], fraction: float, seed: int) -> tuple[list[P], list[P]]:
    """A seeded split of records; at least one eval record when fraction > 0, at least one train record. The
    copies of a record a mix repeats (`records:` over the file's size; same file and place) fall on one side, so
    no held-out example is also trained on."""
    if fraction == 0:
        return items, []
    records = list(dict.fromkeys((x.file, x.where) for x in items))  # distinct records, in order
    n_eval = max(1, round(len(records) * fraction))
    if n_eval >= len(records):
        raise DataError(f"{path}: data.validation_split={fraction} leaves no training records out of {len(records)}",
                        hint="lower data.validation_split or add records")
    held = {records[i] for i in random.Random(f"{seed}:validation_split").sample(range(len(records)), n_eval)}
    return ([x for x in items if (x.file, x.where) not in held], [x for x in items if (x.file, x.where) in held])
