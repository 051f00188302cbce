"""Activation offload on CPU: exact gradients, files that come and go, clean-up on every exit, preflight."""

from __future__ import annotations

import os
import time
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from finetune.errors import FinetuneError
from finetune.memory.bandwidth import offload_bytes_per_step
from finetune.memory.offload import ActivationOffload, activation_offload, check_offload_dir, offload_dir_for
from finetune.recipe.schema import MemoryConfig

LAYERS, BATCH, SEQ = 4, 2, 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from finetune.testing import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("offload-llama"), num_hidden_layers=LAYERS)


def load(model_dir: Path, adapter: str = "full", checkpointing: bool = False) -> torch.nn.Module:
    """The tiny model for full fine-tuning, LoRA, or QLoRA (NF4 base, 4-bit repack disabled)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = None
    if adapter == "qlora":
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=quant)
    if adapter in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        from finetune.model.load import disable_cpu_4bit_repack

        disable_cpu_4bit_repack(model)
        model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear"))
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(4, 300, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def step(model: torch.nn.Module, offload: ActivationOffload | None = None) -> list[torch.Tensor]:
    """One forward + backward (inside the offload context when given); returns the trainable grads."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # same dropout masks in every run
    if offload is None:
        model(**batch()).loss.backward()
    else:
        with offload:
            model(**batch()).loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
@pytest.mark.parametrize("adapter", ["full", "lora", "qlora"])
def test_gradients_bit_identical(model_dir, tmp_path, adapter, checkpointing):
    model = load(model_dir, adapter, checkpointing)
    reference = step(model)
    tiers = {
        "cpu": dict(tier="cpu"),
        "disk": dict(tier="disk", offload_dir=tmp_path / "disk"),
        "cpu-spilling-to-disk": dict(tier="cpu", cpu_limit=4096, offload_dir=tmp_path / "spill"),
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


def test_checkpointing_offloads_exactly_the_layer_inputs(model_dir, tmp_path):
    """With checkpointing only the inputs of layers 0..L-2 leave; the predicted byte count matches."""
    model = load(model_dir, "full", checkpointing=True)
    offload = ActivationOffload(model, "disk", min_size=1024, offload_dir=tmp_path)
    step(model, offload)
    offload.close()
    assert offload.stats["offloaded_tensors"] == LAYERS - 1
    hidden = model.config.hidden_size
    assert offload.stats["offloaded_bytes"] == offload_bytes_per_step(
        LAYERS, hidden, BATCH, SEQ, dtype_bytes=4, min_size=1024, checkpoint_every_n_layers=1)
    assert offload_bytes_per_step(LAYERS, hidden, BATCH, SEQ, 4, min_size=10**9, checkpoint_every_n_layers=1) == 0


def _files(path: Path) -> list[str]:
    return sorted(os.listdir(path)) if path.exists() else []


def _watch_backward(model, offload_dir: Path, seen: list[int]) -> list:
    """Record the file count whenever backward reaches a decoder layer's output (last layer first)."""
    from finetune.memory.offload import decoder_layers

    def forward_hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.register_hook(lambda grad: seen.append(len(_files(offload_dir))))
    return [layer.register_forward_hook(forward_hook) for layer in decoder_layers(model)]


def test_disk_tier_writes_during_forward_and_deletes_as_it_reads(model_dir, tmp_path):
    model = load(model_dir, "lora", checkpointing=False)
    offload = ActivationOffload(model, "disk", min_size=1024, offload_dir=tmp_path)
    counts: list[int] = []
    hooks = _watch_backward(model, tmp_path, counts)
    try:
        with offload:
            loss = model(**batch()).loss
            deadline = time.monotonic() + 10
            while len(_files(tmp_path)) < offload.stats["offloaded_tensors"] and time.monotonic() < deadline:
                time.sleep(0.01)  # writes are asynchronous
            written = len(_files(tmp_path))
            assert written == offload.stats["offloaded_tensors"] > 0
            assert all(name.endswith(".bin") for name in _files(tmp_path))
            loss.backward()
            assert _files(tmp_path) == []
    finally:
        for hook in hooks:
            hook.remove()
        offload.close()
    assert offload.disk.bytes_read == offload.disk.bytes_written == offload.stats["offloaded_bytes"]
    # Backward reaches layer outputs last to first: files are still there when it starts (read ahead only a
    # couple of layers) and disappear as layers are done.
    assert len(counts) == LAYERS and counts[0] > 0
    assert counts == sorted(counts, reverse=True)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_disk_files_removed_when_backward_fails(model_dir, tmp_path, error):
    model = load(model_dir, "full", checkpointing=True)
    offload = ActivationOffload(model, "disk", min_size=1024, offload_dir=tmp_path)
    from finetune.memory.offload import decoder_layers

    def fail(grad):
        raise error("stop mid-backward")

    def explode(module, args, output):
        (output[0] if isinstance(output, tuple) else output).register_hook(fail)
    hook = decoder_layers(model)[1].register_forward_hook(explode)
    try:
        with pytest.raises(error, match="mid-backward"):
            with offload:
                loss = model(**batch()).loss
                assert offload.stats["offloaded_tensors"] == LAYERS - 1
                loss.backward()
        assert _files(tmp_path) == []
    finally:
        hook.remove()
        offload.close()


def test_disk_files_removed_when_backward_never_runs(model_dir, tmp_path):
    model = load(model_dir, "full", checkpointing=False)
    offload = ActivationOffload(model, "disk", min_size=1024, offload_dir=tmp_path)
    with offload:
        loss = model(**batch()).loss
    assert offload.stats["offloaded_tensors"] > 0
    assert _files(tmp_path) == []
    with pytest.raises(RuntimeError, match="after its offload step ended"):
        loss.backward()
    offload.close()


def test_retain_graph_backward_twice(model_dir, tmp_path):
    model = load(model_dir, "full", checkpointing=False)
    model.zero_grad()
    loss = model(**batch()).loss
    loss.backward(retain_graph=True)
    loss.backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    offload = ActivationOffload(model, "disk", min_size=1024, offload_dir=tmp_path)
    with offload:
        loss = model(**batch()).loss
        loss.backward(retain_graph=True)
        loss.backward()
    offload.close()
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), reference, strict=True))
    assert _files(tmp_path) == []


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages that ops return while active (not the model's), and the peak."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.current = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}
        self._model = {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._refs and key not in self._model and storage.nbytes():
                    nbytes = storage.nbytes()
                    self._refs[key] = weakref.ref(storage, lambda _r, k=key, n=nbytes: self._free(k, n))
                    self.current += nbytes
                    self.peak = max(self.peak, self.current)
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self._refs.pop(key, None)
        self.current -= nbytes


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_disk_tier_lowers_peak_live_bytes(model_dir, tmp_path, checkpointing):
    """Offloaded bytes leave memory: the peak falls by what was offloaded, less the read-ahead window."""
    model = load(model_dir, "full", checkpointing)
    with LiveBytes(model) as plain:
        step(model)
    offload = ActivationOffload(model, "disk", min_size=1024, offload_dir=tmp_path)
    with LiveBytes(model) as offloaded:
        step(model, offload)
    offload.close()
    moved = offload.stats["offloaded_bytes"]
    per_layer = moved / (LAYERS - 1)
    window = (offload.prefetch_layers + 1) * per_layer  # layers read ahead plus the one in use
    assert offloaded.peak < plain.peak
    assert plain.peak - offloaded.peak >= moved - window - 1


def test_preflight_unwritable_dir_fails_before_anything(tmp_path):
    not_a_dir = tmp_path / "file.txt"
    not_a_dir.write_text("x")
    with pytest.raises(FinetuneError, match="not writable") as info:
        check_offload_dir(not_a_dir / "offload", needed_bytes=1 << 20)
    assert str(not_a_dir / "offload") in str(info.value)
    assert "memory.offload_dir" in str(info.value) and "memory.offload" in info.value.hint
    assert sorted(os.listdir(tmp_path)) == ["file.txt"]


def test_preflight_too_small_dir_names_needed_and_free(tmp_path):
    (tmp_path / "keep.bin").write_bytes(b"1")
    with pytest.raises(FinetuneError) as info:
        check_offload_dir(tmp_path, needed_bytes=1 << 60)
    message = str(info.value)
    assert str(tmp_path) in message and "free" in message and "needs" in message and "PiB" not in message
    assert "TiB" in message  # 1 EiB shown in the largest unit
    assert sorted(os.listdir(tmp_path)) == ["keep.bin"]  # the probe file is gone, nothing else touched
    assert check_offload_dir(tmp_path, needed_bytes=1 << 20) == tmp_path.resolve()


def test_activation_offload_from_recipe(model_dir, tmp_path):
    model = load(model_dir)
    assert activation_offload(model, MemoryConfig(offload="none"), tmp_path) is None
    with pytest.raises(ValueError, match="planner"):
        activation_offload(model, MemoryConfig(offload="auto"), tmp_path)
    cfg = MemoryConfig(offload="disk", offload_min_size="1KiB")
    assert offload_dir_for(cfg, tmp_path) == tmp_path / "offload"
    offload = activation_offload(model, cfg, tmp_path)
    try:
        assert offload.min_size == 1024 and offload.disk.directory == tmp_path / "offload"
    finally:
        offload.close()
