"""One rich console for the whole package, so progress bars and messages do not fight."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

# soft_wrap: messages are not broken at 80 columns when stderr is a file or a pipe (logs, the UI, tests).
console = Console(stderr=True, soft_wrap=True)
# A command's result (`finetune validate`'s ok line): stdout, so `finetune validate r.yaml > out` keeps it and a
# script reads it apart from the messages and errors on stderr.
result = Console(soft_wrap=True)


# Progress on a console that is no terminal (a log file, nohup, docker logs, CI): a plain line each tenth of
# the work or every LINE_SECONDS, whichever comes first.
LINE_FRACTION = 0.1
LINE_SECONDS = 30.0


def progress_bar(label: str, info: bool = False) -> Progress | ProgressLines:
    """The progress long work shows (training, the reference pass): count, elapsed time and ETA; `info` adds a
    per-task `info` field (tokens/s, loss). A live bar on a terminal; elsewhere plain lines (ProgressLines),
    since a bar redrawn in place reaches a log only when it ends."""
    if not console.is_terminal:
        return ProgressLines(label, info)
    extra = (TextColumn("{task.fields[info]}"),) if info else ()
    return Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), *extra, TimeElapsedColumn(),
                    TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False)


class ProgressLines:
    """rich Progress's calls (start, add_task, update, stop, `with`) for a log: a timestamped line ("12:03:04
    train 30/300 (10%) loss 1.2345  2,100 tok/s  elapsed 0:01:02  eta 0:09:18"), printed and flushed at the
    update that completes the next tenth of the total or comes LINE_SECONDS after the last line, and at the
    end. With `info`, lines are printed at the updates that set it, so a line's count and fields belong
    together (training sets them at each logged step). One task, as its callers use."""

    def __init__(self, label: str, info: bool = False):
        self.label, self.waits_for_info = label, info
        self.total: float | None = None
        self.completed = self.first = self.printed = 0.0
        self.fields: dict[str, Any] = {}
        self.start_time = self.printed_time = time.monotonic()

    def start(self) -> None:
        """Nothing to draw: lines come with the updates."""

    def add_task(self, description: str, total: float | None = None, completed: float = 0, **fields: Any) -> int:
        self.total, self.completed, self.first, self.printed = total, completed, completed, completed
        self.fields = fields
        self.start_time = self.printed_time = time.monotonic()
        return 0

    def update(self, task: int, *, completed: float | None = None, advance: float | None = None,
               **fields: Any) -> None:
        self.completed = completed if completed is not None else self.completed + (advance or 0)
        self.fields.update(fields)
        if self.waits_for_info and "info" not in fields:
            return
        step = math.ceil((self.total or 0) * LINE_FRACTION)
        if (step and self.completed >= self.printed + step) or time.monotonic() - self.printed_time >= LINE_SECONDS:
            self._line()

    def stop(self) -> None:
        if self.completed > self.printed:
            self._line()

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _line(self) -> None:
        now = time.monotonic()
        count = f"{self.completed:g}/{self.total:g} ({self.completed / self.total:.0%})" if self.total \
            else f"{self.completed:g}"
        done = self.completed - self.first
        elapsed = now - self.start_time
        eta = (f"  eta {timedelta(seconds=round(elapsed / done * (self.total - self.completed)))}"
               if self.total and done > 0 else "")
        info = f" {self.fields['info']}" if self.fields.get("info") else ""
        console.print(f"{time.strftime('%H:%M:%S')} {self.label} {count}{info}  elapsed "
                      f"{timedelta(seconds=round(elapsed))}{eta}", markup=False, highlight=False)
        console.file.flush()
        self.printed, self.printed_time = self.completed, now


# Warnings libraries raise about their own insides, which a finetune user can do nothing about: (category,
# message pattern, module that raises it). Filtered where they start, by the CLI, the UI server
# (quiet_libraries) and the tests (tests/conftest.py) alike, so each is listed here once.
LIBRARY_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    # transformers 5 deprecated the property peft still reads on every adapter it wraps (five times a load).
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated", r"transformers\.modeling_utils"),
    # Liger's fused-loss forward (memory.kernels: liger) still passes the argument transformers 5 renamed.
    (FutureWarning, r"`past_key_values` is deprecated", r"torch\.nn\.modules\.module"),
)


def filter_library_warnings() -> None:
    """Ignore the LIBRARY_WARNINGS; every other warning still shows (and fails a test when our code raises it)."""
    for category, message, module in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def quiet_libraries() -> None:
    """Silence library chatter that says nothing actionable, so our progress and messages stay readable."""
    # bitsandbytes warns on every import on AVX512-BF16 CPUs that an optional hub kernel is missing; we must not
    # install it (it downloads from the hub) and the built-in path works.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # ...and through the `kernels` package (a transformers dependency) it says offline mode skips a trust check.
    logging.getLogger("kernels").setLevel(logging.ERROR)
    # Liger (memory.kernels: liger) names, on import, each optional backend it lacks (CuTe DSL, Ascend).
    logging.getLogger("liger_kernel.backends.registry").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    filter_library_warnings()
    if not console.is_terminal and "tqdm" not in sys.modules:
        # Library bars (transformers' GGUF conversion and shard writer, gguf's writer) redraw with carriage
        # returns: one endless line in a log. tqdm reads TQDM_* once, when imported; ours prints lines there.
        os.environ["TQDM_DISABLE"] = "1"
    if not {"transformers", "huggingface_hub"} & sys.modules.keys():
        # Read when they are first imported: setting them costs nothing, importing transformers here took
        # seconds, before a command could even report a missing file (finetune.api.preflight).
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        return
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
