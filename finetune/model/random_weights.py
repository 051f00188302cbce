"""`model.path: random:FOLDER`: a model built from FOLDER's config.json with weights drawn at random, for
benchmarks at full size without downloading anything (memory and speed do not depend on the weights' values).

FOLDER holds config.json and a tokenizer, no weights. The random tensors go through transformers'
`from_pretrained(state_dict=...)`, so bitsandbytes quantizes them on load exactly as it would real ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # random_folder serves the torch-free path checks (finetune.model.source.check_model_path)
    import torch

PREFIX = "random:"


def random_folder(path: str) -> Path | None:
    """FOLDER of a `random:FOLDER` model path, else None."""
    return Path(path.removeprefix(PREFIX)).expanduser() if path.startswith(PREFIX) else None


def random_state_dict(config: Any, dtype: torch.dtype, device: str | int) -> dict[str, torch.Tensor]:
    """Random weights (normal, std = config.initializer_range; ones for norms, zeros for biases) on the CPU.

    Each tensor is drawn on `device` (fast on a GPU) and moved to the CPU at once, so the device never holds
    more than one of them: loading then needs no more device memory than loading real weights does.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.model.building import BUILDING

    with torch.device("meta"), BUILDING:
        meta = AutoModelForCausalLM.from_config(config, dtype=dtype)
    std = getattr(config.get_text_config(), "initializer_range", 0.02)
    seen: set[int] = set()
    out = {}
    for name, tensor in meta.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied weights (lm_head = embeddings) are drawn once
            continue
        seen.add(id(tensor))
        if tensor.dim() >= 2:
            value = torch.randn(tensor.shape, dtype=tensor.dtype, device=device).mul_(std)
        elif name.endswith("bias"):
            value = torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)
        else:
            value = torch.ones(tensor.shape, dtype=tensor.dtype, device=device)
        out[name] = value.cpu()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # hand the draws' blocks back: a real load would not have cached them
    return out
