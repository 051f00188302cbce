"""Units every layer shares: byte sizes (parse and print), compute dtypes, and the cache folder.

At the bottom of the import graph and torch-free, so the recipe schema, the UI and the planner read the same
facts; `torch_dtype` imports torch only when called.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
MAX_SIZE = 2**50  # 1 PiB: far above any machine, low enough that arithmetic on it stays exact


def parse_bytes(value: Any) -> Any:
    """Turn '12GiB', '12GB', '512M' or an int into a byte count; leave 'auto' and None alone.

    Raises only ValueError (the planner's --gpu-memory relies on it), for .inf, NaN, negative and garbage."""
    if value is None or value == "auto":
        return value
    if isinstance(value, bool):
        raise ValueError("expected a size such as 12GiB, not true/false")
    if isinstance(value, int | float):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]{0,30}\.?[0-9]{1,30})\s*([a-zA-Z]{0,3})\s*", str(value)[:100])
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError("expected a size such as 12GiB, 512MiB or a number of bytes")
        number, unit = float(match.group(1)), match.group(2).lower()
    if not math.isfinite(number) or number < 0:
        raise ValueError("a size must be a finite number of bytes, 0 or more")
    size = number * _UNITS[unit]
    if size > MAX_SIZE:
        raise ValueError("a size must be at most 1 PiB")
    return value if isinstance(value, int) else int(size)


def gpu_size(text: str) -> tuple[str, str | None]:
    """A GPU's memory as people write it: a card sold as "16 GB" holds 16 GiB, so GB and TB read as GiB and
    TiB (16GB would otherwise plan 1.1 GiB short). Returns the size to plan and a line saying it was read so
    (None when the text needed no reading: GiB, MB, auto); 10**9-byte units are written as MB (16000MB)."""
    match = re.fullmatch(r"\s*([0-9]{0,30}\.?[0-9]{1,30})\s*([gGtT])[bB]\s*", text[:100])
    if match is None:
        return text, None
    binary = f"{match.group(1)}{match.group(2).upper()}iB"
    return binary, (f"{text.strip()} read as {binary}, as a GPU's memory is labelled (a 16 GB card holds 16 GiB); "
                    f"for powers of 10 write MB, e.g. {float(match.group(1)) * (1000 if match.group(2) in 'gG' else 10**6):g}MB")


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. 1.50 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def size_text(n: int) -> str:
    """A byte count as a recipe would spell it, in the largest unit it is a whole number of (512 MiB, 20 GB),
    else format_bytes; parse_bytes reads it back."""
    for name in ("TiB", "TB", "GiB", "GB", "MiB", "MB", "KiB", "KB"):
        if n and n % _UNITS[name.lower()] == 0:
            return f"{n // _UNITS[name.lower()]} {name}"
    return format_bytes(n)


def format_number(value: Any) -> str:
    """A logged value for people to read (train.log, the UI's log tail): a float in four significant figures,
    in scientific notation below 0.001 or from a million up (learning_rate=7.253e-04, not
    0.0007252766679155447; loss=1.235, tokens_per_second=1234.6); anything else as str() writes it. The exact
    values stay in metrics.jsonl."""
    if not isinstance(value, float) or not math.isfinite(value) or value == 0:
        return str(value)
    if not 1e-3 <= abs(value) < 1e6:
        return f"{value:.3e}"
    return f"{value:.{max(4 - 1 - math.floor(math.log10(abs(value))), 1)}f}".rstrip("0").rstrip(".")


class DType(NamedTuple):
    torch_name: str  # attribute of the torch module
    bytes: int  # per element


# model.dtype's names (the schema's choices besides auto).
DTYPES: dict[str, DType] = {"bf16": DType("bfloat16", 2), "fp16": DType("float16", 2), "fp32": DType("float32", 4)}


def dtype_name(choice: str, device: str, bf16_supported: bool = True) -> str:
    """model.dtype resolved for `device`: auto is bf16 on CUDA (fp16 on GPUs without bf16) and fp32 on CPU,
    where bf16 matmuls are slow and lossy."""
    if choice != "auto":
        return choice
    if device != "cuda":
        return "fp32"
    return "bf16" if bf16_supported else "fp16"


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name in DTYPES."""
    import torch

    return getattr(torch, DTYPES[name].torch_name)


def cache_dir() -> Path:
    """The folder (not created here) of everything computed once per machine and kept: converted models,
    measured bandwidths. $FINETUNE_CACHE, else ~/.cache/finetune."""
    return Path(os.environ.get("FINETUNE_CACHE") or Path.home() / ".cache" / "finetune")
