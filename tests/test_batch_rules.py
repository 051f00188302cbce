"""Learning rate and beta2 when the batch differs from the one they were tuned for (finetune/recipe/batch_rules.py)."""

from __future__ import annotations

import math

import pytest

from finetune.recipe import validate_recipe
from finetune.recipe.batch_rules import (
    MAX_LR_FACTOR,
    advise,
    apply_batch_rules,
    reference_batch,
    scale_for_batch,
)
from finetune.recipe.optimizers import SPECS


def test_adam_family_scales_the_learning_rate_with_the_square_root_and_keeps_beta2_half_life_in_tokens():
    rule = scale_for_batch(1e-4, (0.9, 0.999), "adamw", reference=4, batch=16)
    assert rule.new_learning_rate == pytest.approx(2e-4) and rule.rule == "sqrt" and not rule.capped
    assert rule.new_betas == (0.9, pytest.approx(0.999 ** 4))
    # half-life in steps x sequences per step is the same at both batches
    half_life = lambda beta2, batch: math.log(0.5) / math.log(beta2) * batch  # noqa: E731
    assert half_life(rule.new_betas[1], 16) == pytest.approx(half_life(0.999, 4))
    down = scale_for_batch(1e-4, (0.9, 0.99), "apollo_mini", reference=16, batch=4)
    assert down.new_learning_rate == pytest.approx(5e-5) and down.new_betas[1] == pytest.approx(0.99 ** 0.25)


def test_sgd_scales_linearly_and_has_no_beta2_and_the_factor_is_capped():
    rule = scale_for_batch(0.01, (0.9, 0.999), "sgd", reference=2, batch=6)
    assert rule.new_learning_rate == pytest.approx(0.03) and rule.rule == "linear" and rule.new_betas is None
    capped = scale_for_batch(1e-4, (0.9, 0.999), "adamw", reference=1, batch=64)  # sqrt(64) = 8 > the cap
    assert capped.capped and capped.new_learning_rate == pytest.approx(MAX_LR_FACTOR * 1e-4)
    assert "capped at 4x" in capped.describe() and "beta2 0.999 ->" in capped.describe()


def test_every_registered_optimizer_names_its_rule():
    assert {s.lr_batch_scaling for s in SPECS} <= {"sqrt", "linear"}
    assert [s.name for s in SPECS if s.lr_batch_scaling == "linear"] == ["sgd"]
    assert not any(s.uses_beta2 for s in SPECS if s.name in ("sgd", "adafactor"))


def _recipe(**training) -> object:
    return validate_recipe({"model": {"path": "m"}, "data": {"path": "d.jsonl"},
                            "training": {"learning_rate": 1e-4, **training}})


def test_the_recipe_rescales_only_when_its_batch_differs_from_the_reference_and_only_once():
    plain = _recipe(micro_batch_size=2, gradient_accumulation_steps=4)
    assert reference_batch(plain) == 8 and apply_batch_rules(plain, 8) == (plain, None)  # the default: no change
    given = _recipe(micro_batch_size=2, gradient_accumulation_steps=8, reference_batch_size=4)
    scaled, rule = apply_batch_rules(given, reference_batch(given))
    assert rule.batch == 16 and scaled.training.learning_rate == pytest.approx(2e-4)
    assert scaled.optimizer.betas[1] == pytest.approx(0.999 ** 4)
    assert scaled.training.reference_batch_size == 16  # its recipe.yaml is not rescaled again
    assert apply_batch_rules(scaled, reference_batch(scaled)) == (scaled, None)
    # micro-batch left to the planner with a target batch: the target is the reference
    auto = _recipe(micro_batch_size="auto", gradient_accumulation_steps="auto", effective_batch_size=16)
    assert reference_batch(auto) == 16
    assert reference_batch(_recipe(micro_batch_size="auto")) is None  # nothing to compare against


def test_effective_batch_size_accepts_auto_and_rejects_zero():
    assert _recipe(effective_batch_size="auto").training.effective_batch_size == "auto"
    with pytest.raises(Exception, match="effective_batch_size"):
        _recipe(effective_batch_size=0)


def test_auto_batch_with_several_processes_is_refused_naming_the_key():
    with pytest.raises(Exception, match="training.effective_batch_size=auto with 2 processes"):
        validate_recipe({**_recipe(effective_batch_size="auto").model_dump(mode="python"),
                         "distributed": {"gpus": 2}}, "test")


def test_finetune_plan_shows_the_rescaling(tiny_model_dir, tmp_path, capsys):
    from finetune.cli import main
    from finetune.recipe.load import recipe_to_yaml

    recipe = validate_recipe({"model": {"path": str(tiny_model_dir)}, "data": {"path": "d.jsonl", "max_seq_len": 64},
                              "quantization": {"bits": None},
                              "training": {"learning_rate": 1e-4, "micro_batch_size": 2,
                                           "gradient_accumulation_steps": 8, "reference_batch_size": 4}})
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_to_yaml(recipe))
    assert main(["plan", str(path), "--gpu-memory", "2GiB", "--device", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "batch rules: batch 16 vs reference 4 sequences: learning rate 0.0001 -> 0.0002 (sqrt rule)" in out


def test_advice_is_the_largest_power_of_two_batch_within_the_useful_fraction_of_the_noise_scale():
    advice = advise(3200.0, 20.0, batch_used=2, learning_rate=1e-3, betas=(0.9, 0.999), optimizer="adamw")
    # 0.1 x 3200 tokens = 320 tokens = 16 sequences of 20 labelled tokens
    assert advice["settings"]["training.effective_batch_size"] == 16
    assert advice["settings"]["training.learning_rate"] == pytest.approx(1e-3 * math.sqrt(8), rel=1e-3)
    assert advice["settings"]["optimizer.betas"][1] == pytest.approx(0.999 ** 8, rel=1e-6)
    assert "160 sequences" in advice["reason"]
    assert "settings" not in advise(None, 20.0, 2, 1e-3, (0.9, 0.999), "adamw")


def test_finetune_plan_takes_the_advice_of_a_finished_run(tiny_model_dir, tmp_path, capsys):
    from finetune.cli import main
    from finetune.recipe.load import recipe_to_yaml
    from finetune.rundir import RunDir, atomic_write_json

    previous = RunDir(tmp_path / "previous")
    previous.root.mkdir()
    atomic_write_json(previous.results, {"state": "completed", "advice": advise(
        3200.0, 20.0, batch_used=2, learning_rate=1e-3, betas=(0.9, 0.999), optimizer="adamw")})
    recipe = validate_recipe({"model": {"path": str(tiny_model_dir)}, "data": {"path": "d.jsonl", "max_seq_len": 64},
                              "quantization": {"bits": None}, "training": {"micro_batch_size": 4}})
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_to_yaml(recipe))
    assert main(["plan", str(path), "--gpu-memory", "2GiB", "--device", "cpu", "--advice", str(previous.root)]) == 0
    out = capsys.readouterr().out
    assert "advice from" in out and "--set training.effective_batch_size=16" in out
    assert "mb=4 ga=4" in out  # 16 sequences at the recipe's micro-batch
    assert main(["plan", str(path), "--device", "cpu", "--advice", str(tmp_path)]) == 1  # no results.json there
    assert "no batch advice" in capsys.readouterr().err


def test_finetune_plan_shows_what_auto_will_do(tiny_model_dir, tmp_path, capsys):
    from finetune.cli import main
    from finetune.recipe.load import recipe_to_yaml

    recipe = validate_recipe({"model": {"path": str(tiny_model_dir)}, "data": {"path": "d.jsonl", "max_seq_len": 64},
                              "quantization": {"bits": None},
                              "training": {"micro_batch_size": 4, "effective_batch_size": "auto"}})
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_to_yaml(recipe))
    assert main(["plan", str(path), "--gpu-memory", "2GiB", "--device", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "effective batch auto: starts at 4 sequences (micro-batch 4 x 1)" in out
    assert "up to 256; learning rate x sqrt of the batch ratio (capped at 4x), beta2 ** ratio" in out
