"""Matplotlib figures for the UI: loss and learning-rate curves, the memory plan as stacked bars, and a
finished run's noise scale against its batch and a preference run's rewards.

Figures are built with `matplotlib.figure.Figure` (not pyplot), so nothing global accumulates while a
timer redraws them every few seconds.
"""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import FormatStrFormatter, LogFormatter

from finetune.rundir import REWARD_ACCURACY, REWARD_KEYS
from finetune.units import format_bytes

GIB = 1 << 30
BREAKDOWN = ("weights", "trainable_weights", "gradients", "optimizer_state", "activations", "logits_and_loss", "other")
_COLORS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#64b5cd", "#8c8c8c")


LABEL_BAND = 0.4  # inches at the top of every figure left empty: Gradio draws the panel's label over it


def ui_figure(width: float, height: float) -> Figure:
    """A figure whose axes and titles stay below the label Gradio's gr.Plot lays over its top-left corner."""
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    fig.get_layout_engine().set(rect=(0, 0, 1, 1 - LABEL_BAND / height))
    return fig


def _figure(width: float = 7, height: float = 3.2) -> tuple[Figure, Any]:
    fig = ui_figure(width, height)
    return fig, fig.add_subplot()


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and r.get("step") is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _plain(value: float, decimals: int) -> str:
    """A tick value as a short plain number: 1100, 30.5, 52k, 52.5k, 2.1M."""
    scale, suffix = next(((u, x) for u, x in ((1e9, "G"), (1e6, "M"), (1e4, "k")) if abs(value) >= u), (1, ""))
    if suffix == "k":
        scale = 1e3
    text = f"{value / scale:.{decimals}f}"
    return (text.rstrip("0").rstrip(".") if "." in text else text) + suffix


class PlainLogFormatter(LogFormatter):
    """LogFormatter's choice of which ticks carry a label, each spelled as a plain number with as many
    decimals as it takes to tell the labels apart (LogFormatter writes 52,000 and 54,000 both as 5e+04)."""

    def format_ticks(self, values: list[float]) -> list[str]:
        chosen = super().format_ticks(values)
        for decimals in range(5):
            labels = [_plain(v, decimals) if text else "" for v, text in zip(values, chosen, strict=True)]
            shown = [label for label in labels if label]
            if len(set(shown)) == len(shown):
                break
        return labels


def _log_axis(ax: Any) -> None:
    """A logarithmic y axis labelled with distinct plain numbers (30, not 3x10^1), also between powers of ten."""
    ax.set_yscale("log")
    for set_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        set_formatter(PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


NO_DATA = "no data yet"


def show_empty(ax: Any, text: str = NO_DATA) -> None:
    """An axes with nothing to draw: no ticks or grid (matplotlib's empty range, -0.04 to 0.04, reads as data),
    one grey line in the middle saying why it is empty."""
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)
    if text:
        ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray", fontsize=11)


EVENT_COLORS = {"checkpoint": "#55a868", "oom": "#c44e52", "batch": "#8172b2", "warning": "#dd8452"}


def mark_events(ax: Any, events: list[tuple[int, str, str, str]]) -> None:
    """A dotted vertical line per run event (step, label, kind, detail) with its label at the top of the axes."""
    for step, label, kind, _ in events:
        color = EVENT_COLORS.get(kind, "#8c8c8c")
        ax.axvline(step, color=color, linestyle=":", linewidth=1.3)
        ax.annotate(label, (step, 1), xycoords=("data", "axes fraction"), xytext=(2, -2), textcoords="offset points",
                    rotation=90, va="top", ha="left", fontsize=7, color=color)


def loss_figure(runs: dict[str, list[dict[str, Any]]], title: str = "loss", by_run: bool = False,
                events: list[tuple[int, str, str, str]] = ()) -> Figure:
    """Training loss (lines) and eval loss (markers) over optimizer steps, one colour per run;
    `by_run` names each curve after its run (for comparisons) instead of "train"/"eval"; `events` (step,
    label, kind) are drawn as marked vertical lines."""
    fig, ax = _figure()
    mark_events(ax, events)
    for i, (name, rows) in enumerate(runs.items()):
        color = f"C{i % 10}"
        ax.plot(*_series(rows, "loss"), color=color, label=name if by_run else "train loss")
        steps, evals = _series(rows, "eval_loss")
        if evals:
            ax.plot(steps, evals, "o--", color=color, label=f"{name} eval" if by_run else "eval loss")
    noise = {name: _series(rows, "gns") for name, rows in runs.items()}
    if any(values for _, values in noise.values()):  # gradient noise scale, on its own log axis
        gns_ax = ax.twinx()
        for i, (steps, values) in enumerate(noise.values()):
            gns_ax.plot(steps, values, ":", color=f"C{i % 10}", alpha=0.7)
        _log_axis(gns_ax)
        gns_ax.set_ylabel("noise scale (tokens)")
        ax.plot([], [], ":", color="gray", label="noise scale (right axis)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if any(series[0] for rows in runs.values() for series in (_series(rows, "loss"), _series(rows, "eval_loss"))):
        ax.legend(loc="upper right", fontsize=8)
    else:
        show_empty(ax, NO_DATA if runs else "no run selected")
    return fig


def lr_figure(rows: list[dict[str, Any]]) -> Figure:
    """The learning-rate schedule as logged."""
    fig, ax = _figure(height=2.4)
    steps, rates = _series(rows, "learning_rate")
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    if not steps:
        show_empty(ax)
        return fig
    ax.plot(steps, rates, color="C2")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.1e"))  # an offset label would be clipped
    ax.grid(alpha=0.3)
    return fig


OFF_SCALE = 3.0  # a budget over this many times the tallest bar is named, not drawn: the bars would be slivers


def memory_figure(bars: list[tuple[str, dict[str, float]]], budget: float | None,
                  title: str = "predicted peak memory") -> Figure:
    """Stacked bars of memory per component for each option, against the budget line (GiB or MiB). The axis
    is scaled to the bars: a budget far above them (an 862 MiB plan on a 20 GiB card) is named in the legend,
    with the share the tallest bar takes of it, instead of drawn at a height that would flatten the bars."""
    fig, ax = _figure(height=3.6)
    labels = [name for name, _ in bars]
    totals = [sum(float(v or 0) for k, v in b.items() if k in BREAKDOWN) for _, b in bars]
    tallest = max(totals, default=0)
    drawn = budget if budget and budget <= OFF_SCALE * max(tallest, 1) else None
    unit, scale = ("GiB", GIB) if max([*totals, drawn or 0]) >= GIB else ("MiB", 1 << 20)
    bottoms = [0.0] * len(bars)
    for part, color in zip(BREAKDOWN, _COLORS, strict=True):
        heights = [float(b.get(part) or 0) / scale for _, b in bars]
        if any(heights):
            ax.bar(labels, heights, bottom=bottoms, color=color, label=part.replace("_", " "))
            bottoms = [lo + h for lo, h in zip(bottoms, heights, strict=True)]
    top = max([*bottoms, (drawn or 0) / scale]) or 1
    for part in BREAKDOWN:  # each segment tall enough to hold it carries its size
        for x, (_, b) in enumerate(bars):
            size = float(b.get(part) or 0)
            below = sum(float(b.get(p) or 0) for p in BREAKDOWN[:BREAKDOWN.index(part)])
            if size / scale >= 0.07 * top:
                ax.annotate(format_bytes(size), (x, (below + size / 2) / scale), ha="center", va="center",
                            fontsize=7, color="white")
    for x, total in enumerate(bottoms):
        ax.annotate(format_bytes(total * scale), (x, total), ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, top * 1.1)  # room for the totals above the tallest bar
    if drawn:
        ax.axhline(drawn / scale, color="black", linestyle="--", linewidth=1.2, label=f"budget {format_bytes(drawn)}")
    elif budget:
        ax.plot([], [], color="black", linestyle="--", linewidth=1.2, marker="^", markersize=5,
                label=f"budget {format_bytes(budget)}, above\nthis axis: the tallest bar\nis {_share(tallest / budget)} of it")
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.tick_params(axis="x", labelsize=8, labelrotation=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return fig


def _share(fraction: float) -> str:
    return f"{fraction:.0%}" if fraction >= 0.01 else "under 1%"


def timeline_figure(rows: list[dict[str, Any]], planned_peak: float | None,
                    events: list[tuple[int, str, str, str]] = (), seen_peak: float | None = None) -> Figure:
    """Tokens/s and the measured peak memory per logged step against the plan's peak (and the plan at the
    longest sequence seen), with the run's events marked."""
    fig = ui_figure(7, 4.4)
    speed, mem = fig.subplots(2, 1, sharex=True)
    steps, speeds = _series(rows, "tokens_per_second")
    speed.plot(steps, speeds, color="C0", marker=".", label="tokens/s")
    speed.set_ylabel("tokens/s")
    speed.grid(alpha=0.3)
    speed.set_ylim(0, max(speeds, default=1) * 1.15)  # from 0, the fastest step's point inside the frame
    steps, peaks = _series(rows, "peak_memory_bytes")
    values = [*peaks, planned_peak or 0, seen_peak or 0]
    unit, scale = ("GiB", GIB) if max(values, default=0) >= GIB else ("MiB", 1 << 20)
    mem.plot(steps, [p / scale for p in peaks], color="C3", marker=".", label="measured peak")
    if planned_peak:
        mem.axhline(planned_peak / scale, color="black", linestyle="--", linewidth=1.1,
                    label=f"predicted at max_seq_len ({format_bytes(planned_peak)})")
    if seen_peak:
        mem.axhline(seen_peak / scale, color="C1", linestyle="-.", linewidth=1.1,
                    label=f"predicted at the longest sequence seen ({format_bytes(seen_peak)})")
    mem.set_ylabel(f"memory ({unit})")
    mem.set_xlabel("step")
    mem.grid(alpha=0.3)
    mem.set_ylim(bottom=0)
    for ax in (speed, mem):
        mark_events(ax, events)
    if not speeds:
        show_empty(speed)
    if steps or planned_peak:
        mem.legend(loc="lower right", fontsize=7)
    else:
        show_empty(mem, "")
    return fig


def context_figure(sweep: dict[str, Any], chosen_gb: int | None, chosen_micro_batch: int | None = None,
                   note: str | None = None) -> Figure:
    """Per GPU size: the longest trainable context and the largest micro-batch at the recipe's max_seq_len,
    the chosen GPU's bars highlighted and the chosen plan (max_seq_len, its micro-batch) starred; `note`, a line
    under the title (why every size's bars are the same)."""
    fig = ui_figure(9, 3.8)
    fig.suptitle("what fits on each GPU size" + (f"\n{note}" if note else ""), fontsize=10)
    ctx, mbs = fig.subplots(1, 2)
    rows = sweep["sizes"]
    labels = [f"{r['gpu_gb']} GB" for r in rows]
    colors = ["#dd8452" if r["gpu_gb"] == chosen_gb else "#4c72b0" for r in rows]
    contexts = [r["longest_context"] or 0 for r in rows]
    ctx.bar(labels, contexts, color=colors)
    for x, value in enumerate(contexts):
        ctx.annotate(f"{value:,}" if value else "none", (x, max(value, 1)), ha="center", va="bottom", fontsize=7)
    ctx.set_yscale("log", base=2)
    ctx.set_ylim(bottom=min(128, sweep["max_seq_len"] / 2), top=max([*contexts, sweep["max_seq_len"], 256]) * 16)
    ctx.axhline(sweep["max_seq_len"], color="black", linestyle="--", linewidth=1,
                label=f"recipe max_seq_len {sweep['max_seq_len']:,}")
    ctx.set_title("longest context (tokens, micro-batch 1)", fontsize=9)
    batches = [r["largest_micro_batch"] or 0 for r in rows]
    cap = sweep.get("micro_batch_cap")
    mbs.bar(labels, batches, color=colors)
    for x, value in enumerate(batches):  # at the search's cap: "32+", a larger one may fit too
        mbs.annotate(f"{value}+" if value == cap else str(value) if value else "none", (x, value), ha="center",
                     va="bottom", fontsize=7)
    mbs.set_title(f"largest micro-batch at {sweep['max_seq_len']:,} tokens"
                  + (f" (the most tried: {cap})" if cap else ""), fontsize=9)
    mbs.set_ylim(top=max([*batches, 1]) * 1.4)
    if chosen_gb in [r["gpu_gb"] for r in rows]:
        x = [r["gpu_gb"] for r in rows].index(chosen_gb)
        ctx.plot([x], [sweep["max_seq_len"]], marker="*", markersize=14, color="#c44e52", linestyle="none",
                 label="chosen plan")
        if chosen_micro_batch:
            mbs.plot([x], [chosen_micro_batch], marker="*", markersize=14, color="#c44e52", linestyle="none",
                     label=f"chosen plan (micro-batch {chosen_micro_batch})")
            mbs.legend(loc="upper right", fontsize=7)
    ctx.legend(loc="upper right", fontsize=7)
    for ax in (ctx, mbs):
        ax.tick_params(axis="x", labelsize=8)
        ax.set_xlabel("GPU memory")
    return fig


def noise_figure(report: dict[str, Any], events: list[tuple[int, str, str, str]] = ()) -> Figure:
    """The measured noise scale over steps (finetune.api.run_batch_report, labelled tokens, log axis) beside
    the batch the run used, in the same unit (a step line through its batch changes), the batch advised for
    next time dashed, and the batch changes marked."""
    fig, ax = _figure(height=3.0)
    steps = [s for s, _ in report["noise_series"]]
    ax.plot(steps, [v for _, v in report["noise_series"]], color="C2", marker=".", label="measured noise scale")
    per = report["tokens_per_sequence"]
    if per:
        scale = per * report["gpus"]
        batches = [(c["step"], (c.get("to") or {}).get("effective_batch_size")) for c in report["changes"]]
        start = (report["changes"][0].get("from") or {}).get("effective_batch_size") if batches \
            else report["sequences"] / report["gpus"]
        last = max([*steps, *[s for s, _ in batches], 1])
        xs, ys = [0], [start * scale]
        for step, batch in batches:
            xs, ys = [*xs, step, step], [*ys, ys[-1], batch * scale]
        ax.plot([*xs, last], [*ys, ys[-1]], color="C0", label="batch used")
        advised = (report["advice"].get("settings") or {}).get("training.effective_batch_size")
        if isinstance(advised, int):
            ax.axhline(advised * per, color="C1", linestyle="--", linewidth=1.1,
                       label=f"advised for next time ({advised} seq.)")
    mark_events(ax, events)
    _log_axis(ax)
    ax.margins(y=0.15)  # the advised batch is often the lowest line: keep it off the frame
    ax.set_xlabel("step")
    ax.set_ylabel("labelled tokens")
    ax.set_title("noise scale and batch")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return fig


def reward_figure(report: dict[str, Any]) -> Figure:
    """A preference run's rewards (finetune.api.run_reward_report): chosen, rejected and their margin over
    steps above, the accuracy of chosen over rejected below; training lines, held-out evaluations as markers."""
    fig = ui_figure(7, 4.4)
    rewards, accuracy = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    colors = dict(zip(REWARD_KEYS, ("C0", "C3", "C2", "C4"), strict=True))
    for key, label in REWARD_KEYS.items():
        ax = accuracy if key == REWARD_ACCURACY else rewards
        curve = report["curves"][key]
        for kind, style, name in (("train", "-", label), ("eval", "o--", f"{label}, held-out")):
            if curve[kind]:
                ax.plot([s for s, _ in curve[kind]], [v for _, v in curve[kind]], style, color=colors[key],
                        label=name, alpha=0.8 if kind == "train" else 1.0)
    rewards.axhline(0, color="black", linewidth=0.6)
    rewards.set_ylabel("reward")
    rewards.set_title("rewards of chosen and rejected answers")
    if not accuracy.get_lines():  # kto: its answers are not paired
        accuracy.text(0.5, 0.5, "no accuracy: this method's answers are not paired", ha="center", va="center",
                      transform=accuracy.transAxes, color="gray")
    accuracy.set_ylim(-0.05, 1.05)
    accuracy.set_ylabel("chosen > rejected")
    accuracy.set_xlabel("step")
    for ax in (rewards, accuracy):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=7, ncols=2)
    return fig


def grpo_figure(report: dict[str, Any]) -> Figure:
    """A GRPO run's mean reward over steps (held-out greedy answers as markers) above, the completion length
    below (finetune.api.run_grpo_report)."""
    fig = ui_figure(7, 4.4)
    reward, length = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    for ax, key, label, color in ((reward, "reward", "mean reward", "C0"),
                                  (length, "completion_length", "completion tokens", "C1")):
        curve = report["curves"][key]
        for kind, style, name in (("train", "-", label), ("eval", "o--", f"{label}, held-out (greedy)")):
            if curve[kind]:
                ax.plot([s for s, _ in curve[kind]], [v for _, v in curve[kind]], style, color=color, label=name,
                        alpha=0.8 if kind == "train" else 1.0)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=7)
    reward.set_title("rewards of the sampled answers")
    length.set_xlabel("step")
    return fig
