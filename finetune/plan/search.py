"""Enumerate the `auto` settings of a recipe, drop what does not fit the budget, rank the rest by tokens/s.

Why one module of ~800 lines: the search is one pipeline (the model's spec, the candidates from the `auto`
keys, the fit and room checks, the ranking, the `Plan` it returns) whose steps share the candidate and plan
types; the models it asks (memory, speed, trace, vision) are modules of their own.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import ValidationError

from finetune.data.batching import Batching, epoch_shape
from finetune.data.shape import DataShape
from finetune.errors import FinetuneError, RecipeError, UsageError
from finetune.memory.bandwidth import cpu_compute, transfer_bandwidth
from finetune.memory.device_memory import usable_gpu_memory
from finetune.memory.offload import offload_dir_for
from finetune.memory.offload_disk import left_behind
from finetune.model.kernels import compile_pays, kernel_choices
from finetune.model.moe import moe_config
from finetune.model.vision import in_vision
from finetune.plan import weight_stream as stream
from finetune.plan.batches import PricedBatch, run_batches
from finetune.plan.cost_model import figures_of, stream_links, tokens_per_second
from finetune.plan.data import PlannedData, read_data
from finetune.plan.memory_model import (
    ModelSpec,
    managed_state,
    memory_floor,
    predict_memory,
    step_completions,
    streamed_weight_bytes,
    weights_streamed,
)
from finetune.plan.planner import DEFAULT, Planner
from finetune.plan.shapes import ModelShapes, target_dtype
from finetune.plan.trace import (
    model_facts,
    model_key,
    model_type_of,
    param_table_of,
    planned_config,
    real_config,
)
from finetune.plan.vision import Grid, image_tokens, planned_grids, processor_config, shown_rows
from finetune.recipe.batch_rules import accumulation_for
from finetune.recipe.families import family_for
from finetune.recipe.init_from import resolve_init_from
from finetune.recipe.offload_tiers import STORES, tier_names, tier_spec
from finetune.recipe.optimizers import auto_preferences
from finetune.recipe.resolved import RunConfig, resolve
from finetune.recipe.schema import (
    BATCHINGS,
    MIN_IMAGE_PIXELS,
    SHARDED_STRATEGIES,
    STRATEGIES,
    Recipe,
    strategy_problems,
)
from finetune.recipe.settings import Settings, inactive_settings, read_settings, write_settings
from finetune.recipe.settings import table as settings_table
from finetune.rl.step import scoring_passes, trace_objective
from finetune.step.liger_losses import kernels_line
from finetune.step.preference import PreferenceLoss, loads_reference_adapter, reference_is_current
from finetune.units import format_bytes, parse_bytes
from finetune.vision import layout_of

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
MICRO_BATCH_GAIN = 0.10  # the predicted speed-up a larger micro-batch must bring to be chosen over a smaller one
# Optimizers `auto` may pick (the registry's auto_preference); the factor is a preference (update quality),
# not a speed.
AUTO_OPTIMIZERS = auto_preferences()


# Why a configuration was rejected, for callers that act on it (the text in `reason` is for people):
# over_budget: its traced peak exceeds the budget; over_budget_floor: its lower bound (weights and optimizer
# state, no trace) already does; offload_space: its offload tier's folder or RAM lacks the room; host_ram: a
# paged optimizer's managed state, or the experts memory.offload_experts keeps there, do not fit in free host RAM.
RejectionKind = Literal["over_budget", "over_budget_floor", "offload_space", "host_ram", "slow_disk"]


@dataclass
class Candidate:
    settings: dict[str, Any]
    peak_bytes: int
    breakdown: dict[str, int]
    tokens_per_s: float
    reason: str | None = None  # set together with `kind`: a rejected configuration
    kind: RejectionKind | None = None
    communication_bytes: int = 0  # of the peak: the strategy's communication buffers (in breakdown["other"])
    reference_pass_bytes: int = 0  # training.precompute_reference: peak of the pass before training
    managed_bytes: int = 0  # a paged optimizer's state in CUDA managed memory: host RAM, not in the peak
    generation_bytes: int = 0  # training.method grpo: generation's peak (the peak is the larger of the two)
    training_bytes: int = 0  # training.method grpo: the training phase's peak

    def reject(self, kind: RejectionKind, reason: str) -> None:
        """Mark this configuration rejected: `kind` for code, `reason` (one line) for people."""
        self.kind, self.reason = kind, reason


@dataclass
class Plan:
    """The planner's answer: chosen settings, predicted peak and breakdown, budget, alternatives."""

    device: str
    settings: dict[str, Any]
    peak_bytes: int
    breakdown: dict[str, int]
    budget_bytes: int
    fits: bool
    tokens_per_s: float
    alternatives: list[Candidate] = field(default_factory=list)
    rejected: list[Candidate] = field(default_factory=list)
    min_budget_bytes: int | None = None
    world_size: int = 1  # the plan is per device; tokens_per_s is the whole job's
    communication_bytes: int = 0  # of the peak: the strategy's communication buffers (in breakdown["other"])
    reference_pass_bytes: int = 0  # training.precompute_reference: peak of the pass before training (in peak_bytes
    # when it is the larger)
    managed_bytes: int = 0  # a paged optimizer's state in CUDA managed memory: outside the peak, in host RAM
    generation_bytes: int = 0  # training.method grpo: generation's peak (peak_bytes is the larger of the two)
    training_bytes: int = 0  # training.method grpo: the training phase's peak
    device_figures: dict[str, float] = field(default_factory=dict)  # what tokens_per_s rests on (figures_of)
    figures_measured: bool = False  # device_figures were measured on this machine (a CPU), not DEVICE's constants
    notes: list[str] = field(default_factory=list)  # settings the search left out, and why
    # a vision-language model: what its images cost (vision_weights: the vision tower and projector's bytes,
    # within breakdown's weights; images and image_tokens: one example's, as traced); {} for a text model
    vision: dict[str, int] = field(default_factory=dict)
    attention: str = ""  # the attention kernel planned (model.attn_implementation, auto resolved for the device)
    # the data planned for (plan.data): examples, longest_tokens (the longest example), sequence (the row length
    # traced: the largest micro-batch's the run forms, else the longest example's, at most max_seq_len; packing:
    # max_seq_len), max_seq_len, packing (0/1), and where the run's batches were cut (finetune.plan.batches) rows
    # and padded (0/1) of that micro-batch; {} where the data could not be read before the plan (planned at
    # data.max_seq_len, with a note saying why)
    data: dict[str, int] = field(default_factory=dict)
    # nothing fits: each setting the recipe fixes that, left to the planner (auto), would make the plan fit, as
    # {"key": "memory.offload_experts", "value": what the planner then picks, "peak_bytes", "tokens_per_s"}
    fixes: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def fix_lines(self) -> list[str]:
        """Each of `fixes` for people: "memory.offload_experts: auto fits (the planner picks cpu): peak 10.40 GiB,
        4,765 tokens/s predicted"."""
        return [f"{f['key']}: auto fits (the planner picks {json.dumps(f['value'])}): peak "
                f"{format_bytes(f['peak_bytes'])}, {f['tokens_per_s']:,.0f} tokens/s predicted" for f in self.fixes]

    def planned_for(self) -> str:
        """What the peak is for, in words: the largest micro-batch the run forms (its rows and row tokens), or
        the longest example's rows where the run's batches are not known before it, or data.max_seq_len's rows
        where the data was not read before the plan ("" then: a note says why)."""
        return planned_for(self.data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def apply(self, recipe: Recipe) -> RunConfig:
        """`recipe` resolved: every `auto` the planner decides replaced by the chosen value."""
        inactive = inactive_settings(recipe)  # e.g. distributed.strategy with one process stays as written
        chosen = write_settings(recipe, {k: v for k, v in self.settings.items() if k not in inactive})
        if chosen.memory.gpu_memory == "auto":  # the budget planned for (a fresh copy: assigning is safe)
            chosen.memory.gpu_memory = self.budget_bytes + recipe.memory.gpu_memory_margin
        return resolve(chosen)


def planned_for(data: dict[str, int]) -> str:
    """`Plan.planned_for` of a plan's `data` (also of a plan.json read back)."""
    if not data:
        return ""
    if data.get("packing"):
        return f"for packed rows of data.max_seq_len {data['max_seq_len']:,} tokens"
    if "rows" in data:
        return (f"for the run's largest micro-batch ({data['rows']} x {data['sequence']:,} tokens"
                f"{'' if data['padded'] else ', no padding'}; data.max_seq_len {data['max_seq_len']:,})")
    if data["sequence"] < data["max_seq_len"]:
        return (f"for the data's longest example ({data['sequence']:,} tokens; data.max_seq_len "
                f"{data['max_seq_len']:,})")
    return f"for rows of data.max_seq_len {data['max_seq_len']:,} tokens (the data's longest example fills them)"


def _free_memory(device: str) -> int:
    if device == "cuda":
        return usable_gpu_memory() or 0
    import psutil

    return psutil.virtual_memory().available


def _budget(recipe: Recipe, gpu_memory: int | str | None, device: str) -> int:
    value = gpu_memory if gpu_memory is not None else recipe.memory.gpu_memory
    try:
        value = parse_bytes(value)
    except ValueError as exc:
        raise UsageError(f"bad --gpu-memory {gpu_memory!r}: {exc}") from None
    total = _free_memory(device) if value == "auto" else int(value)
    budget = total - recipe.memory.gpu_memory_margin
    if budget <= 0:
        raise UsageError(f"--gpu-memory {format_bytes(total)} leaves no budget after memory.gpu_memory_margin "
                            f"{format_bytes(recipe.memory.gpu_memory_margin)}",
                            hint="give the GPU's memory, e.g. --gpu-memory 12GiB, or lower memory.gpu_memory_margin")
    return budget


def fixed_effective_batch(recipe: Recipe) -> int | None:
    """training.effective_batch_size when a number (auto: the run chooses it from the noise scale and starts
    without accumulation)."""
    effective = recipe.training.effective_batch_size
    return effective if isinstance(effective, int) else None


# data.max_pixels auto: image budgets in whole 28 x 28 cells (a Qwen-VL image token), 16384 to 256 of them
PIXEL_BUDGETS = tuple(n * 28 * 28 for n in (16384, 4096, 2048, 1024, 512, 256))


def auto_values(recipe: Recipe, device: str) -> dict[str, list[Any]]:
    """What each searched setting (finetune.recipe.settings) may become where the recipe says `auto`;
    gradient_accumulation_steps follows the micro-batch instead (`_choices`)."""
    effective = fixed_effective_batch(recipe)
    micro = [b for b in MICRO_BATCHES if not effective or b <= effective]
    world = recipe.distributed.gpus
    return {
        # those that divide the batch over the devices, so the accumulation keeps it exactly (an advised batch
        # of 6 trains at 2 x 3, not 4 x 2 = 8); where none does, every micro-batch up to the batch
        "micro_batch_size": [b for b in micro if effective and accumulation_for(effective, b, world) * b * world == effective]
        or micro,
        "activation_checkpointing": [False, True],
        # Only tiers that free the training device's memory are worth trying (on a CPU run RAM is that memory).
        "offload": ["none", *(t for t in tier_names() if tier_spec(t).frees_device(device))],
        # several processes: the chunked loss would bypass the wrapper's forward (DistributedConfig.problems_with)
        # grpo: the completions' log-probs come from their logits directly (finetune.rl.step)
        "chunked_loss": [False, True] if recipe.distributed.gpus == 1 and not recipe.training.spec.generates
        else [False],
        "bits": [None] if recipe.adapter.type == "full" else [None, 8, 4],
        "optimizer": _auto_optimizers(recipe),
        "tiled_mlp": [False, True],
        # the tiers that free the training device (on a CPU run the host is the device: only the disk does)
        "offload_experts": ["none", *(t for t in tier_names() if tier_spec(t).frees_device(device))],
        # weight streaming: the tiers that free the training device, as for the experts
        "offload_weights": ["none", *(t for t in tier_names() if tier_spec(t).frees_device(device))],
        # read-ahead depths; `_choices` keeps those that can be faster for the candidate's tier (ahead_choices)
        "offload_weights_ahead": list(stream.AHEAD_CHOICES),
        # not a search axis: `predict` fills the chosen plan's room with resident layers (_fill_resident)
        "offload_weights_resident": [0],
        "strategy": _auto_strategies(recipe),
        # grpo: whole groups, doubling; one that holds the step's all is None (_choices)
        "generation_batch_size": [None, *(recipe.grpo.num_generations << k for k in range(11))]
        if recipe.training.spec.generates else [None],
        "kernels": kernel_choices(recipe, device),
        "compile": [compile_pays(recipe, device)],  # one value: compile is memory-neutral, chosen by run length
        # largest first; `predict` tries them one after another (each capped at the model's own limit)
        "max_pixels": list(PIXEL_BUDGETS),
        # not a search axis either: `predict` picks one for the chosen batch (auto_batching)
        "batching": [b for b in BATCHINGS if b != "token_budget" or world == 1],
    }


def _auto_strategies(recipe: Recipe) -> list[str]:
    """The strategies `distributed.strategy: auto` may pick. deepspeed is an optional dependency: considered
    only where it is installed; a deepspeed-only key (DEEPSPEED_KEYS) set leaves only deepspeed, and a
    RecipeError naming the key when it is not installed."""
    dist = recipe.distributed
    if dist.gpus == 1:
        return ["ddp"]
    keys = dist.deepspeed_keys() if dist.strategy == "auto" else []
    if keys and not deepspeed_installed():
        named = "distributed." + ", distributed.".join(keys)
        raise RecipeError(f"{named}: only strategy deepspeed reads {'them' if len(keys) > 1 else 'it'}, and "
                          "deepspeed is not installed, so distributed.strategy auto has no strategy to pick",
                          hint=f"install deepspeed (pip install deepspeed), or remove {named} to let the "
                               "planner choose ddp or fsdp")
    if keys:
        return ["deepspeed"]
    return [s for s in STRATEGIES if s != "deepspeed" or deepspeed_installed()]


def _auto_optimizers(recipe: Recipe) -> list[str]:
    """The optimizers `optimizer.name: auto` may pick that the rest of `recipe` allows (optimizer-specific
    keys: optimizer.rank takes a low-rank one; optimizer.rank below adapter.r; adapter type; layer-wise)."""
    if recipe.optimizer.name != "auto":
        return list(AUTO_OPTIMIZERS)
    allowed, why = [], []
    for name in AUTO_OPTIMIZERS:
        try:
            write_settings(recipe, {"optimizer": name})
        except ValidationError as exc:
            why.append(f"{name}: " + "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors()))
        else:
            allowed.append(name)
    if not allowed:
        raise RecipeError("optimizer.name auto: none of the optimizers it may pick fits the rest of the "
                          "recipe", problems=why, hint="name the optimizer in optimizer.name, or remove the "
                                                       "optimizer.* keys that rule the others out")
    return allowed


def deepspeed_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def _choices(recipe: Recipe, spec: ModelSpec) -> list[Settings]:
    """Every combination of the recipe's settings, each `auto` one taking its `auto_values`."""
    given = read_settings(recipe)
    if given["activation_checkpointing"] == "auto":
        given["checkpoint_every_n_layers"] = 1
    if given["max_pixels"] == "auto":  # not a search axis: `predict` plans each budget in turn (pixel_budgets)
        given["max_pixels"] = None
    if given["batching"] == "auto":  # not a search axis: `predict` picks it for the chosen batch (auto_batching)
        given["batching"] = "random"
    auto = auto_values(recipe, spec.device)
    axes = {name: auto.get(name, [value]) if value == "auto" else [value] for name, value in given.items()}
    effective = fixed_effective_batch(recipe)
    world = recipe.distributed.gpus
    out = []
    for values in itertools.product(*axes.values()):
        st = dict(zip(axes, values, strict=True))
        if st["tiled_mlp"] and given["tiled_mlp"] == "auto" and spec.seq_len <= spec.tiled_mlp_tokens:
            continue  # one chunk: the plain MLP (a fixed true stays: the run tiles longer sequences, this one not)
        if st["kernels"] == "liger" and st["chunked_loss"]:
            continue  # Liger's fused loss replaces the chunked loss
        if st["offload"] != "none" and spec.num_layers < 2:
            continue
        if st["offload_experts"] != "none" and given["offload_experts"] == "auto" and moe_config(spec.config) is None:
            continue  # a dense model has no experts to offload
        if st["offload_weights"] != "none" and st["offload_experts"] != "none":
            continue  # weight streaming moves the experts too (the schema refuses both)
        if given["offload_weights_ahead"] == "auto" and st["offload_weights_ahead"] not in \
                stream.ahead_choices(st["offload_weights"], spec.device):
            continue  # deeper read-ahead only where it can be faster (finetune.plan.weight_stream)
        if world > 1 and given["strategy"] == "auto" and _refused(recipe, st):
            continue
        if st["gradient_accumulation_steps"] == "auto":  # keep training.effective_batch_size over all devices
            st["gradient_accumulation_steps"] = accumulation_for(effective, st["micro_batch_size"], world) \
                if effective else 1
        settings = Settings(**st)
        if given["generation_batch_size"] == "auto" and settings.generation_batch_size is not None \
                and settings.generation_batch_size >= step_completions(spec, settings):
            continue  # the step's all at once: the None candidate
        out.append(settings)
    return out


def _refused(recipe: Recipe, st: dict[str, Any]) -> bool:
    """A combination the strategy cannot run (the schema's strategy_problems), skipped by the search.

    The same verdict as validating the combination as a recipe: the rest of that validation does not depend on
    the combination, once each optimizer `auto` may pick has been checked alone (`_auto_optimizers`)."""
    if st["strategy"] not in SHARDED_STRATEGIES:
        return False
    combined = write_settings(recipe, {k: v for k, v in st.items() if v != "auto"}, validate=False)
    return bool(strategy_problems(combined, st["strategy"]))


def model_spec(recipe: Recipe, config: Any, device: str, planner: Planner = DEFAULT,
               full_length: bool = False) -> ModelSpec:
    """What the memory and speed models read of `recipe` and the model `config`, once; `planner`: whose caches
    its traces go to; `full_length`: sequences of data.max_seq_len tokens (`predict`)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    loss = PreferenceLoss.of(recipe.training, reference_is_current(recipe))
    grpo = recipe.training.spec.generates
    objective = trace_objective(recipe.grpo) if grpo else "sft" if loss is None else loss.objective
    example = planned_example(recipe, config, planner)
    if full_length:
        example = replace(example, seq_len=recipe.data.max_seq_len)
    return ModelSpec(
        config=config, adapter=recipe.adapter, dtype=target_dtype(recipe, device),
        attn=model_facts(config, recipe.model.attn_implementation, planner, device, recipe.data.packing)[1],
        device=device, seq_len=example.seq_len,
        num_layers=text.num_hidden_layers, hidden_size=text.hidden_size,
        optimizer=recipe.optimizer, double_quant=recipe.quantization.double_quant,
        offload_min_size=recipe.memory.offload_min_size, offload_cpu_limit=recipe.memory.offload_cpu_limit,
        recompute_norms=recipe.memory.recompute_norms,
        tiled_mlp_tokens=recipe.memory.tiled_mlp_tokens, world_size=recipe.distributed.gpus,
        interconnect_bandwidth=recipe.distributed.interconnect_bandwidth, zero_stage=recipe.distributed.zero_stage,
        deepspeed_offload=recipe.distributed.deepspeed_offload, objective=objective,
        rows_per_example=1 if loss is None else loss.rows_per_example,
        reference_adapter=loads_reference_adapter(recipe), num_generations=recipe.grpo.num_generations if grpo else 0,
        scoring_passes=scoring_passes(recipe.grpo) if grpo else 0, iterations=recipe.grpo.num_iterations if grpo else 1,
        planner=planner, images=example.grids,
        image_positions=sum(image_tokens(real_config(config), g) for g in example.grids),
        packing=recipe.data.packing)


def vision_costs(spec: ModelSpec) -> dict[str, int]:
    """A vision-language model's image costs for the plan's readers (Plan.vision); {} for a text model."""
    family = family_for(model_type_of(spec.config))
    if family is None or family.vision is None:
        return {}
    params = param_table_of(model_key(spec.config, spec.adapter, spec.dtype, spec.planner), 1, spec.planner)
    real = real_config(spec.config)
    return {"vision_weights": sum(p.numel * p.bytes_per_elem for p in params if in_vision(p.name)),
            "images": len(spec.images), "image_tokens": sum(image_tokens(real, g) for g in spec.images),
            "sequence": spec.seq_len}


def data_facts(data: PlannedData, spec: ModelSpec, recipe: Recipe, priced: PricedBatch | None = None
               ) -> dict[str, int]:
    """What the plan says of the data it was made for (Plan.data); {} where it was not read. `priced`: the run's
    largest micro-batch the peak was priced at (its rows, row tokens as `sequence`, padded 0/1)."""
    if data.shape is None:
        return {}
    facts = {"examples": data.shape.examples, "longest_tokens": data.shape.longest, "sequence": spec.seq_len,
             "max_seq_len": recipe.data.max_seq_len, "packing": int(recipe.data.packing)}
    if priced is not None:
        facts.update(sequence=priced.row, rows=priced.rows, padded=int(priced.padded))
    return facts


def pixel_budgets(recipe: Recipe, config: Any) -> list[int]:
    """The image budgets `data.max_pixels: auto` tries, largest first: PIXEL_BUDGETS, none above the model's own
    limit (its processor's max_pixels); the one size a fixed-size vision tower sees (Gemma 3); [] unless the key
    is auto and the model a vision-language one."""
    if recipe.data.max_pixels != "auto" or "max_pixels" in inactive_settings(recipe):
        return []
    layout = family_for(model_type_of(config)).vision
    if layout is None:
        return []
    images, real = layout_of(layout), real_config(config)
    limit = images.limit(real, processor_config(recipe.model.path))
    if images.fixed_size:
        return [limit]
    return sorted({min(b, int(limit)) for b in PIXEL_BUDGETS}, reverse=True)


def _stat(path: str) -> os.stat_result | None:
    try:
        return Path(path).expanduser().stat()
    except OSError:
        return None


def planned_data(recipe: Recipe, config: Any, planner: Planner = DEFAULT, keep_read: bool = False) -> PlannedData:
    """The recipe's data as the plan sizes its batches (`finetune.plan.data.read_data`; `keep_read`: with the
    data as read and tokenized)."""
    family = family_for(model_type_of(config))
    return read_data(recipe, family is not None and family.vision is not None, planner, keep_read)


def data_for_run(recipe: Recipe, planner: Planner = DEFAULT) -> PlannedData:
    """The recipe's data as `predict` reads it, read now for a run: its shape left in the planner's cache for
    `predict`, the data as read and tokenized (`PlannedData.read`) for the run's build to take over, so that a
    run tokenizes its data once (finetune.train.run)."""
    config = planned_config(recipe.model.path, recipe.model.trust_remote_code, planner)
    return planned_data(resolve_init_from(recipe), config, planner, keep_read=True)


@dataclass(frozen=True)
class PlannedExample:
    """The example a plan traces: its image grids (a vision-language model's record with the most image tokens
    at the pixel budget; () for text), the sequence length traced, and how many records' images alone do not fit
    data.max_seq_len at that budget (bad records the data build skips or refuses: never traced)."""

    grids: tuple[Grid, ...]
    seq_len: int
    too_long: int = 0
    # image data read before the plan, every record fitting: each record's row as the run pads it (its image
    # tokens and text, at most max_seq_len), its grids and their tokens (finetune.plan.batches prices the run's
    # micro-batches of them); () otherwise
    rows: tuple[tuple[int, tuple[Grid, ...], int], ...] = ()


def planned_example(recipe: Recipe, config: Any, planner: Planner = DEFAULT) -> PlannedExample:
    """What the search traces: a bound on the largest micro-batch the run forms from the data (`planned_data`),
    whatever its batching (the chosen plan is then priced at the run's real micro-batches: `plan.batches`). Text
    examples: padded to the longest row of the micro-batch, so the longest example's length, at most
    max_seq_len (packing: max_seq_len rows). Data with images: the images of the record with the most image
    tokens (at data.max_pixels, each resized as its processor resizes) in a sequence as long as the longest
    record's image tokens and text tokens, at most max_seq_len: the image budget sets the sequence, so a
    smaller budget plans a shorter one. Data not read before the plan: max_seq_len (image records: their
    text bounded by `text_tokens_bound`)."""
    max_seq_len = recipe.data.max_seq_len
    data = planned_data(recipe, config, planner).shape
    if data is not None and not data.has_images:
        return PlannedExample((), max_seq_len if recipe.data.packing else data.padded_row(max_seq_len))
    records = list(zip(data.images, data.lengths, strict=True)) if data is not None else \
        _image_records(recipe, config, planner)
    if not any(sizes for sizes, _ in records):
        return PlannedExample((), max_seq_len)
    real = real_config(config)
    pixels = recipe.data.max_pixels
    budget = None if pixels == "auto" else pixels
    most: tuple[int, tuple[Grid, ...]] = (0, ())  # the most image tokens of a record that fits, its grids
    longest = too_long = 0  # the longest record that fits (image tokens and text bound); those that do not fit
    rows = []
    seen: dict[tuple[tuple[int, int], ...], tuple[tuple[Grid, ...], int]] = {}  # records of the same image sizes
    for sizes, text in records:
        key = tuple(sizes)
        if key not in seen:
            grids = planned_grids(real, recipe.model.path, sizes, budget)
            seen[key] = grids, sum(image_tokens(real, g) for g in grids)
        grids, tokens = seen[key]
        if tokens + len(grids) + 1 > max_seq_len:  # the trace's layout: a token before and after each image
            too_long += 1
            continue
        most = max(most, (tokens, grids), key=lambda x: x[0])
        longest = max(longest, tokens + text)
        rows.append((min(max_seq_len, tokens + text), grids, tokens))
    if not most[1]:  # no image record fits: text only, as the build keeps it
        return PlannedExample((), max_seq_len, too_long)
    return PlannedExample(most[1], min(max_seq_len, longest), too_long,
                          tuple(rows) if data is not None and not too_long else ())


def planned_sequence(recipe: Recipe, planner: Planner = DEFAULT) -> int:
    """The row length a plan of `recipe` traces (`planned_example`): the data's largest micro-batch's, or
    data.max_seq_len where the data is not read before the plan; what `finetune measure` runs its steps at."""
    config = planned_config(recipe.model.path, recipe.model.trust_remote_code, planner)
    return planned_example(resolve_init_from(recipe), config, planner).seq_len


def _image_records(recipe: Recipe, config: Any, planner: Planner) -> list[tuple[list[tuple[int, int]], int]]:
    """Each good record's image sizes (from the headers) and text bound, read once per data and its files'
    versions (`data.max_pixels: auto` plans several budgets); [] for a text model or data not readable yet."""
    family = family_for(model_type_of(config))
    if family is None or family.vision is None:
        return []
    from finetune.data.build import record_shapes

    data, method = recipe.data, recipe.training.method
    files = [data.path] if isinstance(data.path, str) else [f.path for f in data.path]
    stamps = tuple((f, s.st_mtime_ns, s.st_size) for f in files if (s := _stat(f)) is not None)
    key = data.model_dump_json(exclude={"max_pixels", "max_seq_len"})
    try:
        return planner.images.get_or_compute((key, method, stamps), lambda: record_shapes(data, method))
    except FinetuneError:
        return []


def fitting_budgets(recipe: Recipe, config: Any, budgets: list[int], planner: Planner = DEFAULT) -> list[int]:
    """Of `budgets` (data.max_pixels auto's, largest first) those at which every record's images fit
    data.max_seq_len: an image's tokens are never cut, so a budget that makes a record too long would lose it.
    Where none does, the largest smaller budget that does (halving, in whole 28 x 28 cells, down to
    MIN_IMAGE_PIXELS); where none ever does, `budgets` (those records are bad records the data build reports)."""
    def fits(pixels: int) -> bool:
        return planned_example(write_settings(recipe, {"max_pixels": pixels}), config, planner).too_long == 0

    good = [b for b in budgets if fits(b)]
    smaller = budgets[-1] // 2 // MIN_IMAGE_PIXELS * MIN_IMAGE_PIXELS
    while not good and smaller >= MIN_IMAGE_PIXELS:
        if fits(smaller):
            good = [smaller]
        smaller = smaller // 2 // MIN_IMAGE_PIXELS * MIN_IMAGE_PIXELS
    return good or budgets


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the disk that holds `path` (or would: its nearest existing parent)."""
    path = path.expanduser().resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def evaluate(spec: ModelSpec, shapes: ModelShapes, settings: Settings, free: dict[str, int] | None = None,
             bandwidth: dict[str, float] | None = None, figures: dict[str, float] | None = None) -> Candidate:
    """Predict memory and speed of one configuration; offload beyond the free space its tier's bytes live in
    (`free`, bytes by the tier table's `holds_in`; absent: not checked) is rejected, and so is a paged
    optimizer's managed state that, with a cpu tier's tensors, exceeds free host RAM. `figures`: the device's
    speed figures (cost_model.figures_of; default its constants)."""
    pred = predict_memory(spec, settings)
    tps = tokens_per_second(spec, shapes, settings, offloaded_bytes=pred.offloaded_bytes, bandwidth=bandwidth,
                            figures=figures)
    cand = Candidate(asdict(settings), pred.peak_bytes, pred.breakdown, tps,
                     communication_bytes=pred.communication_bytes, reference_pass_bytes=pred.reference_pass_bytes,
                     managed_bytes=pred.managed_bytes, generation_bytes=pred.generation_bytes,
                     training_bytes=pred.training_bytes)
    holds_in = tier_spec(settings.offload).holds_in if settings.offload != "none" else None
    if holds_in is not None:
        available = (free or {}).get(holds_in)
        if available is not None and pred.offloaded_bytes > available:
            cand.reject("offload_space", f"{settings.offload} offload needs {format_bytes(pred.offloaded_bytes)} "
                        f"{STORES[holds_in]}, {format_bytes(available)} free")
    ram = (free or {}).get("host_ram")
    short = stream.lacking_room(spec, settings, free or {}, pred.offloaded_bytes if holds_in == "offload_dir" else 0)
    if cand.kind is None and short is not None:
        cand.reject(*short)
    slow = stream.slow_disk(settings.offload_weights, bandwidth or {})
    if cand.kind is None and slow is not None:  # auto never streams from a disk that slow (finetune.plan.weight_stream)
        cand.reject("slow_disk", f"memory.offload_dir: {slow}")
    if cand.kind is None and pred.managed_bytes and ram is not None:
        in_ram = pred.managed_bytes + (pred.offloaded_bytes if holds_in == "host_ram" else 0)
        if in_ram > ram:
            cand.reject("host_ram", f"{settings.optimizer} keeps {format_bytes(pred.managed_bytes)} of state in "
                        f"managed memory, paged to host RAM: needs {format_bytes(in_ram)} of RAM, {format_bytes(ram)} free")
    return cand


def predict(recipe: Recipe, *, model_config: Any = None, gpu_memory: int | str | None = None,
            device: str | None = None, training_only: bool = False, planner: Planner = DEFAULT,
            full_length: bool = False, lengths: Sequence[int] | None = None, suggest: bool = True) -> Plan:
    """Plan a run without loading weights: resolve `auto` settings to the fastest configuration that fits.
    `training_only`: price the training step alone, not what precedes it (training.precompute_reference's
    pass): a re-plan during training, after an out-of-memory error. `full_length`: sequences of
    data.max_seq_len tokens even where the data's image records are shorter (how long a context fits), and not
    the data's longest example. `planner`: whose in-memory caches the plan uses (`Planner()`: caches of its own).
    `lengths`: the training examples' tokens (default: those of the data read before the plan; data.batching
    auto picks from them: auto_batching). `suggest`: where nothing fits, plan again with each fixed setting left
    to the planner (`Plan.fixes`)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() or gpu_memory not in (None, "auto") else "cpu"
    recipe = resolve_init_from(recipe)  # adapter.init_from: price the adapter's own shape
    config = model_config or planned_config(recipe.model.path, recipe.model.trust_remote_code, planner)
    budgets = pixel_budgets(recipe, config)
    if budgets:
        budgets = fitting_budgets(recipe, config, budgets, planner)  # data.max_pixels auto: the largest image budget whose plan fits, else the smallest's plan
        for pixels in budgets:
            plan = predict(write_settings(recipe, {"max_pixels": pixels}), model_config=config,
                           gpu_memory=gpu_memory, device=device, training_only=training_only, planner=planner,
                           full_length=full_length, lengths=lengths, suggest=suggest)
            if plan.fits:
                break
        return plan
    spec = replace(model_spec(recipe, config, device, planner, full_length), reference_pass=not training_only)
    budget = _budget(recipe, gpu_memory, "cuda" if torch.cuda.is_available() and device == "cuda" else "cpu")
    shapes = model_facts(config, recipe.model.attn_implementation, planner)[0]
    choices = _choices(recipe, spec)
    data = planned_data(recipe, config, planner)
    if lengths is None and data.shape is not None:
        lengths = data.shape.lengths  # the examples the run will batch: data.batching auto groups by them
    notes = [data.note] if data.note and not full_length else []
    if shapes.mlp_linear == 0 and moe_config(config) is not None and recipe.memory.tiled_mlp == "auto" \
            and any(st.tiled_mlp for st in choices):
        choices = [st for st in choices if not st.tiled_mlp]
        notes.append("memory.tiled_mlp left out: the decoder layers' MLPs are mixture-of-experts blocks, which "
                     "route tokens, and the tiled MLP runs dense MLPs only (docs/moe.md)")
    tiers = {st.offload for st in choices} | {st.offload_experts for st in choices} | {st.offload_weights for st in choices}
    bandwidth, free = _offload_resources(recipe, device, tiers - {"none"})
    slow = stream.slow_disk(recipe.memory.offload_weights, bandwidth)
    if slow is not None and "offload_weights" not in inactive_settings(recipe):
        raise RecipeError(f"memory.offload_dir {offload_dir_for(recipe.memory, recipe.output.dir)}: {slow}", hint="set memory.offload_dir to a folder on an SSD, or memory.offload_weights: cpu "
                                     "(host RAM) or auto")
    if device == "cuda" and any(managed_state(spec, st) for st in choices):
        free.setdefault("host_ram", _free_memory("cpu"))
    # A CPU is priced with what it measured (once per machine and thread count, cached); a GPU with constants.
    measured = device == "cpu"
    figures = figures_of(device, cpu_compute() if measured else None)
    # Cheap lower bounds first: a configuration whose weights and optimizer state alone exceed the budget is
    # rejected without tracing its activations.
    floors = sorted(((memory_floor(spec, st), i, st) for i, st in enumerate(choices)),
                    key=lambda x: (x[0], x[1]))
    candidates, pruned = [], []
    over: dict[Settings, int] = {}  # checkpointed configurations already over budget, by settings
    fits_untiled: set[Settings] = set()
    best_score: dict[int, float] = {}  # micro-batch -> the best score of its fitting configurations so far
    order = sorted(floors, key=lambda x: (x[2].tiled_mlp, not x[2].activation_checkpointing,
                                          x[2].offload_weights != "none"))
    for floor, _, st in order:
        with_ckpt = replace(st, activation_checkpointing=True, checkpoint_every_n_layers=1)
        if floor > budget:
            pruned.append((floor, st))
        elif not st.activation_checkpointing and with_ckpt in over:
            # Dominance: without checkpointing every layer keeps what a checkpointed run recomputes for one.
            pruned.append((over[with_ckpt], st))
        elif st.offload_weights != "none" and {replace(stream.resident(st), offload_weights_ahead=a)
                                                for a in {*stream.AHEAD_CHOICES, st.offload_weights_ahead}} & fits_untiled:
            continue  # weight streaming only buys memory (finetune.plan.weight_stream): its resident twin fits
        elif st.tiled_mlp and (replace(st, tiled_mlp=False) in fits_untiled
                               or _score_of(st.optimizer, tokens_per_second(spec, shapes, st, bandwidth=bandwidth,
                                                                                  figures=figures))
                               <= best_score.get(st.micro_batch_size, 0.0)):
            # Tiling only buys memory: skip it (and its traces) where the plain MLP fits, or where even with
            # free transfers it cannot beat a configuration of its micro-batch that already fits (each
            # micro-batch's best competes in _smallest_batch_first).
            continue
        else:
            cand = evaluate(spec, shapes, st, free, bandwidth, figures)
            candidates.append(cand)
            if st.activation_checkpointing and cand.peak_bytes > budget:
                over[st] = cand.peak_bytes
            if cand.kind is None and cand.peak_bytes <= budget:
                fits_untiled.add(st)
                best_score[st.micro_batch_size] = max(best_score.get(st.micro_batch_size, 0.0), _score(cand))
    pruned.sort(key=lambda x: x[0])
    exact = data.shape is not None and not full_length and not recipe.data.packing
    if exact and len(choices) == 1 and len(candidates) == 1 and candidates[0].kind is None \
            and candidates[0].peak_bytes > budget and recipe.data.batching != "auto":
        # nothing to search: the recipe's one configuration fits or not at its run's own micro-batches where
        # they are known (the bound over every batching holds only where a search compares configurations)
        only = candidates[0]
        rows = planned_example(recipe, config, planner).rows if data.shape.has_images else ()
        _price_run_batches(only, Settings(**only.settings), recipe, rows, spec, shapes, data.shape, training_only,
                           (free, bandwidth, figures))
    for c in candidates:
        if c.kind is None and c.peak_bytes > budget:
            c.reject("over_budget", f"needs {format_bytes(c.peak_bytes)}, budget {format_bytes(budget)}")
    ok = _smallest_batch_first(sorted((c for c in candidates if c.kind is None), key=lambda c: -_score(c)))
    if (ok and recipe.memory.offload_weights_resident == "auto"
            and weights_streamed(spec, Settings(**ok[0].settings))):  # the chosen plan streams its weights
        filled = _fill_resident(spec, shapes, ok[0], budget, free, bandwidth, figures)
        if filled is not ok[0]:
            ok[0] = filled
            candidates.append(filled)
    leanest = min(candidates, key=lambda c: c.peak_bytes, default=None)
    while not ok and pruned and (leanest is None or pruned[0][0] < leanest.peak_bytes):
        # Nothing fits: find the leanest configuration (branch and bound on the lower bounds).
        _floor, st = pruned.pop(0)
        cand = evaluate(spec, shapes, st, free, bandwidth, figures)
        if cand.kind is None:
            cand.reject("over_budget", f"needs {format_bytes(cand.peak_bytes)}, budget {format_bytes(budget)}")
        candidates.append(cand)
        leanest = cand if leanest is None or cand.peak_bytes < leanest.peak_bytes else leanest
    rejected = sorted((c for c in candidates if c.kind is not None), key=lambda c: c.peak_bytes)
    rejected += [Candidate(asdict(st), floor, {}, 0.0, f"needs at least {format_bytes(floor)}, budget "
                           f"{format_bytes(budget)}", "over_budget_floor") for floor, st in pruned]
    inactive = inactive_settings(recipe)  # settings that do not matter here (one process: no strategy)
    full = {id(c): dict(c.settings) for c in candidates}  # every setting, for the pricing at the run's batches
    for cand in candidates + rejected:
        cand.settings = {k: v for k, v in cand.settings.items() if k not in inactive}
    chosen = ok[0] if ok else leanest
    if "batching" not in inactive and recipe.data.batching == "auto":
        for cand in [*ok[1:4], chosen]:  # each at its own micro-batch; the chosen one's reason is a note
            cand.settings["batching"], why = auto_batching(recipe, cand.settings, lengths, figures["half_tokens"])
        notes.append(f"data.batching auto: {chosen.settings['batching']} ({why})")
    priced = None  # the chosen plan's priced micro-batch: None where the bound (max_seq_len or the longest) stays
    if ok and exact:
        # the search's bound holds every batching; the plans shown are priced at the batches theirs forms
        rows = planned_example(recipe, config, planner).rows if data.shape.has_images else ()
        for cand in {id(c): c for c in [chosen, *ok[1:4]]}.values():
            batch = _price_run_batches(cand, Settings(**{**full[id(cand)], **cand.settings}), recipe, rows, spec,
                                       shapes, data.shape, training_only, (free, bandwidth, figures))
            priced = batch if cand is chosen else priced
    notes += _stream_notes(spec, shapes, chosen, bandwidth, figures)
    loss = PreferenceLoss.of(recipe.training)
    if chosen.settings.get("kernels") == "liger" and loss is not None:
        notes.append(kernels_line(loss))
    fixes = [] if ok or not suggest or training_only or full_length else \
        freed_fixes(recipe, config, gpu_memory, device, planner)
    return Plan(device, chosen.settings, chosen.peak_bytes, chosen.breakdown, budget, bool(ok), chosen.tokens_per_s,
                alternatives=ok[1:4], rejected=rejected,
                min_budget_bytes=None if ok else leanest.peak_bytes + recipe.memory.gpu_memory_margin,
                world_size=spec.world_size, communication_bytes=chosen.communication_bytes,
                reference_pass_bytes=chosen.reference_pass_bytes, managed_bytes=chosen.managed_bytes,
                generation_bytes=chosen.generation_bytes, training_bytes=chosen.training_bytes,
                device_figures=figures, figures_measured=measured, notes=notes,
                vision=vision_costs(spec), attention=spec.attn,
                data=data_facts(data, spec, recipe, priced) if not full_length else {}, fixes=fixes)


def _price_run_batches(cand: Candidate, settings: Settings, recipe: Recipe,
                       rows: tuple[tuple[int, tuple[Grid, ...], int], ...], spec: ModelSpec,
                       shapes: ModelShapes, data: DataShape, training_only: bool,
                       resources: tuple[dict[str, int], dict[str, float], dict[str, float]]) -> PricedBatch | None:
    """`cand`'s memory at the largest micro-batch the run forms (finetune.plan.batches), which its peak then
    is, and that micro-batch; None (the peak stays the search's bound) where those batches are not known
    before the run: more epochs than are cut, records whose images do not fit, or token_budget in a re-plan
    (an out-of-memory recovery splits the loader's budgeted batches, whose budget the recipe no longer says)."""
    if training_only and settings.batching == "token_budget":
        return None
    if data.has_images and not rows:  # `rows`: planned_example's, each image record's row (() where some do not fit)
        return None
    batches = run_batches(recipe, settings.micro_batch_size, settings.gradient_accumulation_steps,
                          settings.batching, data.lengths, rows, spec.rows_per_example)
    if batches is None:
        return None
    free, bandwidth, figures = resources
    worst, batch = max(((evaluate(replace(spec, seq_len=b.row, padded=b.padded, images=b.grids,
                                          image_positions=b.image_tokens, image_rows=shown_rows(
                                              spec.config, b.rows, b.image_rows) if b.grids else None),
                                  shapes, replace(settings, micro_batch_size=b.rows), free, bandwidth, figures), b)
                        for b in batches), key=lambda x: x[0].peak_bytes)
    for name in ("peak_bytes", "breakdown", "communication_bytes", "reference_pass_bytes", "managed_bytes",
                 "generation_bytes", "training_bytes"):
        setattr(cand, name, getattr(worst, name))
    return batch


BATCHING_GAIN = 0.02  # the predicted saving a batching other than random must bring to be chosen by auto


def auto_batching(recipe: Recipe, settings: dict[str, Any], lengths: Sequence[int] | None,
                  pass_tokens: float) -> tuple[str, str]:
    """data.batching auto for the chosen `settings`: the batching of least predicted time per epoch, and why.

    A micro-batch is priced as its padded tokens plus `pass_tokens` (the cost model's half_tokens: a pass of n
    tokens runs at n / (n + half_tokens) of the peak). random stays unless another saves BATCHING_GAIN of it
    (random is the least correlated order), token_budget unless it saves that much over length_grouped. All
    three are priced at the plan's micro-batch: token_budget's budget is micro_batch_size x the longest
    example, within the micro_batch_size x seq_len tokens the plan traces, its rows capped by the step's
    examples. Without `lengths` (data not read before planning) random, the order plans were checked on."""
    micro, accumulation = settings["micro_batch_size"], settings["gradient_accumulation_steps"]
    if recipe.data.packing:
        return "random", "packed rows are full already"
    tokens = recipe.training.effective_batch_tokens  # steps of a token target: grouped by length too
    if micro * accumulation == 1 and tokens is None:
        return "random", "one example per step: nothing to group"
    if not lengths:  # nothing says grouping is faster here; the plan's trace is of random batches
        return "random", "the examples' lengths are not known before planning"
    kinds = ["random", "length_grouped"] + (["token_budget"] if recipe.distributed.gpus == 1 else [])
    shapes = {k: epoch_shape(lengths, Batching(k, micro, accumulation, token_budget=micro * max(lengths),
                                               step_tokens=tokens), recipe.training.seed) for k in kinds}
    cost = {k: shape.cost(pass_tokens) for k, shape in shapes.items()}
    best = "length_grouped" if cost["length_grouped"] < (1 - BATCHING_GAIN) * cost["random"] else "random"
    if "token_budget" in cost and cost["token_budget"] < (1 - BATCHING_GAIN) * cost[best]:
        best = "token_budget"
    share = ", ".join(f"{k} {100 * shapes[k].real_share:.0f}%" for k in kinds)
    return best, f"real tokens per micro-batch: {share}; predicted time {cost[best] / cost['random']:.2f}x random's"


def _stream_notes(spec: ModelSpec, shapes: ModelShapes, chosen: Candidate, bandwidth: dict[str, float],
                  figures: dict[str, float]) -> list[str]:
    """A weight-streaming plan's line on what bounds its step (finetune.plan.weight_stream)."""
    settings = Settings(**chosen.settings)
    if settings.offload_weights == "none":
        return []
    resident = tokens_per_second(spec, shapes, stream.resident(settings), bandwidth=bandwidth, figures=figures)
    note = stream.bound_note(spec, settings, chosen.tokens_per_s, resident,
                             stream_links(settings.offload_weights, spec.device, figures, bandwidth))
    return [note] if note else []


# Settings a recipe may fix that the search can choose instead, tried one at a time when nothing fits (the
# memory savings first: they keep the training the recipe asks for).
FREEABLE = ("offload_experts", "offload", "activation_checkpointing", "chunked_loss", "tiled_mlp", "micro_batch_size",
            "bits", "optimizer", "max_pixels", "generation_batch_size")


def freed_fixes(recipe: Recipe, config: Any, gpu_memory: int | str | None, device: str,
                planner: Planner) -> list[dict[str, Any]]:
    """Where nothing fits: each setting `recipe` fixes (FREEABLE, not auto) that, left to the planner, gives a
    plan that fits: its recipe key, the value the planner picks, and that plan's peak and tokens/s. So "does
    not fit" names the setting that would make it fit (a recipe that keeps experts on the GPU, where offloading
    them fits half the memory) instead of a budget alone."""
    given = read_settings(recipe)
    keys = {s.name: s.key for s in settings_table()}
    inactive = inactive_settings(recipe)
    fixes = []
    for name in FREEABLE:
        if given[name] == "auto" or name in inactive:
            continue
        try:
            freed = write_settings(recipe, {name: "auto"})
        except (ValidationError, FinetuneError):
            continue  # a combination the schema refuses (no auto for this setting here)
        plan = predict(freed, model_config=config, gpu_memory=gpu_memory, device=device, planner=planner,
                       suggest=False)
        if plan.fits and plan.settings.get(name) != given[name]:
            fixes.append({"key": keys[name], "value": plan.settings.get(name), "peak_bytes": plan.peak_bytes,
                          "tokens_per_s": plan.tokens_per_s})
    return fixes


def _offload_resources(recipe: Recipe, device: str, tiers: set[str]) -> tuple[dict[str, float], dict[str, int]]:
    """For the offload tiers among the choices: the measured bandwidth of their links (measured once per
    machine, then read from the cache) and the free bytes where they hold tensors."""
    specs = [tier_spec(name) for name in tiers]
    offload_dir = offload_dir_for(recipe.memory, recipe.output.dir)
    bandwidth = transfer_bandwidth(offload_dir, cuda=device == "cuda" and torch.cuda.is_available(),
                                   links={s.link for s in specs}) if specs else {}
    stores = {s.holds_in for s in specs}
    free = {}
    if "host_ram" in stores and device == "cuda":  # on a CPU run RAM is the budgeted device memory
        free["host_ram"] = _free_memory("cpu")
    if "offload_dir" in stores:
        # what a killed run left there counts as free: the run removes it before writing (reclaim_left_behind)
        free["offload_dir"] = free_disk_bytes(offload_dir) + sum(size for _, size, _ in left_behind(offload_dir))
    return bandwidth, free


def _fill_resident(spec: ModelSpec, shapes: ModelShapes, chosen: Candidate, budget: int, free: dict[str, int],
                   bandwidth: dict[str, float], figures: dict[str, float]) -> Candidate:
    """memory.offload_weights_resident auto: the chosen streaming plan keeps its first layers on the device, as
    many as the budget has room for, where that is faster (a link-bound step: the link carries the other layers
    only); else `chosen` itself (no layer kept where the link is hidden: the time model gains nothing)."""
    st = Settings(**chosen.settings)
    per_layer = streamed_weight_bytes(spec, st)[1]
    room = min(int((budget - chosen.peak_bytes) // max(per_layer, 1)),
               spec.num_layers - st.offload_weights_ahead - 1)
    for kept in range(room, 0, -1):  # the memory is linear in the layers kept: the first that fits is the most
        trial = evaluate(spec, shapes, replace(st, offload_weights_resident=kept), free, bandwidth, figures)
        if trial.kind is None and trial.peak_bytes <= budget:
            return trial if trial.tokens_per_s > chosen.tokens_per_s else chosen
    return chosen


def _smallest_batch_first(ranked: list[Candidate]) -> list[Candidate]:
    """`ranked` (best first) with the chosen plan moved to the front: the best settings at each micro-batch
    compete, and the smallest micro-batch whose best is predicted at most MICRO_BATCH_GAIN slower than the
    fastest plan wins. A larger micro-batch costs memory and makes each step (the feedback, a checkpoint's
    distance) longer, which a few percent of predicted speed does not buy; on a CPU, whose matmuls are near
    their peak at a few hundred tokens, this keeps `auto` at small micro-batches."""
    if not ranked:
        return ranked
    best_at: dict[int, Candidate] = {}  # micro-batch -> its fastest plan (ranked is best first)
    for c in ranked:
        best_at.setdefault(c.settings["micro_batch_size"], c)
    fastest = _score(ranked[0])
    chosen = min((c for c in best_at.values() if _score(c) * (1 + MICRO_BATCH_GAIN) >= fastest),
                 key=lambda c: c.settings["micro_batch_size"])
    return [chosen] + [c for c in ranked if c is not chosen]


def _score(c: Candidate) -> float:
    return _score_of(c.settings["optimizer"], c.tokens_per_s)


def _score_of(optimizer: str, tokens_per_s: float) -> float:
    return tokens_per_s * AUTO_OPTIMIZERS.get(optimizer, 1.0)
