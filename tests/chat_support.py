"""A finished run directory made in a second, without training: the tiny model's recipe and a random LoRA
adapter that changes the model's answers (what chat and export need from a run)."""

from __future__ import annotations

from pathlib import Path

from tests.ui_support import tiny_recipe, write_dataset


def fake_run(run_dir: Path, model_dir: Path, seed: int = 0) -> Path:
    """`run_dir` holding recipe.yaml and adapter/ (weights, tokenizer) as a completed LoRA run leaves them."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.recipe.load import recipe_to_yaml, validate_recipe
    from finetune.rundir import RunDir

    run = RunDir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    data = write_dataset(run_dir.parent / "data.jsonl")
    run.recipe.write_text(recipe_to_yaml(validate_recipe(tiny_recipe(model_dir, data, run_dir))))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(run.adapter)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(run.adapter)
    return run_dir
