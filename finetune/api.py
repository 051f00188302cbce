"""The Python API. The CLI and the web UI call these functions and hold no logic of their own.

A facade: the planning questions live in finetune/plan/ (sizes.py, advice.py, context.py) and the reports of a
run directory in finetune/run_view.py; they are re-exported here so the shells import one module. What uses a
finished run (generate, compare, chat) gets from here how the run's base loads (`streamed_use`: through the
weight store where the run streamed it), which the finetune.model layer below may not import. Those that import torch load when first asked for
(`__getattr__`): `finetune --help` or the UI's form must not wait for torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.export.files import GGUFOptions
from finetune.export.files import ollama_command as ollama_command  # re-exported for the CLI and UI
from finetune.export.progress import ExportStep as ExportStep  # re-exported for the CLI and UI
from finetune.recipe.goals import goal_values
from finetune.recipe.load import load_recipe as _load_recipe
from finetune.recipe.load import recipe_data, validate_recipe
from finetune.recipe.schema import Recipe
from finetune.reports import LocalModel, Machine
from finetune.run_view import GRPO_CURVES as GRPO_CURVES  # the run reports, re-exported for the CLI and UI
from finetune.run_view import RunView as RunView
from finetune.run_view import plan_at_seen_length as plan_at_seen_length
from finetune.run_view import run_batch_report as run_batch_report
from finetune.run_view import run_evaluation_table as run_evaluation_table
from finetune.run_view import run_grpo_report as run_grpo_report
from finetune.run_view import run_memory as run_memory
from finetune.run_view import run_reward_report as run_reward_report
from finetune.run_view import view_of as view_of
from finetune.rundir import EVAL_PREFIX as EVAL_PREFIX  # the keys the run reports read, for the UI
from finetune.rundir import REWARD_KEYS as REWARD_KEYS
from finetune.rundir import RunDir

if TYPE_CHECKING:  # torch and transformers load only when a command needs them
    from finetune.model.chat import ChatModels
    from finetune.model.load import LoadedModel
    from finetune.plan import Plan
    from finetune.train.run import RunResult

# Answers defined where torch is imported, by module: imported on first use (see the docstring).
_ELSEWHERE = {
    "finetune.plan.sizes": ("plan_gpu_sizes", "plan_sizes", "speed_estimate"),
    "finetune.plan.advice": ("batch_plan", "run_advice", "apply_advice"),
    "finetune.plan.context": ("check_context", "context_note", "longest_example", "longest_record_bytes"),
}
_DEFINED_IN = {name: module for module, names in _ELSEWHERE.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _DEFINED_IN:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_DEFINED_IN[name]), name)


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read and validate a recipe file; raises RecipeError with one message per problem."""
    return _load_recipe(path, overrides)


def validate(data: dict, source: str = "recipe") -> Recipe:
    """Validate a recipe given as a mapping (the UI form)."""
    return validate_recipe(data, source)


def preflight(recipe: Recipe) -> dict[str, Any]:
    """What would otherwise fail a minute into `plan` or `run`, checked in seconds before any model loads or
    run directory is made: every path the recipe reads exists (model.path when it is local, data.path,
    data.chat_template's file, adapter.init_from, grpo's kind python reward files) and the data file parses (the record reader, format
    detection and each record's fields; no tokenizer), and training.compile and memory.kernels: liger can run here. Raises the
    error the run would; returns the data's format and record counts (finetune.data.build.check_records)."""
    from finetune.data.build import check_records
    from finetune.data.chat import template_file
    from finetune.errors import RecipeError
    from finetune.model.source import check_model_path, known_config
    from finetune.plan.context import image_token_counter
    from finetune.recipe.families import check_config_file
    from finetune.recipe.init_from import resolve_init_from

    if recipe.training.compile is True or recipe.memory.kernels == "liger":  # imports torch: only then
        from finetune.model.kernels import check_compile, check_kernels

        check_compile(recipe)
        check_kernels(recipe)
    check_model_path(recipe.model.path, recipe.model.revision)
    # a family the tool describes (a hub id not in the local cache: when loaded)
    family = check_config_file(known_config(recipe.model.path, recipe.model.revision))
    experts_only = {"adapter.target_experts": recipe.adapter.target_experts,  # keys that act on experts alone
                    "memory.offload_experts": recipe.memory.offload_experts not in ("none", "auto")}
    for key in (k for k, given in experts_only.items() if given and family is not None and not family.moe):
        raise RecipeError(f"{key}: model.path is a {family.name} model, not a mixture-of-experts model",
                          hint=f"remove {key} (it applies to mixture-of-experts models only)")
    resolve_init_from(recipe)
    template_file(recipe.data.chat_template)
    if recipe.training.spec.generates:
        from finetune.rl.rewards import check_reward_files

        check_reward_files(recipe.grpo, prefix="grpo.")
    vision = family is not None and family.vision is not None
    return check_records(recipe.data, recipe.training.method, model_takes_images=vision,
                         count_image_tokens=image_token_counter(recipe.model.path, recipe.model.trust_remote_code)
                         if vision else None)


def preview_data(recipe: Recipe, n: int = 3) -> tuple[list[dict], list[str]]:
    """The first n examples as the model will see them (token texts with a has-loss flag; `images`, the paths
    of a vision-language example's images) and the records that could not be read, reported as the CLI
    reports them."""
    from finetune.data import preview
    from finetune.data.mix import read_files
    from finetune.errors import DataError
    from finetune.model.load import load_tokenizer
    from finetune.model.source import resolve_model_path, takes_images

    tokenizer = load_tokenizer(resolve_model_path(recipe.model.path, recipe.model.revision), recipe.model)
    examples = preview(recipe.data, tokenizer, n=n, model_takes_images=takes_images(recipe.model.path,
                                                                                    recipe.model.revision))
    problems = [p for f in read_files(recipe.data) for p in f.read.problems]
    if not examples:
        raise DataError(f"{recipe.data.label()}: no usable record among those read", problems[:10])
    return examples, problems


def plan(recipe: Recipe, *, gpu_memory: str | int | None = None, device: str | None = None) -> Plan:
    """Predict peak memory per component (no weights loaded) and resolve `auto` settings to the fastest fit.
    A budget in the recipe (memory.gpu_memory: 8GiB) names a GPU as --gpu-memory does: without `device` the
    plan is for that GPU, not for this machine's CPU (a run plans for the device it trains on)."""
    from finetune.plan import predict
    from finetune.plan.context import check_context

    if device is None and gpu_memory is None and recipe.memory.gpu_memory != "auto":
        device = "cuda"
    check_context(recipe)
    return predict(recipe, gpu_memory=gpu_memory, device=device)


def this_machine() -> Machine:
    """The device a run started here trains on: `device` (cuda, else cpu), a `name` for people and its
    `memory_bytes` (the GPU's total, else the RAM's), so a page can offer "plan for this machine"
    (`plan(recipe, device=...)`) beside the common cards."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return {"device": "cuda", "name": props.name, "memory_bytes": props.total_memory}
    import os

    import psutil

    return {"device": "cpu", "name": f"CPU, {os.cpu_count()} cores", "memory_bytes": psutil.virtual_memory().total}


def apply_goal(recipe: Recipe, goal: str) -> Recipe:
    """`recipe` with the values of a newcomer's goal (finetune/recipe/goals.py: quick test, best quality,
    longest context) written over it. With adapter.init_from the goal's adapter shape is left out: the saved
    adapter's shape is the one trained on."""
    from finetune.recipe.schema import SHAPE_KEYS

    data = recipe_data(recipe)
    for key, value in goal_values(goal).items():
        section, field = key.split(".")
        if not (section == "adapter" and field in SHAPE_KEYS and recipe.adapter.init_from):
            data[section][field] = value
    return validate_recipe(data, f"goal {goal!r}")


def local_models(folders: list[Path], hub_cache: Path | None = None) -> list[LocalModel]:
    """The models this machine has, for a model picker: model folders (config.json + safetensors) and .gguf
    files under `folders` (nothing outside them, symlinks resolved), the GGUF files installed packages ship
    (`pkg:PACKAGE/FILE`), and the complete models in the Hugging Face cache (`hub_cache`, default HF_HUB_CACHE)
    by hub id. Packaged models first (the quickstart's), then the folders', then the cache's."""
    from finetune.model.catalog import folder_models, hub_cache_models, package_models

    return [*package_models(), *folder_models(folders), *hub_cache_models(hub_cache)]


def recipe_gallery(folder: str | Path = "recipes") -> list[dict[str, str]]:
    """The ready recipes in `folder` (the quickstart first): name, path, title and description, from the
    file's leading comment lines written as "Short title: what it does ...": the title is the text before the
    first ": " (a label that fits a list), the description everything after it."""
    out = []
    for path in sorted(Path(folder).glob("*.yaml"), key=lambda p: (p.stem != "quickstart", p.stem)):
        lines = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.startswith("#"):
                break
            lines.append(line.lstrip("#").strip())
        title, _, first = (lines[0] if lines else path.stem).partition(": ")
        out.append({"name": path.stem, "path": str(path), "title": title,
                    "description": " ".join([first[:1].upper() + first[1:], *lines[1:]]).strip()})
    return out


def measure(recipe: Recipe, *, steps: int = 2) -> dict[str, Any]:
    """Run `steps` real training steps under the memory tracker; the measured peak and its breakdown by
    component (`auto` settings resolved by the planner first, as `run` would)."""
    from finetune.train.measure import measure as _measure

    return _measure(recipe, steps)


def run(recipe: Recipe, *, resume: bool = False, overwrite: bool = False,
        allow_data_change: bool = False, base: LoadedModel | None = None) -> RunResult:
    """Fine-tune; blocks until done or stopped (Ctrl-C / SIGTERM save a checkpoint first). `resume` on data
    other than the run started on (records, content, order, tokenizer, max_seq_len, ...) raises DataChanged
    (exit code 2) unless `allow_data_change`. `base`: a model from `load_base`, trained on instead of loading
    recipe.model and handed back as loaded (several runs on the same weights, each planned anew)."""
    preflight(recipe)  # before torch is imported: a missing file is reported in a second, no run directory made
    if recipe.memory.plan:
        from finetune.plan.context import check_context

        check_context(recipe)
    from finetune.train.run import run as _run

    return _run(recipe, resume=resume, overwrite=overwrite, allow_data_change=allow_data_change, base=base)


def newest_checkpoint(recipe: Recipe) -> Path | None:
    """The checkpoint `finetune run --resume` would continue recipe's run from, or None (e.g. after a run was
    interrupted)."""
    from finetune.train.checkpoints import find_resumable

    folder = RunDir(Path(recipe.output.dir)).checkpoints
    return find_resumable(folder).newest if folder.is_dir() else None


def load_base(recipe: Recipe) -> LoadedModel:
    """Load recipe.model once, quantized as the recipe says, for several `run(..., base=)` calls."""
    from finetune.model.load import load_base as _load_base

    return _load_base(recipe.model, recipe.quantization)


def launch(recipe: Recipe, argv: list[str], gpus: int, *, resume: bool = False, overwrite: bool = False) -> int:
    """`finetune run --gpus N`: after the checks that need no process (an engine that is not installed, a
    folder that already holds a run), start N local processes (torchrun) that each run `finetune` with
    `argv`; returns their exit code."""
    from finetune.train.checkpoints import check_output_dir
    from finetune.train.distributed import check_available
    from finetune.train.distributed import launch as _launch

    check_available(recipe)
    RunDir(Path(recipe.output.dir)).refuse_if_locked("finetune run")  # rank 0 takes the lock once started
    check_output_dir(recipe, resume, overwrite)
    preflight(recipe)
    return _launch(argv, gpus)


def generate(run_dir: str | Path, prompt: str, *, image: str | Path | None = None, max_new_tokens: int = 128,
             use_adapter: bool = True) -> str:
    """Answer `prompt` with the run's model (or its base model with use_adapter=False), about `image` where one
    is given (a vision-language run; the file and the model are checked before anything loads)."""
    from finetune.model.chat import generate as _generate
    from finetune.model.trained import check_image, load_trained, loaded, vision_of
    from finetune.train.streamed_load import streamed_use

    image = check_image(run_dir, image)

    def load(arriving: Any) -> tuple:
        return load_trained(run_dir, use_adapter=use_adapter, arriving=arriving)

    with loaded(run_dir, streamed_use, load) as (model, tokenizer):  # the base streamed where the run streamed it
        vision = vision_of(run_dir, model, tokenizer) if image else None
        return _generate(model, tokenizer, prompt, image=image, vision=vision, max_new_tokens=max_new_tokens)


def compare(run_dir: str | Path, prompt: str, *, image: str | Path | None = None, max_new_tokens: int = 128
            ) -> tuple[str, str]:
    """(base model's answer, fine-tuned answer) to the same prompt (and image), the model loaded once, its base
    as the run streamed it (finetune.model.compare.compare)."""
    from finetune.model.compare import compare as _compare
    from finetune.train.streamed_load import streamed_use

    return _compare(run_dir, prompt, image=image, max_new_tokens=max_new_tokens, streaming=streamed_use)


def compare_runs(run_dirs: list[str | Path], prompt: str, *, image: str | Path | None = None,
                 max_new_tokens: int = 128, parents: bool = True) -> list[tuple[str, str]]:
    """[(label, answer)]: the base model's, then each run's (and with `parents` the runs each started from), from
    one loaded base, streamed as the first run streamed it (finetune.model.compare.compare_runs)."""
    from finetune.model.compare import compare_runs as _compare_runs
    from finetune.train.streamed_load import streamed_use

    return _compare_runs(run_dirs, prompt, image=image, max_new_tokens=max_new_tokens, parents=parents,
                         streaming=streamed_use)


def chat_models() -> ChatModels:
    """The models chat keeps loaded (finetune.model.chat.ChatModels), each run's base loaded as the run streamed
    it; `close()` drops them and closes their weight stores (their files removed)."""
    from finetune.model.chat import ChatModels
    from finetune.train.streamed_load import streamed_use

    return ChatModels(streaming=streamed_use)


def chat_worker() -> int:
    """The chat worker process the UI starts (ui.chat_serve): finetune.model.chat's JSON-lines loop on stdin and
    stdout over `chat_models()`, until stdin closes."""
    from finetune.model.chat import main

    return main(chat_models())


def lineage(run_dirs: list[str | Path]) -> list[tuple[Path, str]]:
    """[(run directory, label)]: the runs with, before each, the runs its adapter started from
    (adapter.init_from: the SFT run of a DPO run), oldest first; see finetune.model.trained.lineage."""
    from finetune.model.trained import lineage as _lineage

    return _lineage(list(run_dirs))


def export(run_dir: str | Path, out_dir: str | Path, progress: Callable[[ExportStep], None] = lambda step: None,
           gguf: GGUFOptions | None = None) -> Path:
    """Merge the run's adapter into its base model and save it as safetensors, or with `gguf` as one GGUF file
    (and an Ollama Modelfile); `progress` gets an ExportStep per step (str(): "[1/4] loading the base model:
    ...", `to_json()` for machines). Refused
    while a run or another export holds the run directory."""
    from finetune.model.trained import export_merged

    with RunDir(Path(run_dir)).lock("finetune export"):
        return export_merged(run_dir, out_dir, progress, gguf)


def evaluate(run_dir: str | Path, data: str | Path | None = None, *, compare: list[str | Path] | None = None,
             max_new_tokens: int | None = None, progress: Callable[[str], None] = lambda line: None
             ) -> dict[str, Any]:
    """Held-out loss, perplexity and answer matches of the run on `data`, or (None) on the records its
    data.validation_split held out (with `compare`: the base model and the runs listed beside it); also saved
    as the run's evaluation.json (finetune.evaluate.run). A preference run (dpo, orpo, simpo, cpo) is measured
    on chosen/rejected pairs instead: preference accuracy, reward margin, the chosen answers' NLL. Refused, as export is, while a run, a resume or an
    export holds the run directory."""
    from finetune.evaluate.run import evaluate as _evaluate

    with RunDir(Path(run_dir)).lock("finetune eval"):
        return _evaluate(run_dir, data, compare=compare, max_new_tokens=max_new_tokens, progress=progress)
