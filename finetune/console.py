"""One rich console for the whole package, so progress bars and messages do not fight."""

import logging
import os
import sys
import warnings

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


def progress_bar(label: str, info: bool = False) -> Progress:
    """The bar long work shows (training, the reference pass): count, elapsed time and ETA; `info` adds a
    per-task `info` field (tokens/s, loss)."""
    extra = (TextColumn("{task.fields[info]}"),) if info else ()
    return Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), *extra, TimeElapsedColumn(),
                    TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False)


def quiet_libraries() -> None:
    """Silence library chatter that says nothing actionable, so our progress and messages stay readable."""
    # bitsandbytes warns on every import on AVX512-BF16 CPUs that an optional hub kernel is missing; we must not
    # install it (it downloads from the hub) and the built-in path works.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated", category=FutureWarning)
    if not {"transformers", "huggingface_hub"} & sys.modules.keys():
        # Read when they are first imported: setting them costs nothing, importing transformers here took
        # seconds, before a command could even report a missing file (finetune.api.preflight).
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        return
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
