"""Helpers shared by tests that train the tiny model through `finetune run`: a chat dataset and a small
LoRA recipe, so each test file states only what it changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.rundir import read_jsonl

# A small real data file, for recipes whose data only has to be there (`finetune plan` checks that it parses).
SAMPLE_DATA = str(Path(__file__).resolve().parents[1] / "recipes" / "data" / "quickstart.jsonl")


def sums_data(path: Path, n: int) -> Path:
    """`n` chat records "What is i plus i?" -> "It is 2i." with answers of varied length (messages format)."""
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}." + " yes" * (i % 5)}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def text_data(path: Path, lengths: list[int]) -> Path:
    """Text records of exactly `lengths` tokens of the tiny models' tokenizer (finetune.testing.make_tokenizer):
    records of different lengths make every micro-batch of several rows padded, as chat data does."""
    from finetune.testing import make_tokenizer

    tokenizer = make_tokenizer()
    ids = tokenizer("the quick brown fox jumps over the lazy dog " * max(lengths))["input_ids"]
    records = [tokenizer.decode(ids[:n]) for n in lengths]
    assert [len(tokenizer(r)["input_ids"]) for r in records] == lengths  # every record's length as asked
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in records))
    return path


def tiny_lora_recipe(model_dir: Path, data: Path, out_dir: Path, *overrides: dict) -> dict:
    """A LoRA recipe for the tiny model with every memory technique off; each override ({section: {key:
    value}}) is merged in order, section by section."""
    recipe = {
        "model": {"path": str(model_dir)}, "quantization": {"bits": None},
        "adapter": {"type": "lora", "r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 64, "batching": "random"},  # the order its tests compare
        "training": {"warmup_ratio": 0.0},
        "memory": {"activation_checkpointing": False, "chunked_loss": False, "tiled_mlp": False},
        "output": {"dir": str(out_dir), "save_steps": 100},
    }
    for sections in overrides:
        for section, values in sections.items():
            recipe[section] = {**recipe.get(section, {}), **values}
    return recipe


def three_step_recipe(folder: Path, arch: str, *overrides: dict, **shape: int) -> Path:
    """A tiny `arch` model in folder/model and a recipe file training it 3 steps of micro-batch 2 on text records
    of different lengths just under max_seq_len (`text_data`: every micro-batch padded) (LoRA without
    dropout, `tiny_lora_recipe`'s settings, then `overrides`) into folder/run; the recipe's path. `shape`
    overrides the tiny config (`num_hidden_layers=4`)."""
    import yaml

    from finetune.testing import make_tiny_model_dir

    model_dir = make_tiny_model_dir(folder / "model", arch, **shape)
    data = text_data(folder / "data.jsonl", [63 - k for k in range(12)])  # about max_seq_len 64, padded batches
    recipe = tiny_lora_recipe(model_dir, data, folder / "run",
                              {"training": {"max_steps": 3, "micro_batch_size": 2, "gradient_accumulation_steps": 1}},
                              {"adapter": {"dropout": 0.0}}, *overrides)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def assert_same_steps(run_dir: Path, reference_dir: Path, keys: tuple[str, ...], steps: list[int]) -> None:
    """metrics.jsonl of `run_dir` has exactly `steps`, each with the `keys` values of the same step in
    `reference_dir`'s (to float tolerance)."""
    expected = {r["step"]: r for r in read_jsonl(reference_dir / "metrics.jsonl") if "loss" in r}
    rows = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}
    assert sorted(rows) == steps
    for step, row in rows.items():
        for key in keys:
            assert row[key] == pytest.approx(expected[step][key], rel=1e-4, abs=1e-6), (step, key)


def torchrun(*args: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 -m finetune ARGS` with this checkout first on the path, one thread each."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "finetune", *args], env=env, capture_output=True, text=True, timeout=300)


def run_plan(run_dir: Path | str) -> dict:
    """A run's plan.json, made for the data's largest micro-batch (`longest`: its row length): what the run's
    measured peak is compared with."""
    plan = json.loads((Path(run_dir) / "plan.json").read_text())
    return {**plan, "longest": plan["data"]["sequence"]}
