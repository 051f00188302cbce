"""The CUDA path's logic on CPU: the tiers drive a `Mover`; here a fake one plays the side stream.

`ThreadMover` runs every copy on one worker thread in submission order (a stream), after a short delay so
that copies really are in flight when the compute thread moves on; events are `threading.Event`s. The
compute thread only ever blocks in `ready` (where a tensor is needed) or on a buffer still being copied.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_offload_support import LAYERS, batch, load, make_model_dir, step

from finetune.memory.offload import ActivationOffload
from finetune.memory.offload_cpu import HostPool, bucket

model_dir = pytest.fixture(scope="module")(make_model_dir)


class ThreadMover:
    """A fake device: copies on a worker thread (the side stream), a log of what the compute thread did."""

    def __init__(self, delay: float = 0.002):
        self.delay = delay
        self.stream = ThreadPoolExecutor(1, thread_name_prefix="fake-stream")
        self.log: list[tuple[str, int]] = []
        self.buffers = 0
        self.blocked_in_forward = 0
        self.forward = True
        self._origin: dict[int, int] = {}  # device copy -> host buffer it came from

    def _enqueue(self, copy, after=None) -> threading.Event:
        done = threading.Event()

        def run():
            if after is not None:
                after.wait()
            time.sleep(self.delay)
            copy()
            done.set()
        self.stream.submit(run)
        return done

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        self.buffers += 1
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8)  # garbage if a copy were skipped

    def to_host(self, src, dst):
        return self._enqueue(lambda: dst.copy_(src))

    def to_device(self, src, after):
        dst = torch.full_like(src, float("nan")) if src.is_floating_point() else torch.empty_like(src)
        event = self._enqueue(lambda: dst.copy_(src), after)
        self.log.append(("h2d", src.untyped_storage().data_ptr()))
        self._origin[dst.untyped_storage().data_ptr()] = src.untyped_storage().data_ptr()
        return dst, event

    def ready(self, tensor, event):
        self.log.append(("ready", self._origin.get(tensor.untyped_storage().data_ptr(), 0)))
        event.wait()
        return tensor

    def wait_host(self, event):
        compute_thread = threading.current_thread() is threading.main_thread()
        if event is not None and not event.is_set() and self.forward and compute_thread:
            self.blocked_in_forward += 1
        if event is not None:
            event.wait()


def run_step(model, offload, mover) -> list[torch.Tensor]:
    """One step; the mover learns when backward starts (the LM head's gradient is computed first)."""
    mover.forward = True

    def backward_starts(module, grad_output):
        mover.forward = False
    hook = model.get_output_embeddings().register_full_backward_pre_hook(backward_starts)
    try:
        return step(model, offload)
    finally:
        hook.remove()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_mover_path_exact_and_prefetched(model_dir, tmp_path, tier, checkpointing):
    model = load(model_dir, "full", checkpointing)
    reference = step(model)
    mover = ThreadMover()
    offload = ActivationOffload(model, tier, min_size=1024, offload_dir=tmp_path, mover=mover)
    try:
        grads = run_step(model, offload, mover)
        assert all(torch.equal(g, r) for g, r in zip(grads, reference, strict=True))
        buffers_after_first_step = mover.buffers
        mover.log.clear()
        for _ in range(2):
            grads = run_step(model, offload, mover)
            assert all(torch.equal(g, r) for g, r in zip(grads, reference, strict=True))
    finally:
        offload.close()
        mover.stream.shutdown()
    # The pinned pool is reused from step to step instead of growing: exactly for the RAM tier (each copy
    # holds its buffer for the step); for the disk tier a tensor holds at most a staging buffer and a read
    # buffer at a time, so reuse keeps three steps within one step's worst case (no reuse: 6 per tensor).
    per_step = offload.stats["offloaded_tensors"] / 3
    if tier == "cpu":
        assert mover.buffers == buffers_after_first_step
    else:
        assert mover.buffers <= 2 * per_step
    # Forward never waits for a copy: out-copies are fire-and-forget (the disk tier's bounded queue aside).
    assert mover.blocked_in_forward == 0
    if tier == "cpu" and checkpointing:
        # One input per offloaded layer (layer L-1 stays): copy-backs are issued a layer ahead of use.
        log = [kind for kind, _ in mover.log[: len(mover.log) // 2]]
        assert LAYERS == 4 and log == ["h2d", "h2d", "ready", "h2d", "ready", "ready"]
    else:
        # Copies back are issued before the compute thread asks for them, and only a layer ahead: never more
        # outstanding than two layers' worth (a tensor shared by all layers, like rotary cos/sin, included).
        issued = used = 0
        for kind, _ in mover.log:
            issued += kind == "h2d"
            used += kind == "ready"
            assert used <= issued


def test_pool_size_classes_survive_changing_sequence_lengths():
    for n in (1, 4096, 4097, 10**6, 123_456_789):
        assert n <= bucket(n) <= max(4096, n * 1.125)
    mover = ThreadMover()
    pool = HostPool(mover)
    for _ in range(3):  # batches of slightly different lengths share one size class
        held = [pool.acquire(n) for n in (1_000_000, 1_010_000, 990_000)]
        assert all(b.numel() >= 1_010_000 for b in held)
        for b in held:
            pool.release(b)
    assert mover.buffers == 3
    small = pool.acquire(5000)
    pool.release(small)
    # Idle buffers never exceed the most bytes ever in use at once.
    assert pool.idle <= pool.peak_in_use
    mover.stream.shutdown()


def test_read_ahead_stays_within_prefetch_layers(model_dir, tmp_path):
    """Whenever backward uses a tensor of layer l, copies back were issued only for layers >= l - 1
    (prefetch_layers = 1 for the RAM tier), also with rotary cos/sin shared by every layer."""
    model = load(model_dir, "full", checkpointing=False)
    mover = ThreadMover()
    offload = ActivationOffload(model, "cpu", min_size=1024, mover=mover)
    layers_of: dict[int, set[int]] = {}  # host buffer -> the layers that saved it
    with offload:
        loss = model(**batch()).loss
        for layer, refs in offload._by_layer.items():
            for ref in refs:
                layers_of.setdefault(ref().item.buffer.data_ptr(), set()).add(layer)
        loss.backward()
    offload.close()
    mover.stream.shutdown()
    assert offload.prefetch_layers == 1
    assert any(len(layers) == LAYERS - 1 for layers in layers_of.values())  # cos/sin: in every offloaded layer
    lowest_issued = LAYERS
    for kind, ptr in mover.log:
        if kind == "h2d":  # a shared tensor is fetched for the highest layer that saved it
            lowest_issued = min(lowest_issued, max(layers_of[ptr]))
        elif len(layers_of[ptr]) == 1:
            assert lowest_issued >= min(layers_of[ptr]) - offload.prefetch_layers
