"""The recipe schema: the single source of truth for CLI validation, the UI form, docs and defaults.

Every field has a default or is required, and a one-line description. Sections mirror the YAML.

Why one module of ~800 lines: it is the recipe's one source of truth, every section's model and the checks
that need the whole recipe; the registries it reads (methods, optimizers, tiers, families) are modules of
their own.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from finetune.recipe.methods import (
    METHODS,
    Knob,
    MethodSpec,
    method_description,
    method_keys,
    method_knobs,
    method_spec,
    uses_reference,
)
from finetune.recipe.offload_tiers import offload_description, tier_names
from finetune.recipe.optimizers import SPECS, names_with_key, optimizer_names, optimizer_spec, specific_keys
from finetune.recipe.rewards import Reward, RewardsConfig
from finetune.recipe.section import Section
from finetune.units import MAX_SIZE, parse_bytes

MAX_COUNT = 2**31 - 1  # steps, sizes in tokens, ranks: what torch and the Trainer keep in 32-bit ints
NAME_MAX = 255  # bytes in one file or folder name: the limit of ext4, XFS, btrfs, APFS and NTFS alike
MAX_REPEAT = 100  # a data mix's `records:` may ask for at most this many copies of what its file holds


ByteSize = Annotated[int, BeforeValidator(parse_bytes), Field(ge=0, le=MAX_SIZE)]
PositiveByteSize = Annotated[int, BeforeValidator(parse_bytes), Field(gt=0, le=MAX_SIZE)]
Fraction = Annotated[float, Field(ge=0, lt=1)]
Auto = Literal["auto"]
MIN_IMAGE_PIXELS = 28 * 28  # data.max_pixels: one merged patch of the smallest vision-language processors
MAX_IMAGE_PIXELS = 2**28  # about 16k x 16k: above Pillow's decompression-bomb limit

# The keys a newcomer sets first, with their short names, in the order shown: the UI's basic form (every other
# key is under its "Advanced settings"); tests/test_ui_form.py checks that each is a key of Recipe.
BASIC = {"model.path": "Model", "data.path": "Data file", "training.method": "Method", "adapter.type": "Adapter",
         "adapter.r": "LoRA rank", "data.max_seq_len": "Longest sequence (tokens)", "training.max_steps": "Steps",
         "training.learning_rate": "Learning rate", "memory.gpu_memory": "GPU memory budget"}


class ModelConfig(Section):
    path: str = Field(description="Local Hugging Face folder, a hub id (when online), a .gguf file, or pkg:PACKAGE/FILE inside an installed package.")
    trust_remote_code: bool = Field(False, description="Run model code shipped with the checkpoint; off unless you trust it.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) when path is a hub id.")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="Compute dtype; auto picks bf16 where the GPU supports it and fp32 on CPU.")
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention", "chunked"] = Field(
        "auto", description="Attention kernel; auto picks the best that runs the model's attention (soft-capping, "
                            "sinks, sliding windows) and packed documents without s x s memory on the device: "
                            "flash_attention_2 (installed, CUDA), sdpa, flex_attention (CUDA), chunked; eager "
                            "only where none can, with the reason printed.")


class QuantizationConfig(Section):
    bits: Literal[4, 8] | Auto | None = Field(
        4, description="Base-weight quantization: 4 (NF4, QLoRA), 8 (LLM.int8), null for none, auto lets the planner choose.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type; NF4 is the QLoRA default.")
    double_quant: bool = Field(True, description="Quantize the 4-bit block scales too (saves ~0.37 bits per weight).")


# The adapter keys that fix its shape: adapter.init_from takes them from the saved adapter (what a recipe
# leaves unset there, finetune.recipe.init_from and load.recipe_data keep unset).
SHAPE_KEYS = ("type", "r", "alpha", "rslora", "target_modules", "modules_to_save")


class AdapterConfig(Section):
    type: Literal["lora", "dora", "full"] = Field("lora", description="lora, dora (weight-decomposed LoRA) or full fine-tuning.")
    r: int = Field(16, ge=1, le=1024, description="LoRA rank.")
    alpha: float = Field(32, gt=0, le=1e6, description="LoRA scaling numerator (scale = alpha / r, or alpha / sqrt(r) with rslora).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: str | list[str] = Field(
        "all-linear", description="Modules to adapt: all-linear or a list of module-name suffixes such as [q_proj, v_proj].")
    target_experts: bool = Field(
        False, description="Mixture-of-experts models: LoRA on the routed experts' fused weights too (peft "
        "target_parameters; LoRA only, with dropout 0: peft cannot apply dropout there). Off: attention, shared "
        "experts and dense layers are adapted, the experts and routers stay frozen (docs/moe.md).")
    vision: Literal["frozen", "lora", "full"] = Field(
        "frozen", description="Vision-language models: what trains of the vision tower and projector (kept in 16 "
        "bits, never quantized): frozen (only the language model is adapted), lora (LoRA on their Linear layers "
        "too), full (their weights trained whole and saved with the adapter).")
    rslora: bool = Field(False, description="Rank-stabilised LoRA scaling alpha / sqrt(r).")
    modules_to_save: list[str] | None = Field(None, description="Extra modules trained in full and saved with the adapter.")
    fp32_compute: bool = Field(
        False, description="Run LoRA matmuls in fp32 as peft does (a fp32 copy of every adapted layer's input is kept "
        "for backward); false: in the model's dtype with adapter.dtype weights and gradients (fp32 unless set), like "
        "mixed precision.")
    dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="LoRA/DoRA only: dtype of the adapter weights, their gradients and their optimizer state; "
        "bf16 halves those (torchtune's default: 0.67 GiB saved at r=64 on a 3B model) at the cost of bf16 "
        "rounding in the updates; fp32 keeps fp32 master weights.")
    init_from: str | None = Field(
        None, description="Start from an earlier LoRA/DoRA adapter of the same base model: a run directory (its "
        "adapter/) or an adapter folder (safetensors). Its type, r, alpha, rslora, target_modules and "
        "modules_to_save are used (a recipe value that differs is an error); dropout and fp32_compute stay the "
        "recipe's. dpo/kto: the reference model is this adapter (a frozen copy; none with precompute_reference, "
        "whose pass runs before the first step), not the bare base.")


class DataFile(Section):
    """One file of a data mix (data.path as a list): a path, or a mapping with its weight or record count.
    A plain path in the list stands for `{path: ...}`; dumped back the same way (a path, or only the keys set)."""

    path: str = Field(description="A dataset file or save_to_disk folder, read as data.path reads one.")
    weight: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="This file's share of the weighted files' part of the mix (weights are relative); "
        "that part is as large as it can be without repeating a record.")
    records: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="Take exactly this many records from the file: a seeded sample, or "
        "every record repeated (and a seeded sample of the rest) when it holds fewer; at most "
        f"{MAX_REPEAT} times the records the file holds (the copies are held in memory).")

    @model_validator(mode="before")
    @classmethod
    def _plain_path(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"path": value}
        if not isinstance(value, dict):
            raise ValueError("expected a file path, or a mapping such as {path: data.jsonl, weight: 0.5}")
        return value

    @model_validator(mode="after")
    def _one_amount(self) -> DataFile:
        if self.weight is not None and self.records is not None:
            raise ValueError("give weight (a share of the mix) or records (a count), not both")
        return self

    @model_serializer(mode="wrap")
    def _short(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = {k: v for k, v in handler(self).items() if v is not None}
        return data["path"] if list(data) == ["path"] else data


def _one_or_many(value: Any) -> str:
    return "files" if isinstance(value, list | tuple) else "file"


DataPath = Annotated[Annotated[str, Tag("file")] | Annotated[list[DataFile], Tag("files")],
                     Discriminator(_one_or_many)]


BATCHINGS = ("random", "length_grouped", "token_budget")  # data.batching's kinds (finetune.data.batching)


class DataConfig(Section):
    path: DataPath = Field(description="JSON, JSONL, CSV, Parquet file, or a datasets save_to_disk folder; or a "
        "list of them mixed by the seed, each a path or {path, weight} or {path, records} (docs/training.md, "
        "\"Mixing several files\"). Relative paths are read from the working directory.")
    format: Literal["auto", "alpaca", "messages", "sharegpt", "text", "preference", "sharegpt_preference", "kto"] = Field(
        "auto", description="Record format; auto detects it from the first records. preference: prompt/chosen/"
        "rejected (strings or message lists); sharegpt_preference: conversations + chosen + rejected turns; kto: "
        "prompt/completion + boolean label.")
    max_seq_len: int = Field(1024, ge=8, le=2**20, description="Longest sequence in tokens: longer examples are cut or dropped (data.overlong). The memory plan is made for the largest micro-batch the data forms (its longest example, at most this; packing: rows of this length), or for this length where the data cannot be read before the plan.")
    validation_split: float = Field(0.0, ge=0, lt=1, description="Fraction of records held out for evaluation.")
    overlong: Literal["truncate", "drop", "error"] = Field(
        "truncate", description="Examples longer than max_seq_len. truncate: cut the prompt (oldest turns first, "
        "then the start of the last user message; the system message stays if it fits) so the answer keeps its "
        "tokens, then cut the end; a record whose answer still cannot start within max_seq_len is dropped and "
        "counted with a warning. drop: leave them out and count them. error: stop and name them. An image's tokens "
        "are never cut: an image record whose images end past max_seq_len is a bad record (data.on_bad_record), "
        "and truncate cuts only its end.")
    on_bad_record: Literal["error", "skip"] = Field("error", description="Stop on a malformed record, or skip and count it.")
    packing: bool = Field(False, description="Pack several examples into one sequence (no cross-attention between them).")
    batching: Literal[("auto", *BATCHINGS)] = Field(  # type: ignore[valid-type]  # finetune.data.batching
        "auto", description="How examples become micro-batches (padded to their longest row). random: drawn at random. "
        "length_grouped: steps of examples of similar length (sorted within shuffled chunks of 64 steps; the order "
        "of the steps stays random), far less padding. token_budget: length_grouped's steps, each cut into "
        "micro-batches of up to micro_batch_size x the longest example's tokens, so short examples run more rows per "
        "forward pass (one process only). The effective batch stays in examples (tokens with training.effective_batch_tokens). auto: the planner picks the one "
        "predicted fastest from the examples' lengths; random where they are not known before planning, where "
        "grouping saves nothing (micro-batch 1 without accumulation, packing) or where a method generates (grpo).")
    assistant_only_loss: bool = Field(True, description="Chat formats: compute the loss only on assistant turns.")
    chat_template: str | None = Field(
        None, description="Jinja chat template (or a path to one); default: the tokenizer's, else a ChatML template.")
    system_prompt: str | None = Field(None, description="System message added to chat records that have none.")
    max_samples: int | None = Field(None, ge=1, le=MAX_COUNT, description="Use at most this many records (after shuffling with the seed).")
    max_pixels: Annotated[int, Field(ge=MIN_IMAGE_PIXELS, le=MAX_IMAGE_PIXELS)] | Auto | None = Field(
        "auto", description="Vision-language models: the most pixels (width x height) an image keeps; a larger one is "
        "resized down, keeping its aspect ratio, before it becomes image tokens (fewer pixels: fewer tokens, less "
        "memory). auto: the planner picks the largest budget whose memory peak fits and at which every record's "
        "image tokens fit max_seq_len, up to the model's own limit "
        "(its preprocessor_config.json); null: the model's own limit. Qwen2/2.5/3-VL: the processor's max_pixels; SmolVLM and Idefics3: the "
        "longest edge, in whole tiles; Llama 3.2 Vision: the number of tiles; Gemma 3 sees every image at its fixed "
        "size; Mistral 3: the longest edge (the budget's square root, in whole 28-pixel blocks). Text-only models "
        "ignore it.")

    @field_validator("path", mode="before")
    @classmethod
    def _some_file(cls, value: Any) -> Any:
        if isinstance(value, list | tuple) and not value:
            raise ValueError("an empty list names no data; give a file, or a list of one or more files")
        return value

    @field_validator("path")
    @classmethod
    def _each_file_once(cls, value: str | list[DataFile]) -> str | list[DataFile]:
        if isinstance(value, list):
            seen: dict[str, int] = {}
            for i, entry in enumerate(value):
                same = seen.setdefault(os.path.abspath(entry.path), i)  # as read: from the cwd
                if same != i:
                    raise ValueError(f"entries {same} and {i} name the same file ({entry.path}); list each file once "
                                     "and give it records: N to take more of it")
        return value

    def files(self) -> list[DataFile]:
        """Every file of the data, in recipe order: the one path, or each entry of the list."""
        return [DataFile(path=self.path)] if isinstance(self.path, str) else list(self.path)

    def file_keys(self) -> list[str]:
        """The recipe key of each file in `files()` (`data.path`, or `data.path[i]`), for messages."""
        return ["data.path"] if isinstance(self.path, str) else [f"data.path[{i}]" for i in range(len(self.path))]

    def label(self) -> str:
        """The data as messages name it: the path, or the listed paths joined with `+`."""
        return " + ".join(f.path for f in self.files())


# training.precompute_reference, placed by `training_config` after the methods' knobs
PRECOMPUTE_REFERENCE = Field(
    False, description="dpo, kto (with a reference): compute the reference model's log-probabilities of "
    "the training and eval data once, before training (one forward pass over the data, saved in the run "
    "directory for --resume), instead of a reference forward in every step: steps about a quarter faster, "
    "which repays the pass after about one epoch; the planner prices the pass's own peak too.")


class TrainingFields(Section):
    """The training section's hand-written fields and checks; `training_config` adds the method's fields."""

    methods: ClassVar[tuple[MethodSpec, ...]] = METHODS  # the registry the section was made from

    max_steps: int | None = Field(None, ge=1, le=MAX_COUNT, description="Optimizer steps to run; null trains for `epochs`.")
    epochs: float = Field(1, gt=0, le=1e6, description="Passes over the training data when max_steps is null.")
    micro_batch_size: int | Auto = Field(1, description="Sequences per forward pass; auto lets the planner choose.")
    gradient_accumulation_steps: int | Auto = Field(
        1, description="Micro-batches per optimizer step; auto keeps effective_batch_size with the planner's micro-batch.")
    effective_batch_size: int | Auto | None = Field(
        None, description="Target sequences per optimizer step when micro-batch or accumulation is auto; auto: "
        "chosen during the run from the measured gradient noise scale: updates start at one sequence inside each "
        "micro-batch and grow, then accumulate, while a larger batch costs at most 2% more tokens; learning rate "
        "and beta2 follow the batch rules.")
    effective_batch_tokens: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="The effective batch in real (non-padding) tokens instead of "
        "sequences: a step takes examples until their tokens reach this, in micro-batches as data.batching cuts "
        "them, so its micro-batches vary in number (gradient_accumulation_steps is not used); length_grouped or "
        "token_budget batching keeps them full. null: the batch in sequences (micro-batch x accumulation).")
    learning_rate: float = Field(2.0e-4, gt=0, le=1, description="Peak learning rate.")
    lr_scheduler: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="Schedule after warmup; wsd = warmup, stable, then decay over decay_ratio.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Fraction of steps spent warming up linearly.")
    decay_ratio: float = Field(0.1, gt=0, le=1, description="wsd only: fraction of steps spent decaying to zero.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the global gradient norm to this; null disables clipping.")
    seed: int = Field(42, ge=0, le=2**32 - 1, description="Seed for data order, initialisation and dropout.")
    logging_steps: int = Field(1, ge=1, le=MAX_COUNT, description="Log metrics every this many optimizer steps.")
    eval_steps: int | None = Field(None, ge=1, le=MAX_COUNT, description="Evaluate every this many steps (needs validation_split); null: at the end.")
    # The batch-size engine (docs/training.md, "Batch size from the gradient noise scale").
    noise_scale: bool = Field(True, description="Measure the gradient noise scale (gns, grad_sq, trace_sigma in "
        "metrics.jsonl; labelled tokens) from per-micro-batch gradient norms; no gradient copy.")
    noise_scale_split_every: int = Field(10, ge=1, le=MAX_COUNT, description="Without accumulation: run every "
        "this many steps' micro-batch as two halves (same gradient) so the noise scale can still be measured; "
        "with effective_batch_size auto at micro-batch 1 or a layer-wise optimizer, two steps share one update.")
    reference_batch_size: int | None = Field(None, ge=1, le=MAX_COUNT, description="Sequences per step that "
        "learning_rate and optimizer.betas were tuned for; a different effective batch rescales them (sqrt or "
        "linear rule by optimizer, capped; beta2 ** (batch / reference)). null: the recipe's effective batch.")
    compile: bool | Auto = Field(
        False, description="torch.compile each decoder layer (one graph reused by every layer, as torchtune does) "
        "on CUDA, or on the CPU with inductor's C++ backend (needs a C++ compiler); auto: on where the run is long "
        "enough to repay the compile time (docs/training.md). Planned as uncompiled: its memory effect is a "
        "declared estimate (none beyond memory.recompute_norms, which prices the largest part of what compile's "
        "fusion saves), to be measured by the GPU kit.")
    # The training method (finetune/recipe/methods.py) and the knobs several methods share; each method's entry
    # names the shared knobs that apply to it and declares its own (`training_config` adds those, and sets the
    # names and description of training.method).
    method: str = "sft"
    beta: float = Field(0.1, gt=0, le=1e3, description="dpo, kto: strength of the pull towards the reference model "
                        "(the reward scale); orpo: weight of the odds-ratio term; simpo, cpo: the reward scale (beta x the "
                        "answer's log-probability, its mean over tokens for simpo).")
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid", description="dpo only: sigmoid (DPO), ipo (squared loss around 1/(2 beta)), hinge (SLiC).")
    reference_free: bool = Field(
        False, description="dpo only: compare against a uniform reference instead of the base model (no "
        "reference forward).")
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="dpo (loss_type sigmoid), simpo, cpo: assumed fraction of flipped labels "
        "(conservative DPO).")

    @field_validator("micro_batch_size", "gradient_accumulation_steps", "effective_batch_size")
    @classmethod
    def _positive_count(cls, value: int | str | None) -> int | str | None:
        if value is not None and value != "auto" and not 1 <= value <= MAX_COUNT:
            raise ValueError(f"must be a positive integer (at most {MAX_COUNT}) or auto")
        return value

    @model_validator(mode="after")
    def _auto_batch(self) -> TrainingFields:
        """effective_batch_size auto: the run multiplies the accumulation (normally 1; an out-of-memory recovery
        may have doubled it) by what the measured noise scale supports."""
        if self.effective_batch_size == "auto" and not self.noise_scale:
            raise ValueError("effective_batch_size auto needs noise_scale: true (it follows the measured noise scale)")
        return self

    @model_validator(mode="after")
    def _keys_fit_method(self) -> TrainingFields:
        """A preference knob set for a method it does not apply to (as optimizer-specific keys are checked)."""
        misplaced: dict[tuple[str, ...], list[str]] = {}
        for key, methods in method_keys(self.methods).items():
            if self.method not in methods and getattr(self, key) != type(self).model_fields[key].default:
                misplaced.setdefault(methods, []).append(f"training.{key}")
        problems = [f"{', '.join(keys)}: {'apply' if len(keys) > 1 else 'applies'} only to {_and(methods, 'or')}, "
                    f"not {self.method}; remove {'them' if len(keys) > 1 else 'it'} or change training.method"
                    for methods, keys in misplaced.items()]
        if self.precompute_reference and self.reference_free:
            problems.append("training.precompute_reference: reference_free dpo has no reference to precompute; "
                            "remove one of the two")
        if self.label_smoothing and self.loss_type != "sigmoid":
            problems.append(f"training.label_smoothing: applies only to loss_type sigmoid, not {self.loss_type}; "
                            "remove it or set training.loss_type: sigmoid")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def spec(self) -> MethodSpec:
        """The training method's registry entry (finetune/recipe/methods.py)."""
        return method_spec(self.method)

    @property
    def uses_reference(self) -> bool:
        """Whether the loss compares against the reference model (the base, adapter switched off)."""
        return uses_reference(self.method, self.reference_free)


def _knob_field(knob: Knob) -> tuple[type, Any]:
    """A method's knob as a pydantic field definition: its default's type, bounds and description."""
    bounds = {name: getattr(knob, name) for name in ("ge", "gt", "le", "lt") if getattr(knob, name) is not None}
    return type(knob.default), Field(knob.default, description=knob.description, **bounds)


def training_config(methods: tuple[MethodSpec, ...] = METHODS) -> type[TrainingFields]:
    """The training section for a method registry: `training.method` takes its names, and each entry's knobs
    are fields placed after the shared ones (before precompute_reference, as docs/recipe.md lists them), which
    apply only to the method declaring them."""
    knobs = {name: _knob_field(knob) for name, knob in method_knobs(methods).items()}
    return create_model(  # type: ignore[call-overload]  # fields built from the registry
        "TrainingConfig", __base__=TrainingFields, __module__=__name__,
        methods=(ClassVar[tuple[MethodSpec, ...]], methods),
        method=(Literal[tuple(m.name for m in methods)],  # type: ignore[valid-type]  # the registry's names
                Field(methods[0].name, description=method_description(methods))),
        **knobs,
        precompute_reference=(bool, PRECOMPUTE_REFERENCE))


TrainingConfig = training_config()


class GRPOConfig(RewardsConfig):
    """training.method grpo (finetune/rl, docs/rl.md): how completions are sampled and scored and how the
    GRPO-family loss weighs them. The names and defaults are TRL 1.16's GRPOConfig's."""

    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = Field(
        "dapo", description="How token losses become one number: grpo (mean per completion, then over "
        "completions), bnpo (mean over a micro-batch's tokens), dr_grpo (sum / (completions x "
        "max_completion_length): no length bias), dapo (sum / the completion tokens of the whole optimizer step).")
    epsilon: float = Field(0.2, gt=0, lt=1, description="Clip the probability ratio to [1 - epsilon, 1 + "
                           "epsilon_high].")
    epsilon_high: float | None = Field(
        None, gt=0, le=10, description="Upper clip of the ratio (DAPO's clip-higher, e.g. 0.28); null: epsilon.")
    beta: float = Field(0.0, ge=0, le=1e3, description="Weight of the KL penalty to the reference model (the "
                        "base, adapter switched off); 0: no reference forward at all.")
    num_generations: int = Field(8, ge=2, le=1024, description="Completions sampled per prompt; each is judged "
                                 "against its group's mean reward.")
    num_iterations: int = Field(1, ge=1, le=1024, description="Optimizer passes over each batch of generated "
                                "completions (TRL's mu); above 1 the old policy's log-probabilities are kept and "
                                "the ratio is clipped.")
    max_completion_length: int = Field(256, ge=1, le=2**20, description="Longest completion in tokens; prompts "
                                       "get data.max_seq_len minus this (longer prompts are dropped and counted).")
    generation_batch_size: Annotated[int, Field(ge=1, le=2**20)] | Auto | None = Field(
        "auto", description="Completions generated at once (the KV cache holds them all); null: all "
        "of an optimizer step's; auto: the planner picks the fastest that fits, in whole groups of num_generations.")
    temperature: float = Field(1.0, gt=0, le=100, description="Sampling temperature of the completions.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: keep the smallest set of tokens whose "
                         "probability reaches top_p; 1: all.")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide each advantage (reward minus its group's mean) by the standard deviation of "
        "its group, of the batch, or not at all (Dr. GRPO).")
    rewards: list[Reward] | None = Field(  # type: ignore[assignment]  # required only under method grpo
        None, description="The reward functions, summed with their weights (kind answer, format, length, python; "
        "docs/rl.md); required with training.method grpo.")

    @model_validator(mode="after")
    def _trusted(self) -> GRPOConfig:
        """In a recipe the trust check is one of `problems_with`'s, naming the keys with their section."""
        return self

    @model_validator(mode="after")
    def _clip_range(self) -> GRPOConfig:
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ValueError(f"grpo.epsilon_high {self.epsilon_high} is below grpo.epsilon {self.epsilon}: the "
                             "upper clip is 1 + epsilon_high; raise it or remove it")
        return self

    def problems_with(self, recipe: Recipe) -> list[str]:
        """The grpo keys against the rest of `recipe`: set only for method grpo, rewards given, room for a
        prompt, a reference to compare against when beta > 0."""
        method = recipe.training.method
        if not recipe.training.spec.generates:  # generation_batch_size's auto and null (the planner's value for it) mean nothing here
            keys = [f"grpo.{k}" for k, f in type(self).model_fields.items() if getattr(self, k) != f.default
                    and not (k == "generation_batch_size" and getattr(self, k) is None)]
            return [f"{', '.join(keys)}: {'apply' if len(keys) > 1 else 'applies'} only to training.method grpo, "
                    f"not {method}; remove {'them' if len(keys) > 1 else 'it'} or set training.method: grpo"] \
                if keys else []
        problems = [problem] if (problem := self.untrusted("grpo.")) else []
        if not self.rewards:
            problems.append("grpo.rewards: training.method grpo needs at least one reward (e.g. kind: answer); "
                            "see docs/rl.md")
        if self.max_completion_length >= recipe.data.max_seq_len:
            problems.append(f"grpo.max_completion_length={self.max_completion_length} leaves no room for a prompt "
                            f"in data.max_seq_len={recipe.data.max_seq_len} (prompt + completion); raise "
                            "data.max_seq_len or lower grpo.max_completion_length")
        if recipe.training.effective_batch_size == "auto":
            problems.append("training.effective_batch_size: auto follows the measured gradient noise scale, which a "
                            "grpo run does not measure; set a number of completions per update or remove it")
        if recipe.memory.chunked_loss is True:
            problems.append("memory.chunked_loss: true with training.method grpo: the completions' log-probs are "
                            "computed from their logits directly; set it to false or auto")
        if recipe.data.format != "auto":
            problems.append(f"data.format={recipe.data.format} with training.method grpo: GRPO reads prompt-only "
                            'records ({"prompt": ..., <reward fields>} or {"messages": [..., user turn]}); remove '
                            "data.format")
        if self.beta and recipe.adapter.type == "full":
            problems.append(f"grpo.beta={self.beta} with adapter.type=full: the reference model is the base with "
                            "the adapter switched off, and a full fine-tune has no adapter; use adapter.type: lora "
                            "or grpo.beta: 0")
        return problems


class MemoryConfig(Section):
    plan: bool = Field(
        True, description="Plan the memory before training (the run stops with the reason when no plan can be "
        "made); false trains without a plan (`finetune run --no-plan`): `auto` keys then take their plain values "
        "where those are always safe, and nothing predicts whether the step fits.")
    activation_checkpointing: bool | Auto = Field(
        True, description="Recompute activations in backward instead of storing them (non-reentrant); auto: planner.")
    checkpoint_every_n_layers: int = Field(1, ge=1, le=MAX_COUNT, description="Checkpoint one decoder layer in every n (1 = all layers).")
    offload: Literal[("none", *tier_names(), "auto")] = Field(  # type: ignore[valid-type]  # from the tier table
        "none", description=offload_description())
    offload_dir: str | None = Field(None, description="Folder for disk offload; default <output.dir>/offload.")
    offload_min_size: ByteSize = Field(1 << 20, description="Only tensors at least this big are offloaded.")
    offload_cpu_limit: ByteSize | None = Field(
        None, description="RAM the cpu tier may hold before tensors spill to disk; null: no limit.")
    chunked_loss: bool | Auto = Field(
        "auto", description="Compute the LM head and loss in chunks so full logits never exist; auto: planner.")
    recompute_norms: bool = Field(
        True, description="Norms inside decoder layers keep only their input for backward and redo their fp32 "
        "math there, instead of keeping fp32 copies (negligible compute).")
    tiled_mlp: bool | Auto = Field(
        "auto", description="Run each layer's MLP over the sequence in chunks of tiled_mlp_tokens and recompute it "
        "chunk by chunk in backward (one extra MLP forward; for long sequences); auto: planner.")
    tiled_mlp_tokens: int = Field(1024, ge=16, le=MAX_COUNT, description="Sequence positions per MLP chunk with tiled_mlp.")
    offload_experts: Literal[("none", *tier_names(), "auto")] = Field(  # type: ignore[valid-type]  # the tier table
        "none", description="Mixture-of-experts models: where the frozen expert weights (as stored: 4-bit or "
        "16-bit) live, each MoE layer's brought to the GPU when it runs and the next layer's fetched meanwhile: "
        "none (on the device), cpu (pinned host RAM; counts against offload_cpu_limit), disk (files in "
        "offload_dir, read ahead a layer: for experts larger than host RAM); auto: planner (the disk only where "
        "RAM is short). true and false still mean cpu and none.")
    kernels: Literal["none", "liger", "auto"] = Field(
        "none", description="Fused kernels: liger (Liger Kernel's RMSNorm, RoPE, SwiGLU/GeGLU and fused linear "
        "cross-entropy, per family; CUDA with the cuda extra installed; replaces memory.chunked_loss, priced like "
        "it), none; auto: liger where it runs, else none. none by default until the GPU kit has measured Liger here.")
    offload_weights: Literal[("none", *tier_names(), "auto")] = Field(  # type: ignore[valid-type]  # the tier table
        "none", description="Where every decoder layer's frozen weights (as stored: 4-bit with their quant state, "
        "or 16-bit; a MoE layer's experts too) live, each layer's brought to the GPU when it runs (forward, "
        "recompute, backward) and the next offload_weights_ahead layers' fetched meanwhile: none (on the device), "
        "cpu (pinned host RAM), disk (files in offload_dir: for a model larger than host RAM); auto: planner. "
        "Trained weights and the optimizer state stay on the device. For a model larger than the GPU.")
    offload_weights_ahead: Annotated[int, Field(ge=1, le=8)] | Auto = Field(
        "auto", description="Decoder layers whose frozen weights offload_weights fetches ahead of need (the device "
        "holds this many plus one); auto: planner (2 for the disk tier on a GPU, where the next layer's disk read "
        "overlaps this one's copy to the GPU, if it fits; else 1).")
    offload_weights_resident: Annotated[int, Field(ge=0, le=MAX_COUNT)] | Auto = Field(
        "auto", description="With offload_weights: the first decoder layers whose frozen weights stay on the device "
        "(not streamed: the link carries the others only); auto: planner (as many as the budget has room for where "
        "the link bounds the step, else 0).")
    gpu_memory: PositiveByteSize | Auto = Field("auto", description="Memory budget, e.g. 12GiB; auto: the GPU memory free when the run starts "
        "(torch.cuda.mem_get_info), so what other processes hold then is excluded; gpu_memory_margin stays free "
        "below it for what they (and the CUDA context, allocator fragmentation) may take later.")
    gpu_memory_margin: ByteSize = Field(512 << 20, description="Head-room kept free below the budget; if a step "
        "still runs out of memory, `finetune run` redoes it with a cheaper plan (docs/memory.md, out-of-memory recovery).")

    @field_validator("offload_dir")
    @classmethod
    def _folder_names(cls, value: str | None) -> str | None:
        """A folder every disk could make: no NUL byte, no name longer than NAME_MAX bytes (caught here, not as
        an OSError from the planner's look at the folder)."""
        if value is None:
            return value
        if "\x00" in value:
            raise ValueError("holds a NUL byte, which no folder name can")
        long = next((part for part in value.split("/") if len(os.fsencode(part)) > NAME_MAX), None)
        if long is not None:
            raise ValueError(f"the folder name {long[:24]}... is {len(os.fsencode(long))} bytes long; disks allow "
                             f"{NAME_MAX} per name: use a shorter one")
        return value

    @model_validator(mode="after")
    def _one_loss(self) -> MemoryConfig:
        """Liger's fused linear cross-entropy is the loss without logits: the chunked loss is its alternative."""
        if self.kernels == "liger" and self.chunked_loss is True:
            raise ValueError("memory.kernels: liger computes the loss with its fused linear cross-entropy, which "
                             "replaces memory.chunked_loss; set memory.chunked_loss: false (or auto)")
        return self

    @field_validator("offload_experts", mode="before")
    @classmethod
    def _experts_tier(cls, value: Any) -> Any:
        """The key was a boolean before it named a tier: true keeps meaning host RAM, false on the device."""
        if isinstance(value, bool):
            return "cpu" if value else "none"
        return value


OptimizerName = Literal[(*optimizer_names(), "auto")]  # type: ignore[valid-type]  # from the registry


def _optimizer_names_text() -> str:
    return ", ".join(f"{s.name} ({s.summary})" for s in SPECS)


class OptimizerConfig(Section):
    """Presets (finetune/optim/presets.py says why): rank relative to the projected weights' width, not the
    fixed 128 (Hugging Face) or 16 (LLaMA-Factory): galore width/4, scale 0.25; apollo width/8, channel
    scaling, scale 1; apollo_mini rank 1, tensor scaling, scale 128; projection renewed every 200 steps."""

    name: OptimizerName = Field(
        "adamw", description=f"Optimizer: {_optimizer_names_text()}; auto lets the planner choose.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="Decoupled weight decay (not applied to biases and norms).")
    betas: tuple[Fraction, Fraction] = Field((0.9, 0.999), description="Adam betas (beta1, beta2), each in [0, 1).")
    eps: float = Field(1e-8, gt=0, lt=1, description="Adam epsilon.")
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd only: momentum (adds one state tensor per weight when > 0).")
    rank: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="APOLLO/GaLore projection rank; null: the preset's (galore width/4, apollo width/8, "
        "apollo_mini 1, width = the projected weights' short side: hidden size, or adapter.r with LoRA).")
    update_proj_gap: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="Optimizer steps between projection refreshes; null: the preset's 200.")
    scale: float | None = Field(
        None, gt=0, le=1e6, description="APOLLO/GaLore update scale; null: the preset's (galore 0.25, apollo 1, apollo_mini 128).")
    proj_type: Literal["std", "left", "right", "reverse_std"] | None = Field(
        None, description="Which side is compressed: std (preset) the shorter one, so the projection matrix is the "
        "small one; reverse_std the longer; left; right. "
        "APOLLO's projection is always random, GaLore's from an SVD.")
    scale_type: Literal["channel", "tensor"] | None = Field(
        None, description="APOLLO only: scaling per channel (apollo preset) or per tensor (apollo_mini preset).")
    target_modules: str | list[str] | None = Field(
        None, description="Weights given the low-rank treatment: module-name parts such as [attn, mlp] or "
        "[q_proj, v_proj]; null: every trained 2-D weight, embeddings and lm_head included (they hold most of "
        "a small model's AdamW state). The rest (1-D, too narrow for the rank) use AdamW.")
    layerwise: bool = Field(
        False, description="Update each weight from its backward hook and free its gradient. Works with "
        "gradient accumulation (GaLore then accumulates in projected form; clipping is exact); without "
        "accumulation only one gradient is ever resident and clipping uses the previous step's norm.")

    @model_validator(mode="after")
    def _keys_fit_name(self) -> OptimizerConfig:
        """Optimizer-specific keys (the registry's `keys`) set for an optimizer they do not apply to."""
        if self.name == "auto":  # the planner may pick any optimizer
            return self
        misplaced: dict[tuple[str, ...], list[str]] = {}
        for key in specific_keys():
            if key not in optimizer_spec(self.name).keys and getattr(self, key) != type(self).model_fields[key].default:
                misplaced.setdefault(names_with_key(key), []).append(f"optimizer.{key}")
        if misplaced:
            raise ValueError("; ".join(
                f"{', '.join(keys)}: {'apply' if len(keys) > 1 else 'applies'} only to {_and(names)}, not "
                f"{self.name}; remove {'them' if len(keys) > 1 else 'it'} or change optimizer.name"
                for names, keys in misplaced.items()))
        return self

    def problems_with(self, recipe: Recipe) -> list[str]:
        """Settings of this optimizer (from its registry spec) that contradict the rest of `recipe`."""
        problems = []
        if self.layerwise and recipe.model.dtype == "fp16":
            problems.append(
                "optimizer.layerwise with model.dtype=fp16: fp16 training scales the loss, and layer-wise updates "
                "happen inside backward before the scale can be removed; use bf16 or fp32")
        if self.name == "auto":
            return problems
        spec, adapter = optimizer_spec(self.name), recipe.adapter
        if adapter.type not in spec.adapters:
            problems.append(f"optimizer {self.name} trains only adapter.type {_and(spec.adapters, 'or')}, not "
                            f"{adapter.type}; change adapter.type or optimizer.name")
        if self.layerwise and not spec.layerwise:
            problems.append(f"optimizer.layerwise: {self.name} has no layer-wise mode; set optimizer.layerwise: "
                            "false or change optimizer.name")
        if spec.low_rank and self.rank is not None and adapter.type != "full" and self.rank >= adapter.r:
            problems.append(
                f"optimizer.rank={self.rank} >= adapter.r={adapter.r}: the LoRA matrices are only {adapter.r} wide, "
                f"so a rank-{self.rank} {self.name} projection keeps them whole and saves no memory; set "
                "optimizer.rank below adapter.r, leave it null for the preset, or use adamw")
        return problems


def _and(names: tuple[str, ...], word: str = "and") -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {word} {names[-1]}"


class OutputConfig(Section):
    dir: str = Field("runs/run", description="Run directory: recipe, plan, metrics, checkpoints and the adapter.")
    save_steps: int = Field(100, ge=1, le=MAX_COUNT, description="Save a checkpoint every this many optimizer steps.")
    save_total_limit: int = Field(2, ge=1, le=MAX_COUNT, description="Keep only the newest this many checkpoints.")


# -- distributed: several GPUs / nodes through accelerate -------------------------------------
STRATEGIES = ("ddp", "fsdp", "deepspeed")  # "auto": the planner picks the fastest that fits each GPU
SHARDED_STRATEGIES = ("fsdp", "deepspeed")  # optimizer state (and more) split across processes
DEEPSPEED_KEYS = ("zero_stage", "deepspeed_offload", "deepspeed_nvme_path")  # read by deepspeed only


class DistributedConfig(Section):
    gpus: int = Field(1, ge=1, le=65536, description="Processes (one per GPU) in the whole job, the world size the "
        "plan divides by; `finetune run --gpus N` sets it and starts N local processes, and under torchrun or "
        "`accelerate launch` it is the launcher's WORLD_SIZE.")
    strategy: Literal[("auto", *STRATEGIES)] = Field(  # type: ignore[valid-type]
        "auto", description="ddp (replicate, all-reduce gradients), fsdp (FSDP2: shard parameters, gradients "
        "and optimizer state), deepspeed (ZeRO via accelerate, optional dependency) or auto (the planner picks "
        "the fastest that fits each GPU); ignored with one process.")
    zero_stage: Literal[2, 3] = Field(3, description="deepspeed only: ZeRO-2 shards gradients and optimizer state, "
        "ZeRO-3 also parameters.")
    deepspeed_offload: Literal["none", "cpu", "nvme"] = Field(
        "none", description="deepspeed only: where ZeRO keeps the optimizer state (and updates it): on the GPU, "
        "in CPU RAM, or on an NVMe folder (deepspeed_nvme_path).")
    deepspeed_nvme_path: str | None = Field(None, description="deepspeed_offload: nvme only: a folder on a fast SSD.")
    interconnect_bandwidth: PositiveByteSize = Field(
        20 * 10**9, description="Bytes/s between GPUs the planner assumes for gradient and parameter traffic "
        "(20GB: PCIe 4.0 x16; NVLink is 10x that).")

    def deepspeed_keys(self) -> list[str]:
        """The deepspeed-only keys (DEEPSPEED_KEYS) not at their defaults: they need strategy deepspeed."""
        return [k for k in DEEPSPEED_KEYS if getattr(self, k) != type(self).model_fields[k].default]

    @model_validator(mode="after")
    def _keys_fit_strategy(self) -> DistributedConfig:
        ds_keys = self.deepspeed_keys()
        if ds_keys and self.strategy not in ("deepspeed", "auto"):
            raise ValueError(f"distributed.{', distributed.'.join(ds_keys)} apply only to strategy deepspeed, not "
                             f"{self.strategy}; remove them or set distributed.strategy: deepspeed")
        if (self.deepspeed_offload == "nvme") != (self.deepspeed_nvme_path is not None):
            raise ValueError("distributed.deepspeed_offload: nvme and distributed.deepspeed_nvme_path go together; "
                             "set both (or neither)")
        return self

    def problems_with(self, recipe: Recipe) -> list[str]:
        """Memory techniques that do not work under the chosen strategy (only with more than one process)."""
        if self.gpus == 1:
            return []
        problems = []
        if recipe.training.effective_batch_size == "auto":  # under every strategy
            problems.append(f"training.effective_batch_size=auto with {self.gpus} processes: the noise scale is "
                            "measured on one process only for now; give a number (e.g. a one-GPU run's advice)")
        if recipe.training.precompute_reference:
            problems.append(f"training.precompute_reference with {self.gpus} processes: the reference pass runs on one "
                            "process only for now; set it to false (the reference forward then runs in each step)")
        if recipe.optimizer.layerwise:  # under every strategy (auto too: none of them can run it)
            problems.append(f"optimizer.layerwise with distributed.strategy={self.strategy} with {self.gpus} "
                            "processes: layer-wise updates step each weight inside backward, before the gradient "
                            "is averaged across processes; set optimizer.layerwise: false")
        if recipe.memory.chunked_loss is True:
            problems.append(f"memory.chunked_loss: true with {self.gpus} processes: the chunked loss runs the decoder "
                            "and LM head itself, outside the DDP/FSDP/DeepSpeed wrapper that synchronises them; "
                            "set it to false or auto (auto then chooses false)")
        if self.strategy == "auto":  # auto: the planner only picks combinations that work
            return problems
        return problems + strategy_problems(recipe, self.strategy)


def strategy_problems(recipe: Recipe, strategy: str) -> list[str]:
    """Why `recipe` cannot run under `strategy` with several processes (empty: it can)."""
    where = f"distributed.strategy={strategy} with {recipe.distributed.gpus} processes"
    problems = []
    if recipe.memory.offload != "none" and strategy in SHARDED_STRATEGIES:
        problems.append(f"memory.offload={recipe.memory.offload} with {where}: the offload hooks would move the "
                        "gathered (unsharded) weights that backward saves; use strategy ddp or memory.offload: none")
    name = recipe.optimizer.name
    if strategy in SHARDED_STRATEGIES and name != "auto" and not optimizer_spec(name).sharded_states:
        problems.append(f"optimizer {name} with {where}: its state is computed over whole weights (projected, "
                        "factored, orthogonalized or block-quantized), and each process holds only a shard; use "
                        "adamw or sgd, or strategy ddp")
    if recipe.quantization.bits == 8 and strategy in SHARDED_STRATEGIES:
        problems.append(f"quantization.bits=8 with {where}: LLM.int8 weights cannot be sharded; use bits 4 "
                        "(FSDP-QLoRA) or null, or strategy ddp")
    if recipe.quantization.bits == 4 and strategy == "deepspeed":
        problems.append(f"quantization.bits=4 with {where}: use strategy fsdp for QLoRA on sharded weights "
                        "(FSDP-QLoRA), or ddp")
    return problems


class Recipe(Section):
    """A whole fine-tuning recipe."""

    model: ModelConfig
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig, description="Base-weight quantization.")
    adapter: AdapterConfig = Field(default_factory=AdapterConfig, description="What is trained.")
    data: DataConfig
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Loop, schedule and batch.")
    memory: MemoryConfig = Field(default_factory=MemoryConfig, description="Activation memory and the budget.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer and its state.")
    output: OutputConfig = Field(default_factory=OutputConfig, description="Where results go.")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig,
                                           description="Several GPUs or nodes (DDP, FSDP2, DeepSpeed ZeRO).")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig,
                             description="training.method grpo: sampling, rewards and the GRPO-family loss.")

    @model_validator(mode="after")
    def _coherent(self) -> Recipe:
        if self.adapter.type == "full" and self.quantization.bits in (4, 8):
            raise ValueError(
                f"quantization.bits={self.quantization.bits} cannot be used with adapter.type=full: quantized "
                "weights cannot be trained; set quantization.bits: null or use adapter.type: lora")
        if self.training.eval_steps is not None and self.data.validation_split == 0:
            raise ValueError("training.eval_steps needs data.validation_split > 0")
        if self.data.batching not in ("auto", "random") and self.training.spec.generates:
            raise ValueError(f"data.batching={self.data.batching} with training.method={self.training.method}: its "
                             "rows are prompts to generate from, with no tokens to group; set data.batching: auto")
        if self.data.batching == "token_budget" and self.distributed.gpus > 1:
            raise ValueError("data.batching=token_budget with several processes: each would run a different "
                             "number of micro-batches per step; set data.batching: length_grouped")
        if self.training.effective_batch_tokens is not None:
            if problem := self._token_batch_problem():
                raise ValueError(f"training.effective_batch_tokens with {problem}")
        why = method_spec(self.training.method).packing
        if why and self.data.packing:
            raise ValueError(f"data.packing cannot be used with training.method={self.training.method}: {why}; "
                             "set data.packing: false")
        if self.training.uses_reference and self.adapter.type == "full":
            raise ValueError(
                f"training.method={self.training.method} with adapter.type=full: the reference model is the base "
                "with the adapter switched off, and a full fine-tune has no adapter; use adapter.type: lora, "
                "training.method: orpo, or (dpo) training.reference_free: true")
        if self.adapter.dtype != "fp32" and self.adapter.type == "full":
            raise ValueError(f"adapter.dtype={self.adapter.dtype} applies to LoRA/DoRA adapters; a full fine-tune "
                             "trains the model's own weights in model.dtype: remove adapter.dtype or set model.dtype")
        if self.adapter.dtype != "fp32" and self.adapter.fp32_compute:
            raise ValueError(f"adapter.dtype={self.adapter.dtype} with adapter.fp32_compute: true: fp32 LoRA matmuls "
                             "need fp32 adapter weights; set adapter.fp32_compute: false or adapter.dtype: fp32")
        if self.adapter.target_experts and self.adapter.type == "full":
            raise ValueError("adapter.target_experts with adapter.type=full: a full fine-tune already trains every "
                             "weight, the experts included; remove adapter.target_experts")
        if self.adapter.target_experts and self.adapter.type != "lora":
            raise ValueError(f"adapter.target_experts applies to adapter.type=lora, not {self.adapter.type}: peft "
                             "adapts fused expert weights (target_parameters) with plain LoRA only, no DoRA; set "
                             "adapter.type: lora, or remove adapter.target_experts (DoRA then adapts attention, "
                             "shared experts and dense layers)")
        if self.adapter.target_experts and self.quantization.bits in (4, "auto"):
            raise ValueError(f"adapter.target_experts with quantization.bits={self.quantization.bits}: peft adapts "
                             "fused expert weights held in 16 bits, and bits 4 stores them in 4; set "
                             "quantization.bits: null (or 8: experts stay 16-bit) or remove adapter.target_experts")
        if self.adapter.target_experts and self.memory.offload_experts != "none":
            raise ValueError(f"adapter.target_experts with memory.offload_experts={self.memory.offload_experts}: "
                             "the offload moves frozen expert weights off the device, and these would be trained; "
                             "set memory.offload_experts: none")
        if {self.memory.offload_weights, self.memory.offload_experts}.isdisjoint({"none", "auto"}):
            raise ValueError(f"memory.offload_weights={self.memory.offload_weights} with memory.offload_experts="
                             f"{self.memory.offload_experts}: offload_weights streams every frozen weight, the "
                             "experts included; set memory.offload_experts: none")
        if self.memory.offload_weights not in ("none", "auto") and self.adapter.target_experts:
            raise ValueError(f"adapter.target_experts with memory.offload_weights={self.memory.offload_weights}: "
                             "the expert weights would be trained, and only frozen weights stream; set "
                             "memory.offload_weights: none or remove adapter.target_experts")
        if self.memory.offload_weights not in ("none", "auto") and self.training.compile:
            raise ValueError(f"memory.offload_weights={self.memory.offload_weights} with training.compile: true: "
                             "the layers' fetch hooks would break the compiled graph; set training.compile: false")
        if self.memory.offload_weights not in ("none", "auto") and self.distributed.gpus > 1:
            raise ValueError(f"memory.offload_weights={self.memory.offload_weights} with distributed.gpus="
                             f"{self.distributed.gpus}: weight streaming runs in one process; set "
                             "memory.offload_weights: none or distributed.gpus: 1")
        if self.adapter.type == "full" and self.memory.offload_weights not in ("none", "auto"):
            raise ValueError(f"memory.offload_weights={self.memory.offload_weights} with adapter.type=full: a full "
                             "fine-tune trains every weight, and only frozen weights stream; set "
                             "memory.offload_weights: none")
        if self.adapter.target_experts and self.adapter.dropout:
            raise ValueError(f"adapter.target_experts with adapter.dropout={self.adapter.dropout}: peft's LoRA on "
                             "fused expert weights (target_parameters) cannot apply dropout; set adapter.dropout: 0")
        if self.adapter.init_from is not None and self.adapter.type == "full":
            raise ValueError("adapter.init_from starts from a LoRA/DoRA adapter; it cannot be used with "
                             "adapter.type=full")
        problems = self.optimizer.problems_with(self) + self.distributed.problems_with(self) + \
            self.grpo.problems_with(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _token_batch_problem(self) -> str | None:
        """Why steps of a token target cannot run with the rest of the recipe (None: they can)."""
        t = self.training
        if t.effective_batch_size is not None:
            return (f"training.effective_batch_size={t.effective_batch_size}: each defines the effective batch; "
                    "keep one")
        if t.reference_batch_size is not None:
            return (f"training.reference_batch_size={t.reference_batch_size}: the learning-rate rules rescale for "
                    "a batch in sequences; remove training.reference_batch_size")
        if t.spec.generates:
            return (f"training.method={t.method}: its steps are prompts to generate from; remove "
                    "training.effective_batch_tokens")
        if self.data.packing:
            return ("data.packing: packed rows are full already, a step of them is micro_batch_size x "
                    "max_seq_len tokens; set data.packing: false or remove training.effective_batch_tokens")
        if self.distributed.gpus > 1:
            return (f"distributed.gpus={self.distributed.gpus}: each process would run a different number of "
                    "micro-batches per step; remove training.effective_batch_tokens")
        if self.optimizer.layerwise:
            return ("optimizer.layerwise: a layer-wise optimizer updates after a fixed number of backwards; set "
                    "optimizer.layerwise: false")
        return None


def max_prompt_tokens(recipe: Recipe) -> int:
    """training.method grpo: the longest prompt, data.max_seq_len less the completion's grpo.max_completion_length
    (the sequence the plan is made for is prompt + completion)."""
    return recipe.data.max_seq_len - recipe.grpo.max_completion_length
