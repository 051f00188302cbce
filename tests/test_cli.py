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
    """Split piped `finetune keys` lines at their tabs, after checking the header."""
    assert lines[0] == "key\ttype\tdefault\tdescription"
    rows = [tuple(line.split("\t")) for line in lines[1:]]
    assert all(len(row) == 4 for row in rows)  # no tab inside a field
    return rows


def test_keys_prints_one_parsable_line_per_key_on_stdout():
    """Piped (not a terminal), as in `finetune keys | grep` or `| less`: nothing on stderr, no name cut at 80
    columns, text in square brackets kept, real types and sizes in units, and no field padded (padding to the
    widest type made lines hundreds of characters long): a line is as long as its four fields and three tabs."""
    proc = subprocess.run([sys.executable, "-m", "finetune", "keys"], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "COLUMNS": "80", "PATH": ""}, check=True)
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    parsed = _columns(lines)
    assert all(len(line) == sum(map(len, row)) + 3 and row == tuple(f.strip() for f in row)
               for line, row in zip(lines[1:], parsed, strict=True))
    assert max(len(row[1]) for row in parsed) > 20  # a wide type exists, and did not widen the other lines
    rows = {row[0]: row for row in parsed}
    leaves = [key for key, _, is_section in iter_fields() if not is_section]
    assert list(rows) == leaves  # one line per key, every name whole
    assert any(len(key) > 30 for key in rows)  # e.g. distributed.interconnect_bandwidth, no "…"
    assert rows["adapter.modules_to_save"][1] == "list[str] | null"
    assert rows["memory.gpu_memory_margin"][2] == "512 MiB"
    assert rows["memory.offload_min_size"][2] == "1 MiB"
    assert "[q_proj, v_proj]" in rows["adapter.target_modules"][3]  # rich would have eaten it as markup


def _on_a_terminal(argv: list[str], columns: int) -> str:
    """What `finetune ARGV` writes to a terminal (a pseudo-terminal) `columns` wide, COLUMNS unset."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "finetune", *argv], cwd=ROOT, stdout=slave, stderr=subprocess.PIPE,
                            env={"PYTHONPATH": str(ROOT), "PATH": ""})
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    return b"".join(chunks).decode().replace("\r\n", "\n")


@pytest.mark.parametrize("columns", [100, 150])
def test_keys_on_a_terminal_wraps_to_its_width(columns):
    """On a terminal every line fits its width (piped, the longest line is over 600 characters: the type column
    padded to the reward list's type) and every key keeps its whole type, default and description: in columns
    where the description column is wide enough (150), else each description under its key (100)."""
    from finetune.recipe.docs import reference_rows

    lines = _on_a_terminal(["keys"], columns).splitlines()
    assert lines and max(map(len, lines)) <= columns
    rows = reference_rows()
    squeeze = "".join
    if columns == 100:  # key, type and default on a line, the description indented under it
        text = squeeze(lines).replace(" ", "")
        assert all(squeeze((key, typ, default, desc)).replace(" ", "") in text for key, typ, default, desc in rows)
        return
    starts = [lines[0].index(name) for name in ("key", "type", "default", "description")]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    found: list[list[str]] = []
    for line in lines[1:]:
        cells = [line[a:b].strip() for a, b in bounds]
        if cells[0]:
            found.append(cells)
        else:  # a wrapped continuation of the row above
            found[-1] = [f"{have} {more}".strip() for have, more in zip(found[-1], cells, strict=True)]
    assert [row[0] for row in found] == [row[0] for row in rows]
    assert all(squeeze(got).replace(" ", "") == squeeze(want).replace(" ", "")
               for got, want in zip(found, rows, strict=True))


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
    "an empty size in a list": (["plan", "RECIPE", "--gpu-memory", "8GiB,,x"], "'8GiB,,x': size 2 is empty; give "
                                "sizes with their units separated by commas, e.g. 8GiB,12GiB,16GiB,24GiB"),
    "a bad size in a list": (["plan", "RECIPE", "--gpu-memory", "8GiB,x"], "'8GiB,x': size 2, 'x',: expected a size"),
    "a size without a unit in a list": (["plan", "RECIPE", "--gpu-memory", "8GiB,12"], "size 2, '12', has no unit"),
    "auto in a list": (["plan", "RECIPE", "--gpu-memory", "8GiB,auto"], "auto (this GPU's free memory) plans alone"),
    "several sizes for a cpu": (["plan", "RECIPE", "--gpu-memory", "8GiB,12GiB", "--device", "cpu"],
                                "plans GPUs of those sizes, not this CPU"),
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


def test_a_gpu_size_in_gb_is_read_as_the_card_label_means_it_with_a_line_saying_so(tiny_recipe, capsys):
    """A "2 GB" card holds 2 GiB: --gpu-memory 2GB plans a 2 GiB budget, not 2e9 bytes, and
    says so on stderr in one line; 2GiB says nothing; MB stays decimal (the way to mean 10**9 bytes)."""
    assert main(["plan", str(tiny_recipe), "--gpu-memory", "2GB", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["budget_bytes"] == 2 * 2**30
    assert err.strip() == ("--gpu-memory: 2GB read as 2GiB, as a GPU's memory is labelled (a 16 GB card holds "
                           "16 GiB); for powers of 10 write MB, e.g. 2000MB")
    assert main(["plan", str(tiny_recipe), "--gpu-memory", "2GiB,2000MB", "--json"]) == 0
    out, err = capsys.readouterr()
    assert [row["gpu_bytes"] for row in json.loads(out)["sizes"]] == [2 * 2**30, 2 * 10**9] and err == ""


def test_a_max_seq_len_past_the_model_or_far_past_the_data_says_so(tiny_recipe, capsys):
    """Above the model's positions (the tiny model has 2,048): refused before the search, in one line naming
    the model's limit and the data's longest record, exit 2. Within them but far above the data's records, a
    plan where nothing fits says the data is far shorter."""
    import time

    from finetune import api

    start = time.monotonic()
    assert main(["plan", str(tiny_recipe), "--set", "data.max_seq_len=1000000"]) == 2
    err = capsys.readouterr().err
    recipe = api.load_recipe(str(tiny_recipe), ["data.max_seq_len=2048"])  # the model's limit: nothing cut
    longest = api.plan(recipe).data["longest_tokens"]  # the data as the plan tokenizes it with the model's tokenizer
    assert 5 < longest < api.longest_record_bytes(recipe)  # tokens, not the bound from the record's bytes
    assert err.splitlines()[0] == (f"error: data.max_seq_len 1,000,000 is above the model's own limit of 2,048 "
                                   f"positions (max_position_embeddings of {recipe.model.path}); "
                                   f"the longest example of {SAMPLE_DATA} has {longest:,} tokens")
    assert "set data.max_seq_len to at most 2,048" in err and "Traceback" not in err
    assert time.monotonic() - start < 60
    assert main(["plan", str(tiny_recipe), "--gpu-memory", "1MiB", "--set", "data.max_seq_len=2048"]) == 1
    assert (f"data.max_seq_len 2,048 is far above the data's longest example (the longest example of {SAMPLE_DATA} "
            f"has {longest:,} tokens)" in capsys.readouterr().err)
    assert main(["plan", str(tiny_recipe), "--gpu-memory", "1MiB", "--set", f"data.max_seq_len={4 * longest}"]) == 1
    assert "far above" not in capsys.readouterr().err


def test_plan_with_several_gpu_sizes_prints_a_row_per_size_as_the_planner_and_the_ui_chart_answer(tiny_recipe, capsys):
    """`--gpu-memory A,B,C`: each size's plan (fits, peak, settings, tokens/s: what `finetune plan --gpu-memory
    A` chooses) beside the UI chart's numbers for it (api.plan_gpu_sizes: longest context at micro-batch 1,
    largest micro-batch, marked where it is the search's cap); exit 0 when any size fits. One size: the plan
    as before."""
    from finetune import api
    from finetune.plan.search import MICRO_BATCHES
    from finetune.units import format_bytes

    sizes = ["256MiB", "540MiB", "1GiB"]  # the tiny model on CUDA: ~533 MiB, mostly the CUDA context
    assert main(["plan", str(tiny_recipe), "--gpu-memory", ",".join(sizes), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    recipe = api.load_recipe(str(tiny_recipe))
    chart = api.plan_gpu_sizes(recipe, (0.25, 540 / 1024, 1.0))["sizes"]
    assert [row["gpu_memory"] for row in report["sizes"]] == sizes
    for size, row, swept in zip(sizes, report["sizes"], chart, strict=True):
        alone = api.plan(recipe, gpu_memory=size)
        assert (row["fits"], row["peak_bytes"], row["settings"], row["tokens_per_s"]) == \
               (alone.fits, alone.peak_bytes, alone.settings, alone.tokens_per_s)
        assert (row["longest_context"], row["largest_micro_batch"]) == \
               (swept["longest_context"], swept["largest_micro_batch"])
    assert [row["fits"] for row in report["sizes"]] == [False, True, True]
    assert report["micro_batch_cap"] == max(MICRO_BATCHES) == report["sizes"][-1]["largest_micro_batch"]

    assert main(["plan", str(tiny_recipe), "--gpu-memory", ",".join(sizes)]) == 0
    out = capsys.readouterr().out
    small = report["sizes"][0]
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
    assert cells == [[size, "yes" if row["fits"] else "no", format_bytes(row["peak_bytes"]),
                      f"{row['tokens_per_s']:,.0f}" if row["fits"] else "-",
                      f"{row['longest_context']:,}" if row["longest_context"] else "none",
                      "none" if row["largest_micro_batch"] is None else str(row["largest_micro_batch"])
                      + (" (cap)" if row["largest_micro_batch"] == report["micro_batch_cap"] else "")]
                     for size, row in zip(sizes, report["sizes"], strict=True)]
    assert f"{report['micro_batch_cap']} (cap): the search tries micro-batches up to {report['micro_batch_cap']}" in out
    chosen = {}
    for size in sizes[1:]:
        assert main(["plan", str(tiny_recipe), "--gpu-memory", size]) == 0
        chosen[size] = capsys.readouterr().out.splitlines()[1].strip()  # the settings line under "Plan for cuda"
    assert (f"  256MiB: nothing fits: the leanest plan needs {format_bytes(small['min_budget_bytes'])}\n"
            f"  540MiB: {chosen['540MiB']}\n  1GiB: {chosen['1GiB']}\n") in out
    assert main(["plan", str(tiny_recipe), "--gpu-memory", "256MiB"]) == 1
    assert main(["plan", str(tiny_recipe), "--gpu-memory", "256MiB,300MiB"]) == 1  # no size fits: 1
    single = capsys.readouterr().out
    assert single.startswith("Plan for cuda: does not fit") and "plans per GPU size" in single.split("Nothing fits")[1]


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
