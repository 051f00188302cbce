"""Freeing what a run of the GPU kit left, so no run's memory counts in the next one's peak."""

from __future__ import annotations

import gc

import torch


def release() -> None:
    """Free what the last run left: Python garbage, the allocator's cache and the pinned host buffers
    (offload's staging), so no run's memory counts in the next one's peak."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        empty_host_cache()
        torch.cuda.reset_peak_memory_stats()


def empty_host_cache() -> None:
    """Release the pinned host buffers torch caches (torch.accelerator's call where this torch has it)."""
    (getattr(torch.accelerator, "empty_host_cache", None) or torch._C._host_emptyCache)()
