"""An evaluation.json as a table (the CLI prints it, the UI's run view shows it): one row per model."""

from __future__ import annotations

from typing import Any

from finetune.evaluate.match import KINDS

HEADERS = ["model", "loss", "perplexity", *KINDS]


def table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): held-out loss and perplexity, then each match kind (exact, contains, numeric) as "3/8"
    (or "-" where no record applies)."""
    rows = []
    for model in report.get("models", []):
        matches = [f"{m['matched']}/{m['of']}" if (m := model.get(kind)) else "-" for kind in KINDS]
        rows.append([str(model["label"]), f"{model['loss']:.4f}", f"{model['perplexity']:.2f}", *matches])
    return HEADERS, rows
