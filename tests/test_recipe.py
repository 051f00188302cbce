"""Recipe schema: overrides, readable errors (key path, line, did-you-mean), exit code 2, docs in sync."""

from __future__ import annotations

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


def test_validate_cli_exit_codes_without_traceback(tmp_path):
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
