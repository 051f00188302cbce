"""A read view of a run directory: each of its files read once (`RunView`), and the reports a run's page and
the end of `finetune run` draw from them (memory against the plan, batch and noise scale, rewards, GRPO curves,
the latest evaluation). Why in the train layer, beside train/ and evaluate/ (tests/test_import_graph.py): a
report re-evaluates the plan at the length the run saw and formats `finetune eval`'s table, so it sits above
plan/; the API re-exports them for the CLI and the UI."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

from finetune.recipe.load import load_recipe_text, recipe_data, validate_recipe
from finetune.reports import BatchReport, EvaluationTable, GRPOReport, RewardReport, RunMemory, SeenLengthPlan
from finetune.rundir import EVAL_PREFIX, REWARD_KEYS, RunDir


class RunView:
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


def view_of(run: str | Path | RunView) -> RunView:
    """`run` as RunView: itself when it is one (what it has read stays read), else a fresh look."""
    return run if isinstance(run, RunView) else RunView(run)


def run_evaluation_table(run: str | Path | RunView) -> EvaluationTable | None:
    """The run's latest `finetune eval` as {"headers", "rows" (one per model), "data", "records_read",
    "examples_kept", "with_expected_answer", "preference"}, or None before one ran."""
    report = view_of(run).evaluation
    if not report or not report.get("models"):
        return None
    from finetune.evaluate.report import table

    headers, rows = table(report)
    return {"headers": headers, "rows": rows, "data": report.get("data"), "records_read": report.get("records_read"),
            "examples_kept": report.get("examples_kept", report.get("records")),  # "records": an older file's name
            "with_expected_answer": report.get("with_expected_answer"), "preference": report.get("preference")}


def plan_at_seen_length(run: str | Path | RunView) -> SeenLengthPlan | None:
    """When a run's longest sequence is shorter than data.max_seq_len and its plan was made for max_seq_len (the
    data could not be read before the plan, or a run of an older version), its plan re-evaluated at that length
    (what the measured peak should be compared with); None while the run has not said, when it is not shorter,
    or when the plan was made for the data already (plan.json's `data`).

    Keys: longest (tokens), max_seq_len, peak_bytes and breakdown at the longest, planned_peak_bytes."""
    from finetune.plan import predict

    files = view_of(run)
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


def run_memory(run: str | Path | RunView) -> RunMemory | None:
    """The run's memory as the end of `finetune run` reports it: the plan's peak (for the data's largest
    micro-batch, or at data.max_seq_len where the data was not read before the plan), then the plan re-evaluated
    at the data's longest example (`plan_at_seen_length`: what the measured peak should be compared with) and
    the measured peak (the last logged: an out-of-memory recovery's re-plan starts a new one). None when the run
    has no plan (the planner could not trace the model)."""
    files = view_of(run)
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


def run_batch_report(run: str | Path | RunView) -> BatchReport | None:
    """What a finished run says about its batch (results.json and its recipe), for the run view: the batch
    used (micro x accumulation x gpus, in sequences and labelled tokens; `update_batch`: auto's sequences per
    update, below the micro-batch while its warmup ran), the noise scale over time (as (step,
    labelled tokens)), the batch changes (metrics.jsonl's `batch_changed` rows) and the advice
    for next time (`settings` as recipe keys and a `reason`, or only a reason). None when results.json has
    no account of the batch (a run still going, or one from an older version)."""
    files = view_of(run)
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


def run_reward_report(run: str | Path | RunView) -> RewardReport | None:
    """A preference run's rewards, for the run view: `curves` (each REWARD_KEYS key -> `train` and `eval` lists
    of (step, value) from metrics.jsonl, one eval point per step) and the held-out values `before` and `after`
    training (results.json; empty while the run goes). None for a run that logged no rewards (sft)."""
    files = view_of(run)
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


def run_grpo_report(run: str | Path | RunView) -> GRPOReport | None:
    """A GRPO run's view: `curves` (each GRPO_CURVES key -> `train` and held-out `eval` lists of (step, value)),
    the held-out values `before` and `after` training (results.json; empty while the run goes) and the
    `samples` of the last step that logged some (completions.jsonl). None for a run of another method."""
    files = view_of(run)
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
