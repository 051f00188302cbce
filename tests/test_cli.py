"""The command line as a newcomer meets it: `keys` output that pipes and parses, --version, exit code 2 for
every bad argument, and plan text that names only what applies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from finetune import __version__
from finetune.cli import main
from finetune.recipe.load import iter_fields, recipe_to_yaml
from finetune.recipe.schema import Recipe
from tests.run_support import SAMPLE_DATA

ROOT = Path(__file__).resolve().parents[1]


def _columns(lines: list[str]) -> list[tuple[str, str, str, str]]:
    """Split `finetune keys` lines at the columns its header starts."""
    header = lines[0]
    starts = [header.index(name) for name in ("key", "type", "default", "description")]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    return [tuple(line[a:b].strip() for a, b in bounds) for line in lines[1:]]


def test_keys_prints_one_parsable_line_per_key_on_stdout():
    """Piped (not a terminal), as in `finetune keys | grep`: nothing on stderr, no name cut at 80 columns,
    text in square brackets kept, real types and sizes in units."""
    proc = subprocess.run([sys.executable, "-m", "finetune", "keys"], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "COLUMNS": "80", "PATH": ""}, check=True)
    assert proc.stderr == ""
    rows = {row[0]: row for row in _columns(proc.stdout.splitlines())}
    leaves = [key for key, _, is_section in iter_fields() if not is_section]
    assert list(rows) == leaves  # one line per key, every name whole
    assert any(len(key) > 30 for key in rows)  # e.g. distributed.interconnect_bandwidth, no "…"
    assert rows["adapter.modules_to_save"][1] == "list[str] | null"
    assert rows["memory.gpu_memory_margin"][2] == "512 MiB"
    assert rows["memory.offload_min_size"][2] == "1 MiB"
    assert "[q_proj, v_proj]" in rows["adapter.target_modules"][3]  # rich would have eaten it as markup


def test_keys_of_one_section_and_an_unknown_section(capsys):
    assert main(["keys", "memory"]) == 0
    rows = _columns(capsys.readouterr().out.splitlines())
    assert rows and all(key.startswith("memory.") for key, *_ in rows)
    assert main(["keys", "memroy"]) == 2
    err = capsys.readouterr().err
    assert "no section 'memroy'" in err and "memory" in err.split("sections:")[1]


def test_the_markdown_reference_spells_sizes_in_units():
    assert "| `memory.gpu_memory_margin` | size (e.g. 12GiB) | `512 MiB` |" in (ROOT / "docs" / "recipe.md").read_text()


def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"finetune {__version__}"


@pytest.fixture(scope="module")
def tiny_recipe(tmp_path_factory) -> Path:
    from finetune.testing import make_tiny_model_dir

    folder = tmp_path_factory.mktemp("cli")
    model = make_tiny_model_dir(folder / "model")
    recipe = Recipe.model_validate({"model": {"path": str(model)}, "data": {"path": SAMPLE_DATA, "max_seq_len": 64},
                                    "quantization": {"bits": None}, "memory": {"gpu_memory_margin": 0}})
    path = folder / "recipe.yaml"
    path.write_text(recipe_to_yaml(recipe))
    return path


BAD = {  # argv (RECIPE: the tiny recipe, DIR: a folder that is not a run) -> what the message must say
    "a size without a unit": (["plan", "RECIPE", "--gpu-memory", "12"], "has no unit; give a size with its unit, e.g. 12GiB"),
    "a size that is not one": (["plan", "RECIPE", "--gpu-memory", "twelve"], "expected a size such as 12GiB"),
    "a budget the margin eats": (["plan", "RECIPE", "--gpu-memory", "1KiB", "--set", "memory.gpu_memory_margin=1MiB"],
                                 "leaves no budget"),
    "advice from a folder without it": (["plan", "RECIPE", "--advice", "DIR"], "no batch advice"),
    "zero gpus": (["plan", "RECIPE", "--gpus", "0"], "expected a positive whole number"),
    "zero steps": (["measure", "RECIPE", "--steps", "0"], "expected a positive whole number"),
    "an unknown device": (["plan", "RECIPE", "--device", "tpu"], "invalid choice"),
    "a missing recipe": (["validate", "DIR/none.yaml"], "recipe file not found"),
    "a bad override": (["validate", "RECIPE", "--set", "training.nope=1"], "unknown key training.nope"),
    "generate from a folder that is not a run": (["generate", "DIR", "--prompt", "hi"], "is not a run directory"),
    "no new tokens": (["generate", "DIR", "--prompt", "hi", "--max-new-tokens", "0"], "positive whole number"),
    "export from a folder that is not a run": (["export", "DIR", "--out", "DIR/out"], "is not a run directory"),
    "an unknown command": (["trian", "RECIPE"], "invalid choice"),
    "allow-data-change without resume": (["run", "RECIPE", "--allow-data-change"], "applies to --resume"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_every_bad_argument_exits_2_with_a_message(case, tiny_recipe, tmp_path, capsys):
    argv, message = BAD[case]
    argv = [a.replace("RECIPE", str(tiny_recipe)).replace("DIR", str(tmp_path)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exited:  # argparse's own checks
        code = exited.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, (code, err)


def test_a_single_gpu_plan_names_no_distributed_strategy(tiny_recipe, capsys):
    assert main(["plan", str(tiny_recipe), "--gpu-memory", "1GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["device"] == "cuda" and plan["world_size"] == 1
    every = [plan["settings"], *(c["settings"] for c in plan["alternatives"] + plan["rejected"])]
    assert all("strategy" not in s and "micro_batch_size" in s for s in every)
    assert main(["plan", str(tiny_recipe), "--gpu-memory", "1GiB"]) == 0
    assert "strategy" not in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [(["--port", "99999"], "expected a port from 1 to 65535"),
                                           (["--port", "http"], "expected a port"),
                                           (["--allow-dir", "/no/such/folder"], "is not a folder")])
def test_bad_ui_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["ui", *argv])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_run_no_plan_trains_without_a_plan_and_says_so(tiny_recipe, tmp_path, capsys):
    """--no-plan is memory.plan: false: no plan.json, the auto keys with a safe plain value take it, one line
    says nothing predicts the fit."""
    out = tmp_path / "run"
    assert main(["run", str(tiny_recipe), "--no-plan", "--set", f"output.dir={out}",
                 "--set", "training.max_steps=1"]) == 0
    captured = capsys.readouterr()
    said = " ".join((captured.out + captured.err).split())
    assert "memory plan skipped (memory.plan: false)" in said and "memory.chunked_loss: auto -> false" in said
    assert not (out / "plan.json").exists() and (out / "adapter").is_dir()
