"""`finetune plan --advice RUN_DIR` and the UI's "use this advice" (both finetune.api.apply_advice): a
micro-batch pinned above the advised batch is released to auto, so the run trains at the advised batch."""

from __future__ import annotations

import pytest

from finetune import api
from finetune.recipe import validate_recipe
from finetune.recipe.batch_rules import advise
from finetune.recipe.load import recipe_to_yaml
from finetune.rundir import RunDir, atomic_write_json


@pytest.fixture
def advised_2(tmp_path):
    """A finished run whose advice is a batch of 2 (its noise scale is small next to its step times)."""
    previous = RunDir(tmp_path / "previous")
    previous.root.mkdir()
    atomic_write_json(previous.results, {"state": "completed", "advice": advise(
        3200.0, 20.0, 2, batch_used=8, learning_rate=1e-3, betas=(0.9, 0.999), optimizer="adamw",
        times=(0.01, 0.0001))})
    assert api.run_advice(previous.root)[0][0] == "training.effective_batch_size=2"
    return previous.root


def _recipe_file(tmp_path, model_dir, micro_batch_size: int):
    recipe = validate_recipe({"model": {"path": str(model_dir)}, "quantization": {"bits": None},
                              "data": {"path": "d.jsonl", "max_seq_len": 64},
                              "training": {"micro_batch_size": micro_batch_size}})
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_to_yaml(recipe))
    return path


def test_a_pinned_micro_batch_above_the_advised_batch_is_released_and_the_plan_uses_the_batch(
        tiny_model_dir, tmp_path, advised_2, capsys):
    from finetune.cli import main

    path = _recipe_file(tmp_path, tiny_model_dir, micro_batch_size=8)
    assert main(["plan", str(path), "--gpu-memory", "2GiB", "--device", "cpu", "--advice", str(advised_2)]) \
        == 0
    out = capsys.readouterr().out
    assert "training.micro_batch_size 8 is above the advised batch of 2: the advice released it to auto" \
        in out
    assert '--set training.micro_batch_size="auto"' in out
    assert "mb=2 ga=1" in out  # the advised batch, not micro-batch 8 x 1

    # the API the UI's button calls: the same recipe, and the plan trains 2 sequences per step
    recipe, keys_set, why = api.apply_advice(api.load_recipe(path), advised_2)
    assert recipe == api.apply_advice(path, advised_2)[0]
    assert recipe.training.micro_batch_size == "auto" and 'training.micro_batch_size="auto"' in keys_set
    assert "released it to auto" in why
    settings = api.plan(recipe, gpu_memory="2GiB", device="cpu").settings
    assert settings["micro_batch_size"] * settings["gradient_accumulation_steps"] == 2


def test_a_micro_batch_pinned_on_the_command_line_wins_over_the_advice_with_a_note(
        tiny_model_dir, tmp_path, advised_2, capsys):
    from finetune.cli import main

    path = _recipe_file(tmp_path, tiny_model_dir, micro_batch_size=1)
    assert main(["plan", str(path), "--gpu-memory", "2GiB", "--device", "cpu", "--advice", str(advised_2),
                 "--set", "training.micro_batch_size=4"]) == 0
    out = capsys.readouterr().out
    assert "--set training.micro_batch_size 4 is above the advised batch of 2 and wins" in out
    assert "mb=4 ga=1" in out and "released" not in out


def test_an_advised_batch_trains_exactly_at_a_micro_batch_that_divides_it(tiny_model_dir, tmp_path):
    """micro-batch auto with an effective batch of 6: 2 x 3 or 1 x 6, never 4 x 2 = 8."""
    recipe = validate_recipe({"model": {"path": str(tiny_model_dir)}, "quantization": {"bits": None},
                              "data": {"path": "d.jsonl", "max_seq_len": 64},
                              "training": {"micro_batch_size": "auto", "gradient_accumulation_steps": "auto",
                                           "effective_batch_size": 6}})
    settings = api.plan(recipe, gpu_memory="2GiB", device="cpu").settings
    assert settings["micro_batch_size"] * settings["gradient_accumulation_steps"] == 6
