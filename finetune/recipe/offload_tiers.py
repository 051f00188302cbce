"""The offload tier table: one entry per recipe `memory.offload` value, the one list everything else reads.

The schema takes its `memory.offload` values and their description from here; `finetune.memory.offload`
builds each tier (and its spill chain) from the entry's factory; the planner reads which tiers free device
memory, how far ahead they fetch, which measured bandwidth prices them and whose free space bounds them.
This module imports neither torch nor finetune.memory (the schema, at the bottom of the import graph,
imports it): a factory is named as "module:Class" and imported only when a run builds the tier.

How to add an offload tier: append one `TierSpec` to `TIERS` below and write its class, which implements
`finetune.memory.offload_tier.OffloadTier` (store / drain / close; what `store` returns implements
`StoredTensor`: fetch / get / release) and is built from a `TierSetup`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Bandwidths the planner measures once per machine (finetune.memory.bandwidth.transfer_bandwidth) and
# prices a tier's transfers by.
Link = Literal["host_device", "disk"]
# Free space the planner checks a tier's bytes against, and how its rejection names it.
STORES = {"host_ram": "of RAM", "offload_dir": "in memory.offload_dir"}


@dataclass(frozen=True)
class TierSpec:
    """Everything the tool knows about one offload tier."""

    name: str  # the recipe's memory.offload value
    summary: str  # a word or two for the memory.offload description (docs/recipe.md)
    factory: str  # "module:Class": Class(TierSetup) -> an OffloadTier
    prefetch_layers: int  # decoder layers whose tensors backward fetches ahead of need
    frees_device_on: tuple[str, ...]  # training devices (cpu, cuda) whose memory a stored tensor leaves
    link: Link  # the measured bandwidth that prices its transfers (out and back)
    holds_in: str  # a key of STORES: whose free space its bytes must fit in
    overhead: float  # bookkeeping (hooks, copy launches, files) relative to compute, even when hidden
    limit_key: str | None = None  # memory.* key capping the bytes it holds; what exceeds it goes to spill_to
    spill_to: str | None = None  # the next tier of its spill chain
    # Its bytes stay with the host (RAM, or files read back through RAM), so the weights it holds load there, not
    # onto the device: true of RAM and disk; a tier in another device's memory would say False.
    on_host: bool = True

    def frees_device(self, device: str) -> bool:
        """Whether moving a tensor here lowers the training device's peak (on a CPU run RAM is the device)."""
        return device in self.frees_device_on


# Overheads: torchtune measured 0.1% for CPU offload, SSDTrain "negligible"; disk pays for threads and files.
TIERS: tuple[TierSpec, ...] = (
    TierSpec("cpu", "RAM", "finetune.memory.offload_cpu:HostTier", prefetch_layers=1, frees_device_on=("cuda",),
             link="host_device", holds_in="host_ram", overhead=0.01, limit_key="offload_cpu_limit", spill_to="disk"),
    TierSpec("disk", "SSD", "finetune.memory.offload_disk:DiskTier", prefetch_layers=2,
             frees_device_on=("cpu", "cuda"), link="disk", holds_in="offload_dir", overhead=0.03),
)


def tier_names() -> tuple[str, ...]:
    """The `memory.offload` values that name a tier (besides none and auto)."""
    return tuple(spec.name for spec in TIERS)


def tier_spec(name: str) -> TierSpec:
    """The entry for `name`; KeyError names the known tiers."""
    for spec in TIERS:
        if spec.name == name:
            return spec
    raise KeyError(f"unknown offload tier {name!r}; known: {', '.join(tier_names())}")


def on_host(name: str) -> bool:
    """Whether a memory.offload* value keeps its bytes on the host (a tier whose entry says so; none keeps them
    on the training device), so the weights it holds load there, not onto the device."""
    return name in tier_names() and tier_spec(name).on_host


def chain_names(name: str, limits: dict[str, int]) -> list[str]:
    """The tiers a run offloading to `name` uses, in order: a tier with a limit spills to its `spill_to`.

    `limits`: bytes per tier name (from each tier's `limit_key`); a tier without one is never full.
    """
    names = [name]
    spec = tier_spec(name)
    while spec.spill_to is not None and limits.get(spec.name) is not None:
        spec = tier_spec(spec.spill_to)
        if spec.name in names:
            raise ValueError(f"offload tier {spec.name!r} spills back into its own chain {names}")
        names.append(spec.name)
    return names


def offload_description() -> str:
    """The memory.offload field description, listing the tiers."""
    tiers = ", ".join(f"{spec.name} ({spec.summary})" for spec in TIERS)
    return f"Where saved activations go during forward: none, {tiers}, auto: planner."
