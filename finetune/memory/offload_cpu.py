"""The RAM tier of activation offload: device <-> host copies that never stall the compute stream.

All device-specific work goes through a `Mover` (streams, events, pinned buffers). `CudaMover` is the real
one; tests drive the same tier logic with a thread-backed mover on CPU. On a CPU-only run the tensors already
live in RAM, so the tier keeps them as they are (it still counts them for `offload_cpu_limit`).
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from typing import Any

import torch

from finetune.memory.offload_tier import Mover, TierSetup

STEP_ENDED = ("activation offload: a saved tensor was used after its offload step ended; "
              "run backward inside the `with activation_offload(...)` block")


class CudaMover:
    """Copies on two side streams (one per direction) ordered with CUDA events."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> torch.cuda.Event:
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)
        # The caching allocator must not hand src's memory out again before the copy has read it.
        src.record_stream(self.d2h)
        event = torch.cuda.Event()
        event.record(self.d2h)
        return event

    def to_device(self, src: torch.Tensor, after: Any) -> tuple[torch.Tensor, torch.cuda.Event]:
        if after is not None:
            self.h2d.wait_event(after)
        with torch.cuda.stream(self.h2d):
            dst = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device=self.device)
            dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.h2d)
        return dst, event

    def ready(self, tensor: torch.Tensor, event: Any) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(event)
        # Allocated on the side stream, used and freed on the compute stream.
        tensor.record_stream(compute)
        return tensor

    def wait_host(self, event: Any) -> None:
        if event is not None:
            event.synchronize()


def host_view(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`buffer`'s bytes seen as a tensor with `like`'s dtype, shape and strides (offset 0)."""
    return torch.empty(0, dtype=like.dtype).set_(buffer.untyped_storage(), 0, like.shape, like.stride())


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a dense tensor that starts its storage, as uint8 (bf16 and bool included, which numpy
    cannot hold); a pooled buffer may be longer than the tensor, so the length comes from the tensor."""
    nbytes = tensor.numel() * tensor.element_size()
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage(), 0, (nbytes,), (1,))


def bucket(nbytes: int) -> int:
    """Pool size class: rounded up to 1/8 of a power of two (at most 12.5% unused), so that sequence
    lengths that change from batch to batch still reuse buffers."""
    if nbytes <= 4096:
        return 4096
    step = 1 << max(0, nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


class HostPool:
    """Reusable host buffers by size class (page-locked ones are slow to allocate).

    A released buffer remembers the last copy that touched it; it is waited for only when handed out again.
    Idle buffers are kept up to the most bytes ever in use at once, so the pool cannot grow without bound.
    """

    def __init__(self, mover: Mover):
        self.mover = mover
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocated = 0  # buffers ever created: stays flat across steps once the pool is warm
        self.in_use = self.peak_in_use = self.idle = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        size = bucket(nbytes)
        with self._lock:
            free = self._free[size]
            entry = free.pop() if free else None
            if entry is None:
                self.allocated += 1
            else:
                self.idle -= size
            self.in_use += size
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        if entry is None:
            return self.mover.host_buffer(size)
        buffer, event = entry
        self.mover.wait_host(event)
        return buffer

    def release(self, buffer: torch.Tensor, event: Any = None) -> None:
        size = buffer.numel()
        with self._lock:
            self.in_use -= size
            if self.idle + size <= self.peak_in_use:
                self._free[size].append((buffer, event))
                self.idle += size


class DeviceCopy:
    """The device-side copy of a host tensor: started ahead of need, shared by all views unpacked from it
    while any of them lives, made again only if needed again afterwards (a second backward)."""

    def __init__(self, mover: Mover):
        self.mover = mover
        self.event: Any = None  # the last copy reading the host buffer
        self._pending: tuple[torch.Tensor, Any] | None = None
        self._storage: weakref.ref | None = None

    def _alive(self) -> torch.UntypedStorage | None:
        return self._storage() if self._storage is not None else None

    def start(self, host: torch.Tensor, after: Any = None) -> None:
        if self._pending is None and self._alive() is None:
            self._pending = self.mover.to_device(host, after)
            self.event = self._pending[1]

    def get(self, host: torch.Tensor, after: Any = None) -> torch.Tensor:
        storage = self._alive()
        if storage is not None:
            return torch.empty(0, dtype=host.dtype, device=storage.device).set_(
                storage, 0, host.shape, host.stride())
        self.start(host, after)
        tensor, event = self._pending
        self._pending = None  # the handle keeps no device memory once autograd has the tensor
        tensor = self.mover.ready(tensor, event)
        self._storage = weakref.ref(tensor.untyped_storage())
        return tensor


class HostCopy:
    """One activation held in host memory: copied out at pack time, copied back (prefetched) in backward."""

    def __init__(self, tier: HostTier, tensor: torch.Tensor, layout: torch.Tensor, nbytes: int):
        self.tier = tier
        self.nbytes = nbytes
        mover = tier.mover
        if mover is None:  # the device is the host: keep the tensor itself
            self.buffer = None
            self.host = tensor
            return
        self.buffer = tier.pool.acquire(nbytes)
        self.host = host_view(self.buffer, layout)
        self._stored_event = mover.to_host(tensor, self.host)
        self.device = DeviceCopy(mover)

    def fetch(self) -> None:
        """Start the copy back to the device (no-op when already started or on a CPU run)."""
        if self.buffer is not None:
            self.device.start(self.host, self._stored_event)

    def get(self) -> torch.Tensor:
        if self.host is None:
            raise RuntimeError(STEP_ENDED)
        if self.buffer is None:
            return self.host
        return self.device.get(self.host, self._stored_event)

    def release(self) -> None:
        if self.host is None:
            return
        self.host = None
        self.tier.give_back(self)
        if self.buffer is not None:
            self.tier.pool.release(self.buffer, self.device.event or self._stored_event)
            self.buffer = None


class HostTier:
    """The `cpu` offload tier (an `OffloadTier`): holds offloaded activations in RAM up to `setup.limit`
    bytes; `store` returns None once the limit is hit, so the spill chain hands the tensor on."""

    def __init__(self, setup: TierSetup):
        self.mover: Mover | None = setup.mover
        self.pool = HostPool(self.mover) if self.mover is not None else None
        self.limit = setup.limit
        self.held = 0
        self._live: set[HostCopy] = set()
        self._lock = threading.Lock()

    def store(self, tensor: torch.Tensor, layout: torch.Tensor, nbytes: int) -> HostCopy | None:
        with self._lock:
            if self.limit is not None and self.held + nbytes > self.limit:
                return None
            self.held += nbytes
        try:
            copy = HostCopy(self, tensor, layout, nbytes)
        except BaseException:
            with self._lock:
                self.held -= nbytes
            raise
        with self._lock:
            self._live.add(copy)
        return copy

    def give_back(self, copy: HostCopy) -> None:
        with self._lock:
            self.held -= copy.nbytes
            self._live.discard(copy)

    def drain(self) -> None:
        """Nothing to wait for: a released copy has handed its buffer back, ordered by the copy's event."""

    def close(self) -> None:
        """End of training: release the copies still held (nothing runs in the background)."""
        with self._lock:
            live = list(self._live)
        for copy in live:
            copy.release()
