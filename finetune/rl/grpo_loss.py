"""The GRPO family's loss and advantages, as TRL 1.16 computes them (trl/trainer/grpo_trainer.py).

Advantages (`group_advantages`, TRL's `_generate_and_score_completions`, multi_objective_aggregation
"sum_then_normalize"): the rewards of the `group_size` completions of one prompt, minus their group mean, divided
by the group's standard deviation (`scale="group"`), the whole batch's (`"batch"`), or not at all (`"none"`),
plus 1e-4. Completions are laid out group after group (prompt 0's completions, then prompt 1's, ...); a NaN
reward (no reward function could score it) is left out of the statistics and gets advantage 0.

More in docs/rl.md, "In the code: finetune/rl/grpo_loss.py".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
Scale = Literal["group", "batch", "none"]
STD_EPS = 1e-4  # TRL's: a group whose rewards are all equal gets advantages 0, not a division by zero


def group_advantages(rewards: torch.Tensor, group_size: int, scale: Scale = "group") -> torch.Tensor:
    """Each completion's advantage over its prompt's group (see the module docstring); `rewards` is 1-D."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} are not whole groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
    advantages = rewards - mean
    if scale == "group":
        std = _nanstd(grouped, dim=1).repeat_interleave(group_size) if group_size > 1 else torch.zeros_like(rewards)
        advantages = advantages / (std + STD_EPS)
    elif scale == "batch":
        std = _nanstd(rewards) if rewards.numel() > 1 else torch.zeros(())
        advantages = advantages / (std + STD_EPS)
    elif scale != "none":
        raise ValueError(f"scale must be group, batch or none, not {scale!r}")
    return torch.nan_to_num(advantages, nan=0.0)


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sample standard deviation ignoring NaNs (Bessel-corrected, as torch.std and TRL's nanstd)."""
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    count = (~torch.isnan(x)).sum(dim=dim) if dim is not None else (~torch.isnan(x)).sum()
    return (torch.nansum((x - mean) ** 2, dim=dim) / (count - 1)).sqrt()


@dataclass(frozen=True)
class LossResult:
    """The loss to backpropagate and what a run logs about it (masked token means)."""

    loss: torch.Tensor
    kl: float | None  # mean k3 KL to the reference; None when beta is 0
    clip_ratio: float  # fraction of tokens whose ratio was clipped on the side that matters for its advantage


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor,
              mask: torch.Tensor, *, loss_type: LossType = "grpo", epsilon_low: float = 0.2,
              epsilon_high: float | None = None, beta: float = 0.0, ref_logps: torch.Tensor | None = None,
              max_completion_length: int | None = None, window_tokens: float | None = None,
              accumulation: int = 1, kl_correction: bool = True) -> LossResult:
    """One micro-batch's GRPO-family loss from per-token log-probs (completions x tokens, padded; `mask` 1 on
    completion tokens). `old_logps` None means this is the first pass (ratio 1, as TRL). `advantages` is one
    per completion. dr_grpo needs `max_completion_length`; dapo takes `window_tokens` (default: this batch's)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, not {loss_type!r}")
    if beta and ref_logps is None:
        raise ValueError("beta > 0 needs the reference model's log-probs (ref_logps)")
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    high = epsilon_low if epsilon_high is None else epsilon_high
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        if kl_correction:
            kl = kl * ratio
        per_token = per_token + beta * kl
    masked = per_token * mask
    if loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0) / accumulation
    elif loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type dr_grpo divides by max_completion_length; give it")
        loss = masked.sum() / (per_token.size(0) * max_completion_length) / accumulation
    else:
        tokens = mask.sum() if window_tokens is None else torch.as_tensor(window_tokens, dtype=logps.dtype)
        loss = masked.sum() / tokens.clamp(min=1.0)
    region = ((ratio < 1 - epsilon_low) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
    return LossResult(loss, None if kl is None else _masked_mean(kl, mask), _masked_mean(region.to(mask.dtype), mask))


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    mean = (x.detach() * mask).sum() / mask.sum().clamp(min=1.0)
    return math.nan if mean.is_meta else float(mean)  # the planner's trace runs the loss on `meta` tensors
