"""`finetune plan --advice RUN_DIR` and the UI's "use this advice" (both finetune.api.apply_advice): a
micro-batch pinned above the advised batch is released to auto, so the run trains at the advised batch."""

from __future__ import annotations

import pytest
from run_support import SAMPLE_DATA

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
                              "data": {"path": SAMPLE_DATA, "max_seq_len": 64},
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
                              "data": {"path": SAMPLE_DATA, "max_seq_len": 64},
                              "training": {"micro_batch_size": "auto", "gradient_accumulation_steps": "auto",
                                           "effective_batch_size": 6}})
    settings = api.plan(recipe, gpu_memory="2GiB", device="cpu").settings
    assert settings["micro_batch_size"] * settings["gradient_accumulation_steps"] == 6


def _started_from_an_r8_adapter(tmp_path, model_dir):
    """A recipe whose adapter.init_from is a run with an r=8, alpha=8 adapter, its shape keys left unset (the
    defaults, r 16 and alpha 32, would contradict the adapter if they counted as set)."""
    import json

    from finetune.recipe.load import load_recipe_text
    from finetune.rundir import atomic_write_text

    parent = RunDir(tmp_path / "sft")
    parent.create()
    atomic_write_text(parent.recipe, recipe_to_yaml(validate_recipe(
        {"model": {"path": str(model_dir)}, "data": {"path": SAMPLE_DATA},
         "output": {"dir": str(parent.root)}})))
    parent.adapter.mkdir()
    (parent.adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}))
    (parent.adapter / "adapter_model.safetensors").write_bytes(b"")  # resolving reads only the config
    return load_recipe_text(f"model: {{path: {model_dir}}}\nquantization: {{bits: null}}\n"
                            f"data: {{path: {SAMPLE_DATA}, max_seq_len: 64}}\n"
                            f"adapter: {{init_from: {parent.root}}}\noutput: {{dir: {tmp_path / 'next'}}}\n")


def test_advice_goal_and_settings_keep_the_shape_of_an_init_from_adapter(tiny_model_dir, tmp_path, advised_2):
    from finetune.recipe.init_from import resolve_init_from
    from finetune.recipe.settings import write_settings

    recipe = _started_from_an_r8_adapter(tmp_path, tiny_model_dir)
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_to_yaml(recipe))
    for changed in (api.apply_advice(recipe, advised_2)[0], api.apply_advice(path, advised_2)[0],
                    api.apply_goal(recipe, "quick test"), api.apply_goal(recipe, "longest context"),
                    write_settings(recipe, {"micro_batch_size": 2})):
        assert changed.adapter.init_from == recipe.adapter.init_from
        adapter = resolve_init_from(changed).adapter  # not refused: r and alpha are the adapter's, not set
        assert (adapter.r, adapter.alpha, adapter.target_modules) == (8, 8.0, ["q_proj", "v_proj"])


def test_a_pinned_micro_batch_that_does_not_divide_the_advised_batch_is_released(tiny_model_dir, tmp_path,
                                                                                 capsys):
    """Advice 6 with micro-batch 4 pinned would train 4 x 2 = 8: released to auto, the plan trains 6."""
    from finetune.cli import main

    previous = RunDir(tmp_path / "previous")
    previous.root.mkdir()
    atomic_write_json(previous.results, {"state": "completed", "advice": {"settings": {
        "training.effective_batch_size": 6, "training.gradient_accumulation_steps": "auto",
        "training.reference_batch_size": 6}, "reason": "test"}})
    path = _recipe_file(tmp_path, tiny_model_dir, micro_batch_size=4)
    recipe, keys_set, why = api.apply_advice(path, previous.root)
    assert "training.micro_batch_size 4 does not divide the advised batch of 6 (it would train 8): the " \
           "advice released it to auto" in why and 'training.micro_batch_size="auto"' in keys_set
    settings = api.plan(recipe, gpu_memory="2GiB", device="cpu").settings
    assert settings["micro_batch_size"] * settings["gradient_accumulation_steps"] == 6

    # pinned on the command line it wins, and the plan says it trains 8, not the batch of 6
    assert main(["plan", str(path), "--gpu-memory", "2GiB", "--device", "cpu", "--advice", str(previous.root),
                 "--set", "training.micro_batch_size=4"]) == 0
    out = capsys.readouterr().out
    assert ("--set training.micro_batch_size 4 does not divide the advised batch of 6 (it would train 8) "
            "and wins") in out
    assert "batch: trains 4 x 2 accumulation = 8 sequences per step, not training.effective_batch_size 6" \
        in out


def test_the_plan_says_when_no_micro_batch_divides_the_batch_over_the_processes(tiny_model_dir):
    """A batch of 7 over 2 processes: no micro-batch divides it, the planner falls back to one that does not
    and the plan output says which batch trains."""
    recipe = validate_recipe({"model": {"path": str(tiny_model_dir)}, "quantization": {"bits": None},
                              "data": {"path": SAMPLE_DATA, "max_seq_len": 64},
                              "training": {"micro_batch_size": "auto", "gradient_accumulation_steps": "auto",
                                           "effective_batch_size": 7},
                              "distributed": {"gpus": 2, "strategy": "ddp"}})
    plan = api.plan(recipe, gpu_memory="2GiB", device="cuda")
    micro, accumulation = plan.settings["micro_batch_size"], plan.settings["gradient_accumulation_steps"]
    trained = micro * accumulation * 2
    assert trained != 7
    assert (f"batch: trains {micro} x {accumulation} accumulation x 2 processes = {trained} sequences per "
            "step, not training.effective_batch_size 7: the micro-batch x processes does not divide it") \
        in "\n".join(api.batch_plan(recipe, plan))


@pytest.mark.parametrize("stats", [True, False], ids=["tokens-known", "no-data-stats"])
def test_advice_for_a_recipe_with_a_batch_in_tokens_speaks_in_tokens_and_validates(
        tiny_model_dir, tmp_path, advised_2, capsys, stats):
    """training.effective_batch_tokens refuses effective_batch_size (and reference_batch_size) beside it: the
    advised batch of 2 sequences is given as the tokens of 2 of the advising run's sequences (its
    data_stats.json), and every `--set` the command prints, applied to the recipe, validates. Without the run's
    token counts no batch change is advised (nor the learning rate and betas made for it)."""
    from finetune.cli import main
    from finetune.recipe.load import load_recipe

    if stats:
        atomic_write_json(RunDir(advised_2).data_stats, {"train_tokens": 1000, "train_sequences": 40})
    recipe = validate_recipe({"model": {"path": str(tiny_model_dir)}, "quantization": {"bits": None},
                              "data": {"path": SAMPLE_DATA, "max_seq_len": 64},
                              "training": {"effective_batch_tokens": 200}})
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_to_yaml(recipe))
    assert main(["plan", str(path), "--gpu-memory", "2GiB", "--device", "cpu", "--advice", str(advised_2)]) == 0
    out = capsys.readouterr().out
    lines = [x.strip() for x in out.splitlines() if x.strip().startswith("--set ")]  # `  --set K=V  --set K=V`
    printed = [item for x in lines for item in x.removeprefix("--set ").split("  --set ")]
    keys = {p.split("=", 1)[0] for p in printed}
    assert not keys & {"training.effective_batch_size", "training.reference_batch_size",
                       "training.gradient_accumulation_steps"}, out
    applied = load_recipe(path, printed)  # validates
    if stats:
        assert "training.effective_batch_tokens=50" in printed and "training.learning_rate" in keys
        assert applied.training.effective_batch_tokens == 50  # 2 sequences of 1000 / 40 tokens
        assert "2 sequence(s) of the run's 25 tokens each" in out
    else:
        assert not keys & {"training.effective_batch_tokens", "training.learning_rate"}, out
        assert applied.training.effective_batch_tokens == 200 and "no batch change advised" in out
