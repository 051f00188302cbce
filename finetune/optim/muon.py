"""Muon (torch.optim.Muon) for 2-D hidden weights, AdamW for everything else, as the Muon authors recommend.

Muon orthogonalizes each weight matrix's momentum (Newton-Schulz, in bf16), which is defined for 2-D hidden
weights only: embeddings, the LM head (by name, LoRA adapters on them included), norms, biases and any
non-2-D parameter get AdamW with the recipe's betas and eps. Muon's learning rate is adjusted by shape with
`match_rms_adamw` (Moonshot, "Muon is Scalable for LLM Training"), so its updates have AdamW's RMS and the
one `training.learning_rate` and `optimizer.weight_decay` suit both parts; momentum is Muon's 0.95 with
Nesterov. State: one momentum buffer per Muon weight (no step counter); AdamW's two moments and step tensor
for the rest. Layer-wise mode builds one Muon or AdamW per weight, which updates exactly as the hybrid does.
"""

from __future__ import annotations

import torch

from finetune.optim.combined import CombinedOptimizer
from finetune.optim.factories import Factory
from finetune.optim.state_size import StateBytes, adamw_state
from finetune.recipe.schema import OptimizerConfig

_NOT_HIDDEN = ("embed", "lm_head", "wte", "wpe")  # module-name parts of token/position embeddings and heads


def is_hidden_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """Muon's weights: 2-D, outside the embeddings and the LM head."""
    return len(shape) == 2 and not any(part in name for part in _NOT_HIDDEN)


def factory(opt: OptimizerConfig, learning_rate: float) -> Factory:
    """Muon for the group build.py marks "method": "muon", AdamW for the others (one of them if one is empty)."""
    def build(groups: list[dict], seed_offset: int = 0) -> torch.optim.Optimizer:
        hidden = [g for g in groups if g.get("method") == "muon"]
        rest = [g for g in groups if g.get("method") != "muon"]
        parts = []
        if hidden:
            parts.append(torch.optim.Muon(hidden, lr=learning_rate, adjust_lr_fn="match_rms_adamw"))
        if rest:
            parts.append(torch.optim.AdamW(rest, lr=learning_rate, betas=tuple(opt.betas), eps=opt.eps))
        return parts[0] if len(parts) == 1 else CombinedOptimizer(parts)

    return build


def state(shape: tuple[int, ...], itemsize: int, opt: OptimizerConfig, own: bool) -> StateBytes:
    """A Muon weight keeps its momentum buffer; the rest AdamW's state."""
    if own:
        return torch.Size(shape).numel() * itemsize, False
    return adamw_state(shape, itemsize, opt, own)
