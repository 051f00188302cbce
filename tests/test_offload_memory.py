"""Offloaded bytes really leave memory: counted by the tensor-level tracker on CPU (disk tier)."""

from __future__ import annotations

import gc
import time

import pytest
from test_offload_support import batch, files, load, make_model_dir, step

from finetune.memory.offload import ActivationOffload
from finetune.memory.tracker import MemoryTracker

model_dir = pytest.fixture(scope="module")(make_model_dir)


def live_after_forward(model, offload: ActivationOffload | None, tmp_path) -> int:
    """Bytes live once the loss exists (all disk writes finished), then finish the step."""
    live = tracked(model)
    with live:
        if offload is None:
            loss = model(**batch()).loss
        else:
            offload.__enter__()
            loss = model(**batch()).loss
            deadline = time.monotonic() + 10
            while len(files(tmp_path)) < offload.stats["offloaded_tensors"] and time.monotonic() < deadline:
                time.sleep(0.01)
        gc.collect()
        at_loss = live.current
        loss.backward()
        if offload is not None:
            offload.__exit__(None, None, None)
    live.remove_hooks()
    return at_loss


def tracked(model) -> MemoryTracker:
    tracker = MemoryTracker()
    tracker.register_model(model)
    return tracker


def peak_of_step(model, offload: ActivationOffload | None = None) -> int:
    tracker = tracked(model)
    with tracker:
        step(model, offload)
    tracker.remove_hooks()
    return tracker.peak


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_offloaded_bytes_leave_memory(model_dir, tmp_path, checkpointing):
    """Once the loss exists, live bytes are lower by exactly the bytes written to disk.

    min_size 4 KiB leaves out the 2 KiB rotary cos/sin: every layer saves them, the last layer keeps them on
    the device, so offloading the copy of the lower layers frees nothing (it is correct, only not counted)."""
    model = load(model_dir, "lora", checkpointing)
    plain = live_after_forward(model, None, tmp_path)
    offload = ActivationOffload(model, "disk", min_size=4096, offload_dir=tmp_path)
    offloaded = live_after_forward(model, offload, tmp_path)
    offload.close()
    moved = offload.stats["offloaded_bytes"]
    assert moved > 0
    assert plain - offloaded == moved


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_peak_live_bytes_never_rise_and_fall_without_checkpointing(model_dir, tmp_path, checkpointing):
    """Without checkpointing the saved activations make the peak, and it falls by at least one layer's worth
    (read-ahead brings back at most prefetch_layers + 1 layers). With checkpointing on this toy model the peak
    sits in the backward of the first layers, where nothing is offloaded any more; it must not rise."""
    model = load(model_dir, "lora", checkpointing)
    plain = peak_of_step(model)
    offload = ActivationOffload(model, "disk", min_size=1024, offload_dir=tmp_path)
    offloaded = peak_of_step(model, offload)
    offload.close()
    assert offloaded <= plain
    if not checkpointing:
        assert plain - offloaded >= offload.stats["offloaded_bytes"] / (offload.num_layers - 1)
