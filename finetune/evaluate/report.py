"""An evaluation.json as a table (the CLI prints it, the UI's run view shows it): one row per model."""

from __future__ import annotations

from typing import Any

from finetune.evaluate.match import KINDS
from finetune.rundir import is_number

HEADERS = ["model", "loss", "perplexity", *KINDS]


def table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): held-out loss and perplexity, then each match kind (exact, contains, numeric) as "3/8"
    (or "-" where no record applies). A damaged file is read for what it still holds: a model entry without
    numeric loss and perplexity is left out, a match count of the wrong shape shown as "-"."""
    models = report.get("models")
    rows = []
    for model in models if isinstance(models, list) else []:
        if not isinstance(model, dict) or not all(is_number(model.get(k)) for k in ("loss", "perplexity")):
            continue
        matches = [f"{m['matched']}/{m['of']}" if isinstance(m := model.get(kind), dict)
                   and all(is_number(m.get(k)) for k in ("matched", "of")) else "-" for kind in KINDS]
        rows.append([str(model.get("label", "?")), f"{model['loss']:.4f}", f"{model['perplexity']:.2f}", *matches])
    return HEADERS, rows


def run_loss(report: dict[str, Any] | None, run_name: str) -> float | None:
    """The held-out loss `finetune eval` measured for the run itself (its model entry is labelled with the run
    folder's name, and comes after the base model and any compared runs), or None before an eval of it ran."""
    models = (report or {}).get("models")
    for model in reversed(models if isinstance(models, list) else []):
        if isinstance(model, dict) and model.get("label") == run_name and is_number(model.get("loss")):
            return float(model["loss"])
    return None
