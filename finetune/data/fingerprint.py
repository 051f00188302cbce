"""A fingerprint of what decides a run's examples, so `--resume` can tell that the data changed.

A run saves it in its run directory (finetune.train.run); resuming on other data would mix two datasets in
one run and make its step count meaningless, so `--resume` compares and refuses, naming what changed, unless
`--allow-data-change`. What decides the examples: the records as read (their content, in order), their
number, the tokenizer (its whole definition, not its folder), the chat template used, the format, and the
recipe keys and seed that sample, split, cut and pack them. The data file's path is shown, not compared: the
same records moved elsewhere are the same data. Several files (data.path as a list): the records of every
file, and per file (`files`) its weight or record count, its number of records and their hash, so that a
change to any file or to its share of the mix is named (`data.path[1].weight 0.3 -> 0.5`). Records with images:
the images too (`images_sha256`, from each file's size and first and last bytes, not its path), so an image
replaced under the same name is named.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from finetune.data.mix import is_mix
from finetune.data.read import ReadResult
from finetune.errors import FinetuneError
from finetune.recipe.schema import DataConfig

VERSION = 1


class DataChanged(FinetuneError):
    """`--resume` on data other than the run's: a usage error (exit code 2)."""

    exit_code = 2


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def tokenizer_identity(tokenizer: Any) -> dict[str, str]:
    """Its name (shown) and a hash of its definition (compared): vocabulary, merges, normalisation, added and
    special tokens, its own chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps([type(tokenizer).__name__, tokenizer.special_tokens_map, tokenizer.chat_template],
                       sort_keys=True, default=str)
    return {"name": str(getattr(tokenizer, "name_or_path", "")), "sha256": _sha256(definition + extra)}


def _hashes(read: ReadResult) -> list[str]:
    return [_sha256(json.dumps(r.value, sort_keys=True, default=str)) for r in read.records]


def records_digest(cfg: DataConfig, reads: Sequence[ReadResult]) -> dict[str, Any]:
    """The records' part of the fingerprint: their number and hashes (per file, for a list). It takes a pass over
    every record, so a build that reuses a read (finetune.data.build.DataRead) computes it once and hands it to
    `data_fingerprint`."""
    records = [h for read in reads for h in _hashes(read)]
    problems = [p for read in reads for p in read.problems]
    out: dict[str, Any] = {
        "records": len(records) + len(problems),
        "content_sha256": _sha256("\n".join(records + problems)),
        "records_sha256_any_order": _sha256("\n".join(sorted(records + problems))),
    }
    if is_mix(cfg):
        out["files"] = [{"path": entry.path, "weight": entry.weight, "records": entry.records,
                         "records_read": read.total,
                         "content_sha256": _sha256("\n".join(_hashes(read) + read.problems))}
                        for entry, read in zip(cfg.files(), reads, strict=True)]
    return out


def data_fingerprint(cfg: DataConfig, reads: Sequence[ReadResult], fmt: str, tokenizer: Any, template: str | None,
                     seed: int, method: str, digest: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fingerprint of one build of the data (build_datasets computes it from what it read): `reads`, one
    per file of `cfg.files()`; `digest`: their `records_digest`, where already computed."""
    digest = records_digest(cfg, reads) if digest is None else digest
    settings = cfg.model_dump(exclude={"path", "max_seq_len", "format", "batching"})  # batching: the order only
    settings = {f"data.{k}": v for k, v in settings.items()} | {"training.seed": seed, "training.method": method}
    out = {
        "version": VERSION, "path": cfg.label(),
        "records": digest["records"],
        "content_sha256": digest["content_sha256"],
        "records_sha256_any_order": digest["records_sha256_any_order"],
        "tokenizer": tokenizer_identity(tokenizer), "max_seq_len": cfg.max_seq_len, "format": fmt,
        "chat_template_sha256": _sha256(template) if template is not None else None,
        "settings": settings,
    }
    if "files" in digest:
        out["files"] = digest["files"]
    return out


IMAGE_SAMPLE = 64 << 10  # bytes of each image's start and end in its identity: a replaced file differs there


def images_identity(paths: Sequence[str]) -> str:
    """A hash of the images the records show, in order: each file's size and its first and last bytes (read
    in milliseconds, unlike the whole of a large dataset's images)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as file:
            head = file.read(IMAGE_SAMPLE)
            size = file.seek(0, 2)
            file.seek(max(len(head), size - IMAGE_SAMPLE))
            digest.update(f"{size}:".encode() + head + file.read())
    return digest.hexdigest()


def _file_changes(saved: list[dict[str, Any]] | None, now: list[dict[str, Any]] | None) -> list[str]:
    """What differs between two runs' data files when either is a list: the number of files, and per file
    (by position) its content and its weight or record count."""
    if saved is None and now is None:
        return []
    if saved is None or now is None:
        return ["data.path " + ("one file -> a list of files (mixed and shuffled)" if now is not None
                                else "a list of files -> one file")]
    if len(saved) != len(now):
        return [f"data.path files {len(saved)} -> {len(now)}"]
    changes = []
    for i, (old, new) in enumerate(zip(saved, now, strict=True)):
        key = f"data.path[{i}]"
        if old.get("records_read") != new["records_read"]:
            changes.append(f"{key} ({new['path']}): records {old.get('records_read')} -> {new['records_read']}")
        elif old.get("content_sha256") != new["content_sha256"]:
            changes.append(f"{key} ({new['path']}): record content changed")
        changes += [f"{key}.{amount} {old.get(amount)} -> {new[amount]}" for amount in ("weight", "records")
                    if old.get(amount) != new[amount]]
    return changes


def _record_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """How the records as a whole changed: their number, else their content or only their order."""
    if saved.get("records") != now["records"]:
        return [f"records {saved.get('records')} -> {now['records']}"]
    if saved.get("content_sha256") != now["content_sha256"]:
        return ["the same records in another order"
                if saved.get("records_sha256_any_order") == now["records_sha256_any_order"] else "record content changed"]
    return []


def data_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between the fingerprint a run saved and the data's now, one phrase each ([] if nothing)."""
    changes = _file_changes(saved.get("files"), now.get("files")) or _record_changes(saved, now)
    old_tok, new_tok = saved.get("tokenizer") or {}, now["tokenizer"]
    if old_tok.get("sha256") != new_tok["sha256"]:
        changes.append(f"tokenizer changed ({old_tok.get('name') or '?'} -> {new_tok['name']})")
    if saved.get("max_seq_len") != now["max_seq_len"]:
        changes.append(f"data.max_seq_len {saved.get('max_seq_len')} -> {now['max_seq_len']}")
    if saved.get("format") != now["format"]:
        changes.append(f"format {saved.get('format')} -> {now['format']}")
    if saved.get("images_sha256") != now.get("images_sha256"):
        changes.append("images changed")
    if saved.get("chat_template_sha256") != now["chat_template_sha256"]:
        changes.append("chat template changed")
    old_settings = saved.get("settings") or {}
    changes += [f"{key} {old_settings[key]!r} -> {value!r}" for key, value in now["settings"].items()
                if key in old_settings and old_settings[key] != value]  # a key added since: not a change
    return changes


def check_resumed_data(saved: dict[str, Any] | None, now: dict[str, Any], where: str, allow: bool) -> list[str]:
    """`--resume`: the changes from the run's saved fingerprint (none when the run saved none); raises
    DataChanged if there are any and `allow` (--allow-data-change) is off."""
    changes = data_changes(saved, now) if saved is not None else []
    if changes and not allow:
        raise DataChanged(
            f"--resume: the data ({now['path']}) differs from what {where} started on: {'; '.join(changes)}",
            hint="resume with the data the run started on, start a new run (another output.dir, or --overwrite), "
                 "or pass --allow-data-change to continue on this data anyway")
    return changes
