"""End to end through the real pipeline: overfitting, stop + resume, the CLI and the run directory."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from finetune.cli import main
from finetune.recipe import validate_recipe
from finetune.rundir import read_jsonl
from finetune.train.run import run

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                        {"role": "assistant", "content": "The capital of France is Paris."}]}


def _data(tmp_path: Path, n: int = 8, varied: bool = False) -> Path:
    path = tmp_path / "data.jsonl"
    rows = []
    for i in range(n):
        row = json.loads(json.dumps(EXAMPLE))
        if varied:
            row["messages"][0]["content"] += f" ({i})"
            row["messages"][1]["content"] += " " + "fox " * (i % 4)
        rows.append(json.dumps(row))
    path.write_text("\n".join(rows) + "\n")
    return path


def _recipe_dict(tmp_path: Path, model_dir: Path, **sections) -> dict:
    recipe = {
        "model": {"path": str(model_dir)},
        "quantization": {"bits": None},
        "adapter": {"type": "lora", "r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"path": str(_data(tmp_path)), "max_seq_len": 64},
        "training": {"max_steps": 30, "micro_batch_size": 2, "learning_rate": 1e-2, "warmup_ratio": 0.0},
        "memory": {"activation_checkpointing": True},
        "output": {"dir": str(tmp_path / "run"), "save_steps": 100},
    }
    for section, values in sections.items():
        recipe[section] = {**recipe.get(section, {}), **values}
    return recipe


@pytest.mark.parametrize("variant", [
    pytest.param({}, id="lora"),
    pytest.param({"quantization": {"bits": 4}}, id="qlora"),
    pytest.param({"adapter": {"type": "full"}, "training": {"learning_rate": 2e-3}}, id="full"),
    pytest.param({"adapter": {"type": "dora"}}, id="dora"),
    pytest.param({"adapter": {"rslora": True, "alpha": 4}}, id="rslora"),
    pytest.param({"quantization": {"bits": 8}}, id="lora-int8"),
])
def test_overfits_one_repeated_example(tmp_path, tiny_model_dir, variant):
    result = run(validate_recipe(_recipe_dict(tmp_path, tiny_model_dir, **variant)))
    losses = [r["loss"] for r in read_jsonl(result.run_dir / "metrics.jsonl") if "loss" in r]
    assert result.state == "completed" and len(losses) == 30
    assert losses[0] > 3.0, f"a random model should start near ln(vocab); got {losses[0]}"
    assert losses[-1] < 0.3, f"did not overfit: {losses[0]:.3f} -> {losses[-1]:.3f}"


def _cli(args: list[str], **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "finetune", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _write_recipe(tmp_path: Path, data: dict, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# enough steps that Ctrl-C, sent once step 3 is logged, lands before the end: a tiny model runs ~100 steps/s
CTRL_C_STEPS = 64


def test_ctrl_c_saves_and_resume_matches_uninterrupted(tmp_path, tiny_model_dir):
    base = _recipe_dict(tmp_path, tiny_model_dir, data={"path": str(_data(tmp_path, 16, varied=True))},
                        training={"max_steps": CTRL_C_STEPS, "learning_rate": 3e-3}, adapter={"dropout": 0.1},
                        output={"save_steps": 50})
    straight = run(validate_recipe({**base, "output": {"dir": str(tmp_path / "straight"), "save_steps": 50}}))
    reference = {r["step"]: r["loss"] for r in read_jsonl(straight.run_dir / "metrics.jsonl") if "loss" in r}

    recipe_path = _write_recipe(tmp_path, {**base, "output": {"dir": str(tmp_path / "stopped"), "save_steps": 50}},
                                "stopped")
    proc = _cli(["run", str(recipe_path)])
    metrics = tmp_path / "stopped" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not any(r.get("step", 0) >= 3 for r in read_jsonl(metrics)):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err
    assert "--resume" in err and "Traceback" not in err
    status = json.loads((tmp_path / "stopped" / "status.json").read_text())
    assert status["state"] == "stopped"
    stopped_at = status["step"]
    assert 3 <= stopped_at < CTRL_C_STEPS
    assert (tmp_path / "stopped" / "checkpoints" / f"checkpoint-{stopped_at}").is_dir()

    assert main(["run", str(recipe_path), "--resume"]) == 0
    resumed = {r["step"]: r["loss"] for r in read_jsonl(metrics) if "loss" in r}
    assert sorted(resumed) == list(range(1, CTRL_C_STEPS + 1)), "each step logged exactly once"
    for step in range(stopped_at + 1, CTRL_C_STEPS + 1):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5), f"step {step}"


def test_cli_run_directory_generate_and_export(tmp_path, tiny_model_dir):
    recipe_path = _write_recipe(tmp_path, _recipe_dict(
        tmp_path, tiny_model_dir, training={"max_steps": 4}, data={"validation_split": 0.25},
        output={"save_steps": 2, "save_total_limit": 1}), "smoke")
    proc = _cli(["run", str(recipe_path)])
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    run_dir = tmp_path / "run"
    for name in ("recipe.yaml", "metrics.jsonl", "env.json", "status.json", "results.json", "train.log",
                 "adapter/adapter_config.json", "adapter/adapter_model.safetensors", "adapter/tokenizer.json",
                 "loss.png", "plan.json", "plan.png"):
        assert (run_dir / name).is_file(), name
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["checkpoint-4"]  # keep the last K=1
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    for key in ("loss", "learning_rate", "grad_norm", "tokens_per_second", "peak_memory_bytes"):
        assert all(isinstance(r[key], (int, float)) for r in train_rows), key
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4], "one evaluation row at the end, not two"
    assert json.loads((run_dir / "results.json").read_text())["eval_loss"] == evals[0]["eval_loss"]
    # On CPU the peak comes from the tensor tracker, split by component, next to the planner's prediction.
    plan = json.loads((run_dir / "plan.json").read_text())
    measured = train_rows[-1]
    assert sum(measured["peak_memory_breakdown"].values()) == measured["peak_memory_bytes"]
    # The plan is made for the data (~26-token examples, max_seq_len 64): the measured peak near it.
    assert 0 < measured["peak_memory_bytes"] <= plan["peak_bytes"] * 1.05
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed"
    # ... the longest sequence the run trains on is the one the plan was made for: nothing to re-plan for the UI.
    assert 8 < status["longest_sequence_tokens"] < 64
    assert plan["data"]["sequence"] == plan["data"]["longest_tokens"] == status["longest_sequence_tokens"]
    from finetune.api import plan_at_seen_length

    assert plan_at_seen_length(run_dir) is None
    # Checkpoints are events on the curves.
    assert [r["step"] for r in rows if r.get("event") == "checkpoint_saved"] == [2, 4]
    assert yaml.safe_load((run_dir / "recipe.yaml").read_text())["training"]["max_steps"] == 4

    proc = _cli(["generate", str(run_dir), "--prompt", "What is the capital of France?", "--compare",
                 "--max-new-tokens", "8"])
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "base model:" in out and "fine-tuned:" in out

    # Exported merged weights reproduce base + adapter.
    from transformers import AutoModelForCausalLM

    from finetune.model.trained import load_trained

    assert main(["export", str(run_dir), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    peft_model, _ = load_trained(run_dir)
    ids = torch.randint(4, 400, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, peft_model(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)

    # Export replaces only an earlier export; a folder of the user's (and folders named like our temporaries
    # beside the target) are never touched.
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    for sibling in ("merged.tmp", "merged.old"):
        (tmp_path / sibling).mkdir()
        (tmp_path / sibling / "keep.txt").write_text("keep")
    assert main(["export", str(run_dir), "--out", str(tmp_path / "merged")]) == 0  # an earlier export: replaced
    assert main(["export", str(run_dir), "--out", str(user)]) == 2
    assert (user / "notes.txt").read_text() == "mine" and sorted(p.name for p in user.iterdir()) == ["notes.txt"]
    assert all((tmp_path / s / "keep.txt").read_text() == "keep" for s in ("merged.tmp", "merged.old"))
    assert not list(tmp_path.glob(".merged.*"))  # no temporary folder left behind


def test_existing_run_dir_needs_resume_or_overwrite(tmp_path, tiny_model_dir, capsys):
    recipe_path = _write_recipe(tmp_path, _recipe_dict(tmp_path, tiny_model_dir, training={"max_steps": 1}), "r")
    assert main(["run", str(recipe_path), "--resume"]) == 2  # a usage error
    assert "no checkpoint" in capsys.readouterr().err
    assert main(["run", str(recipe_path)]) == 0
    assert main(["run", str(recipe_path)]) == 1
    assert "already holds a run" in capsys.readouterr().err
    assert main(["run", str(recipe_path), "--overwrite"]) == 0


@pytest.mark.parametrize("optimizer", [
    pytest.param({"name": "apollo_mini", "layerwise": True}, id="apollo_mini-layerwise"),
    pytest.param({"name": "galore", "rank": 4}, id="galore"),
    pytest.param({"name": "adamw_8bit"}, id="adamw_8bit"),
])
def test_recipe_optimizers_train_through_the_pipeline(tmp_path, tiny_model_dir, optimizer):
    """The recipe's optimizer section reaches the Trainer: loss falls and a real grad norm is logged."""
    recipe = _recipe_dict(tmp_path, tiny_model_dir, optimizer=optimizer,
                          training={"max_steps": 12, "gradient_accumulation_steps": 2})
    result = run(validate_recipe(recipe))
    rows = [r for r in read_jsonl(result.run_dir / "metrics.jsonl") if "loss" in r]
    assert all(r["grad_norm"] > 0 for r in rows)
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"]


def test_auto_settings_are_planned_and_saved(tmp_path, tiny_model_dir, capsys):
    """`auto` values are resolved by the planner within the budget; the run directory keeps what was chosen,
    and the console names each value chosen automatically."""
    recipe = _recipe_dict(tmp_path, tiny_model_dir, training={"max_steps": 2, "micro_batch_size": "auto",
                                                              "gradient_accumulation_steps": "auto"},
                          memory={"activation_checkpointing": "auto", "gpu_memory": "1.5MiB", "gpu_memory_margin": 0})
    result = run(validate_recipe(recipe))
    saved = yaml.safe_load((result.run_dir / "recipe.yaml").read_text())
    plan = json.loads((result.run_dir / "plan.json").read_text())
    assert plan["fits"] and plan["budget_bytes"] == int(1.5 * 2**20)
    assert saved["training"]["micro_batch_size"] == plan["settings"]["micro_batch_size"] != "auto"
    assert saved["memory"]["activation_checkpointing"] in (True, False)
    chosen = plan["settings"]
    line = re.search(r"; chose (.*) automatically", capsys.readouterr().err)
    items = line.group(1).split(", ") if line else []
    assert {f"training.micro_batch_size={chosen['micro_batch_size']}",
            f"training.gradient_accumulation_steps={chosen['gradient_accumulation_steps']}",
            f"memory.activation_checkpointing={str(chosen['activation_checkpointing']).lower()}",
            f"memory.chunked_loss={str(chosen['chunked_loss']).lower()}"} <= set(items)
    assert all(re.fullmatch(r"[a-z_]+\.[a-z_]+=\S+", item) for item in items), items
    peaks = [r["peak_memory_bytes"] for r in read_jsonl(result.run_dir / "metrics.jsonl") if "loss" in r]
    assert max(peaks) <= plan["budget_bytes"]


@pytest.mark.parametrize("packing", [False, True])
def test_the_plan_is_made_for_the_data_and_the_end_of_a_run_prints_it_beside_the_measured_peak(
        tmp_path, tiny_model_dir, capsys, packing):
    """Data much shorter than max_seq_len: the first memory line is the plan for the run's largest micro-batch,
    within 5% of the measured peak (packed: for max_seq_len rows, an upper bound where the data does not fill
    them), and the CLI's last line puts the two side by side."""
    from finetune import api
    from finetune.units import format_bytes

    recipe = _recipe_dict(tmp_path, tiny_model_dir, data={"max_seq_len": 256, "packing": packing},
                          training={"max_steps": None, "epochs": 1, "micro_batch_size": 2})
    assert main(["run", str(_write_recipe(tmp_path, recipe, "r"))]) == 0
    run_dir = tmp_path / "run"
    err = capsys.readouterr().err.splitlines()
    first = next(li for li in err if li.startswith("memory plan:"))
    line = next(li for li in err if li.startswith("memory: planned"))
    plan = json.loads((run_dir / "plan.json").read_text())
    planned = plan["peak_bytes"]
    measured = [r["peak_memory_bytes"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("peak_memory_bytes")][-1]
    assert api.plan_at_seen_length(run_dir) is None  # the plan is the data's already
    longest = json.loads((run_dir / "status.json").read_text())["longest_sequence_tokens"]
    if packing:
        assert plan["data"]["sequence"] == longest == 256
        at = "for packed rows of data.max_seq_len 256 tokens"
    else:
        assert plan["data"]["sequence"] == plan["data"]["longest_tokens"] == longest < 64
        padding = "" if plan["data"]["padded"] else ", no padding"  # the run's largest micro-batch, as it is
        at = f"for the run's largest micro-batch ({plan['data']['rows']} x {longest} tokens{padding}; data.max_seq_len 256)"
    assert first.startswith(f"memory plan: {format_bytes(planned)} predicted peak {at}, budget ")
    assert line == f"memory: planned {format_bytes(planned)} {at}; measured peak {format_bytes(measured)}"
    if packing:  # these few short examples fill less than one packed micro-batch of 2 x 256 tokens
        assert measured <= planned
    else:
        assert abs(measured / planned - 1) <= 0.05, (measured, planned)


def test_offload_and_chunked_loss_through_the_pipeline_change_nothing_but_memory(tmp_path):
    """Same losses with memory.offload cpu/disk and memory.chunked_loss; the disk folder is empty afterwards."""
    from finetune.testing import make_tiny_model_dir

    # Four layers: the last layer's inputs stay on the device and the first's is the (LoRA-frozen) embedding
    # output, so two layers would leave nothing to offload.
    model_dir = make_tiny_model_dir(tmp_path / "model", num_hidden_layers=4)

    def losses(name: str, **memory) -> list[float]:
        recipe = _recipe_dict(tmp_path, model_dir, training={"max_steps": 4},
                              memory={"chunked_loss": False, "offload_min_size": 0, **memory},
                              output={"dir": str(tmp_path / name)})
        result = run(validate_recipe(recipe))
        offloaded = json.loads((result.run_dir / "results.json").read_text())["offload"]
        assert (offloaded is not None and offloaded["offloaded_bytes"] > 0) == (memory.get("offload") is not None)
        return [r["loss"] for r in read_jsonl(result.run_dir / "metrics.jsonl") if "loss" in r]

    reference = losses("plain")
    assert losses("cpu", offload="cpu") == pytest.approx(reference, rel=1e-6)
    offload_dir = tmp_path / "offload-files"
    assert losses("disk", offload="disk", offload_dir=str(offload_dir)) == pytest.approx(reference, rel=1e-6)
    assert not offload_dir.exists() or not any(offload_dir.rglob("*.*")), "disk offload left files behind"
    assert losses("chunked", chunked_loss=True) == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gemma2", "phi3"])
def test_other_architectures_train(tmp_path, arch):
    """Each family the planner models also trains (Gemma-2 gets eager attention: sdpa does not support it)."""
    from finetune.testing import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / arch, arch=arch)
    result = run(validate_recipe(_recipe_dict(tmp_path, model_dir, training={"max_steps": 6},
                                              quantization={"bits": 4})))
    losses = [r["loss"] for r in read_jsonl(result.run_dir / "metrics.jsonl") if "loss" in r]
    assert result.state == "completed" and losses[-1] < losses[0]


def test_resume_keeps_what_the_planner_chose(tmp_path, tiny_model_dir):
    from finetune.train.run import keep_resolved

    given = validate_recipe(_recipe_dict(tmp_path, tiny_model_dir, training={"micro_batch_size": "auto",
                                                                             "max_steps": 50}))
    saved = validate_recipe(_recipe_dict(tmp_path, tiny_model_dir, training={"micro_batch_size": 3,
                                                                             "max_steps": 30}))
    resumed = keep_resolved(given, saved)
    assert resumed.training.micro_batch_size == 3  # the interrupted run's choice, not a new plan
    assert resumed.training.max_steps == 50  # keys set now still apply
