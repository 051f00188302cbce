"""What this process may use of the GPU now: the one measurement the planner's `gpu_memory: auto` and the
out-of-memory recovery's re-plans both budget with."""

from __future__ import annotations

import torch


def usable_gpu_memory() -> int | None:
    """What this process could use now (None without CUDA): free device memory plus what its own allocator
    holds, but no more than the allocator may hold when a per-process cap is set
    (torch.cuda.set_per_process_memory_fraction: total x fraction, what a smaller GPU is simulated with).
    Budgeting with the whole GPU's free memory under a cap would pick plans that cannot fit."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    usable = free + torch.cuda.memory_reserved()
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda: 1.0)()  # absent in older torch
    return min(usable, int(total * fraction))
