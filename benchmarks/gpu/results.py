"""The suite's results: one JSON document, rewritten (with its Markdown rendering) after every configuration,
atomically, so a command stopped at its time limit keeps everything that finished; read back to resume."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from finetune.rundir import atomic_write_json, atomic_write_text
from finetune.units import format_bytes

STAGES = {
    "a": "Planner vs measured peak (3 steps of `finetune run`)",
    "b": "Max context, Llama-3.1-8B QLoRA r=16, micro-batch 1",
    "c": "Speed: tokens/s of `finetune run` vs HF Trainer + PEFT and TRL; memory-technique overheads",
    "d": "Unsloth side by side",
}
COLUMNS = {
    "a": ["name", "max_seq_len", "status", "fits", "predicted_bytes", "measured_reserved_bytes", "measured_allocated_bytes",
          "error_reserved", "error_allocated", "allocated_before_bytes", "seconds"],
    "b": ["name", "unsloth_tokens", "predicted_max_tokens", "trained_max_tokens", "vs_unsloth", "probes", "seconds"],
    "c": ["name", "max_seq_len", "finetune_tokens_per_s", "hf_peft_tokens_per_s", "trl_tokens_per_s", "vs_hf_peft", "vs_trl",
          "overhead", "seconds"],
    "d": ["name", "status"],
}


class Results:
    """results.json + results.md in `out_dir`; rows keyed by stage and name."""

    def __init__(self, out_dir: Path, header: dict[str, Any]):
        self.json_path, self.md_path = out_dir / "results.json", out_dir / "results.md"
        old = json.loads(self.json_path.read_text()) if self.json_path.is_file() else {}
        self.data = {**header, "runs": old.get("runs", 0) + 1,
                     "stages": old.get("stages") or {k: {"title": v, "rows": [], "summary": {}, "status": "not run"}
                                                     for k, v in STAGES.items()}}

    def row(self, stage: str, name: str) -> dict[str, Any] | None:
        return next((r for r in self.data["stages"][stage]["rows"] if r["name"] == name), None)

    def put(self, stage: str, row: dict[str, Any]) -> None:
        rows = self.data["stages"][stage]["rows"]
        rows[:] = [r for r in rows if r["name"] != row["name"]] + [row]
        self.save()

    def set_stage(self, stage: str, status: str, summary: dict[str, Any] | None = None) -> None:
        self.data["stages"][stage]["status"] = status
        if summary is not None:
            self.data["stages"][stage]["summary"] = summary
        self.save()

    def save(self) -> None:
        atomic_write_json(self.json_path, self.data)
        atomic_write_text(self.md_path, render(self.data))


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if key.endswith("_bytes"):
            return format_bytes(value)
        if key.startswith(("error", "overhead", "worst overhead", "median |error|", "max |error|")):
            return f"{value:+.1%}"
        if key.startswith(("vs_", "lowest speed ratio")):
            return f"{value:.2f}x"
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, dict):
        return " ".join(f"{k}:{'ok' if v else 'oom'}" for k, v in value.items())
    return str(value).replace("|", "/")


def render(data: dict[str, Any]) -> str:
    """The Markdown report: a header, then per stage its status, summary and table."""
    lines = [f"# GPU suite results: {data.get('device', '?')}", "",
             f"Command: `{data.get('command', '')}`  ", f"Started: {data.get('started', '')}, calls so far: "
             f"{data.get('runs', 1)}  ", "Versions: " + ", ".join(f"{k} {v}" for k, v in data.get("versions", {}).items()),
             ""]
    for key, stage in data["stages"].items():
        lines += [f"## {key}. {stage['title']}", "", f"Status: {stage['status']}", ""]
        if stage["summary"]:
            lines += [f"- {k}: {_cell(k, v)}" for k, v in stage["summary"].items()] + [""]
        if stage["rows"]:
            cols = COLUMNS[key]
            lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(_cell(c, r.get(c)) for c in cols) + " |" for r in stage["rows"]]
            lines.append("")
    return "\n".join(lines)
