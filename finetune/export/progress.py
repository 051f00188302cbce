"""An export's progress as values: `ExportStep` for each step as it starts, and the JSON-lines form that
`finetune export --progress json` writes and the UI reads (standard library only: the API imports it)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ExportStep:
    """One step of an export as it starts: `step` of `of` (from 1), its label (EXPORT_STEPS) and what it works
    on. str() is the line people read ("[2/4] merging the adapter into it: DETAIL"); `finetune export
    --progress json` writes `to_json()`, one object per line, then `done_line` or `error_line`; `read` reads
    any of them back (the UI)."""

    step: int
    of: int
    label: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.step}/{self.of}] {self.label}: {self.detail}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def done_line(folder: Any) -> str:
        """The last line of a successful export: where the model went."""
        return json.dumps({"done": str(folder)})

    @staticmethod
    def error_line(message: str, exit_code: int) -> str:
        """The last line of a failed export: the error as the CLI prints it, and the exit code it ends with."""
        return json.dumps({"error": message, "exit_code": exit_code})

    @staticmethod
    def read(line: str) -> ExportStep | dict[str, Any] | None:
        """A line of `finetune export --progress json`: an ExportStep, the final {"done": folder} or {"error":
        message, "exit_code": n}; None for any other line (a library's warning on the same stream)."""
        try:
            event = json.loads(line)
        except ValueError:
            return None
        if not isinstance(event, dict):
            return None
        if set(event) == {"step", "of", "label", "detail"}:
            return ExportStep(**event)
        return event if "done" in event or "error" in event else None
