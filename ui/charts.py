"""Matplotlib figures for the UI: loss and learning-rate curves, and the memory plan as stacked bars.

Figures are built with `matplotlib.figure.Figure` (not pyplot), so nothing global accumulates while a
timer redraws them every few seconds.
"""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import FormatStrFormatter

from finetune.units import format_bytes

GIB = 1 << 30
BREAKDOWN = ("weights", "trainable_weights", "gradients", "optimizer_state", "activations", "logits_and_loss", "other")
_COLORS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#64b5cd", "#8c8c8c")


def _figure(width: float = 7, height: float = 3.2) -> tuple[Figure, Any]:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    return fig, fig.add_subplot()


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and r.get("step") is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def loss_figure(runs: dict[str, list[dict[str, Any]]], title: str = "loss", by_run: bool = False) -> Figure:
    """Training loss (lines) and eval loss (markers) over optimizer steps, one colour per run;
    `by_run` names each curve after its run (for comparisons) instead of "train"/"eval"."""
    fig, ax = _figure()
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
        gns_ax.set_yscale("log")
        gns_ax.set_ylabel("noise scale (tokens)")
        ax.plot([], [], ":", color="gray", label="noise scale (right axis)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if any(rows for rows in runs.values()):
        ax.legend(loc="upper right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no metrics yet", ha="center", va="center", transform=ax.transAxes, color="gray")
    return fig


def lr_figure(rows: list[dict[str, Any]]) -> Figure:
    """The learning-rate schedule as logged."""
    fig, ax = _figure(height=2.4)
    ax.plot(*_series(rows, "learning_rate"), color="C2")
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.1e"))  # an offset label would be clipped
    ax.grid(alpha=0.3)
    return fig


def memory_figure(bars: list[tuple[str, dict[str, float]]], budget: float | None,
                  title: str = "predicted peak memory") -> Figure:
    """Stacked bars of memory per component for each option, against the budget line (GiB or MiB)."""
    fig, ax = _figure(height=3.6)
    labels = [name for name, _ in bars]
    totals = [sum(float(v or 0) for k, v in b.items() if k in BREAKDOWN) for _, b in bars]
    unit, scale = ("GiB", GIB) if max([*totals, budget or 0]) >= GIB else ("MiB", 1 << 20)
    bottoms = [0.0] * len(bars)
    for part, color in zip(BREAKDOWN, _COLORS, strict=True):
        heights = [float(b.get(part) or 0) / scale for _, b in bars]
        if any(heights):
            ax.bar(labels, heights, bottom=bottoms, color=color, label=part.replace("_", " "))
            bottoms = [lo + h for lo, h in zip(bottoms, heights, strict=True)]
    for x, total in enumerate(bottoms):
        ax.annotate(format_bytes(total * scale), (x, total), ha="center", va="bottom", fontsize=8)
    if budget:
        ax.axhline(budget / scale, color="black", linestyle="--", linewidth=1.2, label=f"budget {format_bytes(budget)}")
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.tick_params(axis="x", labelsize=8, labelrotation=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return fig
