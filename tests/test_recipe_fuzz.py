"""Fuzz the recipe loader as a careless user and an attacker would (issue #11): thousands of seeded mutations of
valid recipes go through the load path the CLI uses, in-process. Each must end in a valid Recipe or in a
FinetuneError whose every line names the file (or --set) and a line or key; none may take more than 2 s or
200 MB. A small sample runs through `python -m finetune validate` for exit code 2 and no traceback."""

from __future__ import annotations

import copy
import os
import random
import re
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from finetune import api
from finetune.errors import FinetuneError
from finetune.recipe import Recipe, recipe_to_yaml, validate_recipe
from finetune.recipe.load import iter_fields

ROOT = Path(__file__).resolve().parents[1]
MINIMAL = "model:\n  path: ./models/my-model\ndata:\n  path: data/train.jsonl\n"
BASES = [MINIMAL, (ROOT / "recipes" / "quickstart.yaml").read_text(),
         recipe_to_yaml(validate_recipe(yaml.safe_load(MINIMAL)))]
FIELDS = [(key, is_section) for key, _, is_section in iter_fields()]
LEAVES = [key for key, is_section in FIELDS if not is_section]
SECTIONS = [key for key, is_section in FIELDS if is_section]
KEY_NAMES = {key.rsplit(".", 1)[-1] for key, _ in FIELDS} | {"(recipe)"}
PARSED = {text: yaml.safe_load(text) for text in BASES}


def parsed(text: str) -> dict:
    """A fresh copy of a base recipe's mapping (parsing it again per case would dominate the run time)."""
    return copy.deepcopy(PARSED[text])

HOSTILE = [float("inf"), float("-inf"), float("nan"), -1, 0, -0.5, 1.0, 1e308, 10**30, -(10**30), True, False, None,
           "", " ", "a\x00b", "\x00", [], {}, [None], [1, 2, 3], {"a": 1}, ["q_proj", ""], "12GiB", "-1GiB", ".inf",
           "auto", "none", "\U0001F600", "[/red]", "x" * 5000, "1e400GiB", "9" * 400, [0.9, 1.0], [0.9], 2**63,
           "2020-01-01", "0x10", "1_000", "  12 GiB  "]
SPECIAL = [":", ": ", "-", "- ", "[", "]", "{", "}", "&x ", "*x", "!!python/object:os.system ", "!!binary ", "\t", '"',
           "'", "%", "@", "`", "|", ">", "\n---\n", "\n...\n", "? ", "!", "#", ",", "<<: ", "\\", "\r", "\u2028"]
BAD_KEYS = ["a b", "\U0001F600", "1", "null", "true", "[a]", "? {a: 1}", "'': 1", "<<", "-", "é", "ke\u200by", "~"]


def dump(data) -> str:
    return yaml.dump(data, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False, allow_unicode=True)


def set_leaf(data: dict, key: str, value) -> None:
    section, name = key.split(".")
    if not isinstance(data.get(section), dict):
        data[section] = {}
    data[section][name] = value


# Each mutator: (rng, base text) -> (file bytes, --set overrides).
Case = tuple[bytes, list[str]]


def hostile_value(rng: random.Random, text: str) -> Case:
    data = parsed(text)
    for _ in range(rng.randint(1, 3)):
        set_leaf(data, rng.choice(LEAVES), rng.choice(HOSTILE))
    return dump(data).encode(), []


def swapped_value(rng: random.Random, text: str) -> Case:
    """A value of another key: right YAML, wrong type or range more often than not."""
    full = PARSED[BASES[2]]
    data = parsed(text)
    source = rng.choice(LEAVES).split(".")
    set_leaf(data, rng.choice(LEAVES), full[source[0]][source[1]])
    return dump(data).encode(), []


def unknown_or_missing(rng: random.Random, text: str) -> Case:
    data = parsed(text)
    choice = rng.randrange(4)
    if choice == 0:
        set_leaf(data, f"{rng.choice(SECTIONS)}.{rng.choice(LEAVES).split('.')[1]}x", 1)
    elif choice == 1:
        data[rng.choice(["trainig", "memry", "extra", "model_path"])] = {"a": 1}
    elif choice == 2:
        data.pop(rng.choice(["model", "data"]), None)
    else:
        data[rng.choice(SECTIONS)] = rng.choice([1, "x", [1], None, True, ""])
    return dump(data).encode(), []


def line_edit(rng: random.Random, text: str) -> Case:
    lines = text.splitlines(keepends=True)
    i = rng.randrange(len(lines))
    choice = rng.randrange(4)
    if choice == 0:  # a duplicate key or section
        lines.insert(rng.randrange(i, len(lines) + 1), lines[i])
    elif choice == 1:
        del lines[i]
    elif choice == 2:
        lines[i] = " " * rng.randint(1, 5) + lines[i]
    else:
        text = "".join(lines)
        return text[:rng.randrange(len(text))].encode(), []
    return "".join(lines).encode(), []


def special_chars(rng: random.Random, text: str) -> Case:
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(text) + 1)
        text = text[:i] + rng.choice(SPECIAL) + text[i:]
    return text.encode(), []


def bad_bytes(rng: random.Random, text: str) -> Case:
    raw = bytearray(text.encode())
    choice = rng.randrange(6)
    if choice == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 2000))), []
    if choice == 1:
        for _ in range(rng.randint(1, 5)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return bytes(raw), []
    if choice == 2:
        return text.replace("path: ", "path: caf\u00e9").encode("latin-1"), []
    if choice == 3:
        i = rng.randrange(len(raw))
        return bytes(raw[:i] + b"\x00" + raw[i:]), []
    if choice == 4:
        return text.encode(rng.choice(["utf-16", "utf-32", "utf-8-sig"])), []
    return bytes(raw) + b"\n" + bytes(raw), []


def aliases(rng: random.Random, text: str) -> Case:
    choice = rng.randrange(4)
    if choice == 0:  # a "billion laughs" bomb of random width and depth
        width, levels = rng.randint(2, 12), rng.randint(3, 14)
        out = "a0: &a0 [" + ", ".join(["lol"] * width) + "]\n"
        for n in range(1, levels):
            out += f"a{n}: &a{n} [" + ", ".join([f"*a{n - 1}"] * width) + "]\n"
        return (text + out if rng.random() < 0.5 else out).encode(), []
    if choice == 1:
        return (text + "x: &s\n  y: *s\n").encode(), []
    if choice == 2:
        return text.replace("path:", "path: *nowhere #", 1).encode(), []
    return (text + "adapter:\n  target_modules: &m [q_proj]\noptimizer:\n  name: galore\n  target_modules: *m\n"
            ).encode(), []


def deep(rng: random.Random, text: str) -> Case:
    depth = rng.choice([rng.randint(2, 30), rng.randint(30, 200), rng.randint(1000, 20000)])
    choice = rng.randrange(3)
    if choice == 0:
        nested = "[" * depth + "]" * depth
    elif choice == 1:
        nested = "{a: " * depth + "1" + "}" * depth
    else:
        nested = "\n" + "".join("  " * (i + 1) + "k:\n" for i in range(min(depth, 300)))
    section = rng.choice(SECTIONS)
    return (text + f"{section}:\n  {rng.choice(LEAVES).split('.')[1]}: {nested}\n").encode(), []


def bad_keys(rng: random.Random, text: str) -> Case:
    key = rng.choice(BAD_KEYS)
    indent = rng.choice(["", "  "])
    lines = text.splitlines(keepends=True)
    i = rng.randrange(len(lines) + 1)
    lines.insert(i, f"{indent}{key}: 1\n")
    return "".join(lines).encode(), []


def huge(rng: random.Random, text: str) -> Case:
    data = parsed(text)
    size = rng.choice([5_000, 20_000, 100_000])
    value = rng.choice(["x" * size, "x " * (size // 2), list(range(size // 50)), {f"k{i}": i for i in range(size // 100)}])
    set_leaf(data, rng.choice(LEAVES), value)
    return dump(data).encode(), []


def overrides(rng: random.Random, text: str) -> Case:
    items = []
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(LEAVES + SECTIONS + ["a b", "x", "training..max_steps", "", "model.path.deeper"])
        value = rng.choice([yaml.safe_dump(rng.choice(HOSTILE), default_flow_style=True).strip().removesuffix("...").strip(),
                            rng.choice(SPECIAL), "[" * 50, "&a [*a]", "{a: 1, a: 2}", "", "1e999", "\x00"])
        items.append(rng.choice([f"{key}={value}", key, f"={value}"]))
    return text.encode(), items


def documents(rng: random.Random, text: str) -> Case:
    return rng.choice([text + "---\n" + text, "---\n" + text, "", "\n", "# only a comment\n", "~", "[]", "42",
                       "'a string'", "!!set {a}", "!!omap [a: 1]", "model: [", "{", ":", "- -", "\t"]).encode(), []


MUTATORS: list[Callable[[random.Random, str], Case]] = [
    hostile_value, swapped_value, unknown_or_missing, line_edit, special_chars, bad_bytes, aliases, deep,
    bad_keys, huge, overrides, documents]


def cases(seed: int, n: int):
    rng = random.Random(seed)
    for i in range(n):
        mutate = MUTATORS[i % len(MUTATORS)]
        yield f"seed {seed} case {i} ({mutate.__name__})", *mutate(rng, rng.choice(BASES))


def located(line: str, path: Path) -> bool:
    """A message line names the file and then a line number or a recipe key, or names the --set argument."""
    if line.startswith("--set"):
        return True
    rest = line.removeprefix(str(path))
    if rest == line:
        return False
    return bool(re.match(r":\d+: ", rest)) or any(re.search(rf"\b{re.escape(k)}\b", rest) for k in KEY_NAMES)


def run_case(path: Path, content: bytes, items: list[str]) -> tuple[Recipe | FinetuneError, float, int]:
    """Load one case as the CLI does; any exception other than FinetuneError fails the test with its traceback."""
    path.write_bytes(content)
    tracemalloc.start()  # traced per case only: tracing the generator too would double the run time
    try:
        start = time.process_time()  # this process's CPU time: other processes on a busy machine do not count
        try:
            result: Recipe | FinetuneError = api.load_recipe(path, items)
        except FinetuneError as exc:
            result = exc
        return result, time.process_time() - start, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_every_fuzzed_recipe_is_valid_or_a_located_error(tmp_path, seed):
    path = tmp_path / "recipe.yaml"
    outcomes = {"valid": 0, "error": 0}
    slowest = (0.0, "")
    biggest = (0, "")
    for name, content, items in cases(seed, 600):
        result, seconds, peak = run_case(path, content, items)
        slowest, biggest = max(slowest, (seconds, name)), max(biggest, (peak, name))
        if isinstance(result, Recipe):
            outcomes["valid"] += 1
            continue
        outcomes["error"] += 1
        lines = result.problems or [result.message]
        for line in lines:
            assert "\n" not in line and located(line, path), f"{name}: {line!r}"
        assert "Traceback" not in str(result), name
    assert slowest[0] < 2.0, f"slowest case took {slowest[0]:.2f} s of CPU: {slowest[1]}"
    assert biggest[0] < 200 * 2**20, f"largest case peaked at {biggest[0] / 2**20:.0f} MiB: {biggest[1]}"
    # The generator is only worth its time if it reaches both outcomes. The draws follow the schema's keys, so
    # each new key moves them: 29-46 valid of 600 per seed with the keys of late 2026; 20 leaves that room.
    assert outcomes["valid"] >= 20 and outcomes["error"] >= 300, outcomes


def test_cli_sample_exits_2_with_a_located_message_and_no_traceback(tmp_path):
    """One error case from each of ten mutators, through `python -m finetune validate` in parallel."""
    chosen: dict[str, tuple[Path, list[str]]] = {}
    for name, content, items in cases(99, 240):
        kind = name.split("(")[1]
        if kind in chosen or len(chosen) == 10:
            continue
        path = tmp_path / f"{len(chosen)}.yaml"
        if isinstance(run_case(path, content, items)[0], FinetuneError):
            chosen[kind] = (path, items)
    assert len(chosen) == 10
    env = {"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "COLUMNS": "200",
           "OMP_NUM_THREADS": "1"}
    procs = {kind: (path, items, subprocess.Popen(
        [sys.executable, "-m", "finetune", "validate", str(path), *(a for i in items for a in ("--set", i))],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)) for kind, (path, items) in chosen.items()}
    for kind, (path, _items, proc) in procs.items():
        out, err = (b.decode("utf-8", "replace") for b in proc.communicate(timeout=120))
        assert proc.returncode == 2, (kind, err)
        assert "Traceback" not in out + err, (kind, err)
        assert str(path) in err or "--set" in err, (kind, err)


# ---- data mixes and MoE offload keys ---------------------------------------------------------------------------

MIX_VALUES = [5e-324, 1e-300, 0.5, 1.0, 1e308, float("inf"), float("nan"), -1, 0, True, "1", None, [], 2**31 - 1,
              2**31, 10**30, 101, 1.5]
OFFLOAD_DIRS = ["offload", "x" * 300, "a/" + "b" * 256, "é" * 130, "a\x00b", "", " ", 5, None, [], "~/off/../off",
                "/" * 3, "x" * 255]
EXPERT_TIERS = ["none", "cpu", "disk", "auto", True, False, "gpu", 1, None, "DISK", ""]


def mix_and_offload(rng: random.Random, text: str) -> Case:
    """data.path as a list of 1-4 entries (plain paths, weights, record counts, both, hostile values, the same
    file twice) and the MoE offload keys with hostile values."""
    data = parsed(text)
    entries: list = []

    def value() -> object:  # hostile one time in four, else a plain amount
        return rng.choice(MIX_VALUES) if rng.random() < 0.25 else rng.choice([0.5, 1, 3, 7, 100])

    for k in range(rng.randint(1, 3)):
        path = rng.choice([f"{k}.jsonl"] * 8 + ["a.jsonl", "", None])
        shape = rng.choice([0, 0, 1, 1, 2, 2, 3, 4])
        entries.append(path if shape == 0 else {"path": path, "weight": value()} if shape == 1 else
                       {"path": path, "records": value()} if shape == 2 else
                       {"path": path, "weight": value(), "records": value()} if shape == 3 else
                       rng.choice(MIX_VALUES))
    set_leaf(data, "data.path", entries)
    if rng.random() < 0.5:
        set_leaf(data, "memory.offload_experts", rng.choice(EXPERT_TIERS))
    if rng.random() < 0.5:
        set_leaf(data, "memory.offload_dir", rng.choice(OFFLOAD_DIRS))
    return dump(data).encode(), []


@pytest.mark.parametrize("seed", [10, 11])
def test_fuzzed_mixes_and_offload_keys_are_valid_or_a_located_error(tmp_path, seed):
    """Seeded mixes and offload keys through the loader: a Recipe or located lines; a valid one's weights are
    finite and positive, its counts within MAX_COUNT and its offload_dir a folder every disk can make. The
    failing case names its seed (`cases`' name)."""
    from finetune.recipe.schema import MAX_COUNT, NAME_MAX

    path = tmp_path / "recipe.yaml"
    rng = random.Random(seed)
    outcomes = {"valid": 0, "error": 0}
    for i in range(300):
        name = f"seed {seed} case {i} (mix_and_offload)"
        content, items = mix_and_offload(rng, rng.choice(BASES))
        result, seconds, _ = run_case(path, content, items)
        assert seconds < 2.0, name
        if isinstance(result, FinetuneError):
            outcomes["error"] += 1
            for line in result.problems or [result.message]:
                assert "\n" not in line and located(line, path), f"{name}: {line!r}"
            continue
        outcomes["valid"] += 1
        for entry in result.data.files():
            assert entry.weight is None or 0 < entry.weight < float("inf"), name
            assert entry.records is None or 1 <= entry.records <= MAX_COUNT, name
        folder = result.memory.offload_dir
        assert folder is None or ("\x00" not in folder and all(len(os.fsencode(p)) <= NAME_MAX
                                                                for p in folder.split("/"))), name
    assert outcomes["valid"] >= 30 and outcomes["error"] >= 100, outcomes


def test_fuzzed_moe_and_mix_recipes_through_the_preflight(tmp_path):
    """Recipes with image records, mixes and MoE offload keys, on a dense, a MoE and a vision-language model,
    through `api.preflight` (what validate, plan and run check before a model loads): a result or a FinetuneError
    of located lines, never another exception, and nothing written. Each case prints its seed."""
    import json

    from PIL import Image

    from finetune.testing import make_tiny_model_dir, vision_model

    models = {arch: make_tiny_model_dir(tmp_path / arch, arch) for arch in ("llama", "qwen3_moe")}
    models["qwen2_5_vl"] = vision_model("qwen2_5_vl", tmp_path / "qwen2_5_vl")
    (tmp_path / "img").mkdir()
    Image.new("RGB", (24, 16), "red").save(tmp_path / "img" / "good.png")
    Image.new("RGB", (300, 1), "red").save(tmp_path / "img" / "wide.png")
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    image = {"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "Red."}]}
    files = {"a.jsonl": [chat] * 3, "b.jsonl": [chat] * 10, "good-img.jsonl": [chat, {**image, "images": ["img/good.png"]}],
             "img.jsonl": [chat, {**image, "images": ["img/good.png"]}, {**image, "images": [None]},
                           {**image, "images": ["img/wide.png"]}, {**image, "images": ["img/good.png\x00x"]}]}
    for name, rows in files.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "recipe.yaml"
    outcomes = {"valid": 0, "error": 0}
    for i in range(40):
        seed = f"preflight:{i}"
        rng = random.Random(seed)
        arch = rng.choice(list(models))
        entries = [rng.choice([str(tmp_path / n), {"path": str(tmp_path / n), "weight": rng.choice([1e-300, 1.0, 1e308])},
                               {"path": str(tmp_path / n), "records": rng.choice([1, 50, 1000, 2**31 - 1])}])
                   for n in rng.sample(list(files), rng.randint(1, 3))]
        too_long = rng.random() < 0.2  # a folder name no disk takes: refused before anything else is checked
        recipe = {"model": {"path": str(models[arch])}, "data": {
            "path": entries if len(entries) > 1 or rng.random() < 0.5 else str(tmp_path / "img.jsonl"),
            "on_bad_record": rng.choice(["error", "skip"])}, "memory": {
            "offload_experts": rng.choice(["none", "cpu", "disk", "auto"]),
            "offload_dir": str(tmp_path / ("x" * 300)) if too_long else str(tmp_path / "off" / "deeper")},
            "output": {"dir": str(tmp_path / "run")}}
        print(f"random.Random({seed!r}): {arch} {recipe['data']} {recipe['memory']}")
        path.write_text(dump(recipe))
        try:
            api.preflight(api.load_recipe(path))
            outcomes["valid"] += 1
        except FinetuneError as exc:
            outcomes["error"] += 1
            for line in exc.problems or [exc.message]:
                assert "\n" not in line and (located(line, path) or "data.path" in line or str(tmp_path) in line
                                             or "memory.offload_experts" in line), f"{seed}: {line!r}"
        assert not (tmp_path / "run").exists() and not (tmp_path / "off").exists(), seed  # the preflight writes nothing
    assert outcomes["valid"] >= 8 and outcomes["error"] >= 8, outcomes  # both ends reached, not one refusal always
