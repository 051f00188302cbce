"""An evaluation.json as a table (the CLI prints it, the UI's run view shows it): one row per model."""

from __future__ import annotations

from typing import Any

from finetune.evaluate.match import KINDS
from finetune.rundir import is_number

HEADERS = ["model", "loss", "perplexity", *KINDS]


# a preference run's held-out pairs (finetune.evaluate.pairs): (evaluation.json key, header, format)
PAIR_COLUMNS = [("loss", "loss", ".4f"), ("prefers_chosen", "prefers chosen", ".1%"),
                ("logp_margin", "log-prob margin", ".3f"), ("reward_accuracy", "reward accuracy", ".1%"),
                ("reward_margin", "reward margin", ".3f"), ("chosen_nll", "chosen NLL/token", ".4f")]


def table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): held-out loss and perplexity, then each match kind (exact, contains, numeric) as "3/8"
    (or "-" where no record applies); for a preference run's pairs (`PAIR_COLUMNS`), its measures, "-" where
    one does not apply (the base model's reward against itself). A damaged file is read for what it still
    holds: a model entry without numeric loss and perplexity is left out, a match count of the wrong shape
    shown as "-"."""
    models = report.get("models")
    if isinstance(report.get("preference"), dict):
        return ["model", *(header for _, header, _ in PAIR_COLUMNS)], [
            [str(m.get("label", "?")), *(format(m[key], spec) if is_number(m.get(key)) else "-"
                                         for key, _, spec in PAIR_COLUMNS)]
            for m in (models if isinstance(models, list) else []) if isinstance(m, dict) and is_number(m.get("pairs"))]
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


def caption(report: dict[str, Any]) -> str:
    """What the table was measured on: the records read and examples kept, and how (answers matched, or a
    preference run's pairs: by which method, against which reference)."""
    kept = f"{report.get('records_read')} held-out records read, {report.get('examples_kept')} examples kept"
    how = report.get("preference")
    if isinstance(how, dict):
        reference = f"reward vs the {how['reference']}" if how.get("reference") else "reward without a reference"
        return f"{kept} (preference pairs, {how.get('method')} beta={how.get('beta')}: {reference})"
    return f"{kept} ({report.get('with_expected_answer')} with an expected answer)"
