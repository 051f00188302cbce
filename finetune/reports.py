"""The shapes of the reports `finetune.api` returns to the CLI and the UI, as TypedDicts: plain dicts at run
time (JSON files and callers read them as before), named keys and value types for a reader and a type
checker. Standard library only, at the bottom layer, so any shell may import them."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class Machine(TypedDict):
    """`api.this_machine()`: where a run started here trains."""

    device: str  # cuda or cpu
    name: str  # for people: the GPU's name, or "CPU, N cores"
    memory_bytes: int  # the GPU's total memory, else the RAM's


class SpeedEstimate(TypedDict):
    """`api.speed_estimate(plan)`: the predicted speed as a person should read it."""

    tokens_per_s: float | None  # rounded to two figures; None: no estimate, or over the believable ceiling
    text: str  # a sentence: "about 1,200 tokens/s"
    short: str  # a table cell: "~1,200"
    basis: str  # the hardware figures the estimate rests on


class LocalModel(TypedDict):
    """One entry of `api.local_models(folders)`: a model this machine has, as a value for model.path."""

    path: str  # what model.path takes: a folder or .gguf path, pkg:PACKAGE/FILE, or a hub id in the cache
    label: str  # for a picker: the name and where it is from
    kind: str  # folder, gguf, package or hub cache


class GPUSizeRow(TypedDict):
    """One GPU size of `api.plan_gpu_sizes`."""

    gpu_gb: float  # GiB
    longest_context: int | None  # tokens; None: not even the shortest length fits
    largest_micro_batch: int | None  # at the recipe's max_seq_len
    recipe_fits: bool  # the recipe as written (its max_seq_len)


class GPUSizes(TypedDict):
    """`api.plan_gpu_sizes(recipe)`: what fits on each GPU size."""

    max_seq_len: int
    model_max_context: int
    sizes: list[GPUSizeRow]
    context_need_bytes: dict[int, int]  # sequence length -> GPU memory needed (margin included)
    micro_batch_need_bytes: dict[int, int]  # micro-batch -> GPU memory needed (margin included)
    micro_batch_cap: int  # the largest micro-batch the search tries: a row at it may fit a larger one too


class SizePlan(TypedDict):
    """One GPU size of `api.plan_sizes`: its plan and what `api.plan_gpu_sizes` says of it."""

    gpu_memory: str  # as given, e.g. 24GB
    gpu_bytes: int
    fits: bool
    peak_bytes: int  # the chosen plan's; not fitting: the leanest plan's
    settings: dict[str, Any]
    tokens_per_s: float
    min_budget_bytes: int | None  # not fitting: the smallest GPU memory the leanest plan needs
    longest_context: int | None  # at micro-batch 1
    largest_micro_batch: int | None  # at max_seq_len, at most micro_batch_cap


class SizePlans(TypedDict):
    """`api.plan_sizes(recipe, sizes)`: `finetune plan --gpu-memory 8GiB,12GiB,...`."""

    max_seq_len: int
    model_max_context: int
    micro_batch_cap: int  # the largest micro-batch the search tries: more may fit
    sizes: list[SizePlan]


class SeenLengthPlan(TypedDict):
    """`api.plan_at_seen_length(run)`: the run's plan at the longest sequence it trains on."""

    longest: int
    max_seq_len: int
    peak_bytes: int
    breakdown: dict[str, int]
    planned_peak_bytes: int | None


class RunMemory(TypedDict):
    """`api.run_memory(run)`: the run's planned, re-evaluated and measured peak memory side by side."""

    planned_peak_bytes: int  # the plan's: for the data's largest micro-batch, else at data.max_seq_len
    max_seq_len: int
    planned_sequence: int | None  # image data: the sequence the plan traced (its longest record), else None
    planned_for: str  # what the peak is for (Plan.planned_for); "" where the plan was made at data.max_seq_len
    seen: SeenLengthPlan | None  # the plan at the data's longest example; None: the data is not shorter
    measured_peak_bytes: int | None  # the last logged peak (since the last re-plan); None: none logged


class EvaluationTable(TypedDict):
    """`api.run_evaluation_table(run)`: the run's latest `finetune eval` as a table."""

    headers: list[str]
    rows: list[list[Any]]
    data: str | None
    records_read: int | None  # records in the data file, bad ones included (None: a file of an older version)
    examples_kept: int | None  # the examples the loss was measured on
    with_expected_answer: int | None  # None for a preference run's pairs
    preference: dict[str, Any] | None  # a preference run's pairs: method, beta, reference (None: sft records)


class BatchReport(TypedDict):
    """`api.run_batch_report(run)`: the batch a finished run used, its noise scale and the advice."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    gpus: int
    sequences: int  # per optimizer step, all processes
    auto: bool  # effective_batch_size: auto
    update_batch: Any  # auto's sequences per update while its warmup ran (results.json's record)
    tokens_per_sequence: float | None
    tokens: int | None  # labelled tokens per optimizer step
    noise_scale: float | None
    noise_series: list[tuple[Any, ...]]  # (step, labelled tokens)
    changes: list[dict[str, Any]]  # metrics.jsonl's batch_changed rows
    advice: dict[str, Any]  # `settings` (recipe keys) and `reason`, or only a reason; {} when none


class RewardCurve(TypedDict):
    train: list[tuple[int, float]]  # (step, value)
    eval: list[tuple[int, float]]


class GRPOReport(TypedDict):
    """`api.run_grpo_report(run)`: a GRPO run's rewards over steps, held out, and its latest sampled answers."""

    curves: dict[str, RewardCurve]  # GRPO_CURVES keys: reward, completion_length, kl, clip_ratio
    before: NotRequired[dict[str, float | None]]  # held-out (greedy) values before training (results.json)
    after: NotRequired[dict[str, float | None]]
    samples: list[dict[str, Any]]  # the last logged step's sampled completions: step, where, completion, reward


class RewardReport(TypedDict):
    """`api.run_reward_report(run)`: a preference run's rewards over steps and held out."""

    curves: dict[str, RewardCurve]  # by REWARD_KEYS key
    before: NotRequired[dict[str, float | None]]  # held-out values before training (results.json)
    after: NotRequired[dict[str, float | None]]
