"""Offloaded bytes really leave memory: counted with a live-storage counter on CPU (disk tier)."""

from __future__ import annotations

import gc

import pytest
from test_offload_support import LiveBytes, batch, load, make_model_dir, step

from finetune.memory.offload import ActivationOffload

model_dir = pytest.fixture(scope="module")(make_model_dir)


def live_after_forward(model, offload: ActivationOffload | None, tmp_path) -> int:
    """Bytes live once the loss exists (all disk writes finished), then finish the step."""
    with LiveBytes(model) as live:
        if offload is None:
            loss = model(**batch()).loss
        else:
            offload.__enter__()
            loss = model(**batch()).loss
            offload.chain.tier("disk").drain()  # a tensor being written is still held by its writer
        gc.collect()
        at_loss = live.current
        loss.backward()
        if offload is not None:
            offload.__exit__(None, None, None)
    return at_loss


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
    with LiveBytes(model) as plain:
        step(model)
    offload = ActivationOffload(model, "disk", min_size=1024, offload_dir=tmp_path)
    with LiveBytes(model) as offloaded:
        step(model, offload)
    offload.close()
    assert offloaded.peak <= plain.peak
    if not checkpointing:
        layers_offloaded = len({i for i in range(offload.num_layers - 1)})
        assert plain.peak - offloaded.peak >= offload.stats["offloaded_bytes"] / layers_offloaded
