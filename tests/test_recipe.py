"""Recipe schema: overrides, readable errors (key path, line, did-you-mean), exit code 2, docs in sync."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.cli import main
from finetune.errors import RecipeError
from finetune.recipe import load_recipe, validate_recipe
from finetune.recipe.docs import reference_markdown

ROOT = Path(__file__).resolve().parents[1]

GOOD = """\
model:
  path: ./models/my-model
data:
  path: data/train.jsonl
training:
  learning_rate: 1.0e-4
"""


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def problems_of(path: Path, overrides=None) -> list[str]:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    return info.value.problems


def test_defaults_and_overrides(tmp_path):
    recipe = load_recipe(write(tmp_path, GOOD), ["training.max_steps=10", "adapter.r=8", "memory.gpu_memory=12GiB"])
    assert recipe.training.max_steps == 10 and recipe.adapter.r == 8
    assert recipe.memory.gpu_memory == 12 * 2**30
    assert recipe.training.learning_rate == 1e-4 and recipe.quantization.bits == 4


def test_unknown_key_names_path_line_and_closest_key(tmp_path):
    path = write(tmp_path, GOOD.replace("learning_rate", "lerning_rate"))
    [problem] = problems_of(path)
    assert problem == f"{path}:6: unknown key training.lerning_rate; did you mean training.learning_rate?"


def test_one_message_per_problem(tmp_path):
    text = GOOD + "memory:\n  offload: ssd\nadapter:\n  r: zero\n"
    problems = problems_of(write(tmp_path, text), ["training.micro_batch_size=big"])
    assert len(problems) == 3
    joined = "\n".join(problems)
    assert "memory.offload" in joined and "'ssd'" in joined
    assert "adapter.r" in joined and "'zero'" in joined
    assert "training.micro_batch_size" in joined and "'auto'" in joined


def test_missing_required_and_unknown_section(tmp_path):
    problems = problems_of(write(tmp_path, "model:\n  path: x\ntrainig:\n  epochs: 1\n"))
    assert any("missing required key data" in p for p in problems)
    assert any("unknown key trainig; did you mean training?" in p for p in problems)


def test_incoherent_combination_is_explained():
    with pytest.raises(RecipeError) as info:
        validate_recipe({"model": {"path": "m"}, "data": {"path": "d"}, "adapter": {"type": "full"}})
    assert "quantization.bits: null" in str(info.value)


def test_bad_set_syntax(tmp_path):
    with pytest.raises(RecipeError, match="use --set section.key=value"):
        load_recipe(write(tmp_path, GOOD), ["training.max_steps"])


def test_validate_cli_exit_codes_without_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # GOOD's paths are relative, and validate checks that they exist
    (tmp_path / "models" / "my-model").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"text": "hello"}\n')
    good = write(tmp_path, GOOD)
    assert main(["validate", str(good)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("learning_rate", "lerning_rate"))
    proc = subprocess.run([sys.executable, "-m", "finetune", "validate", str(bad)], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "200"})
    assert proc.returncode == 2
    assert "did you mean training.learning_rate?" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_docs_reference_is_generated_from_schema():
    """docs/recipe.md is the schema's own text; regenerate with `finetune keys --markdown > docs/recipe.md`."""
    assert (ROOT / "docs" / "recipe.md").read_text() == reference_markdown()


def test_every_shipped_recipe_validates():
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    assert recipes, "no recipes shipped"
    for path in recipes:
        load_recipe(path)


# -- issue #11: every hole named there is refused with file, line and key ----------------------------------------

def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.strip().startswith(needle + ":"))


@pytest.mark.parametrize(("section", "entry", "key", "says"), [
    ("training", "learning_rate: .inf", "training.learning_rate", "finite"),
    ("training", "learning_rate: 2.0", "training.learning_rate", "less than or equal to 1"),
    ("training", "seed: -1", "training.seed", "greater than or equal to 0"),
    ("training", "max_grad_norm: .nan", "training.max_grad_norm", "finite"),
    ("training", "max_grad_norm: 0", "training.max_grad_norm", "greater than 0"),
    ("training", "max_steps: true", "training.max_steps", "not true"),
    ("training", "micro_batch_size: false", "training.micro_batch_size", "not false"),
    ("training", "epochs: .inf", "training.epochs", "finite"),
    ("training", "warmup_ratio: 1.5", "training.warmup_ratio", "less than 1"),
    ("training", "gradient_accumulation_steps: -2", "training.gradient_accumulation_steps", "positive"),
    ("memory", "gpu_memory: 0", "memory.gpu_memory", "greater than 0"),
    ("memory", "gpu_memory: -1", "memory.gpu_memory", "0 or more"),
    ("memory", "gpu_memory: .inf", "memory.gpu_memory", "finite"),
    ("memory", "gpu_memory: -12GiB", "memory.gpu_memory", "a size such as 12GiB"),
    ("memory", "gpu_memory: 1e999GiB", "memory.gpu_memory", "a size such as 12GiB"),
    ("memory", "offload_min_size: -1", "memory.offload_min_size", "0 or more"),
    ("memory", "offload_cpu_limit: .nan", "memory.offload_cpu_limit", "finite"),
    ("memory", "gpu_memory_margin: 2000TiB", "memory.gpu_memory_margin", "at most 1 PiB"),
    ("memory", "offload_dir: ''", "memory.offload_dir", "must not be empty"),
    ("optimizer", "betas: [0.9, 1.0]", "optimizer.betas", "less than 1"),
    ("optimizer", "betas: [-0.1, 0.999]", "optimizer.betas", "greater than or equal to 0"),
    ("optimizer", "betas: [true, 0.999]", "optimizer.betas", "not true"),
    ("optimizer", "eps: 0", "optimizer.eps", "greater than 0"),
    ("optimizer", "weight_decay: -0.1", "optimizer.weight_decay", "greater than or equal to 0"),
    ("adapter", "target_modules: []", "adapter.target_modules", "empty list"),
    ("adapter", "dropout: 1", "adapter.dropout", "less than 1"),
    ("adapter", "r: 0", "adapter.r", "greater than or equal to 1"),
    ("data", "max_seq_len: -8", "data.max_seq_len", "greater than or equal to 8"),
    ("data", "max_samples: 0", "data.max_samples", "greater than or equal to 1"),
    ("data", "chat_template: \"a\\0b\"", "data.chat_template", "NUL"),
    ("output", "dir: ''", "output.dir", "must not be empty"),
    ("output", "save_steps: 1.0e+30", "output.save_steps", "integer"),
])
def test_bad_number_or_string_is_refused_with_line_and_key(tmp_path, section, entry, key, says):
    head = "" if section == "data" else f"{section}:\n"
    text = f"model:\n  path: m\ndata:\n  path: d\n{head}  {entry}\n"
    path = write(tmp_path, text)
    [problem] = problems_of(path)
    assert problem.startswith(f"{path}:{line_of(text, entry.split(':')[0])}: {key}: "), problem
    assert says in problem


@pytest.mark.parametrize("entry", ["model:\n  path: ''\ndata:\n  path: d\n", "model:\n  path: \"m\\0\"\ndata:\n  path: d\n",
                                   "model:\n  path: m\ndata:\n  path: '   '\n"])
def test_empty_or_nul_paths_are_refused(tmp_path, entry):
    [problem] = problems_of(write(tmp_path, entry))
    assert ".path: must not" in problem


def test_empty_low_rank_target_modules_is_refused():
    with pytest.raises(RecipeError, match="optimizer.target_modules: must not be an empty list"):
        validate_recipe({"model": {"path": "m"}, "data": {"path": "d"},
                         "optimizer": {"name": "galore", "target_modules": []}})


def test_duplicate_keys_and_sections_name_both_lines(tmp_path):
    text = GOOD + "  learning_rate: 3.0e-4\nmodel:\n  path: other\n"
    path = write(tmp_path, text)
    problems = problems_of(path)
    assert f"{path}:7: training.learning_rate: duplicate key (also on line 6); the recipe must give it once" in problems
    assert f"{path}:8: model: duplicate key (also on line 1); the recipe must give it once" in problems


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "-1", "-1GiB", "garbage", "12 parsecs", "1e400GiB",
                                   "9" * 5000, "true", "2000TiB", "1" * 40 + "GiB"])
def test_parse_bytes_raises_only_value_error(value):
    """The planner's --gpu-memory relies on ValueError only (OverflowError was a traceback for .inf)."""
    from finetune.units import parse_bytes

    with pytest.raises(ValueError):
        parse_bytes(yaml_value(value))


def yaml_value(text: str):
    import yaml

    return yaml.safe_load(text)


def test_parse_bytes_reads_units():
    from finetune.units import parse_bytes

    assert parse_bytes("12GiB") == 12 * 2**30 and parse_bytes("512 MB") == 512 * 10**6 and parse_bytes(1.5) == 1
    assert parse_bytes("auto") == "auto" and parse_bytes(0) == 0


@pytest.mark.parametrize(("content", "says"), [
    (bytes(range(256)), ":2: not UTF-8 text (byte 0x80"),
    (b"model:\n  path: caf\xe9\n", ":2: not UTF-8 text (byte 0xe9"),
    (b"model:\n  path: m\n\x00\x01\x02", ":3: not valid YAML"),
    (b"- model\n- data\n", ":1: the recipe must be a mapping of sections"),
    (b"model:\n  path: m\n  'a b': 1\n", ":3: model: key 'a b' is not a recipe key"),
    ("model:\n  path: m\n  \U0001F600: 1\n".encode(), ":3: model: key '\U0001F600' is not a recipe key"),
    (b"model:\n  path: m\n1: x\n", ":3: (recipe): key '1' is not a recipe key"),
    (b"model:\n  path: m\n[a]: x\n", ":3: (recipe): key a sequence is not a recipe key"),
    (b"model:\n  path: m\n" + b"x:\n" + b"".join(b"  " * i + b"k:\n" for i in range(1, 40)), ":19: nested more than"),
    (b"model: " + b"[" * 100_000, ":1: nested more than 16 levels deep"),
    (b"model: &a\n  path: m\n  x: *a\n", ":1: model.x: an alias refers to itself"),
    (b"model:\n  path: 2020-13-45\n", ":2: not valid YAML: 'cannot read this value"),
    (b"model:\n  path: m\n  revision: " + b"9" * 5000 + b"\n", ":3: not valid YAML: 'cannot read this value"),
    (b"model: {path: m\ndata:\n", ":2: not valid YAML"),
])
def test_unreadable_recipes_are_one_line_errors(tmp_path, content, says):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(content)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert f"{path}{says}" in str(info.value)


@pytest.mark.parametrize("stopped_by", ["ours", "pyyaml"])
def test_nesting_error_names_file_line_and_limit_whichever_parser_stops_first(tmp_path, monkeypatch, stopped_by):
    """pyyaml >= 6.0.3 (libyaml) refuses deep nesting itself, possibly before our depth check sees an event;
    either way the user reads the same one line, not a hint about indentation."""
    import yaml

    if stopped_by == "pyyaml":  # what pyyaml 6.0.4 raises for 100,000 '[' (older ones never do)
        mark = yaml.Mark("<unicode string>", 0, 4, 7, None, None)

        def parse(*args, **kwargs):
            raise yaml.scanner.ScannerError("while increasing flow level", mark, "exceeded maximum nesting depth",
                                            mark)
            yield  # a generator, like yaml.parse

        monkeypatch.setattr(yaml, "parse", parse)
    path = write(tmp_path, "model:\n  path: m\n" + "x:\n" + "".join("  " * i + "k:\n" for i in range(1, 40)))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    line = 5 if stopped_by == "pyyaml" else 19
    assert str(info.value) == f"{path}:{line}: nested more than 16 levels deep; a recipe is sections of keys " \
                              "(see `finetune keys`)"


def alias_bomb(levels: int = 9) -> str:
    text = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for prev, name in itertools.pairwise("abcdefghijklmnop"[:levels]):
        text += f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]\n"
    return text


def test_alias_bomb_is_refused_without_expanding_it(tmp_path):
    import tracemalloc

    text = alias_bomb()
    assert len(text) < 800
    path = write(tmp_path, text)
    tracemalloc.start()
    try:
        with pytest.raises(RecipeError, match=r"recipe.yaml:\d+: \w+: YAML aliases expand to more than 10000 values"):
            load_recipe(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5 * 2**20  # 9**9 strings would be gigabytes


def test_a_few_aliases_are_fine(tmp_path):
    text = GOOD + "adapter:\n  target_modules: &mods [q_proj, v_proj]\noptimizer:\n  name: galore\n  target_modules: *mods\n"
    recipe = load_recipe(write(tmp_path, text))
    assert recipe.optimizer.target_modules == ["q_proj", "v_proj"] == recipe.adapter.target_modules


def test_oversized_recipe_file_is_refused_before_reading_it_whole(tmp_path):
    path = write(tmp_path, GOOD + "#" * (1 << 21))
    with pytest.raises(RecipeError, match="larger than 1048576 bytes"):
        load_recipe(path)


@pytest.mark.parametrize(("item", "says"), [
    ("training.max_steps=true", "--set: training.max_steps: expected a number or a name here, not true"),
    ("memory.gpu_memory=.inf", "--set: memory.gpu_memory: must be a finite number"),
    ("a b.c=1", "--set 'a b.c': 'a b' is not a recipe key"),
    ("model.path=[a", "--set model.path: not valid YAML"),
    ("model={path: a, path: b}", "--set: model.path: duplicate key"),
    ("model.path=" + alias_bomb().replace("\n", ", ").join("{}"), "--set: model.path.e: YAML aliases expand"),
])
def test_set_overrides_go_through_the_same_checks(tmp_path, item, says):
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, GOOD), [item])
    assert says in str(info.value)


def test_recipe_text_loads_like_a_file(tmp_path):
    from finetune.recipe import load_recipe_text

    assert load_recipe_text(GOOD, "upload.yaml") == load_recipe(write(tmp_path, GOOD))
    with pytest.raises(RecipeError, match="upload.yaml:3: data.path: duplicate key"):
        load_recipe_text("data:\n  path: a\n  path: b\n", "upload.yaml")
    with pytest.raises(RecipeError, match="aliases expand"):
        load_recipe_text(alias_bomb(), "upload.yaml")


def test_cli_prints_user_text_that_looks_like_markup(tmp_path, capsys):
    """rich would read `[/red]` in a user's value as a closing tag and raise a MarkupError traceback."""
    path = write(tmp_path, GOOD + "memory:\n  offload: '[/red]'\n")
    assert main(["validate", str(path)]) == 2
    assert "(got '[/red]')" in capsys.readouterr().err


# names pydantic also writes into an error's location (union branches, validators): as keys they are still keys
COLLIDING_KEYS = ["int", "str", "none", "literal_x", "function-after", "constrained-int", "a b", ""]


@pytest.mark.parametrize("key", COLLIDING_KEYS)
def test_any_unknown_key_is_one_located_line(tmp_path, capsys, key):
    from finetune import api

    good = {"model": {"path": "m"}, "data": {"path": "d"}}
    shown = key if key.isidentifier() else repr(key)
    for data, dotted in (({**good, key: 1}, shown), ({**good, "model": {"path": "m", key: 1}}, f"model.{shown}")):
        with pytest.raises(RecipeError) as info:
            api.validate(data)
        [line] = info.value.problems
        assert line.startswith(f"recipe: unknown key {dotted}; ")
    if key.isidentifier():  # what YAML lets through to validation (other names are refused as they are read)
        path = write(tmp_path, GOOD + f"{key}: 1\n")
        assert main(["validate", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"recipe.yaml:7: unknown key {key}" in err and "Traceback" not in err


def test_python_data_nested_past_the_limit_is_one_line(tmp_path):
    """api.validate takes Python data that no YAML reader bounded: a 2,000-deep list must not recurse."""
    from finetune import api

    deep: list = []
    for _ in range(2000):
        deep = [deep]
    for section, key in (("training", "learning_rate"), ("data", "path"), ("adapter", "target_modules")):
        with pytest.raises(RecipeError) as info:
            api.validate({"model": {"path": "m"}, "data": {"path": "d"}, section: {key: deep}})
        [line] = info.value.problems
        assert line.startswith(f"recipe: {section}.{key}: nested more than 16 levels deep") and "(got [[[" in line
    with pytest.raises(RecipeError, match=r"recipe: training: nested more than 16 levels deep.*\(got \[\[\["):
        api.validate({"model": {"path": "m"}, "data": {"path": "d"}, "training": deep})
