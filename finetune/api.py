"""The Python API. The CLI and the web UI call these functions and hold no logic of their own."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.recipe.load import load_recipe as _load_recipe
from finetune.recipe.load import validate_recipe
from finetune.recipe.schema import Recipe

if TYPE_CHECKING:  # torch and transformers load only when a command needs them
    from finetune.plan import Plan
    from finetune.train.run import RunResult


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read and validate a recipe file; raises RecipeError with one message per problem."""
    return _load_recipe(path, overrides)


def validate(data: dict, source: str = "recipe") -> Recipe:
    """Validate a recipe given as a mapping (the UI form)."""
    return validate_recipe(data, source)


def preview_data(recipe: Recipe, n: int = 3) -> tuple[list[dict], list[str]]:
    """The first n examples as the model will see them (token texts with a has-loss flag) and the records
    that could not be read, reported as the CLI reports them."""
    from finetune.data import preview
    from finetune.data.read import read_records
    from finetune.errors import DataError
    from finetune.model.load import load_tokenizer
    from finetune.model.source import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(recipe.model.path, recipe.model.revision), recipe.model)
    examples = preview(recipe.data, tokenizer, n=n)
    problems = read_records(recipe.data.path).problems
    if not examples:
        raise DataError(f"{recipe.data.path}: no usable record among those read", problems[:10])
    return examples, problems


def plan(recipe: Recipe, *, gpu_memory: str | int | None = None, device: str | None = None) -> Plan:
    """Predict peak memory per component (no weights loaded) and resolve `auto` settings to the fastest fit."""
    from finetune.plan import predict

    return predict(recipe, gpu_memory=gpu_memory, device=device)


def measure(recipe: Recipe, *, steps: int = 2) -> dict[str, Any]:
    """Run `steps` real training steps under the memory tracker; the measured peak and its breakdown by
    component (`auto` settings resolved by the planner first, as `run` would)."""
    from finetune.train.measure import measure as _measure

    return _measure(recipe, steps)


def run(recipe: Recipe, *, resume: bool = False, overwrite: bool = False) -> RunResult:
    """Fine-tune; blocks until done or stopped (Ctrl-C / SIGTERM save a checkpoint first)."""
    from finetune.train.run import run as _run

    return _run(recipe, resume=resume, overwrite=overwrite)


def generate(run_dir: str | Path, prompt: str, *, max_new_tokens: int = 128, use_adapter: bool = True) -> str:
    """Answer `prompt` with the run's model (or its base model with use_adapter=False)."""
    from finetune.model.trained import generate as _generate
    from finetune.model.trained import load_trained

    model, tokenizer = load_trained(run_dir, use_adapter=use_adapter)
    return _generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens)


def compare(run_dir: str | Path, prompt: str, *, max_new_tokens: int = 128) -> tuple[str, str]:
    """(base model's answer, fine-tuned answer) to the same prompt; the model is loaded once."""
    from finetune.model.trained import generate as _generate
    from finetune.model.trained import load_trained

    model, tokenizer = load_trained(run_dir)
    tuned = _generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens)
    if hasattr(model, "disable_adapter"):  # LoRA: the base is the same weights with the adapter switched off
        with model.disable_adapter():
            return _generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens), tuned
    base, base_tokenizer = load_trained(run_dir, use_adapter=False)  # full fine-tune: load the original
    return _generate(base, base_tokenizer, prompt, max_new_tokens=max_new_tokens), tuned


def compare_runs(run_dirs: list[str | Path], prompt: str, *,
                 max_new_tokens: int = 128) -> list[tuple[str, str]]:
    """[(name, answer)]: the base model's answer, then each run's (named by its folder; e.g. an SFT run, then a
    DPO run trained after it), all from one loaded base with the runs' LoRA adapters switched in turn."""
    from finetune.model.trained import generate as _generate
    from finetune.model.trained import load_adapters

    model, tokenizer, names = load_adapters(list(run_dirs))
    with model.disable_adapter():
        answers = [("base model", _generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens))]
    for name, run_dir in zip(names, run_dirs, strict=True):
        model.set_adapter(name)
        answers.append((Path(run_dir).name, _generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens)))
    return answers


def export(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Merge the run's adapter into its base model and save it as safetensors."""
    from finetune.model.trained import export_merged

    return export_merged(run_dir, out_dir)
