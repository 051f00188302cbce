"""Seeded fuzzing of data files: every generated file ends in a dataset or a DataError naming the file and a
line or record, each within 2 s and 200 MB.

Cases are built from a few good records per format (and, when present, records of the shared sample datasets),
damaged by record mutations (wrong types, missing keys, lone surrogates, 5,000-digit numbers, deep nesting,
huge strings, assistant-first or answerless chats, non-object records) and file mutations (bad bytes, a cut
mid-line, BOM, CRLF, empty or blank files), written as JSONL, JSON, CSV, Parquet or save_to_disk, and built
in-process with the tiny tokenizer under random data settings. Image records (paths, content parts, data:
URLs, nulls, files that do not decode) go through the preflight's check and the data build of a tiny
vision-language model, and data mixes with weights and record counts through the data build. Seeds are fixed:
a failure names its case (the image and mix cases print `random.Random(seed)` with what they drew).
"""

from __future__ import annotations

import csv
import io
import json
import random
import re
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from finetune.data import build_datasets
from finetune.errors import DataError
from finetune.recipe.schema import DataConfig

CASES_PER_FORMAT = 80
SHARED_CASES_PER_FILE = 20
MAX_SECONDS = 2.0
MAX_BYTES = 200 * 2**20
LOCATION = re.compile(r":\d+(:|\b)|record \d+|record '|\[\d+\]|line \d+|row \d+")
WHOLE_FILE = re.compile(  # problems of a whole file or setting, where no single line is to blame
    r"is empty|contains no records|no usable records|leaves no training records|not a readable (Parquet|CSV) file"
    r"|save_to_disk|top-level JSON value")

QUICK = "The quick brown fox jumps over the lazy dog. "
SEEDS: dict[str, list[dict[str, Any]]] = {
    "alpaca": [
        {"instruction": "What is the capital of France?", "input": "", "output": "The capital is Paris."},
        {"instruction": "Answer the question.", "input": "What is 2+2?", "output": "4", "system": "Be brief."},
        {"instruction": "Continue.", "output": "and so on", "history": [["Hi", "Hello"], ["Count", "1 2 3"]]},
    ],
    "messages": [
        {"messages": [{"role": "user", "content": "What is the capital of France?"},
                      {"role": "assistant", "content": "Paris."}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
                      {"role": "assistant", "content": "Bye."}]},
        {"messages": [{"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": "", "tool_calls": [
                          {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
                      {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}],
         "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]},
    ],
    "sharegpt": [
        {"conversations": [{"from": "human", "value": "What is the capital of France?"},
                           {"from": "gpt", "value": "Paris."}]},
        {"conversations": [{"from": "human", "value": "Capital?"},
                           {"from": "function_call", "value": '{"name": "capital", "arguments": {"c": "FR"}}'},
                           {"from": "observation", "value": '{"capital": "Paris"}'},
                           {"from": "gpt", "value": "Paris."}],
         "tools": '[{"name": "capital", "parameters": {"type": "object"}}]'},
    ],
    "text": [{"text": QUICK * 3}, {"text": "Fine-tuning adapts a pretrained model."}, {"text": "0123456789"}],
}
BIGINT, DEEP = "@@BIGINT@@", "@@DEEP@@"  # replaced after serialisation by what json.dumps cannot write
RAW = {BIGINT: "7" * 5000, DEEP: "[" * 3000 + "]" * 3000}
ODD_VALUES = [None, 0, -1, 1.5, True, [], {}, ["x"], {"a": 1}, "", "   ", "<|im_start|>", "\x00", "🦊" * 3,
              "\u202e\u0645\u0631\u062d\u0628\u0627", float("inf"), float("nan")]


@dataclass
class Case:
    name: str
    path: Path
    settings: dict[str, Any]
    mutations: list[str] = field(default_factory=list)


def _strings(value: Any, found: list[tuple[Any, Any]], holder: Any = None, key: Any = None) -> None:
    """Every (container, key) pair that holds a string, recursively."""
    if isinstance(value, str) and holder is not None:
        found.append((holder, key))
    elif isinstance(value, dict):
        for k, v in value.items():
            _strings(v, found, value, k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _strings(v, found, value, i)


def _slots(record: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) in a record, nested ones included."""
    found: list[tuple[Any, Any]] = []

    def walk(value: Any) -> None:
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
        for k, v in list(items):
            found.append((value, k))
            walk(v)

    walk(record)
    return found


def _turns(record: Any) -> list | None:
    if isinstance(record, dict):
        for key in ("messages", "conversations"):
            if isinstance(record.get(key), list):
                return record[key]
    return None


def _wrong_type(rng: random.Random, record: Any) -> None:
    slots = _slots(record)
    if slots:
        holder, key = rng.choice(slots)
        holder[key] = rng.choice(ODD_VALUES)


def _missing_key(rng: random.Random, record: Any) -> None:
    slots = [(h, k) for h, k in _slots(record) if isinstance(h, dict)]
    if slots:
        holder, key = rng.choice(slots)
        del holder[key]


def _in_a_string(text: str) -> Callable[[random.Random, Any], None]:
    def mutate(rng: random.Random, record: Any) -> None:
        found: list[tuple[Any, Any]] = []
        _strings(record, found)
        if found:
            holder, key = rng.choice(found)
            at = rng.randint(0, len(holder[key]))
            holder[key] = holder[key][:at] + text + holder[key][at:]
    return mutate


def _replace_value(value: Any) -> Callable[[random.Random, Any], None]:
    def mutate(rng: random.Random, record: Any) -> None:
        slots = _slots(record)
        if slots:
            holder, key = rng.choice(slots)
            holder[key] = value() if callable(value) else value
    return mutate


def _nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


def _huge_string(rng: random.Random, record: Any) -> None:
    found: list[tuple[Any, Any]] = []
    _strings(record, found)
    if found:
        holder, key = rng.choice(found)
        holder[key] = QUICK * rng.randint(2_000, 25_000)  # 90 KB to 1.1 MB


def _reorder_turns(rng: random.Random, record: Any) -> None:
    turns = _turns(record)
    if not turns:
        return
    choice = rng.randrange(4)
    if choice == 0:
        turns.reverse()  # starts with the assistant
    elif choice == 1:
        turns[:] = [t for t in turns if not (isinstance(t, dict) and t.get("role", t.get("from")) in ("assistant", "gpt"))]
    elif choice == 2:
        turns.clear()
    else:
        for t in turns:
            if isinstance(t, dict):
                t["content" if "content" in t else "value"] = ""


RECORD_MUTATIONS: dict[str, Callable[[random.Random, Any], None]] = {
    "wrong_type": _wrong_type, "missing_key": _missing_key,
    "surrogate": _in_a_string("\ud800"), "low_surrogate": _in_a_string("\udcff"),
    "control_token": _in_a_string("<|im_end|>"), "nul_char": _in_a_string("\x00\x1b"),
    "bigint": _replace_value(BIGINT), "deep": _replace_value(DEEP), "nested": _replace_value(lambda: _nested(60)),
    "huge_string": _huge_string, "reorder_turns": _reorder_turns,
}


def _record_level(rng: random.Random, records: list[Any], mutations: list[str]) -> None:
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        i = rng.randrange(len(records))
        if rng.random() < 0.08:
            records[i] = rng.choice([5, "a string", [], None, [records[i]]])
            mutations.append(f"not_an_object@{i}")
            continue
        name = rng.choice(list(RECORD_MUTATIONS))
        RECORD_MUTATIONS[name](rng, records[i])
        mutations.append(f"{name}@{i}")


def _raw(text: str) -> str:
    for placeholder, raw in RAW.items():
        text = text.replace(json.dumps(placeholder), raw).replace(placeholder, raw)
    return text


def _cell(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _serialise(rng: random.Random, container: str, records: list[Any]) -> bytes:
    ascii_only = rng.random() < 0.5
    if container == "jsonl":
        text = "\n".join(json.dumps(r, ensure_ascii=ascii_only) for r in records) + "\n"
    elif container == "json":
        text = json.dumps(records, ensure_ascii=ascii_only, indent=rng.choice([None, 1]))
    elif container == "json_object":
        text = json.dumps({"data": records}, ensure_ascii=ascii_only, indent=1)
    else:  # csv
        rows = [r for r in records if isinstance(r, dict)]
        fields = sorted({k for r in rows for k in r}) or ["text"]
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=fields)
        writer.writeheader()
        for r in records:
            writer.writerow({k: _cell(v) for k, v in r.items()} if isinstance(r, dict) else {})
        text = out.getvalue()
    return _raw(text).encode("utf-8", errors="surrogatepass")  # a lone surrogate becomes invalid UTF-8 bytes


def _file_level(rng: random.Random, data: bytes, mutations: list[str]) -> bytes:
    choice = rng.choice(["none", "none", "none", "bad_byte", "bad_byte", "truncate", "bom", "crlf", "blank_lines",
                         "empty", "whitespace", "duplicate_line"])
    mutations.append(choice)
    if choice == "bad_byte":
        at = rng.randrange(max(1, len(data)))
        return data[:at] + rng.choice([b"\xff", b"\xc3", b"\x80", b"\xed\xa0\x80", b"\x00", b"\xfe\xff"]) + data[at:]
    if choice == "truncate":
        return data[: rng.randrange(max(1, len(data)))]
    if choice == "bom":
        return b"\xef\xbb\xbf" + data
    if choice == "crlf":
        return data.replace(b"\n", b"\r\n")
    if choice == "blank_lines":
        return data.replace(b"\n", b"\n\n \n", 2)
    if choice == "empty":
        return b""
    if choice == "whitespace":
        return b" \n\n\t\n"
    if choice == "duplicate_line":
        lines = data.split(b"\n")
        i = rng.randrange(len(lines))
        return b"\n".join(lines[: i + 1] + lines[i:])
    return data


def _write_arrow(rng: random.Random, container: str, records: list[Any], path: Path,
                 mutations: list[str]) -> Path | None:
    """Parquet or save_to_disk from records Arrow can type; None when it cannot (mixed types)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [r for r in records if isinstance(r, dict)]
    try:
        table = pa.Table.from_pylist([{k: _raw(_cell(v)) for k, v in r.items()} for r in rows])
    except (pa.ArrowException, UnicodeEncodeError):
        return None
    if container == "parquet":
        target = path.with_suffix(".parquet")
        pq.write_table(table, target)
        if rng.random() < 0.3:
            data = target.read_bytes()
            target.write_bytes(data[: rng.randrange(len(data))])
            mutations.append("truncate")
        return target
    import datasets

    target = path.with_suffix("")
    datasets.Dataset(table).save_to_disk(str(target))
    damage = rng.choice(["none", "missing_arrow", "cut_arrow", "bad_state", "bad_info"])
    mutations.append(damage)
    arrow = next(target.glob("*.arrow"), target / "state.json")  # no rows: no shard to damage
    if damage == "missing_arrow":
        arrow.unlink()
    elif damage == "cut_arrow":
        arrow.write_bytes(arrow.read_bytes()[: rng.randrange(arrow.stat().st_size)])
    elif damage == "bad_state":
        (target / "state.json").write_text(rng.choice(["{oops", "[]", "", '{"_data_files": 5}']))
    elif damage == "bad_info":
        (target / "dataset_info.json").write_text("{oops")
    return target


def make_case(rng: random.Random, name: str, fmt: str, seeds: list[dict[str, Any]], tmp_path: Path) -> Case:
    records = json.loads(json.dumps([rng.choice(seeds) for _ in range(rng.randint(1, 8))]))  # deep copies
    mutations: list[str] = []
    _record_level(rng, records, mutations)
    container = rng.choices(["jsonl", "json", "json_object", "csv", "parquet", "save_to_disk"],
                            weights=[40, 25, 8, 15, 8, 4])[0]
    path = tmp_path / f"{name}.data"
    target = _write_arrow(rng, container, records, path, mutations) if container in ("parquet", "save_to_disk") else None
    if target is None:
        container = "jsonl" if container in ("parquet", "save_to_disk") else container
        target = path.with_suffix(".csv" if container == "csv" else ".jsonl" if container == "jsonl" else ".json")
        target.write_bytes(_file_level(rng, _serialise(rng, container, records), mutations))
    settings = {
        "on_bad_record": rng.choice(["error", "skip"]), "overlong": rng.choice(["truncate", "drop"]),
        "max_seq_len": rng.choice([16, 64, 256, 1024]),
        "format": rng.choice([fmt, fmt, "auto", "auto", "auto", "auto", "auto", *SEEDS]),  # sometimes the wrong one
        "validation_split": rng.choice([0.0, 0.0, 0.0, 0.3]),
    }
    return Case(name, target, settings, [container, *mutations])


def run_case(case: Case, tokenizer: Any) -> tuple[str | None, float, int]:
    """(what is wrong with the outcome or None, seconds, peak bytes allocated by Python)."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        bundle = build_datasets(DataConfig(path=str(case.path), **case.settings), tokenizer, seed=0)
        wrong = _check_bundle(bundle, case.settings["max_seq_len"])
    except DataError as exc:
        message = str(exc)
        wrong = None if str(case.path) in message and (LOCATION.search(message) or WHOLE_FILE.search(message)) \
            else f"DataError without file and line: {message[:300]!r}"
    except Exception as exc:  # noqa: BLE001 - any other exception is the failure this fuzzing looks for
        wrong = f"{type(exc).__name__}: {str(exc)[:300]}"
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return wrong, seconds, peak


def _check_bundle(bundle: Any, max_seq_len: int) -> str | None:
    stats = bundle.stats
    if not (stats["train_examples"] == len(bundle.train) >= 1):
        return f"train_examples {stats['train_examples']} but {len(bundle.train)} rows"
    for ids, labels in zip(bundle.train["input_ids"], bundle.train["labels"], strict=True):
        if not (0 < len(ids) == len(labels) <= max_seq_len) or all(x == -100 for x in labels):
            return f"bad row: {len(ids)} ids, {len(labels)} labels, max_seq_len {max_seq_len}"
    return None


def fuzz(cases: list[Case], tokenizer: Any) -> None:
    import finetune.data.packing  # noqa: F401 - imported once before timing: TRL's import is not a case's cost

    failures, slowest, largest = [], (0.0, ""), (0, "")
    for case in cases:
        wrong, seconds, peak = run_case(case, tokenizer)
        if wrong:
            failures.append(f"{case.name} {case.mutations} {case.settings}: {wrong}")
        slowest, largest = max(slowest, (seconds, case.name)), max(largest, (peak, case.name))
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures[:20])
    assert slowest[0] < MAX_SECONDS, f"case {slowest[1]} took {slowest[0]:.2f} s"
    assert largest[0] < MAX_BYTES, f"case {largest[1]} allocated {largest[0] / 2**20:.0f} MiB"


@pytest.mark.parametrize("fmt", sorted(SEEDS))
def test_fuzzed_files_end_in_a_dataset_or_a_located_data_error(tmp_path, tiny_tokenizer, fmt):
    cases = [make_case(random.Random(f"{fmt}:{i}"), f"{fmt}-{i}", fmt, SEEDS[fmt], tmp_path)
             for i in range(CASES_PER_FORMAT)]
    fuzz(cases, tiny_tokenizer)


SHARED_FILES = {"alpaca_en_demo.json": "alpaca", "identity.json": "alpaca",
                "glaive_toolcall_en_demo.json": "sharegpt", "c4_demo.jsonl": "text"}


def test_fuzzed_real_samples(tmp_path, tiny_tokenizer, shared_datasets):
    from finetune.data.read import read_records

    cases = []
    for name, fmt in SHARED_FILES.items():
        seeds = [r.value for r in read_records(shared_datasets / name).records[:12]]
        cases += [make_case(random.Random(f"{name}:{i}"), f"{Path(name).stem}-{i}", fmt, seeds, tmp_path)
                  for i in range(SHARED_CASES_PER_FILE)]
    fuzz(cases, tiny_tokenizer)


# ---- image records and data mixes ----------------------------------------------------------------------------

IMAGE_CASES = 60
MIX_CASES = 60


def _png(size: tuple[int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, "red").save(out, "PNG")
    return out.getvalue()


def _image_pool(folder: Path) -> dict[str, Any]:
    """Image sources as records name them: files good and bad (written here, a few bytes each), content the
    data holds (data: URLs, datasets' {"bytes"}), and what is no image source at all."""
    import base64
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    good = _png((24, 16))
    start = good.index(b"IDAT")
    length = struct.unpack(">I", good[start - 4:start])[0]
    files = {
        "good.png": good, "wide.png": _png((300, 1)), "tall.png": _png((2, 600)),
        "corrupt.png": good[:start - 4] + chunk(b"IDAT", bytes(length)) + good[start + 4 + length + 4:],
        "cut.png": good[:len(good) // 2], "empty.png": b"", "notes.png": b"not an image",
        "bomb.png": b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0))
        + chunk(b"IEND", b""),
        "drawing.eps": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n%%EOF\n",
    }
    (folder / "img").mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / "img" / name).write_bytes(data)
    uri = "data:image/png;base64,"
    return {**{f"img/{name}": f"img/{name}" for name in files},
            "absolute": str(folder / "img" / "good.png"), "file_url": f"file://{folder}/img/good.png",
            "nul": "img/good.png\u0000evil", "nul_url": f"file://{folder}/img/good.png%00.txt",
            "missing": "img/gone.png", "web": "https://example.com/a.png",
            "data_uri": uri + base64.b64encode(good).decode(), "data_zeros": uri + base64.b64encode(bytes(512)).decode(),
            "data_bad": uri + "!!!", "null": None, "number": 5, "blank": "", "nested": ["img/good.png"]}


def _image_record(rng: random.Random, pool: dict[str, Any], mutations: list[str]) -> dict[str, Any]:
    """A chat record with 0-3 images: LLaMA-Factory markers with `images`, or content parts naming their source;
    now and then a marker too many or too few."""
    names = [rng.choice(list(pool)) for _ in range(rng.choice([0, 1, 1, 1, 2, 3]))]
    mutations.append("+".join(names) or "no_image")
    answer = {"role": "assistant", "content": "Red."}
    if rng.random() < 0.5:
        markers = len(names) + rng.choice([0, 0, 0, 0, 1, -1])
        mutations.append(f"markers={markers}")
        return {"messages": [{"role": "user", "content": "<image>" * max(0, markers) + "Colour?"}, answer],
                "images": [pool[n] for n in names]}
    parts = [rng.choice([{"type": "image", "path": pool[n]}, {"type": "image", "image": pool[n]},
                         {"type": "image_url", "image_url": {"url": pool[n]}}]) for n in names]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Colour?"}]}, answer]}


def _write_records(rng: random.Random, records: list[dict], path: Path, mutations: list[str]) -> Path:
    container = rng.choice(["jsonl", "json", "parquet"])
    mutations.insert(0, container)
    if container == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        target = path.with_suffix(".parquet")
        pq.write_table(pa.table({"messages": [json.dumps(r["messages"]) for r in records],
                                 "images": [json.dumps(r.get("images")) for r in records]}), target)
        return target
    target = path.with_suffix(f".{container}")
    target.write_text("".join(json.dumps(r) + "\n" for r in records) if container == "jsonl" else json.dumps(records))
    return target


def _outcome(run: Callable[[], Any], case: str, paths: list[Path]) -> str | None:
    """None where `run` ends in a result, a DataError naming a file and its record, or a RecipeError naming a
    data.path key; else what went wrong (any other exception is what this fuzzing looks for)."""
    from finetune.errors import RecipeError

    try:
        run()
    except RecipeError as exc:
        return None if re.search(r"data\.path(\[\d+\])?", str(exc)) else f"{case}: RecipeError without a key: {exc}"
    except DataError as exc:
        message = str(exc)
        named = any(str(p) in message for p in paths)
        return None if named and (LOCATION.search(message) or WHOLE_FILE.search(message)) else \
            f"{case}: DataError without file and record: {message[:300]!r}"
    except Exception as exc:  # noqa: BLE001 - the failure this fuzzing looks for
        return f"{case}: {type(exc).__name__}: {str(exc)[:300]}"
    return None


@pytest.fixture(scope="module")
def vlm_vision(tmp_path_factory):
    from transformers import AutoConfig, AutoTokenizer

    from finetune.model.vision import vision_data
    from finetune.testing import vision_model

    folder = vision_model("qwen2_5_vl", tmp_path_factory.mktemp("vlm") / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenizer, vision_data(AutoConfig.from_pretrained(folder), folder, tokenizer)


def test_fuzzed_image_records_end_in_a_dataset_or_a_located_data_error(tmp_path, vlm_vision, monkeypatch):
    """Image records (paths, content parts, data: URLs, datasets' bytes, nulls, bad files) through the preflight's
    check and the run's data build (with a vision-language model's processor); each case prints its seed."""
    from finetune.data.build import check_records

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    tokenizer, vision = vlm_vision
    pool = _image_pool(tmp_path)
    failures = []
    for i in range(IMAGE_CASES):
        seed = f"images:{i}"
        rng = random.Random(seed)
        mutations: list[str] = []
        records = [_image_record(rng, pool, mutations) for _ in range(rng.randint(1, 5))]
        path = _write_records(rng, records, tmp_path / f"images-{i}", mutations)
        cfg = DataConfig(path=str(path), max_seq_len=rng.choice([32, 256]), packing=False, validation_split=0.0,
                         on_bad_record=rng.choice(["error", "skip"]), overlong="truncate")
        case = f"random.Random({seed!r}) {mutations} {cfg.on_bad_record} max_seq_len={cfg.max_seq_len}"
        print(case)
        for run in (partial(check_records, cfg, model_takes_images=True),
                    partial(build_datasets, cfg, tokenizer, seed=0, vision=vision)):
            wrong = _outcome(run, case, [path])
            if wrong:
                failures.append(wrong)
    assert not failures, f"{len(failures)} failed:\n" + "\n".join(failures[:20])
    cached = [p for p in (tmp_path / "cache" / "images").rglob("*") if p.is_file()]
    assert all(p.stat().st_size != 512 for p in cached), "a data: payload that is no image was kept in the cache"


def test_fuzzed_mixes_with_weights_and_counts_end_in_a_dataset_or_a_recipe_error(tmp_path, tiny_tokenizer):
    """data.path lists of 2-4 files (a file twice under a link now and then) with weights from 5e-324 to 1e308
    and record counts up to 2**31 - 1: a dataset, or one line naming the data.path key; each case prints its seed."""
    from finetune.recipe.schema import MAX_COUNT

    files = []
    for n in (1, 3, 10):
        path = tmp_path / f"f{n}.jsonl"
        path.write_text("".join(json.dumps(SEEDS["messages"][k % 2]) + "\n" for k in range(n)))
        files.append(path)
    (tmp_path / "link.jsonl").symlink_to(files[1])
    failures = []
    for i in range(MIX_CASES):
        seed = f"mix:{i}"
        rng = random.Random(seed)
        chosen = rng.sample([*files, tmp_path / "link.jsonl"], rng.randint(2, 4))
        entries = []
        for path in chosen:
            amount = rng.choice(["plain", "weight", "records"])
            weight = rng.choice([5e-324, 1e-300, 0.5, 1.0, 3.0, 1e300, 1e308])
            records = rng.choice([1, 2, 7, 30, 100, 101, 1000, MAX_COUNT])
            entries.append({"path": str(path), **({"weight": weight} if amount == "weight" else
                                                  {"records": records} if amount == "records" else {})})
        case = f"random.Random({seed!r}) {entries}"
        print(case)
        cfg = DataConfig(path=entries, max_seq_len=64, validation_split=0.0, max_samples=rng.choice([None, 5]))
        tracemalloc.start()
        wrong = _outcome(partial(build_datasets, cfg, tiny_tokenizer, seed=rng.randrange(3)), case, chosen)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        if wrong or peak > MAX_BYTES:
            failures.append(wrong or f"{case}: allocated {peak / 2**20:.0f} MiB")
    assert not failures, f"{len(failures)} failed:\n" + "\n".join(failures[:20])
