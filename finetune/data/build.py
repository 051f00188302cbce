"""The data pipeline: read -> sample -> detect format -> normalise -> render -> split -> tokenize -> fit -> pack.

Order matters for reproducibility: `max_samples` takes a seeded shuffle of the records in the file, the
validation split is a seeded split of the surviving records (never of tokens), and only then are examples
tokenized, cut or dropped for length (`overlong`), so the split does not depend on max_seq_len.

Why one module of ~650 lines: it runs the pipeline's stages in the order above over the same records and
counts; each stage's rules are modules of their own (formats, chat, fit, packing, mix).

More in docs/training.md, "Building the datasets (finetune/data/build.py)".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from finetune.data.bundle import DataBundle, _listed, _refuse_bad, _sample, _split, checked
from finetune.data.chat import IGNORE_INDEX, ChatEncoder, Encoded, encode_text, resolve_template
from finetune.data.fingerprint import data_fingerprint, images_identity, records_digest
from finetune.data.fit import Source, cut_prompt
from finetune.data.formats import (
    FORMATS,
    PAIR_FORMATS,
    PREFERENCE_FORMATS,
    Chat,
    Example,
    Preference,
    RecordError,
    content_text,
    detect_format,
    images_of,
    normalize,
    unicode_problem,
)
from finetune.data.images import check_images, image_size
from finetune.data.mix import FileRead, data_folders, file_stats, is_mix, mixed_records, read_files, repeated
from finetune.data.prompts import build_prompts, check_prompt_records
from finetune.data.read import Record
from finetune.data.shape import DataShape
from finetune.data.vision import VisionData
from finetune.errors import DataError
from finetune.recipe.methods import METHODS, method_spec
from finetune.recipe.schema import MIN_IMAGE_PIXELS, DataConfig

# a vision-language model's image tokens for one record's image sizes at a pixel budget (None: the model's own)
TokenCounter = Callable[[list[tuple[int, int]], int | None], int]
NAMED_IN_STATS = 3  # locations of skipped, no-loss and overlong records named in the data summary


@dataclass
class _Prepared:
    """A record ready to tokenize: rendered chat (text, loss spans) or raw text; a preference record has a
    second rendered chat (`rejected`) or a `label` (kto). `source`: the conversations rendered, for cutting
    the prompt of an overlong record."""

    where: str
    file: int = 0  # its file's index in data.path (a list); 0 for one file
    chat: tuple[str, list[tuple[int, int]]] | None = None
    text: str | None = None
    rejected: tuple[str, list[tuple[int, int]]] | None = None
    label: bool | None = None
    source: Source | None = None
    images: list[str] = field(default_factory=list)  # the record's images (absolute paths), in order
    origin: tuple[Record, Example] | None = None  # the record and its normalised example


Sequences = list[Encoded]  # an example's sequences: one, or chosen and rejected


def data_kind(method: str) -> str:
    """What examples a training method needs (its registry entry, finetune/recipe/methods.py): sft (sequences),
    pair (chosen + rejected), kto (labelled), prompt (prompts the model answers)."""
    return method_spec(method).data_kind


def evaluable_split(cfg: DataConfig, method: str) -> bool:
    """Whether the run holds records out (data.validation_split) that `finetune eval` can measure without
    --data: records with answers to score (sft data) or preference pairs (dpo, orpo, simpo, cpo); kto's labelled
    answers and a prompt-only method's prompts are not."""
    return cfg.validation_split > 0 and data_kind(method) in ("sft", "pair")


def build_datasets(cfg: DataConfig, tokenizer: Any, seed: int, method: str = "sft",
                   max_prompt_tokens: int | None = None, vision: VisionData | None = None,
                   read: DataRead | None = None, held_out_only: bool = False) -> DataBundle:
    """Read, check, tokenize, mask, split and optionally pack the dataset described by `cfg`, for training
    method `method` (sft, or a preference method: dpo, orpo, simpo, cpo, kto); grpo: prompt-only records of at most
    `max_prompt_tokens` tokens (finetune.data.prompts). `vision`: a vision-language model's image processor
    (records with images then train; without it they are bad records: the model reads only text). `read`: the
    data as an earlier step read it (`data_read`; the plan's `data_shape`, eval's `check_records` and
    `built_fingerprint`), whose records, rendering, split and tokens are taken over where they are this build's.
    `held_out_only`: the records data.validation_split holds out alone (`finetune eval` of a run's split): the
    training part is split off but neither tokenized nor built (an empty `train`, its counts 0)."""
    if data_kind(method) == "prompt":
        return build_prompts(cfg, tokenizer, seed, max_prompt_tokens)
    takes_images = vision is not None
    built = _read(cfg, tokenizer, seed, method, read)
    files, formats, fmt, records, encoder, fingerprint = (built.files, built.formats, built.fmt, built.records,
                                                          built.encoder, built.fingerprint)
    prepared, problems, train_part, eval_part = _prepared_split(built, cfg, seed, method, takes_images)
    _add_images(fingerprint, prepared)
    prepared_from = Counter(p.file for p in prepared)
    dropped = _Dropped()
    train = [] if held_out_only else \
        _fit(train_part, _expand(train_part, _part_tokens(built, takes_images, "train", train_part, tokenizer,
                                                          cfg.max_seq_len), vision), cfg, encoder, dropped, vision,
             built.cuts)
    evaluation = _fit(eval_part, _expand(eval_part, _part_tokens(built, takes_images, "eval", eval_part, tokenizer,
                                                                 cfg.max_seq_len), vision), cfg, encoder, dropped, vision,
                      built.cuts)
    problems = problems + dropped.bad  # image records too long for max_seq_len (refused in _check_dropped under error)
    stats: dict[str, Any] = {
        "format": fmt, "records": sum(f.read.total for f in files), "records_used": len(records),
        "bad_records_skipped": len(problems), "bad_records_at": [_where(p) for p in problems[:NAMED_IN_STATS]],
        "truncated": dropped.truncated, "prompts_cut": dropped.prompts_cut,
        "dropped_overlong": len(dropped.overlong), "overlong_at": [_where(p) for p in dropped.overlong[:NAMED_IN_STATS]],
        "dropped_no_loss": len(dropped.no_loss), "no_loss_at": [_where(p) for p in dropped.no_loss[:NAMED_IN_STATS]],
    }
    if is_mix(cfg):  # per file: read, taken into the mix, examples kept, left out (malformed, overlong, no loss)
        left_out = Counter(r.file for r in records) - prepared_from  # malformed
        stats["files"] = file_stats(files, formats, records, [item.file for item, _ in train + evaluation],
                                    left_out + dropped.by_file)
    _count_images(stats, [(item.file, len(item.images)) for item, _ in train + evaluation])
    _check_dropped(cfg, dropped)
    if not train and not held_out_only:
        raise DataError(
            f"{cfg.label()}: no training examples left: {stats['dropped_overlong']} longer than data.max_seq_len="
            f"{cfg.max_seq_len} were dropped, {stats['dropped_no_loss']} had no tokens to train on",
            problems=_listed(dropped.no_loss + dropped.overlong),
            hint="raise data.max_seq_len, use data.overlong: truncate, or check that records have answers")
    stats.update(
        train_examples=len(train), eval_examples=len(evaluation),
        train_tokens=_tokens(train), eval_tokens=_tokens(evaluation),
        loss_tokens=sum(_loss_count(labels) for _, parts in train for _, labels in parts),
        max_example_tokens=max((len(ids) for _, parts in train for ids, _ in parts), default=0),
    )
    kind = data_kind(method)
    train_ds = _dataset(train, cfg, kind)
    eval_ds = _dataset(evaluation, cfg, kind) if evaluation else None
    stats.update(train_sequences=len(train_ds), eval_sequences=len(eval_ds) if eval_ds is not None else 0)
    from finetune.data.packing import make_collator  # imports TRL's trainer stack: only when building

    collator = make_collator(tokenizer, cfg.packing, kind)
    if vision is not None:
        collator = vision.collator(collator, 2 if kind == "pair" else 1)
    held_out = {(p.file, p.where): p.origin for p in eval_part if p.origin is not None}  # a repeated record once
    return DataBundle(train_ds, eval_ds, stats, collator, fingerprint,
                      repeated(files) + _warnings(cfg, len(problems) - len(dropped.bad), dropped),
                      list(held_out.values()))


_Split = tuple[list[_Prepared], list[str], list[_Prepared], list[_Prepared]]  # prepared, problems, train, eval


@dataclass
class _Read:
    """The data as read for one build: the files, their formats, the records the mix and max_samples take, the
    chat encoder, the fingerprint of what decides the examples (and its records' part, `digest`), and what the
    build made of them so far, kept for the next step that builds the same examples (`DataRead`)."""

    files: list[FileRead]
    formats: list[str]
    fmt: str
    records: list[Record]
    encoder: ChatEncoder | None
    fingerprint: dict[str, Any]
    digest: dict[str, Any]
    splits: dict[bool, _Split] = field(default_factory=dict)  # _prepared_split's, by model_takes_images
    tokens: dict[tuple[bool, str], list[Sequences]] = field(default_factory=dict)  # _part_tokens', by split and part
    # _fit's prompt cuts, by the id of the split's item (the split keeps the items, so the ids stay theirs)
    cuts: dict[int, Sequences | None] = field(default_factory=dict)


@dataclass
class DataRead:
    """The data files as read once for one command: each file parsed and its format (what `check_records`
    checks), and (`built`) what a build made of them for a tokenizer: the records taken, rendered, split and
    tokenized, each kept as it is made. Handed from one step of a command to the next (the plan's `data_shape`
    to the run's `build_datasets`; eval's `check_records`, `built_fingerprint` and build), so that the data is
    read, rendered and tokenized once; a step whose examples would differ (another data config, seed or
    tokenizer definition: its fingerprint says) makes its own."""

    cfg: DataConfig
    method: str
    files: list[FileRead]
    formats: list[str]
    fmt: str
    built: _Read | None = None


def data_read(cfg: DataConfig, method: str = "sft") -> DataRead:
    """Every file of `cfg` read, each file's format found and checked against `method` (not for prompt-only
    data: finetune.data.prompts reads that); raises the DataError the build would."""
    files = read_files(cfg)
    formats, fmt = _formats(cfg, files, method)
    return DataRead(cfg, method, files, formats, fmt)


def data_read_as(cfg: DataConfig, method_for: Callable[[str], str]) -> DataRead:
    """`data_read` for data whose method follows its format (`method_for`: the data's format -> the method it
    is read and checked for): `finetune eval --data` of a preference run measures pairs as pairs and
    conversations as sft records."""
    files = read_files(cfg)
    formats, fmt = _formats(cfg, files, method_for(_formats(cfg, files, None)[1]))
    return DataRead(cfg, method_for(fmt), files, formats, fmt)


def _read_as(cfg: DataConfig) -> dict[str, Any]:
    """What decides which files are read, and their records taken, rendered and split: the data config less
    data.max_pixels (images are expanded after) and data.batching (the order of the steps only)."""
    return cfg.model_dump(exclude={"max_pixels", "batching"})


def _files_of(cfg: DataConfig, method: str, given: DataRead | None) -> DataRead:
    """`given` where it read these files for this method, else the files read now."""
    if given is not None and given.method == method and _read_as(given.cfg) == _read_as(cfg):
        return given
    return data_read(cfg, method)


def _examples_key(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint less what does not change the examples before their images are expanded: the tokenizer's
    name (its definition is kept), data.max_pixels and the images' hash (added once the records are rendered)."""
    settings = {k: v for k, v in fingerprint["settings"].items() if k != "data.max_pixels"}
    return {**{k: v for k, v in fingerprint.items() if k != "images_sha256"},
            "tokenizer": fingerprint["tokenizer"]["sha256"], "settings": settings}


def _read(cfg: DataConfig, tokenizer: Any, seed: int, method: str, given: DataRead | None = None) -> _Read:
    """The data read for this build: `given`'s files, and what it built, where its examples are this build's
    (the same fingerprint but for `_examples_key`'s leave-outs), the fingerprint always this build's."""
    files = _files_of(cfg, method, given)
    reads = [f.read for f in files.files]
    encoder = _encoder(cfg, tokenizer, files.formats[0])
    template = encoder.template if encoder else None
    built = files.built
    digest = built.digest if built is not None else records_digest(cfg, reads)  # of the files alone
    fingerprint = data_fingerprint(cfg, reads, files.fmt, tokenizer, template, seed, method, digest)
    if built is not None and _examples_key(fingerprint) == _examples_key(built.fingerprint):
        return dataclasses.replace(built, encoder=encoder, fingerprint=fingerprint)
    records = _sample(mixed_records(cfg, files.files, seed), cfg.max_samples, seed)
    files.built = _Read(files.files, files.formats, files.fmt, records, encoder, fingerprint, digest)
    return files.built


def _prepared_split(read: _Read, cfg: DataConfig, seed: int, method: str, model_takes_images: bool) -> _Split:
    """The records rendered (malformed ones refused or counted as on_bad_record says), the problem lines, and
    the seeded train and held-out parts (kto on pairs: split by record, then unpaired); made once per read."""
    if model_takes_images in read.splits:
        return read.splits[model_takes_images]
    prepared, problems = _prepare(read.records, read.formats, cfg, read.encoder, model_takes_images)
    _check_packing(cfg, prepared)
    problems = [p for f in read.files for p in f.read.problems] + problems
    _refuse_bad(cfg, read.fmt, problems, len(prepared))
    train_part, eval_part = _split(cfg.label(), prepared, cfg.validation_split, seed)
    if data_kind(method) == "kto" and read.formats[0] in PAIR_FORMATS:
        train_part, eval_part = _unpair(train_part), _unpair(eval_part)
    read.splits[model_takes_images] = prepared, problems, train_part, eval_part
    return read.splits[model_takes_images]


def _part_tokens(read: _Read, model_takes_images: bool, part: str, items: list[_Prepared], tokenizer: Any,
                 max_seq_len: int) -> list[Sequences]:
    """The sequences of a part of the split (`part`: train or eval, its `items`), their images not expanded: a
    text record's first max_seq_len + 1 tokens (enough to cut or drop it), an image record's whole (cut, or
    not, once its image tokens are known); tokenized once per read."""
    key = (model_takes_images, part)
    if key not in read.tokens:
        out: list[Sequences] = [[] for _ in items]
        for whole in (False, True):
            at = [i for i, x in enumerate(items) if bool(x.images) == whole]
            for i, parts in zip(at, _tokenize([items[i] for i in at], tokenizer, read.encoder,
                                              _WHOLE if whole else max_seq_len), strict=True):
                out[i] = parts
        read.tokens[key] = out
    return read.tokens[key]


def _expand(items: list[_Prepared], examples: list[Sequences], vision: VisionData | None) -> list[Sequences]:
    """Each image record's image tokens expanded (`vision`); text records as they are."""
    if vision is None:
        return examples
    return [[vision.expand(e, x.images) for e in parts] if x.images else parts
            for x, parts in zip(items, examples, strict=True)]


def _add_images(fingerprint: dict[str, Any], prepared: list[_Prepared]) -> None:
    """The records' images in the fingerprint, where they have any (text-only data's is as it always was)."""
    if any(p.images for p in prepared):
        fingerprint["images_sha256"] = images_identity([path for p in prepared for path in p.images])


def built_fingerprint(cfg: DataConfig, tokenizer: Any, seed: int, method: str = "sft",
                      model_takes_images: bool = False, read: DataRead | None = None) -> dict[str, Any]:
    """The fingerprint `build_datasets` gives this data (finetune.data.fingerprint), from the records read and
    rendered, not tokenized: in seconds, before a model loads (`finetune eval` compares a run's with it). `read`:
    the files as already read (`data_read`), which keeps the rendered records for the build."""
    built = _read(cfg, tokenizer, seed, method, read)
    prepared, *_ = _prepared_split(built, cfg, seed, method, model_takes_images)
    _add_images(built.fingerprint, prepared)
    return built.fingerprint


SHAPE_CACHE_VERSION = 2


def data_shape(cfg: DataConfig, tokenizer: Any, seed: int, method: str = "sft", model_takes_images: bool = False,
               cache: Path | None = None, read: DataRead | None = None) -> DataShape:
    """Every training example's length as `build_datasets` makes it (the same read, sample, split, tokenize and
    fit to max_seq_len; an image record's text tokens and image sizes, its images not expanded: that needs the
    pixel budget the plan chooses), without building the datasets: what the memory plan sizes its batches by.
    Cached in `cache` (a folder) under the data fingerprint, so planning the same data again does not
    tokenize it again. `read` (`data_read`) keeps what this read and tokenized, for `build_datasets` to take
    over (`finetune run`: the plan's data is the run's). Raises the DataError the build would (malformed records under on_bad_record: error, no
    example left); prompt-only data (grpo) has no shape here: ValueError."""
    if data_kind(method) == "prompt":
        raise ValueError("prompt-only data: the plan sizes its sequences from the generation settings")
    built = _read(cfg, tokenizer, seed, method, read)
    key = hashlib.sha256(json.dumps([SHAPE_CACHE_VERSION, _examples_key(built.fingerprint), model_takes_images],
                                    sort_keys=True, default=str).encode()).hexdigest()
    file = cache / f"{key}.json" if cache is not None else None
    if file is not None and file.is_file():
        try:
            return DataShape.from_json(file.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged entry: measured again and rewritten
    _, _, train_part, _ = _prepared_split(built, cfg, seed, method, model_takes_images)
    tokens = _part_tokens(built, model_takes_images, "train", train_part, tokenizer, cfg.max_seq_len)
    text = [(x, parts) for x, parts in zip(train_part, tokens, strict=True) if not x.images]
    fitted = {id(x): parts for x, parts in
              _fit([x for x, _ in text], [parts for _, parts in text], cfg, built.encoder, _Dropped(), cuts=built.cuts)}
    # in the run's order (the plan pairs examples into micro-batches as the run does); an image record whole:
    # cut (or not) once the image tokens are known
    examples = [(max(len(ids) for ids, _ in parts), tuple(image_size(path) for path in item.images))
                for item, parts in ((x, parts if x.images else fitted.get(id(x)))
                                    for x, parts in zip(train_part, tokens, strict=True))
                if parts is not None]
    with_images = any(x.images for x in train_part)
    if not examples:
        raise DataError(f"{cfg.label()}: no training examples left after fitting them to data.max_seq_len="
                        f"{cfg.max_seq_len}", hint="raise data.max_seq_len, or use data.overlong: truncate")
    shape = DataShape(tuple(n for n, _ in examples), tuple(s for _, s in examples) if with_images else ())
    if file is not None:
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_name(f"{file.name}.tmp{os.getpid()}")
            tmp.write_text(shape.to_json())
            tmp.replace(file)
        except OSError:
            pass  # a read-only cache: measured again next time
    return shape


def _count_images(stats: dict[str, Any], counts: Sequence[tuple[int, int]]) -> None:
    """Add the image counts of the records kept (`counts`: file index, images of one record) to `stats` as
    `images` and `image_records` (per file in `files`), when any record has images (text-only data keeps the
    stats it always had)."""
    if not any(n for _, n in counts):
        return
    for target, part in ([(stats, counts)] + [(entry, [c for c in counts if c[0] == i])
                                              for i, entry in enumerate(stats.get("files", []))]):
        target.update(images=sum(n for _, n in part), image_records=sum(n > 0 for _, n in part))


def _check_packing(cfg: DataConfig, prepared: list[_Prepared]) -> None:
    """Records with images train as whole sequences (no packing)."""
    first = next((p for p in prepared if p.images), None)
    if first is not None and cfg.packing:
        raise DataError(f"{first.where}: the record has images, and data.packing joins records into one sequence, "
                        "which a vision-language model's image positions do not allow", hint="set data.packing: false")


def _check_dropped(cfg: DataConfig, dropped: _Dropped) -> None:
    """Refuse what the user asked to be refused: overlong records (overlong: error), records without an
    answer (on_bad_record: error)."""
    if dropped.overlong and cfg.overlong == "error":
        raise DataError(f"{cfg.label()}: {len(dropped.overlong)} record(s) are longer than data.max_seq_len="
                        f"{cfg.max_seq_len} tokens", problems=_listed(dropped.overlong),
                        hint="raise data.max_seq_len, or set data.overlong: truncate (cut their prompts) or drop")
    if dropped.bad and cfg.on_bad_record == "error":
        raise DataError(f"{cfg.label()}: {len(dropped.bad)} record(s) have images whose tokens do not fit in "
                        f"data.max_seq_len={cfg.max_seq_len}", problems=_listed(dropped.bad),
                        hint="raise data.max_seq_len or lower data.max_pixels, or set data.on_bad_record: skip to "
                             "skip and count them")
    if dropped.no_loss and cfg.on_bad_record == "error":
        raise DataError(f"{cfg.label()}: {len(dropped.no_loss)} record(s) have no tokens to train on",
                        problems=_listed(dropped.no_loss),
                        hint="give them an answer, or set data.on_bad_record: skip to drop and count them")


def _warnings(cfg: DataConfig, bad: int, dropped: _Dropped) -> list[str]:
    """One line per kind of record left out: how many, and where the first few are."""
    def line(problems: list[str], what: str) -> list[str]:
        if not problems:
            return []
        first = ", ".join(_where(p) for p in problems[:NAMED_IN_STATS])
        return [f"{len(problems)} record(s) {what} (first: {first})"]

    fix = "raise data.max_seq_len to keep them"
    overlong = (f"dropped: longer than data.max_seq_len={cfg.max_seq_len} (data.overlong: drop; {fix})"
                if cfg.overlong == "drop" else
                f"dropped: no answer token fits in data.max_seq_len={cfg.max_seq_len} even with the prompt cut ({fix})")
    images = (f"skipped: their image tokens do not fit in data.max_seq_len={cfg.max_seq_len} (raise it, or lower "
              "data.max_pixels)")
    return ([f"{bad} malformed record(s) skipped (data.on_bad_record: skip)"] if bad else []) + \
        line(dropped.bad, images) + line(dropped.overlong, overlong) + line(dropped.no_loss, "dropped: nothing to train on")


# Formats whose records become the same kind of example, and so can be mixed in one dataset.
_KINDS = {"text": "plain text", "preference": "chosen/rejected pairs", "sharegpt_preference": "chosen/rejected pairs",
          "kto": "labelled answers"}  # every other format: conversations


def _formats(cfg: DataConfig, files: list[FileRead], method: str | None) -> tuple[list[str], str]:
    """Each file's format (data.format, else detected per file), checked against `method` (None: not checked,
    the preview's) and against each other (conversations mix with conversations, text with text, pairs with
    pairs), and the data's format as the stats and fingerprint name it: the one format, or the files' formats
    joined with `+`."""
    formats = [_format(cfg, f) for f in files]
    for f, fmt in zip(files, formats, strict=True):
        if method is not None:
            _check_method(f.entry.path, fmt, method)
    kinds = [_KINDS.get(fmt, "conversations") for fmt in formats]
    if len(set(kinds)) > 1:
        other = next(i for i, k in enumerate(kinds) if k != kinds[0])
        raise DataError(f"{files[0].key} ({files[0].entry.path}) holds {kinds[0]} ({formats[0]}) but "
                        f"{files[other].key} ({files[other].entry.path}) holds {kinds[other]} ({formats[other]}): "
                        "they cannot be mixed in one dataset",
                        hint="mix conversation formats (alpaca, messages, sharegpt) with each other, text with text, "
                             "preference pairs with pairs; convert one file, or train on them in separate runs")
    return formats, "+".join(dict.fromkeys(formats))


def _check_method(path: str, fmt: str, method: str) -> None:
    """Preference methods need preference data (pair methods: pairs; kto: labelled answers, or pairs)."""
    kind = data_kind(method)
    if kind == "sft" and fmt in PREFERENCE_FORMATS:
        raise DataError(f"{path}: the records are preference data (format {fmt}), but training.method is sft",
                        hint=f"set training.method to one of {', '.join(m.name for m in METHODS if m.preference)} "
                             "to train on them")
    if kind != "sft" and fmt not in PREFERENCE_FORMATS:
        raise DataError(f"{path}: training.method {method} needs preference data, but the records are {fmt}",
                        hint=f"give records with prompt/chosen/rejected{' or prompt/completion/label' if kind == 'kto' else ''}"
                             " (see data.format in docs/recipe.md), or set training.method: sft")
    if kind == "pair" and fmt not in PAIR_FORMATS:
        raise DataError(f"{path}: training.method {method} needs chosen/rejected pairs, but the records are "
                        f"{fmt} (one answer with a label)", hint="use training.method: kto for labelled answers")


def _unpair(items: list[_Prepared]) -> list[_Prepared]:
    """A pair as two kto examples: the chosen answer good, the rejected one bad."""
    return [_Prepared(p.where, p.file, chat=chat, label=good, source=[source], images=p.images, origin=p.origin)
            for p in items
            for chat, good, source in ((p.chat, True, p.source[0]), (p.rejected, False, p.source[1]))]


def _tokens(fitted: list[tuple[_Prepared, Sequences]]) -> int:
    return sum(len(ids) for _, parts in fitted for ids, _ in parts)


def preview(cfg: DataConfig, tokenizer: Any, n: int = 3, model_takes_images: bool = False) -> list[dict[str, Any]]:
    """The first n usable records as the model sees them: `tokens` is a list of (token text, has_loss).

    Each dict also has `where` (file and record/line) and `truncated` (cut to data.max_seq_len). Preference
    pairs add `rejected_tokens` (the rejected sequence; `tokens` is the chosen one), kto records `label`.
    Malformed records are skipped here whatever on_bad_record says, so the UI can show something. Several
    files: one record of each file in turn (the first of every file, then the second, ...), each in its file's
    format. Image records show (as `images`, their paths) where `model_takes_images`, else are skipped.
    """
    files = read_files(cfg)
    formats, _ = _formats(cfg, files, None)
    encoder = _encoder(cfg, tokenizer, formats[0])
    pending = [_shown(f.read.records, i, formats, cfg, tokenizer, encoder, model_takes_images)
               for i, f in enumerate(files)]
    out: list[dict[str, Any]] = []
    while pending and len(out) < n:
        for file in list(pending):
            item = next(file, None)
            if item is None:
                pending.remove(file)
            elif len(out) < n:
                out.append(item)
    return out


def _shown(records: list[Record], file: int, formats: list[str], cfg: DataConfig, tokenizer: Any,
           encoder: ChatEncoder | None, model_takes_images: bool) -> Iterator[dict[str, Any]]:
    """`preview`'s examples of one file's records, one at a time (tokenized only when asked for)."""
    for record in records:
        prepared, _ = _prepare([dataclasses.replace(record, file=file)], formats, cfg, encoder, model_takes_images)
        dropped = _Dropped()
        fitted = _fit(prepared, _tokenize(prepared, tokenizer, encoder, cfg.max_seq_len), cfg, encoder, dropped)
        if not fitted:
            continue
        (_, parts), = fitted
        shown = [[(tokenizer.decode([tok]), label != IGNORE_INDEX) for tok, label in zip(ids, labels, strict=True)]
                 for ids, labels in parts]
        item = {"where": record.where, "format": formats[file], "tokens": shown[0], "truncated": dropped.truncated > 0}
        if len(shown) > 1:
            item["rejected_tokens"] = shown[1]
        if prepared[0].label is not None:
            item["label"] = prepared[0].label
        if prepared[0].images:
            item["images"] = prepared[0].images
        yield item


def _format(cfg: DataConfig, file: FileRead) -> str:
    """A file's format: data.format (every file's when set), else detected from its own records."""
    if cfg.format != "auto":
        return cfg.format
    records = file.read.records
    try:
        return detect_format([r.value for r in records])
    except RecordError as exc:
        where = records[0].where if records else file.entry.path
        raise DataError(f"{where}: {exc}", hint=f"or set data.format to one of {', '.join(FORMATS)}") from None


def _encoder(cfg: DataConfig, tokenizer: Any, fmt: str) -> ChatEncoder | None:
    if fmt == "text":
        return None
    return ChatEncoder(tokenizer, resolve_template(cfg.chat_template, tokenizer), cfg.assistant_only_loss)


def _prepare(records: Sequence[Record], formats: list[str], cfg: DataConfig, encoder: ChatEncoder | None,
             model_takes_images: bool) -> tuple[list[_Prepared], list[str]]:
    """Each record normalised and rendered in its file's format (`formats`, by file index), and a problem
    line per malformed one (a bad image included)."""
    prepared, problems = [], []
    folders = data_folders(cfg)
    for record in records:
        try:
            example = _example(record, formats[record.file], cfg, folders[record.file])
            check_images(example, model_takes_images)
            images = images_of(example)
            if isinstance(example, Preference):
                assert encoder is not None
                rendered = [encoder.render(chat, first) for chat, first in example.chats()]
                item = _Prepared(record.where, record.file, chat=rendered[0],
                                 rejected=rendered[1] if len(rendered) > 1 else None, label=example.label,
                                 source=example.chats(), images=images, origin=(record, example))
            elif isinstance(example, Chat):
                assert encoder is not None
                item = _Prepared(record.where, record.file, chat=encoder.render(example), source=[(example, 0)],
                                 images=images, origin=(record, example))
            else:
                item = _Prepared(record.where, record.file, text=example, origin=(record, example))
            prepared.append(item)
        except RecordError as exc:
            problems.append(f"{record.where}: {exc}")
    return prepared, problems


def _example(record: Record, fmt: str, cfg: DataConfig, folder: str) -> Example:
    """One record normalised (relative image paths read from `folder`); RecordError if it is malformed or
    holds text that cannot be tokenized."""
    example = normalize(record.value, fmt, cfg.system_prompt, folder)
    text = example if isinstance(example, str) else json.dumps(asdict(example), ensure_ascii=False, default=str)
    if problem := unicode_problem(text):
        raise RecordError(problem)
    return example


def check_records(cfg: DataConfig, method: str = "sft", model_takes_images: bool = False,
                  count_image_tokens: TokenCounter | None = None, read: DataRead | None = None) -> dict[str, Any]:
    """Read and check every record without a tokenizer, in seconds, before a model loads: the file parses,
    its format is known and suits `method`, each record has its fields and its images are readable files
    (headers only; any image is a bad record unless `model_takes_images`, the model family's vision flag);
    with the model's `count_image_tokens` (image sizes, pixel budget -> image tokens), a record whose images
    alone are more tokens than data.max_seq_len at data.max_pixels (auto: the smallest budget it can pick) is bad;
    every file of a list, each whole (not only what the mix takes). Raises the DataError build_datasets would;
    returns the format and the counts of records and of malformed ones (and, for a list, `files`: each file's
    path, format, records, bad_records), with `images` and `image_records` (of the good records) when any
    record has images. `read`: the files as already read (`data_read`), handed on to the build after."""
    if data_kind(method) == "prompt":  # prompt-only records (finetune.data.prompts)
        return check_prompt_records(cfg)
    given = _files_of(cfg, method, read)
    files, formats, fmt = given.files, given.formats, given.fmt
    bad, good = _check_each(cfg, files, formats, model_takes_images, count_image_tokens)
    out = checked(cfg, files, formats, fmt, bad)
    _count_images(out, [(i, len(sizes)) for i, sizes, _ in good])
    return out


def record_image_sizes(cfg: DataConfig, method: str = "sft") -> list[list[tuple[int, int]]]:
    """The (width, height) of each image of every good record of the data, record by record in file order
    (every file of a list, whole; [] for a text-only record), read from the images' headers: what the planner
    counts image tokens from (`finetune.data.image_tokens`); none for prompt-only data (its prompts are text).
    Raises what `check_records` raises."""
    return [sizes for sizes, _ in record_shapes(cfg, method)]


def record_shapes(cfg: DataConfig, method: str = "sft") -> list[tuple[list[tuple[int, int]], int]]:
    """Each good record's image sizes (as `record_image_sizes`) and the most tokens its text can become
    (`text_tokens_bound`): what the planner sizes a vision-language trace's sequence from. Raises what
    `check_records` raises."""
    if data_kind(method) == "prompt":
        return []
    files = read_files(cfg)
    formats, fmt = _formats(cfg, files, method)
    bad, good = _check_each(cfg, files, formats, True)
    checked(cfg, files, formats, fmt, bad)
    return [(sizes, bound) for _, sizes, bound in good]


# the chat template's own tokens: around a conversation (a default system prompt included), per turn, per image
TEMPLATE_TOKENS, TURN_TOKENS, IMAGE_WRAP_TOKENS = 64, 16, 8


def text_tokens_bound(example: Example) -> int:
    """At most how many tokens an example becomes besides its image tokens: each UTF-8 byte of its text at most
    one token (byte-level BPE and byte-fallback SentencePiece alike), its tools' JSON, and the template's own
    tokens (an upper bound: a preference example's prompt counted with both answers)."""
    if isinstance(example, str):
        return len(example.encode()) + TEMPLATE_TOKENS
    turns = example.messages if isinstance(example, Chat) else \
        example.prompt + example.chosen + (example.rejected or [])
    tools = len(json.dumps(example.tools, ensure_ascii=False).encode()) if example.tools else 0
    return (TEMPLATE_TOKENS + tools + sum(len(content_text(t["content"]).encode()) + TURN_TOKENS for t in turns)
            + IMAGE_WRAP_TOKENS * len(images_of(example)))


def _check_each(cfg: DataConfig, files: list[FileRead], formats: list[str], model_takes_images: bool,
                count_image_tokens: TokenCounter | None = None
                ) -> tuple[list[list[str]], list[tuple[int, list[tuple[int, int]], int]]]:
    """Every record of every file normalised and its images' headers read: each file's problem lines, and
    (file index, image sizes, text_tokens_bound) of each good record (with `count_image_tokens`: its image
    tokens fit max_seq_len)."""
    bad, good = [], []
    for i, (f, file_format, folder) in enumerate(zip(files, formats, data_folders(cfg), strict=True)):
        bad.append(list(f.read.problems))
        for record in f.read.records:
            try:
                example = _example(record, file_format, cfg, folder)
                sizes = check_images(example, model_takes_images)
                if count_image_tokens is not None and sizes:
                    _check_image_tokens(cfg, count_image_tokens, sizes)
                good.append((i, sizes, text_tokens_bound(example)))
            except RecordError as exc:
                bad[-1].append(f"{record.where}: {exc}")
    return bad, good


def _check_image_tokens(cfg: DataConfig, count: TokenCounter, sizes: list[tuple[int, int]]) -> None:
    """RecordError where images of these sizes alone are more image tokens than max_seq_len at the pixel budget
    (auto: the smallest it can pick, MIN_IMAGE_PIXELS, which the processor's own minimum bounds)."""
    tokens = count(sizes, MIN_IMAGE_PIXELS if cfg.max_pixels == "auto" else cfg.max_pixels)
    if tokens > cfg.max_seq_len:
        raise RecordError(_image_tokens_problem(tokens, tokens, cfg.max_pixels, cfg.max_seq_len))


def _where(problem: str) -> str:
    """The location that starts a problem line (`data.jsonl:3: ...` -> `data.jsonl:3`)."""
    return problem.split(": ", 1)[0]


def _tokenize(items: list[_Prepared], tokenizer: Any, encoder: ChatEncoder | None,
              max_seq_len: int) -> list[Sequences]:
    """Each item's sequences (one, or chosen and rejected), tokenized in one batch: at least their first
    max_seq_len + 1 tokens (`tokenize_prefixes`)."""
    if encoder is None:
        return [[e] for e in encode_text(tokenizer, [x.text for x in items], max_seq_len)]
    chats = [c for x in items for c in (x.chat, x.rejected) if c is not None]
    encoded = iter(encoder.encode(chats, max_seq_len))
    return [[next(encoded) for _ in range(1 + (x.rejected is not None))] for x in items]


_WHOLE = 1 << 30  # tokens: no cut


def _loss_count(labels: list[int]) -> int:
    return sum(label != IGNORE_INDEX for label in labels)


@dataclass
class _Dropped:
    """What fitting to max_seq_len did: how many were cut (prompts_cut: of them, how many in their prompt),
    and a problem line per dropped record."""

    truncated: int = 0
    prompts_cut: int = 0
    overlong: list[str] = field(default_factory=list)
    no_loss: list[str] = field(default_factory=list)
    by_file: Counter[int] = field(default_factory=Counter)  # examples dropped, by file index
    bad: list[str] = field(default_factory=list)  # image records whose image tokens do not fit: bad records


def _fit(items: list[_Prepared], examples: list[Sequences], cfg: DataConfig, encoder: ChatEncoder | None,
         dropped: _Dropped, vision: VisionData | None = None,
         cuts: dict[int, Sequences | None] | None = None) -> list[tuple[_Prepared, Sequences]]:
    """Apply data.overlong and drop examples without loss tokens, recording both in `dropped`; a preference
    pair is cut, dropped or kept whole. An image record (its images expanded by `vision`) is never cut inside an
    image's tokens: one whose images end past max_seq_len is a bad record; otherwise only its end is cut.
    `cuts`: each item's prompt cut (`cut_prompt`), kept by the read (`_Read.cuts`) for the next fit of it."""
    kept, cuts = [], {} if cuts is None else cuts
    for item, parts in zip(items, examples, strict=True):
        cut = any(len(ids) > cfg.max_seq_len for ids, _ in parts)
        answered = item.chat is None or all(spans for _, spans in filter(None, (item.chat, item.rejected)))
        problem = _images_past(parts, cfg, vision) if cut and item.images else None
        if problem is not None:
            dropped.bad.append(f"{item.where}: {problem}")
            dropped.by_file[item.file] += 1
            continue
        if cut and (cfg.overlong != "truncate" or (item.images and vision is None)):
            dropped.overlong.append(f"{item.where}: longer than data.max_seq_len={cfg.max_seq_len} tokens"
                                    + (" with its image tokens" if item.images else ""))
            dropped.by_file[item.file] += 1
            continue
        if cut and answered and item.source is not None and not item.images:  # cutting turns would lose images
            assert encoder is not None
            if id(item) not in cuts:
                cuts[id(item)] = cut_prompt(item.source, encoder, cfg.max_seq_len)
            shorter = cuts[id(item)]
            if shorter is not None:
                parts = shorter
                dropped.prompts_cut += 1
        parts = [(ids[: cfg.max_seq_len], labels[: cfg.max_seq_len]) for ids, labels in parts]
        if not all(_loss_count(labels) for _, labels in parts):
            if cut and answered:
                dropped.overlong.append(f"{item.where}: no answer token fits in data.max_seq_len="
                                        f"{cfg.max_seq_len}, " + ("after its image tokens (a prompt with images "
                                        "is not cut)" if item.images else "even with its prompt cut"))
            else:
                dropped.no_loss.append(f"{item.where}: " + (
                    "nothing to train on (no assistant turn with text)" if item.chat is not None else
                    "too short to train on (one token)"))
            dropped.by_file[item.file] += 1
            continue
        dropped.truncated += cut
        kept.append((item, parts))
    return kept


def _images_past(parts: Sequences, cfg: DataConfig, vision: VisionData | None) -> str | None:
    """Why an overlong image record cannot be cut (its image tokens, with the text before them, end past
    max_seq_len; cutting inside them breaks the model's count of image features), and the fix; None where
    every image ends within max_seq_len."""
    if vision is None:
        return None
    after = len(vision.wrap[1])  # the tokens that close an image belong to it
    for ids, _ in parts:
        at = [i for i, tok in enumerate(ids) if tok == vision.image_token_id]
        if at and at[-1] + 1 + after > cfg.max_seq_len:
            return _image_tokens_problem(len(at), at[-1] + 1 + after, vision.max_pixels, cfg.max_seq_len)
    return None


def _image_tokens_problem(tokens: int, needed: int, max_pixels: int | str | None, max_seq_len: int) -> str:
    """The bad-record line of a record whose images do not fit max_seq_len: the image tokens it needs at the
    pixel budget, and the fix."""
    budget = ("the smallest pixel budget data.max_pixels: auto tries" if max_pixels == "auto" else
              f"data.max_pixels={max_pixels}" if max_pixels is not None else "the model's own pixel limit")
    text = "" if needed == tokens else f" ({needed} tokens with the text before the last image's end)"
    fix = ("raise data.max_seq_len" if max_pixels == "auto" else
           "raise data.max_seq_len, or lower data.max_pixels (or set it to auto, which picks a budget that fits)")
    return (f"its images need {tokens} image tokens at {budget}{text}, more than data.max_seq_len={max_seq_len}, "
            f"and an image's tokens are never cut: {fix}")


def _dataset(fitted: list[tuple[_Prepared, Sequences]], cfg: DataConfig, kind: str) -> Any:
    import datasets

    from finetune.data.packing import pack

    items, examples = [item for item, _ in fitted], [parts for _, parts in fitted]
    columns: dict[str, list] = {}
    prefixes = ("chosen_", "rejected_") if kind == "pair" else ("",)
    for i, prefix in enumerate(prefixes):
        columns[f"{prefix}input_ids"] = [parts[i][0] for parts in examples]
        columns[f"{prefix}labels"] = [parts[i][1] for parts in examples]
    if kind == "kto":
        columns["kto_label"] = [item.label for item in items]
    if any(item.images for item in items):
        columns["images"] = [item.images for item in items]
    data = datasets.Dataset.from_dict(columns)
    return pack(data, cfg.max_seq_len) if cfg.packing else data
