"""The disk tier: files written during forward, deleted as backward reads them, none left on any exit;
the preflight check of `memory.offload_dir`; the recipe entry point."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from test_offload_support import LAYERS, batch, files, load, make_model_dir

from finetune.errors import FinetuneError
from finetune.memory.bandwidth import cache_path, cpu_compute, offload_bytes_per_step
from finetune.memory.offload import (
    ActivationOffload,
    activation_offload,
    check_offload_dir,
    offload_dir_for,
    preflight_offload,
)
from finetune.memory.offload_disk import OffloadDirError
from finetune.model.family import decoder_layers
from finetune.recipe.schema import MemoryConfig

model_dir = pytest.fixture(scope="module")(make_model_dir)


def _watch_backward(model, offload_dir: Path, seen: list[int]) -> list:
    """Record the file count whenever backward reaches a decoder layer's output (last layer first)."""

    def forward_hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.register_hook(lambda grad: seen.append(len(files(offload_dir))))
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
            while len(files(tmp_path)) < offload.stats["offloaded_tensors"] and time.monotonic() < deadline:
                time.sleep(0.01)  # writes are asynchronous
            written = len(files(tmp_path))
            assert written == offload.stats["offloaded_tensors"] > 0
            assert all(name.endswith(".bin") for name in files(tmp_path))
            loss.backward()
            assert files(tmp_path) == []
    finally:
        for hook in hooks:
            hook.remove()
        offload.close()
    assert offload.chain.tier("disk").bytes_read == offload.chain.tier("disk").bytes_written == offload.stats["offloaded_bytes"]
    # Backward reaches layer outputs last to first: files are still there when it starts (read ahead only a
    # couple of layers) and disappear as layers are done.
    assert len(counts) == LAYERS and counts[0] > 0
    assert counts == sorted(counts, reverse=True)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_disk_files_removed_when_backward_fails(model_dir, tmp_path, error):
    model = load(model_dir, "full", checkpointing=True)
    offload = ActivationOffload(model, "disk", min_size=1024, offload_dir=tmp_path)

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
        assert files(tmp_path) == []
    finally:
        hook.remove()
        offload.close()


def test_disk_files_removed_when_backward_never_runs(model_dir, tmp_path):
    model = load(model_dir, "full", checkpointing=False)
    offload = ActivationOffload(model, "disk", min_size=1024, offload_dir=tmp_path)
    with offload:
        loss = model(**batch()).loss
    assert offload.stats["offloaded_tensors"] > 0
    assert files(tmp_path) == []
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
    assert files(tmp_path) == []


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
        assert offload.min_size == 1024 and offload.chain.tier("disk").directory == tmp_path / "offload"
    finally:
        offload.close()


def test_preflight_from_recipe_runs_before_training(model_dir, tmp_path):
    """What the run calls before step one: predicted disk bytes, or the documented error."""
    model = load(model_dir, "full", checkpointing=False)  # the Trainer switches it on later, in train()
    cfg = MemoryConfig(offload="disk", offload_dir=str(tmp_path / "offload"), offload_min_size="1KiB",
                       activation_checkpointing=True)
    predicted = preflight_offload(model, cfg, tmp_path, micro_batch=2, seq_len=32)
    assert predicted == offload_bytes_per_step(LAYERS, model.config.hidden_size, 2, 32, 4, 1024, 1)
    assert files(tmp_path / "offload") == []
    without_checkpointing = cfg.model_copy(update={"activation_checkpointing": False})
    assert preflight_offload(model, without_checkpointing, tmp_path, micro_batch=2, seq_len=32) > 10 * predicted
    with pytest.raises(OffloadDirError, match="free but disk offload needs"):
        preflight_offload(model, cfg, tmp_path, micro_batch=10**6, seq_len=10**6)
    (tmp_path / "file").write_text("x")
    unwritable = cfg.model_copy(update={"offload_dir": str(tmp_path / "file" / "offload")})
    with pytest.raises(OffloadDirError, match="not writable"):
        preflight_offload(model, unwritable, tmp_path, micro_batch=2, seq_len=32)
    # RAM tier without a limit never touches the disk; with a limit only the excess goes there.
    assert preflight_offload(model, MemoryConfig(offload="cpu"), tmp_path / "none", 2, 32) == 0
    spill = cfg.model_copy(update={"offload": "cpu", "offload_cpu_limit": 4096})
    assert preflight_offload(model, spill, tmp_path, 2, 32) == predicted - 4096
    assert not (tmp_path / "none").exists()


def test_disk_bandwidth_measured_once_and_cached(tmp_path, monkeypatch):
    from finetune.memory import bandwidth

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    measured = bandwidth.measure_disk(tmp_path / "probe", nbytes=4 << 20)
    assert measured["write"] > 0 and measured["read"] > 0
    assert files(tmp_path / "probe") == []
    monkeypatch.setattr(bandwidth, "measure_disk", lambda directory, nbytes: {"write": 1.0, "read": 2.0})
    first = bandwidth.disk_bandwidth(tmp_path / "probe")
    assert first == {"write": 1.0, "read": 2.0}
    assert bandwidth.cache_path() == tmp_path / "cache" / "bandwidth.json"
    monkeypatch.setattr(bandwidth, "measure_disk", lambda directory, nbytes: pytest.fail("measured twice"))
    assert bandwidth.disk_bandwidth(tmp_path) == first  # same filesystem, from the cache


def test_disk_full_mid_step_is_a_clear_error(model_dir, tmp_path, monkeypatch):
    import finetune.memory.offload_disk as offload_disk

    def no_space(path, data):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(offload_disk, "write_tensor_file", no_space)
    model = load(model_dir, "full", checkpointing=True)
    offload = ActivationOffload(model, "disk", min_size=1024, offload_dir=tmp_path)
    with pytest.raises(FinetuneError, match="No space left") as info:
        with offload:
            model(**batch()).loss.backward()
    offload.close()
    assert str(tmp_path) in str(info.value) and "memory.offload_dir" in info.value.hint
    assert files(tmp_path) == []


@pytest.mark.parametrize("free", [0, 6 << 20, None])
def test_planning_disk_offload_on_a_small_or_full_folder_never_raises(tmp_path, monkeypatch, free):
    """The bandwidth probe writes at most a quarter of the free space (none below 1 MiB), and a disk that fills
    while it writes (free None: ENOSPC on the first file) leaves the disk priced at its typical speed."""
    import errno
    import shutil
    from collections import namedtuple

    from finetune import api
    from finetune.memory import bandwidth
    from finetune.recipe import validate_recipe

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    usage = namedtuple("usage", "total used free")
    real_usage = shutil.disk_usage
    room = 64 << 20 if free is None else free
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(real_usage(p).total, 0, room))
    written = []
    real_write = bandwidth.write_tensor_file

    def write(path, chunk):
        if free is None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        written.append(chunk.numel())
        real_write(path, chunk)
    monkeypatch.setattr(bandwidth, "write_tensor_file", write)
    config = Path(__file__).parent / "fixtures" / "configs" / "llama-3.1-8b.json"
    recipe = validate_recipe({"model": {"path": str(config)}, "data": {"path": "d.jsonl"},
                              "memory": {"offload": "disk", "offload_dir": str(tmp_path / "offload")}})
    plan = api.plan(recipe, gpu_memory="24GiB")
    assert sum(written) <= room // 4 and (sum(written) > 0) == (free == 6 << 20)
    assert not bandwidth.cache_path().exists()  # a partial measurement is not kept for later plans
    shown = "0 B" if free == 0 else "6.00 MiB" if free else "64.00 MiB"
    assert not plan.fits and any(f"in memory.offload_dir, {shown} free" in c.reason for c in plan.rejected)


def test_an_unwritable_bandwidth_cache_costs_a_measurement_not_the_plan(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FINETUNE_CACHE", str(blocker / "cache"))  # a folder that cannot be made, even by root
    measured = cpu_compute()
    assert measured["mem_bw"] > 0 and all(value > 0 for value in measured.values())
    assert not cache_path().exists()
