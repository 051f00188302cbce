"""The rich tables `finetune plan` and `finetune measure` print (the CLI renders; the planner only answers)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from finetune.memory.tracker import CATEGORIES
from finetune.plan import Plan, blocked_by_room
from finetune.recipe.offload_tiers import STORES
from finetune.recipe.settings import table as settings_table
from finetune.reports import RunMemory, SizePlans
from finetune.units import format_bytes


def _short(settings: dict[str, Any]) -> str:
    return " ".join(f"{s.label}={settings[s.name]}" for s in settings_table() if s.name in settings)


def breakdown_table(title: str, breakdown: dict[str, int], peak: int, budget: int | None = None) -> Table:
    table = Table(title=title)
    table.add_column("component")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    for key in CATEGORIES:
        value = breakdown.get(key, 0)
        table.add_row(key, format_bytes(value), f"{100 * value / max(peak, 1):.1f}%")
    table.add_row("[bold]peak[/bold]", f"[bold]{format_bytes(peak)}[/bold]", "")
    if budget is not None:
        table.add_row("budget", format_bytes(budget), f"{100 * peak / max(budget, 1):.0f}% used")
    return table


def strategy_line(plan: Plan) -> str:
    """What the chosen strategy splits across the devices, what each keeps whole, and its buffers."""
    from finetune.plan.memory_model import SHARDS

    strategy = plan.settings.get("strategy", "ddp")
    buffers = f"communication buffers {format_bytes(plan.communication_bytes)} (in other)"
    if strategy == "deepspeed":
        return f"strategy deepspeed: ZeRO-2 splits gradients and optimizer state, ZeRO-3 also weights; {buffers}"
    label = {"weights": "frozen weights", "trainable_weights": "trained weights", "grads": "gradients",
             "optimizer_state": "optimizer state"}
    split = [label[k] for k in label if k in SHARDS[strategy]]
    whole = [label[k] for k in label if k not in SHARDS[strategy]] + ["activations"]
    return (f"strategy {strategy}: " + (f"1/{plan.world_size} of {', '.join(split)} per device; " if split else "")
            + f"whole on each: {', '.join(whole)}; {buffers}")


def images_line(plan: Plan) -> str:
    """A vision-language plan's images: the image tokens of the longest image record at the chosen pixel budget,
    the sequence traced, and the vision tower's weights."""
    vision = plan.vision
    pixels = plan.settings.get("max_pixels")
    budget = f"at max_pixels={pixels:,}" if isinstance(pixels, int) else "at the model's own pixel limit"
    if not vision.get("images"):
        images = "no image records traced (text only)"
    else:
        images = (f"the longest image record: {vision['image_tokens']:,} image tokens ({vision['images']} image(s)) "
                  f"{budget}, traced in a {vision.get('sequence', 0):,}-token sequence")
    return f"images: {images}; vision tower and projector {format_bytes(vision.get('vision_weights', 0))} (16 bits)"


def render_plan(plan: Plan, console: Console | None = None) -> None:
    """The chosen plan against the budget, the next best, and why others were rejected."""
    console = console or Console()
    status = "fits" if plan.fits else "[red]does not fit[/red]"
    if plan.world_size == 1:
        console.print(f"Plan for {plan.device}: {status}, {plan.tokens_per_s:,.0f} tokens/s predicted")
    else:
        console.print(f"Plan per device for {plan.world_size} x {plan.device}: {status} on each, "
                      f"{plan.tokens_per_s:,.0f} tokens/s predicted for all {plan.world_size}")
        console.print("  " + strategy_line(plan))
    console.print("  " + _short(plan.settings), soft_wrap=True)  # one line, also when piped (80 columns)
    if plan.attention:
        console.print(f"  attention: {plan.attention}")
    if plan.vision:
        console.print("  " + images_line(plan), soft_wrap=True)
    console.print(breakdown_table("predicted peak", plan.breakdown, plan.peak_bytes, plan.budget_bytes))
    if plan.reference_pass_bytes:
        console.print(f"  reference pass before training (training.precompute_reference): peak "
                      f"{format_bytes(plan.reference_pass_bytes)}, no reference forward in the steps")
    if plan.generation_bytes:
        console.print(f"  grpo: generation phase {format_bytes(plan.generation_bytes)}, training phase "
                      f"{format_bytes(plan.training_bytes)}; the peak above is the larger")
    if plan.managed_bytes:
        console.print(f"  optimizer state in CUDA managed memory ({plan.settings['optimizer']}, paged to host RAM "
                      f"when the GPU is full): {format_bytes(plan.managed_bytes)}, not in the peak")
    if plan.data:
        console.print(f"  data: {plan.data['examples']:,} training examples, the longest {plan.data['longest_tokens']:,} "
                      f"tokens: the peak is {plan.planned_for()}", soft_wrap=True)
    for note in plan.notes:
        console.print(f"  {note}", soft_wrap=True)
    if plan.alternatives:
        alt = Table(title="next best")
        alt.add_column("settings")
        alt.add_column("peak", justify="right")
        alt.add_column("tokens/s", justify="right")
        for c in plan.alternatives:
            alt.add_row(_short(c.settings), format_bytes(c.peak_bytes), f"{c.tokens_per_s:,.0f}")
        console.print(alt)
    if plan.rejected:
        rej = Table(title=f"rejected ({len(plan.rejected)}, smallest first)")
        rej.add_column("settings")
        rej.add_column("why")
        for c in plan.rejected[:5]:
            rej.add_row(_short(c.settings), c.reason or "")
        console.print(rej)
    blocked = blocked_by_room(plan)
    if blocked is not None:  # a larger budget would not help: the offload's room is short
        on_disk = STORES["offload_dir"] in (blocked.reason or "")
        fix = "set memory.offload_dir to a folder with room" if on_disk else \
            "free host RAM or raise memory.offload_cpu_limit"
        console.print(f"[red]Nothing fits.[/red] {blocked.reason}; {fix}.", highlight=False)
    elif not plan.fits:
        console.print(f"[red]Nothing fits.[/red] Smallest budget that works: {format_bytes(plan.min_budget_bytes)} "
                      "(set memory.gpu_memory or free GPU memory).")
        if plan.fixes:
            console.print("Or leave to the planner a setting the recipe fixes:")
        for line in plan.fix_lines():
            console.print(f"  {line}", soft_wrap=True, markup=False)


def render_sizes(report: SizePlans, console: Console | None = None) -> None:
    """`finetune plan --gpu-memory A,B,...`: per GPU size, the plan (fits, peak, tokens/s) and, as the UI's
    per-size chart shows them, the longest context at micro-batch 1 and the largest micro-batch; then each
    size's chosen settings (or the GPU memory the leanest plan needs) on a line of its own: they do not fit a
    table cell at 80 columns. A peak that does not fit is the leanest plan's."""
    console = console or Console()
    cap = report["micro_batch_cap"]
    table = Table(title=f"plans per GPU size (data.max_seq_len {report['max_seq_len']:,})")
    for name in ("GPU memory", "fits", "peak", "tokens/s", "longest context at mb=1",
                 f"largest mb at {report['max_seq_len']:,}"):
        table.add_column(name, justify="left" if name in ("GPU memory", "fits") else "right")
    for row in report["sizes"]:
        largest = row["largest_micro_batch"]
        table.add_row(row["gpu_memory"], "yes" if row["fits"] else "[red]no[/red]",
                      format_bytes(row["peak_bytes"]), f"{row['tokens_per_s']:,.0f}" if row["fits"] else "-",
                      f"{row['longest_context']:,}" if row["longest_context"] else "none",
                      "none" if largest is None else f"{largest} (cap)" if largest == cap else str(largest))
    console.print(table)
    if any(row["largest_micro_batch"] == cap for row in report["sizes"]):
        console.print(f"{cap} (cap): the search tries micro-batches up to {cap}; a larger one may fit as well.")
    console.print(f"Contexts stop at the model's own limit, {report['model_max_context']:,} tokens "
                  "(max_position_embeddings).", soft_wrap=True)
    console.print("chosen settings:")
    for row in report["sizes"]:
        need = f": the leanest plan needs {format_bytes(row['min_budget_bytes'])}" if row["min_budget_bytes"] else ""
        chosen = _short(row["settings"]) if row["fits"] else f"nothing fits{need}"
        console.print(f"  {row['gpu_memory']}: {chosen}", soft_wrap=True)  # one line, also when piped


def render_measurement(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    console.print(breakdown_table(f"measured peak on {result['device']}", result["breakdown"], result["peak_bytes"]))


def memory_line(memory: RunMemory) -> str:
    """The end of `finetune run`: the plan (for the data's largest micro-batch; where the data was not read before
    the plan, at max_seq_len and, re-evaluated, at the data's longest example) and the measured peak, on one
    line, so a run whose data is short reads as matching its plan, not as 2x under it."""
    sequence = memory.get("planned_sequence")
    if memory.get("planned_for"):
        at = memory["planned_for"]
    elif sequence is not None and sequence < memory["max_seq_len"]:
        at = f"at its longest image record's {sequence:,} tokens (max_seq_len {memory['max_seq_len']:,})"
    else:
        at = f"at max_seq_len {memory['max_seq_len']:,}"
    parts = [f"memory: planned {format_bytes(memory['planned_peak_bytes'])} {at}"]
    seen = memory["seen"]
    if seen is not None:
        parts.append(f"at the longest example ({seen['longest']:,} tokens) {format_bytes(seen['peak_bytes'])}")
    measured = memory["measured_peak_bytes"]
    parts.append(f"measured peak {format_bytes(measured)}" if measured is not None else "no peak measured")
    return "; ".join(parts)


def render_evaluation(report: dict[str, Any], console: Console | None = None) -> None:
    """`finetune eval`: one row per model (base model, other runs, the run), then where it was saved."""
    from finetune.evaluate.report import caption, table

    headers, rows = table(report)
    out = Table(*headers, title=caption(report))
    for row in rows:
        out.add_row(*row)
    console = console or Console()
    console.print(out)
    if (line := capped_line(report)) is not None:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def capped_line(report: dict[str, Any]) -> str | None:
    """Which models' answers ran into the length limit (no end of turn within it), and how the limit was set;
    None when no answer did."""
    models = [m for m in report.get("models", []) if isinstance(m, dict) and m.get("capped")]
    if not models:
        return None
    why = (" (twice the longest expected answer + 16; --max-new-tokens N to change)"
           if report.get("max_new_tokens_from") == "expected answers" else " (--max-new-tokens)")
    counts = ", ".join(f"{m['label']} {m['capped']}/{report['with_expected_answer']}" for m in models)
    return f"answers cut at {report['max_new_tokens']} new tokens{why}: {counts}"
