"""The suite's results: one JSON document, rewritten (with its Markdown rendering) after every configuration,
atomically, so a command stopped at its time limit keeps everything that finished; read back to resume.

    python -m benchmarks.gpu.results merge NEW.json INTO_DIR   (a call's results.json into the kept copy)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from finetune.rundir import atomic_write_json, atomic_write_text
from finetune.units import format_bytes

STAGES = {
    "env": "Environment check (carried versions, the GPU, bitsandbytes 4-bit on the device, allocator APIs); the first lease's 8B load",
    "a": "Planner vs measured peak (3 steps of `finetune run`)",
    "b": "Max context, Llama-3.1-8B QLoRA r=16, micro-batch 1",
    "c": "Speed: tokens/s of `finetune run` vs HF Trainer + PEFT and TRL; memory-technique overheads",
    "d": "Unsloth side by side",
}
COLUMNS = {
    "env": ["name", "status", "device", "total_memory_bytes", "allocated_bytes", "python", "torch", "cuda", "checks",
            "estimated_s", "seconds"],
    "a": ["name", "max_seq_len", "status", "fits", "predicted_bytes", "measured_reserved_bytes", "measured_allocated_bytes",
          "error_reserved", "error_allocated", "allocated_before_bytes", "predicted_tokens_per_s", "tokens_per_s",
          "oom_events", "error", "estimated_s", "seconds"],
    "b": ["name", "status", "unsloth_tokens", "predicted_max_tokens", "trained_max_tokens", "vs_unsloth", "probes",
          "errors", "max_probes", "estimated_s", "seconds"],
    "c": ["name", "max_seq_len", "status", "finetune_tokens_per_s", "hf_peft_tokens_per_s", "trl_tokens_per_s", "vs_hf_peft", "vs_trl",
          "overhead", "oom_events", "error", "estimated_s", "seconds"],
    "d": ["name", "status"],
}


class Results:
    """results.json + results.md in `out_dir`; rows keyed by stage and name."""

    def __init__(self, out_dir: Path, header: dict[str, Any]):
        self.json_path, self.md_path = out_dir / "results.json", out_dir / "results.md"
        old = json.loads(self.json_path.read_text()) if self.json_path.is_file() else {}
        self.data = {**header, "runs": old.get("runs", 0) + 1, "calls": old.get("calls", []),
                     "stages": {**_empty_stages(), **old.get("stages", {})}}

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


def _empty_stages() -> dict[str, dict[str, Any]]:
    return {k: {"title": v, "rows": [], "summary": {}, "status": "not run"} for k, v in STAGES.items()}


def merge(new: dict[str, Any], kept: dict[str, Any]) -> dict[str, Any]:
    """`kept` (the results kept between calls) updated with a later call's `new`: its rows replace rows of
    the same stage and name, rows only `kept` has stay, stage status and summary come from the call that
    ran the stage last; the calls' records are joined (each call's once)."""
    out = {**kept, **{k: v for k, v in new.items() if k not in ("stages", "calls", "runs")}}
    out["runs"] = max(kept.get("runs", 0), new.get("runs", 0))
    seen = {json.dumps(c, sort_keys=True) for c in kept.get("calls", [])}
    out["calls"] = kept.get("calls", []) + [c for c in new.get("calls", []) if json.dumps(c, sort_keys=True) not in seen]
    stages = {**_empty_stages(), **kept.get("stages", {})}
    for key, stage in new.get("stages", {}).items():
        old = stages.get(key, {"rows": []})
        names = {r["name"] for r in stage["rows"]}
        rows = [r for r in old["rows"] if r["name"] not in names] + stage["rows"]
        ran = stage["status"] != "not run" or not old.get("status")
        stages[key] = {**(stage if ran else old), "rows": rows}
    out["stages"] = stages
    return out


def merge_into(new_json: Path, out_dir: Path) -> Path:
    """Merge a call's results.json into out_dir/results.json (created when absent) and re-render results.md."""
    new = json.loads(new_json.read_text())
    target = out_dir / "results.json"
    kept = json.loads(target.read_text()) if target.is_file() else {}
    merged = merge(new, kept)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(target, merged)
    atomic_write_text(out_dir / "results.md", render(merged))
    return target


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
        return " ".join(f"{k}:{v}" for k, v in value.items()).replace("|", "/")
    if isinstance(value, list):  # out-of-memory events
        return "; ".join(f"{e.get('event')} at step {e.get('oom_step')}: {e.get('error', '')}"[:160]
                         for e in value).replace("|", "/")
    return str(value).replace("|", "/")


def render(data: dict[str, Any]) -> str:
    """The Markdown report: a header, then per stage its status, summary and table."""
    lines = [f"# GPU suite results: {data.get('device', '?')}", "",
             f"Command: `{data.get('command', '')}`  ", f"Started: {data.get('started', '')}, calls so far: "
             f"{data.get('runs', 1)}  ", "Device time per call (s): "
             + ", ".join(str(c.get("seconds")) for c in data.get("calls", [])) + "  ", "Versions: " + ", ".join(f"{k} {v}" for k, v in data.get("versions", {}).items()),
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


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="merge a call's results.json into the kept results")
    parser.add_argument("verb", choices=["merge"])
    parser.add_argument("new", type=Path, help="the results.json a call returned")
    parser.add_argument("into", type=Path, help="the folder holding the kept results.json (benchmarks/results/...)")
    args = parser.parse_args(argv)
    print(f"merged into {merge_into(args.new, args.into)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
