"""Several processes on CPU over gloo (torchrun, as on N GPUs): the same losses as one process at the same
effective batch, one run directory written by rank 0 only, checkpoints resumable at another world size, and
combinations that cannot work refused before anything is written.

Tolerance: a loss or gradient norm of 2 processes may differ from 1 process only by float32 summation order
(an all-reduce of two halves instead of one accumulated sum): relative 1e-5. Measured: equal to the last digit.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from finetune.cli import main
from finetune.recipe import validate_recipe
from finetune.rundir import LOCK, MARKER, RunDir
from finetune.train.run import run
from tests.run_support import tiny_lora_recipe, torchrun

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5


def _data(tmp_path: Path, n: int = 16) -> Path:
    path = tmp_path / "data.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"What is the capital of France? ({i})"},
                          {"role": "assistant", "content": "The capital of France is Paris. " + "fox " * (i % 4)}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _recipe(tmp_path: Path, model_dir: Path, out: str, **sections) -> dict:
    return tiny_lora_recipe(model_dir, _data(tmp_path), tmp_path / out, {
        # effective batch 4 = micro-batch 2 x accumulation 2 (1 process) or x 2 processes (accumulation 1)
        "training": {"max_steps": 4, "micro_batch_size": 2, "gradient_accumulation_steps": "auto",
                     "effective_batch_size": 4, "learning_rate": 1e-2},
        "memory": {"activation_checkpointing": True}, "output": {"save_steps": 2}}, sections)


def _write(tmp_path: Path, recipe: dict, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(recipe))
    return path


def _losses(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in RunDir(run_dir).read_metrics() if "loss" in r]


def _assert_same(got: list, want: list) -> None:
    assert [s for s, _, _ in got] == [s for s, _, _ in want]
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(got, want, strict=True):
        assert loss == pytest.approx(ref_loss, rel=TOLERANCE), step
        assert norm == pytest.approx(ref_norm, rel=TOLERANCE), step


def _resume_from(run_dir: Path, step: int, new: Path) -> Path:
    """A copy of a finished run cut back to its checkpoint at `step`, as a run stopped there leaves it."""
    shutil.copytree(run_dir, new)
    for later in RunDir(new).checkpoints.glob("checkpoint-*"):
        if int(later.name.split("-")[1]) > step:
            shutil.rmtree(later)
    shutil.rmtree(RunDir(new).adapter)
    return new


def _only_rank_zero_wrote(run_dir: Path, processes: int) -> None:
    rd = RunDir(run_dir)
    log = rd.log.read_text()
    assert log.count("run started") == 1 and log.count("run completed") == 1
    rows = rd.read_metrics()
    assert [r["step"] for r in rows if "event" not in r] == [1, 2, 3, 4]  # one row per step, not per process
    assert [r["step"] for r in rows if r.get("event") == "checkpoint_saved"] == [2, 4]  # one per checkpoint
    assert rd.read_status()["state"] == "completed"
    assert rd.has_adapter() and not (rd.adapter / "training_args.bin").exists()
    assert yaml.safe_load(rd.recipe.read_text())["distributed"]["gpus"] == processes
    leftovers = [p.name for p in run_dir.iterdir() if p.name.startswith(".") and p.name not in (MARKER, LOCK)]
    assert leftovers == [] and not (rd.checkpoints / ".staging").exists()
    for checkpoint in rd.checkpoints.glob("checkpoint-*"):  # every rank's RNG state, one copy of the rest
        assert {p.name for p in checkpoint.glob("rng_state*")} == {f"rng_state_{r}.pth" for r in range(processes)}


def test_lora_ddp_on_two_processes_trains_as_one_and_resumes_at_one(tmp_path, tiny_model_dir):
    """torchrun -m finetune run: 2 processes (accumulation 1) give the losses and gradient norms of 1 process
    (accumulation 2); its step-2 checkpoint resumed by 1 process continues with the same losses."""
    two = _recipe(tmp_path, tiny_model_dir, "two", distributed={"strategy": "ddp"})
    done = torchrun("run", str(_write(tmp_path, two)))
    assert done.returncode == 0, done.stderr[-3000:]
    reference = run(validate_recipe(_recipe(tmp_path, tiny_model_dir, "one")))
    assert reference.state == "completed"
    _assert_same(_losses(tmp_path / "two"), _losses(tmp_path / "one"))
    _only_rank_zero_wrote(tmp_path / "two", 2)
    assert yaml.safe_load((tmp_path / "two" / "recipe.yaml").read_text())["training"][
        "gradient_accumulation_steps"] == 1

    resumed = _resume_from(tmp_path / "two", 2, tmp_path / "resumed")
    assert main(["run", str(_write(tmp_path, {**two, "output": {**two["output"], "dir": str(resumed)}}, "r.yaml")),
                 "--resume"]) == 0
    _assert_same(_losses(resumed), _losses(tmp_path / "one"))
    saved = yaml.safe_load(RunDir(resumed).recipe.read_text())
    assert saved["distributed"]["gpus"] == 1 and saved["training"]["gradient_accumulation_steps"] == 2


def test_full_fsdp2_on_two_processes_trains_as_one_and_resumes_at_two_and_one(tmp_path, tiny_model_dir):
    """finetune run --gpus 2 with FSDP2 (parameters, gradients and AdamW state sharded): the losses of one
    process; the step-2 checkpoint (whole state dict) resumes at 2 processes and at 1 with the same losses."""
    full = {"adapter": {"type": "full"}, "training": {"learning_rate": 1e-3}}
    two = _recipe(tmp_path, tiny_model_dir, "two", distributed={"strategy": "fsdp"}, **full)
    path = _write(tmp_path, two)
    env_before = dict(os.environ)
    code = main(["run", str(path), "--gpus", "2"])
    assert code == 0 and dict(os.environ) == env_before
    assert main(["run", str(path), "--gpus", "2"]) == 1  # refused before any process starts: it holds a run
    assert run(validate_recipe(_recipe(tmp_path, tiny_model_dir, "one", **full))).state == "completed"
    reference = _losses(tmp_path / "one")
    _assert_same(_losses(tmp_path / "two"), reference)
    _only_rank_zero_wrote(tmp_path / "two", 2)

    again = _resume_from(tmp_path / "two", 2, tmp_path / "again")
    done = torchrun("run", str(path), "--set", f"output.dir={again}", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same(_losses(again), reference)
    single = _resume_from(tmp_path / "two", 2, tmp_path / "single")
    assert main(["run", str(path), "--set", f"output.dir={single}", "--resume"]) == 0
    _assert_same(_losses(single), reference)


def test_ddp_on_two_processes_measures_the_noise_scale_of_one(tmp_path, tiny_model_dir):
    """The gradient noise scale with 2 processes (finetune/train/noise_scale.py): each process's micro-batch
    is a small batch, the all-reduced gradient the big one. Without accumulation and without splitting any
    step, it equals 1 process accumulating the same 2 micro-batches (a two-batch estimate is a difference of
    two norms, so float32 summation order weighs more: relative 1e-3)."""
    longer = {"training": {"max_steps": 6}, "output": {"save_steps": 100}}
    two = _recipe(tmp_path, tiny_model_dir, "two", distributed={"strategy": "ddp"}, **longer)
    done = torchrun("run", str(_write(tmp_path, two)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert run(validate_recipe(_recipe(tmp_path, tiny_model_dir, "one", **longer))).state == "completed"
    keys = ("grad_sq", "trace_sigma", "gns")

    def noise(run_dir: Path) -> list[tuple]:
        return [(r["step"], *(r.get(k) for k in keys)) for r in RunDir(run_dir).read_metrics() if "grad_sq" in r]

    got, want = noise(tmp_path / "two"), noise(tmp_path / "one")
    assert [s for s, *_ in got] == [s for s, *_ in want] == [5, 6]  # from noise_scale.MIN_STEPS observations
    for (step, *values), (_, *reference) in zip(got, want, strict=True):
        assert reference[0] > 0 and reference[1] > 0, step
        assert values == pytest.approx(reference, rel=1e-3), step


def test_fsdp_qlora_on_two_processes_trains_as_one(tmp_path, tiny_model_dir):
    """FSDP-QLoRA: NF4 weights stored in the compute dtype are sharded with the rest; the losses are those of
    one process training QLoRA with uint8 storage."""
    two = _recipe(tmp_path, tiny_model_dir, "two", quantization={"bits": 4}, distributed={"strategy": "fsdp"})
    done = torchrun("run", str(_write(tmp_path, two)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert run(validate_recipe(_recipe(tmp_path, tiny_model_dir, "one", quantization={"bits": 4}))).state == \
        "completed"
    _assert_same(_losses(tmp_path / "two"), _losses(tmp_path / "one"))
    assert RunDir(tmp_path / "two").has_adapter()


@pytest.mark.parametrize(("sections", "words"), [
    ({"optimizer": {"layerwise": True}, "distributed": {"strategy": "ddp"}}, "optimizer.layerwise with"),
    ({"optimizer": {"name": "galore"}, "distributed": {"strategy": "fsdp"}}, "optimizer galore with"),
    ({"optimizer": {"name": "apollo_mini"}, "distributed": {"strategy": "deepspeed"}}, "optimizer apollo_mini"),
    ({"memory": {"offload": "cpu"}, "distributed": {"strategy": "fsdp"}}, "memory.offload=cpu with"),
    ({"quantization": {"bits": 8}, "distributed": {"strategy": "fsdp"}}, "LLM.int8 weights cannot be sharded"),
])
def test_a_combination_that_cannot_work_is_refused_before_anything_starts(tmp_path, tiny_model_dir, capsys,
                                                                          sections, words):
    recipe = _write(tmp_path, _recipe(tmp_path, tiny_model_dir, "refused", **sections))
    assert main(["run", str(recipe), "--gpus", "2"]) == 2
    err = capsys.readouterr().err
    assert words in err and "with 2 processes" in err and "Traceback" not in err
    assert not (tmp_path / "refused").exists()
    assert main(["validate", str(recipe)]) == 0  # one process: nothing to distribute, nothing refused


def test_under_a_launcher_the_world_comes_from_the_environment(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """Each process started by torchrun refuses the same way (exit 2, nothing written); --gpus is not for it."""
    recipe = _write(tmp_path, _recipe(tmp_path, tiny_model_dir, "refused", optimizer={"layerwise": True},
                                      distributed={"strategy": "fsdp"}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["run", str(recipe)]) == 2
    assert "optimizer.layerwise with distributed.strategy=fsdp with 2 processes" in capsys.readouterr().err
    assert main(["run", str(recipe), "--gpus", "2"]) == 1
    assert "--gpus is for starting processes" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_deepspeed_missing_is_a_clear_error_before_any_process_starts(tmp_path, tiny_model_dir, capsys):
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed here; the refusal is for machines without it")
    recipe = _write(tmp_path, _recipe(tmp_path, tiny_model_dir, "ds", distributed={"strategy": "deepspeed"}))
    assert main(["run", str(recipe), "--gpus", "2"]) == 1
    err = capsys.readouterr().err
    assert "deepspeed package is not installed" in err and "fsdp" in err
    assert not (tmp_path / "ds").exists()


def test_fsdp_qlora_stores_4bit_weights_in_the_compute_dtype():
    """FSDP can shard 4-bit weights only if their storage dtype is the one of the other weights."""
    import torch

    from finetune.model.load import quantization_config
    from finetune.recipe.schema import QuantizationConfig

    q = QuantizationConfig(bits=4)
    assert quantization_config(q, torch.bfloat16).bnb_4bit_quant_storage == torch.uint8
    assert quantization_config(q, torch.bfloat16, sharded=True).bnb_4bit_quant_storage == torch.bfloat16
