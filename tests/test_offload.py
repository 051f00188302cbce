"""Activation offload gives bit-identical fp32 gradients: every tier, with and without checkpointing,
for full fine-tuning, LoRA and QLoRA."""

from __future__ import annotations

import pytest
import torch
from test_offload_support import BATCH, LAYERS, SEQ, load, make_model_dir, step

from finetune.memory.bandwidth import offload_bytes_per_step
from finetune.memory.offload import ActivationOffload

model_dir = pytest.fixture(scope="module")(make_model_dir)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
@pytest.mark.parametrize("adapter", ["full", "lora", "qlora"])
def test_gradients_bit_identical(model_dir, tmp_path, adapter, checkpointing):
    model = load(model_dir, adapter, checkpointing)
    reference = step(model)
    # Gradients reach every layer (LoRA: B matrices; A gets none while B is still zero).
    assert sum(bool(g.any()) for g in reference) >= len(reference) // 2
    tiers = {
        "cpu": dict(tier="cpu"),
        "disk": dict(tier="disk", offload_dir=tmp_path / "disk"),
        "cpu-spilling-to-disk": dict(tier="cpu", limits={"cpu": 4096}, offload_dir=tmp_path / "spill"),
    }
    for name, kwargs in tiers.items():
        offload = ActivationOffload(model, min_size=1024, **kwargs)
        try:
            grads = step(model, offload)
            assert offload.stats["offloaded_tensors"] > 0, name
            if name == "cpu-spilling-to-disk":
                assert offload.stats["spilled_bytes"] > 0
        finally:
            offload.close()
        assert len(grads) == len(reference)
        for got, want in zip(grads, reference, strict=True):
            assert torch.equal(got, want), f"{name}: gradients differ"


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_checkpointing_offloads_exactly_the_layer_inputs(model_dir, tmp_path, adapter):
    """With checkpointing only layer inputs leave (not the last layer's; not layer 0's under LoRA, a leaf);
    `offload_bytes_per_step`, the planner's formula, predicts the bytes exactly."""
    model = load(model_dir, adapter, checkpointing=True)
    offload = ActivationOffload(model, "disk", min_size=1024, offload_dir=tmp_path)
    step(model, offload)
    offload.close()
    frozen = adapter == "lora"
    assert offload.stats["offloaded_tensors"] == LAYERS - 1 - frozen
    hidden = model.config.hidden_size
    assert offload.stats["offloaded_bytes"] == offload_bytes_per_step(
        LAYERS, hidden, BATCH, SEQ, dtype_bytes=4, min_size=1024, checkpoint_every_n_layers=1,
        frozen_embeddings=frozen)
    assert offload_bytes_per_step(LAYERS, hidden, BATCH, SEQ, 4, min_size=10**9, checkpoint_every_n_layers=1) == 0
