"""A test double offload tier: keeps copies in a dict, records every protocol call, can be made full.

`tier_entry` makes its table entry; `register` adds entries to the tier table for one test, so the planner
and `ActivationOffload` see the fake exactly as they see a real tier.
"""

from __future__ import annotations

from dataclasses import replace

import torch

import finetune.recipe.offload_tiers as offload_tiers
from finetune.memory.offload_tier import TierSetup
from finetune.recipe.offload_tiers import TierSpec


def tier_entry(name: str = "fake", **facts) -> TierSpec:
    """A table entry for `RecordingTier`: by default like disk (frees memory everywhere, priced by the disk
    link, bounded by memory.offload_dir's free space) but with no read-ahead and no overhead."""
    base = TierSpec(name, "test double", "offload_fake:RecordingTier", prefetch_layers=0,
                    frees_device_on=("cpu", "cuda"), link="disk", holds_in="offload_dir", overhead=0.0)
    return replace(base, **facts)


def register(monkeypatch, *entries: TierSpec) -> None:
    """Add `entries` to the tier table for the current test."""
    monkeypatch.setattr(offload_tiers, "TIERS", (*offload_tiers.TIERS, *entries))


class FakeCopy:
    """One stored tensor: a clone in a dict of its tier; each call logged as (call, copy id)."""

    def __init__(self, tier: RecordingTier, key: int, tensor: torch.Tensor, nbytes: int):
        self.tier, self.key, self.nbytes = tier, key, nbytes
        tier.held[key] = tensor.detach().clone(memory_format=torch.preserve_format)

    def fetch(self) -> None:
        self.tier.log.append(("fetch", self.key))

    def get(self) -> torch.Tensor:
        self.tier.log.append(("get", self.key))
        return self.tier.held[self.key]  # KeyError after release: a use after the step ended

    def release(self) -> None:
        if self.tier.held.pop(self.key, None) is not None:
            self.tier.held_bytes -= self.nbytes
            self.tier.log.append(("release", self.key))


class RecordingTier:
    """Implements `OffloadTier` in memory; full (store returns None) once `setup.limit` bytes are held."""

    def __init__(self, setup: TierSetup):
        self.limit = setup.limit
        self.held: dict[int, torch.Tensor] = {}
        self.held_bytes = 0
        self.copies: list[FakeCopy] = []
        self.log: list[tuple[str, int | None]] = []

    def store(self, tensor: torch.Tensor, layout: torch.Tensor, nbytes: int) -> FakeCopy | None:
        assert layout.is_meta and layout.shape == tensor.shape and layout.dtype == tensor.dtype
        if self.limit is not None and self.held_bytes + nbytes > self.limit:
            self.log.append(("full", None))
            return None
        copy = FakeCopy(self, len(self.copies), tensor, nbytes)
        self.held_bytes += nbytes
        self.copies.append(copy)
        self.log.append(("store", copy.key))
        return copy

    def drain(self) -> None:
        self.log.append(("drain", None))

    def close(self) -> None:
        for copy in self.copies:
            copy.release()
        self.log.append(("close", None))
