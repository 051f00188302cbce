"""What an activation offload tier is (`OffloadTier`, `StoredTensor`) and the spill chain that strings tiers.

`ActivationOffload` talks to one `SpillChain` only: each saved tensor goes to the first tier that takes it
(a tier that is full returns None from `store` and the next one gets it), and every tier of the chain is
drained at the end of each step and closed at the end of training. The tiers themselves, and which one
spills into which, come from the table in `finetune.recipe.offload_tiers`.

Lifecycle of one step: `store` in forward; `fetch` (read-ahead), `get` and `release` of each copy in
backward; `drain` once every copy of the step is released (so a tier ends each step holding nothing);
`close` after the last step, which releases whatever is still held.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from finetune.recipe.offload_tiers import chain_names, tier_spec
from finetune.recipe.reference import resolve

if TYPE_CHECKING:
    import torch


class Mover(Protocol):
    """Asynchronous copies between the training device and host memory.

    An event is whatever the mover uses to mark the end of an enqueued copy (None: already done).
    """

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A new uint8 host buffer (page-locked on CUDA) of `nbytes`."""

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        """Enqueue src -> dst after the work already queued on the compute stream; src stays valid until done."""

    def to_device(self, src: torch.Tensor, after: Any) -> tuple[torch.Tensor, Any]:
        """Enqueue a copy of host `src` into a new device tensor of the same layout, once `after` is done."""

    def ready(self, tensor: torch.Tensor, event: Any) -> torch.Tensor:
        """Make the compute stream wait for `event` (no host sync) and hand `tensor` to it."""

    def wait_host(self, event: Any) -> None:
        """Block the calling thread until `event` is done (only before a host buffer is reused)."""


@runtime_checkable
class StoredTensor(Protocol):
    """One offloaded tensor, as a tier holds it."""

    def fetch(self) -> None:
        """Start bringing it back to the device (read-ahead); a no-op when already under way or released."""

    def get(self) -> torch.Tensor:
        """The tensor on the training device, with the layout it was stored with (waits for `fetch`)."""

    def release(self) -> None:
        """Drop it (idempotent): the tier frees its bytes; `get` afterwards raises."""


@runtime_checkable
class OffloadTier(Protocol):
    """Somewhere saved activations wait between forward and backward (RAM, disk, ...)."""

    def store(self, tensor: torch.Tensor, layout: torch.Tensor, nbytes: int) -> StoredTensor | None:
        """Take a copy of `tensor` (dense, `layout`'s dtype, shape and strides: a meta tensor), or None when
        full: the chain then hands it to the next tier. `tensor` may be reused once backward runs."""

    def drain(self) -> None:
        """Wait for background work; delete what released copies left (files, buffers in flight). Mid-step it
        only waits; at the end of a step, once every copy is released, the tier holds nothing."""

    def close(self) -> None:
        """End of training: release every copy still held, drain, stop background threads."""


@dataclass(frozen=True)
class TierSetup:
    """What a tier class is built from (its table entry names the class)."""

    mover: Mover | None  # device <-> host copies; None when training on the CPU
    directory: Path | None  # memory.offload_dir (resolved default); None when no file may be written
    limit: int | None  # bytes it may hold (its table entry's limit_key); None: no limit


class SpillChain:
    """Tiers in order: a tensor goes to the first one with room; drained and closed together."""

    def __init__(self, tiers: list[tuple[str, OffloadTier]]):
        if not tiers:
            raise ValueError("a spill chain needs at least one tier")
        self.tiers = tiers
        self.stored_bytes = dict.fromkeys((name for name, _ in tiers), 0)  # since creation, per tier

    def tier(self, name: str) -> OffloadTier:
        """The chain's tier called `name`."""
        for tier_name, tier in self.tiers:
            if tier_name == name:
                return tier
        raise KeyError(f"no offload tier {name!r} in this chain ({', '.join(n for n, _ in self.tiers)})")

    @property
    def spilled_bytes(self) -> int:
        """Bytes stored past the first tier (it was full)."""
        return sum(self.stored_bytes.values()) - self.stored_bytes[self.tiers[0][0]]

    def store(self, tensor: torch.Tensor, layout: torch.Tensor, nbytes: int) -> StoredTensor | None:
        """The first tier's copy that takes it; None when every tier is full (the tensor stays on the device)."""
        for name, tier in self.tiers:
            item = tier.store(tensor, layout, nbytes)
            if item is not None:
                self.stored_bytes[name] += nbytes
                return item
        return None

    def drain(self) -> None:
        self._each(lambda tier: tier.drain)

    def close(self) -> None:
        self._each(lambda tier: tier.close)

    def _each(self, method: Callable[[OffloadTier], Callable[[], None]]) -> None:
        """Call it on every tier, also after one raised (no tier keeps files because another failed);
        the first error is raised at the end."""
        errors = []
        for _name, tier in self.tiers:
            try:
                method(tier)()
            except BaseException as exc:  # Ctrl-C included: the other tiers still clean up
                errors.append(exc)
        if errors:
            raise errors[0]


def build_chain(name: str, mover: Mover | None, directory: Path | None,
                limits: Mapping[str, int] | None = None) -> SpillChain:
    """The spill chain a run offloading to tier `name` uses, each tier built by its table entry's factory."""
    limits = dict(limits or {})
    tiers: list[tuple[str, OffloadTier]] = []
    try:
        for tier_name in chain_names(name, limits):
            factory = resolve(tier_spec(tier_name).factory)
            tiers.append((tier_name, factory(TierSetup(mover, directory, limits.get(tier_name)))))
    except BaseException:
        if tiers:  # stop the threads of the tiers already built
            SpillChain(tiers).close()
        raise
    return SpillChain(tiers)
