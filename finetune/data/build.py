"""The data pipeline: read -> sample -> detect format -> normalise -> render -> split -> tokenize -> fit -> pack.

Order matters for reproducibility: `max_samples` takes a seeded shuffle of the records in the file, the
validation split is a seeded split of the surviving records (never of tokens), and only then are examples
tokenized, cut or dropped for length (`overlong`), so the split does not depend on max_seq_len.

Malformed records (each problem names its file and line or record) stop the build with on_bad_record: error,
or are skipped and counted. So are records left with no loss token (no assistant turn, or an answer that
starts after max_seq_len): they would train on nothing. The stats name the first few of both.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from finetune.data.chat import IGNORE_INDEX, ChatEncoder, Encoded, encode_text, resolve_template
from finetune.data.formats import (
    FORMATS,
    Chat,
    Example,
    RecordError,
    detect_format,
    normalize,
    unicode_problem,
)
from finetune.data.read import Record, read_records
from finetune.errors import DataError
from finetune.recipe.schema import DataConfig

MAX_LISTED_PROBLEMS = 10
NAMED_IN_STATS = 3  # locations of skipped and no-loss records named in the data summary


@dataclass
class DataBundle:
    """What training needs from the data: datasets, a collator and counts for logs and the planner."""

    train: Any  # datasets.Dataset: input_ids, labels (+ position_ids when packed)
    eval: Any | None
    stats: dict[str, Any]
    collator: Callable[[list[dict[str, Any]]], dict[str, Any]]


@dataclass
class _Prepared:
    """A record ready to tokenize: rendered chat (text, loss spans) or raw text."""

    where: str
    chat: tuple[str, list[tuple[int, int]]] | None = None
    text: str | None = None


def build_datasets(cfg: DataConfig, tokenizer: Any, seed: int) -> DataBundle:
    """Read, check, tokenize, mask, split and optionally pack the dataset described by `cfg`."""
    read = read_records(cfg.path)
    fmt = _format(cfg, read.records)
    records = _sample(read.records, cfg.max_samples, seed)
    encoder = _encoder(cfg, tokenizer, fmt)
    prepared, problems = _prepare(records, fmt, cfg, encoder)
    problems = read.problems + problems
    if problems and cfg.on_bad_record == "error":
        _raise_bad(cfg.path, fmt, problems)
    if not prepared:
        raise DataError(f"{cfg.path}: no usable records ({len(problems)} malformed were skipped)",
                        problems=_listed(problems))
    train_part, eval_part = _split(cfg.path, prepared, cfg.validation_split, seed)
    dropped = _Dropped()
    train = _fit(train_part, _tokenize(train_part, tokenizer, encoder, cfg.max_seq_len), cfg, dropped)
    evaluation = _fit(eval_part, _tokenize(eval_part, tokenizer, encoder, cfg.max_seq_len), cfg, dropped)
    stats: dict[str, Any] = {
        "format": fmt, "records": len(read.records) + len(read.problems), "records_used": len(records),
        "bad_records_skipped": len(problems), "bad_records_at": [_where(p) for p in problems[:NAMED_IN_STATS]],
        "truncated": dropped.truncated, "dropped_overlong": len(dropped.overlong),
        "dropped_no_loss": len(dropped.no_loss), "no_loss_at": [_where(p) for p in dropped.no_loss[:NAMED_IN_STATS]],
    }
    if dropped.no_loss and cfg.on_bad_record == "error":
        raise DataError(f"{cfg.path}: {len(dropped.no_loss)} record(s) have no tokens to train on",
                        problems=_listed(dropped.no_loss),
                        hint="give them an answer within data.max_seq_len (or raise it), or set "
                             "data.on_bad_record: skip to drop and count them")
    if not train:
        raise DataError(
            f"{cfg.path}: no training examples left: {stats['dropped_overlong']} longer than data.max_seq_len="
            f"{cfg.max_seq_len} were dropped, {stats['dropped_no_loss']} had no tokens to train on",
            problems=_listed(dropped.no_loss + dropped.overlong),
            hint="raise data.max_seq_len, use data.overlong: truncate, or check that records have answers")
    stats.update(
        train_examples=len(train), eval_examples=len(evaluation),
        train_tokens=sum(len(ids) for ids, _ in train), eval_tokens=sum(len(ids) for ids, _ in evaluation),
        loss_tokens=sum(_loss_count(labels) for _, labels in train),
        max_example_tokens=max(len(ids) for ids, _ in train),
    )
    train_ds, eval_ds = _dataset(train, cfg), _dataset(evaluation, cfg) if evaluation else None
    stats.update(train_sequences=len(train_ds), eval_sequences=len(eval_ds) if eval_ds is not None else 0)
    from finetune.data.packing import make_collator  # imports TRL's trainer stack: only when building

    return DataBundle(train_ds, eval_ds, stats, make_collator(tokenizer, cfg.packing))


def preview(cfg: DataConfig, tokenizer: Any, n: int = 3) -> list[dict[str, Any]]:
    """The first n usable records as the model sees them: `tokens` is a list of (token text, has_loss).

    Each dict also has `where` (file and record/line) and `truncated` (cut to data.max_seq_len). Malformed
    records are skipped here whatever on_bad_record says, so the UI can show something.
    """
    read = read_records(cfg.path)
    fmt = _format(cfg, read.records)
    encoder = _encoder(cfg, tokenizer, fmt)
    out = []
    for record in read.records:
        prepared, _ = _prepare([record], fmt, cfg, encoder)
        if not prepared:
            continue
        (ids, labels), = _tokenize(prepared, tokenizer, encoder, cfg.max_seq_len)
        cut = len(ids) > cfg.max_seq_len
        ids, labels = ids[: cfg.max_seq_len], labels[: cfg.max_seq_len]
        tokens = [(tokenizer.decode([tok]), label != IGNORE_INDEX) for tok, label in zip(ids, labels, strict=True)]
        out.append({"where": record.where, "format": fmt, "tokens": tokens, "truncated": cut})
        if len(out) == n:
            break
    return out


def _format(cfg: DataConfig, records: Sequence[Record]) -> str:
    if cfg.format != "auto":
        return cfg.format
    try:
        return detect_format([r.value for r in records])
    except RecordError as exc:
        where = records[0].where if records else cfg.path
        raise DataError(f"{where}: {exc}", hint=f"or set data.format to one of {', '.join(FORMATS)}") from None


def _encoder(cfg: DataConfig, tokenizer: Any, fmt: str) -> ChatEncoder | None:
    if fmt == "text":
        return None
    return ChatEncoder(tokenizer, resolve_template(cfg.chat_template, tokenizer), cfg.assistant_only_loss)


def _sample(records: list[Record], max_samples: int | None, seed: int) -> list[Record]:
    """A seeded random subset of max_samples records, kept in file order."""
    if max_samples is None or max_samples >= len(records):
        return records
    keep = sorted(random.Random(f"{seed}:max_samples").sample(range(len(records)), max_samples))
    return [records[i] for i in keep]


def _prepare(records: Sequence[Record], fmt: str, cfg: DataConfig,
             encoder: ChatEncoder | None) -> tuple[list[_Prepared], list[str]]:
    prepared, problems = [], []
    for record in records:
        try:
            example: Example = normalize(record.value, fmt, cfg.system_prompt)
            if isinstance(example, Chat):
                assert encoder is not None
                item = _Prepared(record.where, chat=encoder.render(example))
            else:
                item = _Prepared(record.where, text=example)
            problem = unicode_problem(item.text if item.chat is None else item.chat[0])
            if problem:
                raise RecordError(problem)
            prepared.append(item)
        except RecordError as exc:
            problems.append(f"{record.where}: {exc}")
    return prepared, problems


def _raise_bad(path: str, fmt: str, problems: list[str]) -> None:
    raise DataError(f"{path}: {len(problems)} malformed record(s) for format {fmt}", problems=_listed(problems),
                    hint="fix them, or set data.on_bad_record: skip to skip and count them")


def _listed(problems: list[str]) -> list[str]:
    listed = problems[:MAX_LISTED_PROBLEMS]
    if len(problems) > len(listed):
        listed.append(f"... and {len(problems) - len(listed)} more")
    return listed


def _where(problem: str) -> str:
    """The location that starts a problem line (`data.jsonl:3: ...` -> `data.jsonl:3`)."""
    return problem.split(": ", 1)[0]


def _split(path: str, items: list[_Prepared], fraction: float, seed: int) -> tuple[list[_Prepared], list[_Prepared]]:
    """A seeded split of records; at least one eval record when fraction > 0, at least one train record."""
    if fraction == 0:
        return items, []
    n_eval = max(1, round(len(items) * fraction))
    if n_eval >= len(items):
        raise DataError(f"{path}: data.validation_split={fraction} leaves no training records out of {len(items)}",
                        hint="lower data.validation_split or add records")
    held = set(random.Random(f"{seed}:validation_split").sample(range(len(items)), n_eval))
    return ([x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held])


def _tokenize(items: list[_Prepared], tokenizer: Any, encoder: ChatEncoder | None, max_seq_len: int) -> list[Encoded]:
    if encoder is None:
        return encode_text(tokenizer, [x.text for x in items], max_seq_len)
    return encoder.encode([x.chat for x in items], max_seq_len)


def _loss_count(labels: list[int]) -> int:
    return sum(label != IGNORE_INDEX for label in labels)


@dataclass
class _Dropped:
    """What fitting to max_seq_len did: how many were cut, and a problem line per dropped record."""

    truncated: int = 0
    overlong: list[str] = field(default_factory=list)
    no_loss: list[str] = field(default_factory=list)


def _fit(items: list[_Prepared], examples: list[Encoded], cfg: DataConfig, dropped: _Dropped) -> list[Encoded]:
    """Apply data.overlong and drop examples without loss tokens, recording both in `dropped`."""
    kept = []
    for item, (ids, labels) in zip(items, examples, strict=True):
        cut = len(ids) > cfg.max_seq_len
        if cut and cfg.overlong == "drop":
            dropped.overlong.append(f"{item.where}: longer than data.max_seq_len={cfg.max_seq_len} tokens")
            continue
        ids, labels = ids[: cfg.max_seq_len], labels[: cfg.max_seq_len]
        if not _loss_count(labels):
            dropped.no_loss.append(f"{item.where}: " + (
                f"nothing to train on in its first data.max_seq_len={cfg.max_seq_len} tokens" if cut else
                "nothing to train on (no assistant turn with text)" if item.chat is not None else
                "too short to train on (one token)"))
            continue
        dropped.truncated += cut
        kept.append((ids, labels))
    return kept


def _dataset(examples: list[Encoded], cfg: DataConfig) -> Any:
    import datasets

    from finetune.data.packing import pack

    data = datasets.Dataset.from_dict({"input_ids": [ids for ids, _ in examples],
                                       "labels": [labels for _, labels in examples]})
    return pack(data, cfg.max_seq_len) if cfg.packing else data
