"""Turn run-directory contents and planner output into what the page shows (markdown, HTML, tables)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from finetune.api import RunView, view_of
from finetune.evaluate.report import run_loss
from finetune.recipe.settings import format_choices
from finetune.rundir import COLLAPSED_EVENT, REWARD_ACCURACY, REWARD_KEYS, TRAINING_WARNING, HeldRun, RunDir
from finetune.units import format_bytes
from ui.runs import RunManager


def size(n: Any) -> str:
    """A byte count for people, or n/a."""
    return format_bytes(n) if isinstance(n, (int, float)) else "n/a"


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "n/a"
    s = int(seconds)
    return f"{s // 3600}h {s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m {s % 60:02d}s"


def last_value(rows: list[dict[str, Any]], key: str) -> Any:
    """The most recent logged value of `key` (metrics rows mix train and eval lines)."""
    for row in reversed(rows):
        if row.get(key) is not None:
            return row[key]
    return None


def summary(run_dir: Path) -> dict[str, Any]:
    """One row of the run history: state, progress and final metrics; the eval loss is the latest `finetune
    eval`'s held-out loss of the run (evaluation.json; `evaluated`: True) or else the one training logged."""
    run = RunDir(run_dir)
    status = run.read_status()
    rows = run.read_metrics()
    peaks = [r["peak_memory_bytes"] for r in rows if r.get("peak_memory_bytes")]
    evaluated = run_loss(run.read_evaluation(), run.root.name)
    return {
        "state": status.get("state", "unknown"),
        "step": status.get("step", last_value(rows, "step")),
        "max_steps": status.get("max_steps"),
        "loss": last_value(rows, "loss"),
        "eval_loss": last_value(rows, "eval_loss") if evaluated is None else evaluated,
        "evaluated": evaluated is not None,
        "tokens_per_second": last_value(rows, "tokens_per_second"),
        "peak_memory_bytes": max(peaks) if peaks else None,
    }


def status_html(run: Path | RunView, state: str) -> str:
    """Progress bar, step, ETA, tokens/s and measured against predicted memory for one run."""
    files = view_of(run)
    status, rows = files.status, files.metrics
    step = status.get("step") or last_value(rows, "step") or 0
    max_steps = status.get("max_steps") or 0
    pct = 100.0 * step / max_steps if max_steps else 0.0
    peaks = [r["peak_memory_bytes"] for r in rows if r.get("peak_memory_bytes")]
    plan = files.plan or {}
    items = {
        "state": state,
        "step": f"{step} / {max_steps or '?'}",
        "ETA": _duration(status.get("eta_s")) if state == "running" else "-",
        "loss": _fmt(last_value(rows, "loss")) or "n/a",
        "tokens/s": f"{last_value(rows, 'tokens_per_second') or 0:,.0f}",
        "peak memory, measured": size(max(peaks) if peaks else None),
        "peak memory, predicted": size(plan.get("peak_bytes")),
    }
    cells = "".join(f"<div><small>{html.escape(k)}</small><br><b>{html.escape(str(v))}</b></div>"
                    for k, v in items.items())
    error = status.get("error")
    err = f"<pre style='color:#b00020;white-space:pre-wrap'>{html.escape(str(error))}</pre>" if error else ""
    warnings = "".join(f"<div class='run-warning' style='color:#8a5300'>warning: {html.escape(w)}</div>"
                       for w in run_warnings(files))
    return (f"<div id='run-status' data-state='{html.escape(state)}' data-step='{step}'>"
            f"<div><code>{html.escape(str(files.root))}</code></div>"
            f"<progress value='{pct:.1f}' max='100' style='width:100%'></progress>"
            f"<div style='display:flex;gap:1.5em;flex-wrap:wrap'>{cells}</div>{warnings}{err}</div>")


def run_warnings(files: RunView) -> list[str]:
    """What the run view warns about: a run that stopped learning (status.json's training_warning, from
    finetune.train.reporting.CollapseWatch) and damaged lines of metrics.jsonl that were skipped."""
    warning = files.status.get(TRAINING_WARNING)
    skipped = getattr(files.metrics, "skipped", 0)
    return ([warning] if isinstance(warning, str) else []) + (
        [f"{skipped} damaged line(s) of metrics.jsonl skipped"] if skipped else [])


def _differences(plan: dict[str, Any], option: dict[str, Any]) -> str:
    """The settings in which an option differs from the chosen plan, as `key=value, ...`."""
    chosen = plan.get("settings") or {}
    diff = {k: v for k, v in (option.get("settings") or {}).items() if chosen.get(k) != v}
    return ", ".join(f"{k}={v}" for k, v in diff.items())


def plan_bars(plan: dict[str, Any], limit: int = 5) -> list[tuple[str, dict[str, float]]]:
    """(label, breakdown) for the chosen plan and the first `limit` alternatives that have a breakdown,
    each alternative labelled by the settings in which it differs from the chosen plan."""
    bars = [("chosen plan", with_vision_tower(plan.get("breakdown") or {}, plan.get("vision")))]
    for i, alt in enumerate(plan.get("alternatives") or [], 1):
        if isinstance(alt, dict) and isinstance(alt.get("breakdown"), dict) and len(bars) <= limit:
            bars.append((alt.get("name") or _differences(plan, alt) or f"alternative {i}", alt["breakdown"]))
    return bars


VISION_TOWER = "vision tower weights"  # a vision-language plan's breakdown: its vision tower apart from the weights


def with_vision_tower(breakdown: dict[str, Any], vision: Any) -> dict[str, Any]:
    """A plan's breakdown with a vision-language model's vision tower and projector (plan.vision's
    vision_weights, counted within weights) shown as a component of its own; unchanged for a text model."""
    tower = vision.get("vision_weights") if isinstance(vision, dict) else None
    if not isinstance(tower, (int, float)) or not isinstance(breakdown.get("weights"), (int, float)):
        return breakdown
    out = {}
    for key, value in breakdown.items():
        out[key] = value - tower if key == "weights" else value
        if key == "weights":
            out[VISION_TOWER] = tower
    return out


def images_markdown(plan: dict[str, Any]) -> str | None:
    """What a vision-language plan's images cost: one example's images and image tokens at the chosen pixel
    budget, and the vision tower's weights; None for a text model."""
    vision = plan.get("vision")
    if not isinstance(vision, dict) or not vision:
        return None
    pixels = (plan.get("settings") or {}).get("max_pixels")
    budget = f" at `max_pixels={pixels:,}`" if isinstance(pixels, int) else ""
    sequence = vision.get("sequence")
    traced = f", traced in a {sequence:,}-token sequence" if isinstance(sequence, int) else ""
    return (f"**Images:** the longest image record's {vision.get('images', 0)} image(s) are "
            f"{vision.get('image_tokens', 0):,} image tokens{budget}{traced}; the vision tower and projector weigh "
            f"{size(vision.get('vision_weights'))} (16 bits, within the weights).")


def plan_markdown(plan: dict[str, Any]) -> str:
    """Whether the recipe fits, the peak against the budget, and the settings the planner chose."""
    verdict = "FITS" if plan.get("fits") else "DOES NOT FIT"
    lines = [f"### {verdict}: predicted peak {size(plan.get('peak_bytes'))} of a {size(plan.get('budget_bytes'))} "
             "budget"]
    if plan.get("planned_for"):
        lines.append(f"The peak is {plan['planned_for']}.")
    lines += [f"Note: {note}" for note in plan.get("notes") or []]
    speed = plan.get("speed")
    if speed:
        lines.append(f"Predicted speed: **{speed['text']}** — an estimate: {speed['basis']}.")
    if not plan.get("fits") and plan.get("min_budget_bytes"):
        lines.append(f"The smallest budget any option fits: {size(plan['min_budget_bytes'])}.")
    if plan.get("fix_lines"):
        lines.append("**Or leave to the planner** a setting the recipe fixes: "
                     + "; ".join(f"`{line}`" for line in plan["fix_lines"]))
    chosen = plan.get("chosen_automatically")
    if chosen:
        lines.append("**Chosen automatically** (the recipe's `auto` keys): "
                     + ", ".join(f"`{item}`" for item in format_choices(chosen)))
    settings = plan.get("settings") or {}
    if settings:
        lines.append("**Chosen settings:** " + ", ".join(f"`{k}={v}`" for k, v in settings.items()))
    if images := images_markdown(plan):
        lines.append(images)
    return "\n\n".join(lines)


OPTION_HEADERS = ["option", "predicted peak", "tokens/s (estimate)", "why rejected",
                  "differs from the chosen plan in"]


def option_rows(plan: dict[str, Any]) -> list[list[str]]:
    """Alternatives and rejected options: kind, peak, speed, why rejected, and how they differ (last: long)."""
    rows = []
    for kind in ("alternatives", "rejected"):
        for opt in plan.get(kind) or []:
            if isinstance(opt, dict):
                speed = (opt.get("speed") or {}).get("short") or _fmt(opt.get("tokens_per_s"), ",.0f")
                rows.append([kind.rstrip("s"), size(opt.get("peak_bytes")), speed, str(opt.get("reason") or ""),
                             _differences(plan, opt)])
    return rows


def history_rows(run_dirs: list[str]) -> list[list[Any]]:
    """One row per run: name, state, progress and its final metrics."""
    rows = []
    for d in run_dirs:
        s = summary(Path(d))
        evaluated = f"{_fmt(s['eval_loss'])} (finetune eval)" if s["evaluated"] else _fmt(s["eval_loss"])
        rows.append([d, s["state"], f"{s['step'] or 0} / {s['max_steps'] or '?'}",
                     _fmt(s["loss"]), evaluated, _fmt(s["tokens_per_second"], ".0f"),
                     size(s["peak_memory_bytes"])])
    return rows


def _fmt(value: Any, spec: str = ".4f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else ""


def outside_markdown(held: HeldRun) -> str:
    """One run directory a process started outside this UI holds: a run training, or another command."""
    pid = f"pid {held.pid}" if held.pid else held.holder
    if held.action and held.action.startswith("finetune run"):
        return f"**busy**: a run started outside this UI is training (`{held.root}`, {pid})"
    return f"**busy**: `{held.action or held.holder}` started outside this UI is using `{held.root}` ({pid})"


def queue_markdown(manager: RunManager, outside: list[HeldRun] = ()) -> str:
    """The running job and the queue behind it, after the runs a process started outside this UI holds
    (`outside`: RunManager.outside_runs), which the queue does not know of."""
    jobs = [j for j in manager.jobs() if j.state in ("running", "queued")]
    lines = [f"- {outside_markdown(h)}" for h in outside]
    # a running job as its run view says it (RunManager.run_state): "completed, process exiting" once the run
    # has ended and its process is on its way out, not "running" beside it
    lines += [f"- **{manager.run_state(j.run_dir) if j.state == 'running' else j.state}**"
              f"{' (resume)' if j.resume else ''}: `{j.run_dir}`" for j in jobs]
    return "\n".join(lines) or "GPU free: no run is going and none is queued."


def preview_markdown(examples: list[dict[str, Any]], bad: list[str]) -> str:
    """Detected format, where the shown examples come from, and the records that could not be read."""
    fmt = "+".join(dict.fromkeys(ex.get("format", "?") for ex in examples)) or "?"  # a mix: each file's
    lines = [f"Detected format: **{fmt}**. {len(examples)} example(s) below as the model sees them; "
             "tokens that carry loss are highlighted."]
    lines += [f"- example {i}: {ex.get('where', '')}{' (truncated to max_seq_len)' if ex.get('truncated') else ''}"
              for i, ex in enumerate(examples, 1)]
    if bad:
        lines.append(f"\n**{len(bad)} bad record(s)** (a run stops on them unless data.on_bad_record is skip):")
        lines += [f"- {p}" for p in bad[:10]] + ([f"- … and {len(bad) - 10} more"] if len(bad) > 10 else [])
    return "\n".join(lines)


def measured_bars(run: Path | RunView, seen: dict[str, Any] | None = None
                  ) -> tuple[list[tuple[str, dict[str, float]]], float | None]:
    """Predicted (plan.json; and at the longest sequence seen, `seen`) and measured (the latest logged peak
    breakdown) memory, and the budget."""
    files = view_of(run)
    plan = files.plan or {}
    bars = [("predicted", plan["breakdown"])] if isinstance(plan.get("breakdown"), dict) else []
    if seen and isinstance(seen.get("breakdown"), dict):
        bars.append((f"predicted at {seen['longest']:,} tokens", seen["breakdown"]))
    measured = last_value(files.metrics, "peak_memory_breakdown")
    if isinstance(measured, dict):
        bars.append(("measured", measured))
    return bars, plan.get("budget_bytes")



def run_events(rows: list[dict[str, Any]]) -> list[tuple[int, str, str, str]]:
    """The events a run recorded in metrics.jsonl as (step, short label, kind, detail) chart markers:
    checkpoints saved, batch changes of `effective_batch_size: auto`, out-of-memory recoveries (one that
    changed the micro-batch or accumulation is a batch change too) and give-ups."""
    out = []
    for row in rows:
        event, step = row.get("event"), row.get("oom_step", row.get("step"))  # at the step that failed
        if not isinstance(event, str) or not isinstance(step, int):
            continue
        if event == "checkpoint_saved":
            out.append((step, "checkpoint", "checkpoint", "checkpoint saved"))
            continue
        if event == COLLAPSED_EVENT:  # finetune.train.reporting.CollapseWatch
            out.append((step, "collapsed", "warning", str(row.get("detail") or "training collapsed")))
            continue
        to = row.get("to") or {}
        changes = ", ".join(f"{k} {(row.get('from') or {}).get(k)}→{v}" for k, v in to.items())
        if event == "batch_changed":  # effective_batch_size: auto ramped up (finetune/train/batch_engine.py)
            batch = f"{(row.get('from') or {}).get('effective_batch_size')}→{to.get('effective_batch_size')}"
            out.append((step, f"batch {batch}", "batch", f"batch changed ({changes})"))
            continue
        batch = any(k in to for k in ("micro_batch_size", "gradient_accumulation_steps"))
        if event == "oom_recovered":
            label = "OOM recovered, batch changed" if batch else "OOM recovered"
            out.append((step, label, "batch" if batch else "oom", f"{label} ({changes})"))
        else:
            detail = f"out of memory ({event.removeprefix('oom_').replace('_', ' ')})"
            out.append((step, "out of memory", "oom", detail))
    return out


def seen_length_markdown(seen: dict[str, Any] | None, measured: Any) -> str:
    """Why measured memory can sit far below the prediction: the data is shorter than max_seq_len."""
    if not seen:
        return ""
    return (f"**The examples are shorter than max_seq_len**: the longest sequence in the data is "
            f"{seen['longest']:,} tokens, max_seq_len is {seen['max_seq_len']:,}. The plan was made for "
            f"{seen['max_seq_len']:,} tokens (predicted peak {size(seen.get('planned_peak_bytes'))}); "
            f"re-evaluated at {seen['longest']:,} tokens it predicts **{size(seen['peak_bytes'])}**, "
            f"which is what the measured peak ({size(measured)}) should be compared with. Lower "
            "data.max_seq_len (or turn on data.packing) to plan for what the data really holds.")


def micro_batch_text(value: int | None, cap: int | None) -> str:
    """A largest micro-batch for people: 'none', '8', or '32 (the most tried)' at the search's cap, where a
    larger one may fit too."""
    if not value:
        return "none"
    return f"{value} (the most tried)" if value == cap else str(value)


def same_everywhere(sweep: dict[str, Any]) -> str | None:
    """Why every GPU size's bars are the same, when they are: the recipe fits the smallest size with the longest
    context and the largest micro-batch any size gets, so a bigger GPU buys nothing. None when sizes differ."""
    rows = sweep["sizes"]
    answers = {(r["longest_context"], r["largest_micro_batch"], r["recipe_fits"]) for r in rows}
    if len(rows) < 2 or len(answers) != 1 or not rows[0]["recipe_fits"]:
        return None
    return f"the same plan fits every size from {rows[0]['gpu_gb']:g} GB: nothing to trade"


def sweep_markdown(sweep: dict[str, Any]) -> str:
    """The GPU-size chart's numbers in words (and a table a screen reader can read), after why every size's
    bars are the same when they are."""
    cap = sweep.get("micro_batch_cap")
    same = same_everywhere(sweep)
    first = sweep["sizes"][0] if sweep["sizes"] else {}
    lines = [f"**{same[:1].upper() + same[1:]}.** Each size trains contexts up to {first['longest_context']:,} "
             f"tokens and micro-batch {micro_batch_text(first['largest_micro_batch'], cap)} at "
             f"{sweep['max_seq_len']:,} tokens, so a bigger GPU changes nothing for this recipe.\n"] if same else []
    lines += ["| GPU | longest context (micro-batch 1) | largest micro-batch at "
              f"{sweep['max_seq_len']:,} tokens | this recipe fits |", "|---|---|---|---|"]
    for r in sweep["sizes"]:
        ctx = f"{r['longest_context']:,}" if r["longest_context"] else "none"
        lines.append(f"| {r['gpu_gb']} GB | {ctx} | {micro_batch_text(r['largest_micro_batch'], cap)} | "
                     f"{'yes' if r['recipe_fits'] else 'no'} |")
    limit = sweep.get("model_max_context")
    if limit:
        lines.append(f"\nContexts stop at the model's own limit, {limit:,} tokens (max_position_embeddings).")
    if cap and any(r["largest_micro_batch"] == cap for r in sweep["sizes"]):
        lines.append(f"\nThe planner tries micro-batches up to {cap}: where {cap} fits, a larger one may fit too.")
    return "\n".join(lines)


def events_markdown(events: list[tuple[int, str, str, str]]) -> str:
    """The run's events in words, beside the markers on the curves."""
    if not events:
        return ""
    return "**Events**: " + "; ".join(f"step {step}: {detail}" for step, _, _, detail in events) + "."


def _sequences(n: Any) -> str:
    return f"{n} sequence{'' if n == 1 else 's'}"


def batch_markdown(report: dict[str, Any], run_dir: str = "RUN_DIR") -> str:
    """The batch panel of a finished run (finetune.api.run_batch_report) in words: the batch used, the noise
    scale it measured, every batch change, and what to use next time (with the command that applies it)."""
    per = report["tokens_per_sequence"]
    tokens = f", about {report['tokens']:,} labelled tokens ({per:.3g} per sequence)" if report["tokens"] else ""
    update = report.get("update_batch")
    layout = (f"updates of {update} within micro-batches of {report['micro_batch_size']} (the warmup below the "
              f"micro-batch)" if update and update < report["micro_batch_size"] else
              f"{report['micro_batch_size']} per micro-batch × {report['gradient_accumulation_steps']} accumulation")
    lines = [f"**Batch used**: {layout} × {report['gpus']} GPU{'s' if report['gpus'] > 1 else ''} = "
             f"**{_sequences(report['sequences'])} per optimizer step**{tokens}"
             + (" (effective_batch_size: auto; this is where it ended)." if report["auto"] else ".")]
    gns = report["noise_scale"]
    if gns:
        in_sequences = f" ≈ {gns / per:.3g} sequences" if per else ""
        lines.append(f"**Measured noise scale** at the end: {gns:.4g} labelled tokens{in_sequences} (batches well "
                     "below it use every token; far above it, extra sequences per step mostly repeat what the "
                     "others say).")
    else:
        lines.append("**Measured noise scale**: not measured, so no chart of it: too few steps, micro-batch 1 "
                     "without accumulation, `training.noise_scale: false`, or a run that does not measure it "
                     "(GRPO; FSDP or DeepSpeed).")
    if report["changes"]:
        lines.append("**Batch changes**: " + "; ".join(
            f"step {c['step']}: {(c.get('from') or {}).get('effective_batch_size')} → "
            f"{_sequences((c.get('to') or {}).get('effective_batch_size'))}"
            + (f" (noise scale {c['gns']:.4g} tokens)" if c.get("gns") else "")
            + f", learning rate {_fmt(c.get('learning_rate'), '.3g') or 'n/a'}"
            + (f", beta2 {c['beta2']:.6g}" if c.get("beta2") else "") for c in report["changes"]) + ".")
    advice = report["advice"]
    settings = advice.get("settings")
    if settings:
        batch = settings.get("training.effective_batch_size")
        about = f" (about {round(batch * per):,} labelled tokens)" if per and isinstance(batch, int) else ""
        extra = [f"learning rate **{settings['training.learning_rate']:g}**"] \
            if "training.learning_rate" in settings else []
        if "optimizer.betas" in settings:
            extra.append(f"betas **{settings['optimizer.betas']}**")
        lines.append(f"**Next time**: an effective batch of **{_sequences(batch)}**{about}, " + ", ".join(extra)
                     + f". Why: {advice.get('reason', '')}.")
        lines.append("As recipe keys: " + ", ".join(f"`{k}={v}`" for k, v in settings.items()) + ". The button "
                     f"below writes them into the Recipe tab's form; from a terminal: `finetune plan RECIPE "
                     f"--advice {run_dir}`.")
    else:
        lines.append(f"**Next time**: no advice: {advice.get('reason') or 'the run gave none'}.")
    return "\n\n".join(lines)


def rewards_markdown(report: dict[str, Any]) -> str:
    """A preference run's held-out rewards before and after training (finetune.api.run_reward_report) as a
    table; '' while the run has not written them."""
    before, after = report.get("before") or {}, report.get("after") or {}
    if not before and not after:
        return ""
    lines = ["**Held-out pairs, before and after training**", "", "| | before | after |", "|---|---|---|"]
    for key, label in {**REWARD_KEYS, "loss": "loss"}.items():
        fmt = ".0%" if key == REWARD_ACCURACY else "+.3f" if key in REWARD_KEYS else ".4f"
        lines.append(f"| {label} | {_fmt(before.get(key), fmt) or 'n/a'} | {_fmt(after.get(key), fmt) or 'n/a'} |")
    return "\n".join(lines)


def grpo_markdown(report: dict[str, Any]) -> str:
    """A GRPO run's held-out rewards before and after training and its latest sampled answers as tables
    (finetune.api.run_grpo_report)."""
    before, after = report.get("before") or {}, report.get("after") or {}
    lines = []
    if before or after:
        lines += ["**Held-out prompts, greedy answers, before and after training**", "", "| | before | after |",
                  "|---|---|---|"]
        lines += [f"| {key} | {_fmt(before.get(key), '.3f') or 'n/a'} | {_fmt(after.get(key), '.3f') or 'n/a'} |"
                  for key in dict.fromkeys([*before, *after])]
        lines.append("")
    samples = report["samples"]
    if samples:
        lines += [f"**Sampled answers of step {samples[0]['step']}**", "", "| record | answer | reward |",
                  "|---|---|---|"]
        lines += [f"| {_cell(s.get('where'))} | {_cell(s.get('completion'), 300)} | {_fmt(s.get('reward'), '.3f')} |"
                  for s in samples]
    return "\n".join(lines)


def _cell(value: Any, limit: int = 80) -> str:
    """Text safe inside a markdown table cell: one line, pipes and markup escaped, at most `limit` characters."""
    import html

    text = " ".join(str(value if value is not None else "").split())
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    text = html.escape(text, quote=False)  # first: the entities below must stay entities
    return "".join(f"&#{ord(c)};" if c in "|*_`[]\\#~" else c for c in text)


def evaluation_markdown(evaluation: dict[str, Any] | None) -> str:
    """A run's latest `finetune eval` (finetune.api.run_evaluation_table) as a table, one row per model; ''
    before one ran."""
    if evaluation is None:
        return ""
    read = "" if evaluation["records_read"] is None else f"{evaluation['records_read']} records read, "
    how = evaluation.get("preference")
    measured = (f"preference pairs of a {how.get('method')} run (log-probabilities of chosen and rejected; reward "
                f"vs {how.get('reference') or 'no reference'})" if isinstance(how, dict) else
                f"{evaluation['with_expected_answer']} with an expected answer (greedy generations; exact, contains "
                "and numeric match)")
    lines = [f"{read}{evaluation['examples_kept']} examples kept of `{evaluation['data']}`, {measured}", "",
             "| " + " | ".join(evaluation["headers"]) + " |", "|" + "---|" * len(evaluation["headers"])]
    lines += ["| " + " | ".join(row) + " |" for row in evaluation["rows"]]
    return "\n".join(lines)
