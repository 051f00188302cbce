"""The Python API. The CLI and the web UI call these functions and hold no logic of their own."""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.export.files import GGUFOptions
from finetune.export.files import ollama_command as ollama_command  # re-exported for the CLI and UI
from finetune.export.progress import ExportStep as ExportStep  # re-exported for the CLI and UI
from finetune.recipe.goals import goal_values
from finetune.recipe.load import load_recipe as _load_recipe
from finetune.recipe.load import load_recipe_text, recipe_data, validate_recipe
from finetune.recipe.schema import Recipe
from finetune.reports import (
    BatchReport,
    EvaluationTable,
    GPUSizes,
    GRPOReport,
    LocalModel,
    Machine,
    RewardReport,
    RunMemory,
    SeenLengthPlan,
    SizePlans,
    SpeedEstimate,
)
from finetune.rundir import EVAL_PREFIX, REWARD_KEYS, RunDir

if TYPE_CHECKING:  # torch and transformers load only when a command needs them
    from finetune.data.build import TokenCounter
    from finetune.model.load import LoadedModel
    from finetune.plan import Plan
    from finetune.train.run import RunResult


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


def image_token_counter(model_path: str, trust_remote_code: bool = False) -> TokenCounter | None:
    """A vision-language model's image tokens for a record's image sizes at a pixel budget, as the planner counts
    them (its config and preprocessor_config.json: finetune.plan.vision), so the preflight can refuse images too
    long for max_seq_len from their headers; None where the config cannot be read yet (a hub id not downloaded:
    the data build checks those records)."""
    from finetune.plan.trace import planned_config, real_config
    from finetune.plan.vision import image_tokens, planned_grids

    try:
        config = real_config(planned_config(model_path, trust_remote_code))
    except Exception:  # noqa: BLE001 - not readable before loading: the build's check remains
        return None
    seen: dict[tuple, int] = {}

    def count(sizes: list[tuple[int, int]], max_pixels: int | None) -> int:
        key = (tuple(sizes), max_pixels)
        if key not in seen:
            seen[key] = sum(image_tokens(config, g) for g in planned_grids(config, model_path, sizes, max_pixels))
        return seen[key]
    return count


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

    if device is None and gpu_memory is None and recipe.memory.gpu_memory != "auto":
        device = "cuda"
    check_context(recipe)
    return predict(recipe, gpu_memory=gpu_memory, device=device)


def check_context(recipe: Recipe) -> None:
    """Refuse, before the planner's search, a data.max_seq_len above the model's own limit (its config's
    max_position_embeddings: positions it never saw), naming the limit and how long the data's records are;
    otherwise the search prices the impossible length for a minute and answers only that nothing fits. A
    config that cannot be read yet (a hub id not downloaded) is checked by the plan's own reading of it."""
    from finetune.errors import RecipeError
    from finetune.plan.trace import planned_config

    try:
        text = planned_config(recipe.model.path, recipe.model.trust_remote_code).get_text_config()
    except Exception:  # noqa: BLE001 - the plan reads it again and reports what is wrong with it
        return
    limit = getattr(text, "max_position_embeddings", None)
    if isinstance(limit, int) and recipe.data.max_seq_len > limit:
        longest = longest_record_bytes(recipe)
        data = (f"; the longest record of {recipe.data.label()} is {longest:,} bytes of JSON, so at most about "
                f"{longest:,} tokens" if longest else "")
        raise RecipeError(f"data.max_seq_len {recipe.data.max_seq_len:,} is above the model's own limit of {limit:,} "
                          f"positions (max_position_embeddings of {recipe.model.path}){data}",
                          hint=f"set data.max_seq_len to at most {limit:,}; the longest example's length is "
                               "enough (longer ones are cut or dropped, as data.truncation says)")


def context_note(recipe: Recipe) -> str | None:
    """For a plan where nothing fits: a line saying data.max_seq_len is far (4x) above the data's longest
    record, the length a step's memory grows with, or None."""
    longest = longest_record_bytes(recipe)
    if longest is None or recipe.data.max_seq_len <= 4 * longest:
        return None
    return (f"data.max_seq_len {recipe.data.max_seq_len:,} is far above the data's longest record ({longest:,} bytes "
            f"of JSON, so at most about {longest:,} tokens): a max_seq_len near that needs far less memory")


def longest_record_bytes(recipe: Recipe) -> int | None:
    """The longest record of the data as UTF-8 JSON, in bytes: a bound on its tokens (a token holds at least
    one byte of its text; keys, quotes and braces outweigh a chat template's few markers) read in the time
    it takes to read the file, without a tokenizer. None where the data cannot be read (preflight says why)."""
    import json

    from finetune.data.mix import read_files
    from finetune.errors import FinetuneError

    try:
        values = [r.value for f in read_files(recipe.data) for r in f.read.records]
    except FinetuneError:
        return None
    return max((len(json.dumps(v, ensure_ascii=False).encode()) for v in values), default=None)


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


GPU_SIZES_GB = (8, 12, 16, 24, 48, 80)  # the cards a newcomer is likely to have or rent
CONTEXT_LADDER = tuple(256 << 2 * i for i in range(7))  # 256 .. 1M tokens (the schema's max_seq_len limit)
# Above these the roofline estimate is not believable: per-step overheads it leaves out dominate small models.
SPEED_CEILING = {"cuda": 100_000, "cpu": 10_000}


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


def plan_gpu_sizes(recipe: Recipe, sizes_gb: tuple[float, ...] = GPU_SIZES_GB,
                   ladder: tuple[int, ...] = CONTEXT_LADDER) -> GPUSizes:
    """What fits on each GPU size (GiB; 22.35 for a 24GB card): the longest context it trains (the recipe's
    other settings kept, its `auto` ones chosen by the planner; at most the model's max_position_embeddings)
    and the largest micro-batch at the recipe's max_seq_len.

    One leanest-plan query per sequence length (the smallest memory any allowed configuration needs) answers
    every size at once; the model config is read once and the planner's trace cache keeps repeats cheap.
    Between two lengths of the ladder the boundary is interpolated and the interpolated length checked by
    the planner, so every reported length is one the planner says fits. Returns `sizes` (one row per GPU:
    gpu_gb, longest_context, largest_micro_batch, recipe_fits), the bytes needed per length and micro-batch, and
    `micro_batch_cap`, the largest micro-batch the search tries (a row at the cap may fit more)."""
    from finetune.plan import predict
    from finetune.plan.search import MICRO_BATCHES
    from finetune.plan.trace import planned_config
    from finetune.recipe.init_from import resolve_init_from

    recipe = resolve_init_from(recipe)  # the adapter's shape written out: the copies below set every key
    config = planned_config(recipe.model.path, recipe.model.trust_remote_code)
    margin = recipe.memory.gpu_memory_margin
    cache: dict[tuple[str, int], int] = {}

    def need(key: str, value: int) -> int:
        """Total GPU memory (margin included) the leanest configuration needs with `key` set to `value`."""
        if (key, value) not in cache:
            data = recipe.model_dump(mode="python")
            if key == "seq":  # the longest context is that of one sequence per micro-batch
                data["data"]["max_seq_len"] = value
                if data["training"]["micro_batch_size"] == "auto":
                    data["training"].update(micro_batch_size=1, gradient_accumulation_steps=1,
                                            effective_batch_size=None)
            else:
                data["training"].update(micro_batch_size=value, gradient_accumulation_steps=1,
                                        effective_batch_size=None)
            plan = predict(validate_recipe(data, "plan_gpu_sizes"), model_config=config, gpu_memory=margin + 1,
                           device="cuda", full_length=True)  # contexts of max_seq_len, whatever the images
            # Only configurations traced and rejected for the budget alone count (an offload that would not find
            # enough free RAM or disk does not make a length trainable; a lower bound is no peak); without one,
            # the planner's own minimum.
            over = [c.peak_bytes for c in plan.rejected if c.kind == "over_budget"]
            cache[key, value] = min(over) + margin if over else plan.min_budget_bytes or plan.peak_bytes + margin
        return cache[key, value]

    largest = round(max(sizes_gb) * 2**30)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None) or max(ladder)  # no use training past it
    context_need = {}
    for seq in sorted({s for s in ladder if s < limit} | {min(limit, max(ladder))}):
        context_need[seq] = need("seq", seq)
        if context_need[seq] > largest:
            break
    batch_need = {}
    for mb in MICRO_BATCHES:
        batch_need[mb] = need("mb", mb)
        if batch_need[mb] > largest:
            break
    rows = []
    for gb in sizes_gb:
        total = round(gb * 2**30)
        fit = [s for s, n in context_need.items() if n <= total]
        longest = max(fit) if fit else None
        above = [s for s in context_need if longest is not None and s > longest]
        if above:  # between two ladder points: interpolate, then ask the planner
            lo, hi = context_need[longest], context_need[above[0]]
            guess = longest + int((above[0] - longest) * (total - lo) / max(hi - lo, 1)) // 256 * 256
            for tried in (guess, (longest + guess) // 512 * 256):  # and once more halfway, if that was too long
                if tried > longest and need("seq", tried) <= total:
                    longest = tried
                    break
        batches = [mb for mb, n in batch_need.items() if n <= total]
        rows.append({"gpu_gb": gb, "longest_context": longest, "largest_micro_batch": max(batches) if batches else None,
                     "recipe_fits": need("seq", recipe.data.max_seq_len) <= total})
    return {"max_seq_len": recipe.data.max_seq_len, "model_max_context": limit, "sizes": rows,
            "context_need_bytes": {s: n for (k, s), n in sorted(cache.items()) if k == "seq"},
            "micro_batch_need_bytes": batch_need, "micro_batch_cap": max(MICRO_BATCHES)}


def plan_sizes(recipe: Recipe, sizes: list[str]) -> SizePlans:
    """`finetune plan --gpu-memory 8GiB,12GiB,...`: the plan for each GPU size (`sizes` as --gpu-memory spells
    them), beside what `plan_gpu_sizes` (the UI's per-size chart) says of it: the longest context at micro-batch
    1 and the largest micro-batch at max_seq_len, up to the search's cap (`micro_batch_cap`)."""
    from finetune.plan.search import MICRO_BATCHES
    from finetune.units import parse_bytes

    totals = [int(parse_bytes(size)) for size in sizes]
    sweep = plan_gpu_sizes(recipe, tuple(total / 2**30 for total in totals))
    rows = []
    for size, total, swept in zip(sizes, totals, sweep["sizes"], strict=True):
        chosen = plan(recipe, gpu_memory=total, device="cuda")
        rows.append({"gpu_memory": size, "gpu_bytes": total, "fits": chosen.fits, "peak_bytes": chosen.peak_bytes,
                     "settings": chosen.settings, "tokens_per_s": chosen.tokens_per_s,
                     "min_budget_bytes": chosen.min_budget_bytes, "longest_context": swept["longest_context"],
                     "largest_micro_batch": swept["largest_micro_batch"]})
    return {"max_seq_len": recipe.data.max_seq_len, "model_max_context": sweep["model_max_context"],
            "micro_batch_cap": max(MICRO_BATCHES), "sizes": rows}


def speed_estimate(plan: dict[str, Any]) -> SpeedEstimate:
    """The plan's predicted tokens/s as a person should read it: rounded to two figures, with the hardware
    figures it rests on, and capped where a roofline estimate stops being believable (`text`, `short` for a
    table cell, `basis`, `tokens_per_s`: the rounded figure or None)."""
    from finetune.plan.cost_model import DEVICE, DEVICE_BASIS

    device = plan.get("device") or "cuda"
    figures = plan.get("device_figures") or DEVICE.get(device, DEVICE["cuda"])
    flops = f"{figures['flops'] / 1e12:.1f} TFLOP/s" if figures["flops"] >= 1e12 else \
        f"{figures['flops'] / 1e9:,.0f} GFLOP/s"
    if plan.get("figures_measured"):
        whose, caveat = "measured on this machine's CPU", ""
    else:
        whose, caveat = f"of {DEVICE_BASIS.get(device, device)}", "whatever the card's memory size; "
    basis = (f"roofline model with the figures {whose} ({flops}, {figures['mem_bw'] / 1e9:,.0f} GB/s), {caveat}"
             "real runs are usually slower")
    tps = plan.get("tokens_per_s")
    if not isinstance(tps, (int, float)) or tps <= 0:
        return {"tokens_per_s": None, "text": "no speed estimate", "short": "", "basis": basis}
    ceiling = SPEED_CEILING.get(device, SPEED_CEILING["cuda"])
    if tps > ceiling:
        return {"tokens_per_s": None, "basis": basis, "short": f"over {ceiling:,}",
                "text": f"over {ceiling:,} tokens/s (too small a model for the estimate: per-step overheads, "
                        "which it leaves out, decide the speed)"}
    rounded = float(f"{tps:.2g}")
    return {"tokens_per_s": rounded, "text": f"about {rounded:,.0f} tokens/s", "short": f"~{rounded:,.0f}",
            "basis": basis}


class RunFiles:
    """One look at a run directory: each of its files read at most once, when first asked for. A view of a run
    builds one and hands it to every report and view it draws (the UI's Train tab redraws on every timer tick),
    so metrics.jsonl or plan.json is read once however many of them show it; the run-report functions below
    take one or a run directory (read afresh)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run = RunDir(Path(run_dir))

    @property
    def root(self) -> Path:
        return self.run.root

    @cached_property
    def status(self) -> dict[str, Any]:
        return self.run.read_status()

    @cached_property
    def metrics(self) -> list[dict[str, Any]]:
        return self.run.read_metrics()

    @cached_property
    def plan(self) -> dict[str, Any] | None:
        return self.run.read_plan()

    @cached_property
    def results(self) -> dict[str, Any] | None:
        return self.run.read_results()

    @cached_property
    def evaluation(self) -> dict[str, Any] | None:
        return self.run.read_evaluation()

    @cached_property
    def completions(self) -> list[dict[str, Any]]:
        return self.run.read_completions()

    @cached_property
    def recipe_text(self) -> str | None:
        """The resolved recipe.yaml's text, None while the run has none."""
        try:
            return self.run.recipe.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None


def run_files(run: str | Path | RunFiles) -> RunFiles:
    """`run` as RunFiles: itself when it is one (what it has read stays read), else a fresh look."""
    return run if isinstance(run, RunFiles) else RunFiles(run)


def run_evaluation_table(run: str | Path | RunFiles) -> EvaluationTable | None:
    """The run's latest `finetune eval` as {"headers", "rows" (one per model), "data", "records_read",
    "examples_kept", "with_expected_answer"}, or None before one ran."""
    report = run_files(run).evaluation
    if not report or not report.get("models"):
        return None
    from finetune.evaluate.report import table

    headers, rows = table(report)
    return {"headers": headers, "rows": rows, "data": report.get("data"), "records_read": report.get("records_read"),
            "examples_kept": report.get("examples_kept", report.get("records")),  # "records": an older file's name
            "with_expected_answer": report.get("with_expected_answer")}


def plan_at_seen_length(run: str | Path | RunFiles) -> SeenLengthPlan | None:
    """When a run's longest sequence is shorter than data.max_seq_len and its plan was made for max_seq_len (the
    data could not be read before the plan, or a run of an older version), its plan re-evaluated at that length
    (what the measured peak should be compared with); None while the run has not said, when it is not shorter,
    or when the plan was made for the data already (plan.json's `data`).

    Keys: longest (tokens), max_seq_len, peak_bytes and breakdown at the longest, planned_peak_bytes."""
    from finetune.plan import predict

    files = run_files(run)
    longest = files.status.get("longest_sequence_tokens")
    plan = files.plan or {}
    if not isinstance(longest, int) or files.recipe_text is None or plan.get("data"):
        return None
    recipe = load_recipe_text(files.recipe_text, str(files.run.recipe))
    if longest >= recipe.data.max_seq_len:
        return None
    data = recipe_data(recipe)
    data["data"]["max_seq_len"] = max(longest, 8)
    at = predict(validate_recipe(data, str(files.run.recipe)), device=plan.get("device"), suggest=False)
    return {"longest": longest, "max_seq_len": recipe.data.max_seq_len, "peak_bytes": at.peak_bytes,
            "breakdown": at.breakdown, "planned_peak_bytes": plan.get("peak_bytes")}


def run_memory(run: str | Path | RunFiles) -> RunMemory | None:
    """The run's memory as the end of `finetune run` reports it: the plan's peak (for the data's largest
    micro-batch, or at data.max_seq_len where the data was not read before the plan), then the plan re-evaluated
    at the data's longest example (`plan_at_seen_length`: what the measured peak should be compared with) and
    the measured peak (the last logged: an out-of-memory recovery's re-plan starts a new one). None when the run
    has no plan (the planner could not trace the model)."""
    files = run_files(run)
    plan = files.plan
    if not plan or files.recipe_text is None:
        return None
    recipe = load_recipe_text(files.recipe_text, str(files.run.recipe))
    measured = next((r["peak_memory_bytes"] for r in reversed(files.metrics) if r.get("peak_memory_bytes")), None)
    from finetune.plan.search import planned_for

    sequence = (plan.get("vision") or {}).get("sequence")
    return {"planned_peak_bytes": plan["peak_bytes"], "max_seq_len": recipe.data.max_seq_len,
            "planned_sequence": sequence if isinstance(sequence, int) and plan["vision"].get("images") else None,
            "planned_for": planned_for(plan.get("data") or {}),
            "seen": plan_at_seen_length(files), "measured_peak_bytes": measured}


def batch_plan(recipe: Recipe, plan: Plan) -> list[str]:
    """How `run` rescales the learning rate and beta2 for the plan's batch, and the schedule of
    `effective_batch_size: auto`, as lines for `finetune plan` (none when neither applies)."""
    from finetune.recipe.batch_rules import (
        MAX_ACCUMULATION,
        apply_batch_rules,
        auto_schedule,
        reference_batch,
    )

    resolved, rule = apply_batch_rules(plan.apply(recipe).recipe, reference_batch(recipe))
    lines = [f"batch rules: {rule.describe()}"] if rule is not None else []
    effective, t, gpus = recipe.training.effective_batch_size, resolved.training, resolved.distributed.gpus
    trained = int(t.micro_batch_size) * int(t.gradient_accumulation_steps) * gpus
    if isinstance(effective, int) and trained != effective:  # no micro-batch that divides the batch fits
        processes = f" x {gpus} processes" if gpus > 1 else ""
        lines.append(f"batch: trains {t.micro_batch_size} x {t.gradient_accumulation_steps} accumulation"
                     f"{processes} = {trained} sequences per step, not training.effective_batch_size "
                     f"{effective}: the micro-batch{' x processes' if gpus > 1 else ''} does not divide it; give "
                     "a batch it divides, or a micro-batch that divides it, to train exactly that batch")
    if recipe.training.effective_batch_size == "auto":
        lines.append(auto_schedule(int(resolved.training.micro_batch_size), resolved.optimizer.name,
                                   resolved.optimizer.layerwise, MAX_ACCUMULATION,
                                   resolved.training.noise_scale_split_every, resolved.training.method))
    return lines


def run_advice(run_dir: str | Path) -> tuple[list[str], str]:
    """The batch, learning rate and betas a finished run advises for the next one (results.json, from its
    measured noise scale) as `--set` overrides, and why. FinetuneError when the run has no advice."""
    import json

    from finetune.errors import UsageError

    results = RunDir(Path(run_dir)).read_results()
    advice = (results or {}).get("advice")
    if not advice or "settings" not in advice:
        why = advice["reason"] if advice else "it has no results.json with advice (not finished, or an older version)"
        raise UsageError(f"--advice {run_dir}: no batch advice: {why}",
                            hint="give a finished run directory of this version, or plan without --advice")
    return [f"{k}={json.dumps(v)}" for k, v in advice["settings"].items()], advice["reason"]


def apply_advice(recipe: Recipe | str | Path, run_dir: str | Path, overrides: list[str] | None = None
                 ) -> tuple[Recipe, list[str], str]:
    """`recipe` (a Recipe, or a recipe file read as `load_recipe` reads it) with a finished run's advice
    written over it, then `overrides` (the command line's --set, which win): what `finetune plan --advice
    RUN_DIR` plans and the UI's "use the advice" button writes into the form. Returns (the new recipe, the
    `key=value` settings the advice applied, why).

    A micro-batch pinned above the advised batch, or one that does not divide it, would make the run train
    another batch (micro x accumulation: 4 x 2 = 8 for an advice of 6; the learning rate rescaled to it): the
    advice releases it to auto, so the planner picks one that divides the batch, and `why` says so. A
    micro-batch the overrides pin stays, with a note."""
    import json

    from finetune.recipe.batch_rules import accumulation_for
    from finetune.recipe.load import apply_overrides, parse_override

    advised, why = run_advice(run_dir)
    overrides = list(overrides or [])

    def build(items: list[str]) -> Recipe:
        if isinstance(recipe, Recipe):
            return validate_recipe(apply_overrides(recipe_data(recipe), items),
                                   f"the recipe with the advice of {run_dir}")
        return _load_recipe(recipe, items)

    new = build(advised + overrides)
    t, gpus = new.training, new.distributed.gpus
    batch, micro = t.effective_batch_size, t.micro_batch_size
    trained = accumulation_for(batch, micro, gpus) * micro * gpus \
        if isinstance(batch, int) and isinstance(micro, int) else batch
    if trained != batch:  # the pinned micro-batch trains another batch
        pinned = f"training.micro_batch_size {micro}" + (f" x {gpus} processes" if gpus > 1 else "")
        problem = (f"is above the advised batch of {batch}" if micro * gpus > batch else
                   f"does not divide the advised batch of {batch} (it would train {trained})")
        if any(parse_override(item)[0] == ["training", "micro_batch_size"] for item in overrides):
            why += (f". Note: --set {pinned} {problem} and wins; leave it out (or set one that divides the "
                    "batch) to follow the advice")
        else:
            advised = [*advised, f"training.micro_batch_size={json.dumps('auto')}"]
            new = build(advised + overrides)
            why += (f". The recipe's {pinned} {problem}: the advice released it to auto, so the planner "
                    "picks a micro-batch that divides the batch")
    return new, advised, why


def run_batch_report(run: str | Path | RunFiles) -> BatchReport | None:
    """What a finished run says about its batch (results.json and its recipe), for the run view: the batch
    used (micro x accumulation x gpus, in sequences and labelled tokens; `update_batch`: auto's sequences per
    update, below the micro-batch while its warmup ran), the noise scale over time (as (step,
    labelled tokens)), the batch changes (metrics.jsonl's `batch_changed` rows) and the advice
    for next time (`settings` as recipe keys and a `reason`, or only a reason). None when results.json has
    no account of the batch (a run still going, or one from an older version)."""
    files = run_files(run)
    results = files.results or {}
    batch, noise = results.get("batch"), results.get("noise_scale") or {}
    if not isinstance(batch, dict):
        return None
    gpus = _recipe_gpus(files.recipe_text)
    # effective_batch_size: per process, and smaller than micro x accumulation while auto's warmup ran updates
    # of fewer sequences than the micro-batch (finetune/train/sub_updates.py)
    sequences = batch.get("effective_batch_size", batch["micro_batch_size"] * batch["gradient_accumulation_steps"]) \
        * gpus
    per_sequence = noise.get("tokens_per_sequence")
    return {"micro_batch_size": batch["micro_batch_size"], "gradient_accumulation_steps":
            batch["gradient_accumulation_steps"], "gpus": gpus, "sequences": sequences, "auto": bool(batch.get("auto")),
            "update_batch": batch.get("update_batch"),
            "tokens_per_sequence": per_sequence, "tokens": round(sequences * per_sequence) if per_sequence else None,
            "noise_scale": noise.get("final"),
            "noise_series": [tuple(p) for p in noise.get("series") or []], "changes": batch.get("changes") or [],
            "advice": results.get("advice") or {}}


def run_reward_report(run: str | Path | RunFiles) -> RewardReport | None:
    """A preference run's rewards, for the run view: `curves` (each REWARD_KEYS key -> `train` and `eval` lists
    of (step, value) from metrics.jsonl, one eval point per step) and the held-out values `before` and `after`
    training (results.json; empty while the run goes). None for a run that logged no rewards (sft)."""
    files = run_files(run)
    rows = files.metrics
    curves = {}
    for key in REWARD_KEYS:
        train = [(r["step"], r[key]) for r in rows if r.get(key) is not None and "step" in r]
        evals = {r["step"]: r[EVAL_PREFIX + key] for r in rows if r.get(EVAL_PREFIX + key) is not None and "step" in r}
        curves[key] = {"train": train, "eval": sorted(evals.items())}  # one per step: run.py may log the last twice
    if not any(c["train"] or c["eval"] for c in curves.values()):
        return None
    results = files.results or {}
    held_out = {when: {key: (results.get(f"eval_{when}") or {}).get(EVAL_PREFIX + key)
                       for key in (*REWARD_KEYS, "loss")} for when in ("before", "after")}
    return {"curves": curves, **{when: values for when, values in held_out.items()
                                 if any(v is not None for v in values.values())}}


GRPO_CURVES = ("reward", "completion_length", "kl", "clip_ratio")  # metrics.jsonl keys the GRPO view plots


def run_grpo_report(run: str | Path | RunFiles) -> GRPOReport | None:
    """A GRPO run's view: `curves` (each GRPO_CURVES key -> `train` and held-out `eval` lists of (step, value)),
    the held-out values `before` and `after` training (results.json; empty while the run goes) and the
    `samples` of the last step that logged some (completions.jsonl). None for a run of another method."""
    files = run_files(run)
    rows = files.metrics
    if not any("reward" in r and "loss" in r for r in rows):
        return None
    curves = {}
    for key in GRPO_CURVES:
        evals = {r["step"]: r[EVAL_PREFIX + key] for r in rows if r.get(EVAL_PREFIX + key) is not None}
        curves[key] = {"train": [(r["step"], r[key]) for r in rows if r.get(key) is not None and "loss" in r],
                       "eval": sorted(evals.items())}
    results = files.results or {}
    held_out = {when: {k[len(EVAL_PREFIX):]: v for k, v in (results.get(f"eval_{when}") or {}).items()
                       if k != f"{EVAL_PREFIX}runtime"} for when in ("before", "after")}
    samples = files.completions
    last = samples[-1]["step"] if samples else None
    return {"curves": curves, **{when: values for when, values in held_out.items() if values},
            "samples": [s for s in samples if s["step"] == last]}


def _recipe_gpus(text: str | None) -> int:
    """distributed.gpus of a run's resolved recipe.yaml text (1 when there is none or it cannot be read)."""
    import yaml

    try:
        data = yaml.safe_load(text or "")
        return int(data["distributed"]["gpus"])
    except (yaml.YAMLError, KeyError, TypeError, ValueError):
        return 1


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
    from finetune.model.trained import check_image, load_trained, vision_of

    image = check_image(run_dir, image)
    model, tokenizer = load_trained(run_dir, use_adapter=use_adapter)
    vision = vision_of(run_dir, model, tokenizer) if image else None
    return _generate(model, tokenizer, prompt, image=image, vision=vision, max_new_tokens=max_new_tokens)


def compare(run_dir: str | Path, prompt: str, *, image: str | Path | None = None,
            max_new_tokens: int = 128) -> tuple[str, str]:
    """(base model's answer, fine-tuned answer) to the same prompt (and image); the model is loaded once."""
    from finetune.model.chat import generate as _generate
    from finetune.model.trained import check_image, load_trained, vision_of

    image = check_image(run_dir, image)
    model, tokenizer = load_trained(run_dir)
    ask = {"image": image, "vision": vision_of(run_dir, model, tokenizer) if image else None,
           "max_new_tokens": max_new_tokens}
    tuned = _generate(model, tokenizer, prompt, **ask)
    if hasattr(model, "disable_adapter"):  # LoRA: the base is the same weights with the adapter switched off
        with model.disable_adapter():
            return _generate(model, tokenizer, prompt, **ask), tuned
    base, base_tokenizer = load_trained(run_dir, use_adapter=False)  # full fine-tune: load the original
    return _generate(base, base_tokenizer, prompt, **ask), tuned


def lineage(run_dirs: list[str | Path]) -> list[tuple[Path, str]]:
    """[(run directory, label)]: the runs with, before each, the runs its adapter started from
    (adapter.init_from: the SFT run of a DPO run), oldest first; see finetune.model.trained.lineage."""
    from finetune.model.trained import lineage as _lineage

    return _lineage(list(run_dirs))


def compare_runs(run_dirs: list[str | Path], prompt: str, *, image: str | Path | None = None,
                 max_new_tokens: int = 128, parents: bool = True) -> list[tuple[str, str]]:
    """[(label, answer)]: the base model's answer, then each run's (labelled by its folder; e.g. an SFT run, then
    a DPO run trained after it), all from one loaded base with the runs' LoRA adapters switched in turn.
    `parents`: a run started from another run's adapter (adapter.init_from) brings that run in before it,
    labelled "NAME (start of CHILD)", so a DPO run alone shows base, SFT and DPO. With `image`, every model is
    asked about it."""
    from finetune.model.chat import generate as _generate
    from finetune.model.trained import check_image, load_adapters, vision_of

    runs = lineage(run_dirs) if parents else [(Path(d), Path(d).name) for d in run_dirs]
    for run, _ in runs:
        image = check_image(run, image)
    model, tokenizer, names = load_adapters([run for run, _ in runs])
    ask = {"image": image, "vision": vision_of(runs[-1][0], model, tokenizer) if image else None,
           "max_new_tokens": max_new_tokens}
    with model.disable_adapter():
        answers = [("base model", _generate(model, tokenizer, prompt, **ask))]
    for name, (_, label) in zip(names, runs, strict=True):
        model.set_adapter(name)
        answers.append((label, _generate(model, tokenizer, prompt, **ask)))
    return answers


def export(run_dir: str | Path, out_dir: str | Path, progress: Callable[[ExportStep], None] = lambda step: None,
           gguf: GGUFOptions | None = None) -> Path:
    """Merge the run's adapter into its base model and save it as safetensors, or with `gguf` as one GGUF file
    (and an Ollama Modelfile); `progress` gets an ExportStep per step (str(): "[1/4] loading the base model:
    ...", `to_json()` for machines). Refused
    while a run or another export holds the run directory."""
    from finetune.model.trained import export_merged

    with RunDir(Path(run_dir)).lock("finetune export"):
        return export_merged(run_dir, out_dir, progress, gguf)


def evaluate(run_dir: str | Path, data: str | Path, *, compare: list[str | Path] | None = None,
             max_new_tokens: int | None = None, progress: Callable[[str], None] = lambda line: None
             ) -> dict[str, Any]:
    """Held-out loss, perplexity and answer matches of the run on `data` (with `compare`: the base model and the
    runs listed beside it); also saved as the run's evaluation.json (finetune.evaluate.run). Refused, as export
    is, while a run, a resume or an export holds the run directory."""
    from finetune.evaluate.run import evaluate as _evaluate

    with RunDir(Path(run_dir)).lock("finetune eval"):
        return _evaluate(run_dir, data, compare=compare, max_new_tokens=max_new_tokens, progress=progress)
