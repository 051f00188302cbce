"""The planner's shortcuts change its speed, never its answer: each is checked against the slow path."""

from __future__ import annotations

import pytest
import torch

from finetune.memory import layer_recompute
from finetune.plan import DEFAULT_PLANNER, trace
from finetune.recipe.schema import AdapterConfig, Recipe
from finetune.testing import tiny_config

ARCHS = ["llama", "qwen2", "mistral", "gemma2", "phi3"]  # those of tests/test_plan_accuracy.py's MATRIX
CHUNK = 16
SEQ = 9 * CHUNK + 5  # nine full chunks and a shorter last one


@pytest.fixture
def all_chunks(monkeypatch):
    """Run (by calling it) with the meta shortcuts off: every chunk computed, as on a real device, every
    meta kernel run (no memoised outputs), a model built for every trace."""
    def run(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(layer_recompute, "_chunks_to_run", lambda _x, n: range(n))
            m.setattr(trace._MetaMemo, "__torch_dispatch__",
                      lambda _self, func, _types, args=(), kwargs=None: func(*args, **(kwargs or {})))
            m.setattr(trace, "_take_model", lambda _planner, built: trace._build_model(built))
            m.setattr(trace, "_return_model", lambda _planner, built, model: None)
            return fn(*args, **kwargs)
    return run


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(layer_recompute, "NORM_TOKENS", CHUNK)  # many norm chunks at a small sequence
    DEFAULT_PLANNER.clear()
    yield
    DEFAULT_PLANNER.clear()


CASES = [(arch, 1, True, "lora") for arch in ARCHS] + [
    (arch, every, False, adapter) for arch in ("llama", "phi3") for every, adapter in ((0, "lora"), (1, "full"))]


@pytest.mark.parametrize("arch,checkpoint_every,int8,adapter", CASES)
def test_skipped_chunks_trace_like_all_chunks(arch, checkpoint_every, int8, adapter, fresh, all_chunks):
    """Every window's peak and breakdown of a trace with tiled MLPs and recomputed norms (ten chunks each),
    and with memoised meta kernels (traced twice: the second trace is nearly all memo hits)."""
    config = tiny_config(arch, num_hidden_layers=3, **({"head_dim": 32} if arch == "gemma2" else {}))
    attn = "eager" if arch == "gemma2" else "sdpa"
    key = trace.model_key(config, AdapterConfig(type=adapter, r=8), torch.float32)
    args = (key, attn, 2, SEQ, 3, checkpoint_every, int8, True, CHUNK)
    slow = all_chunks(trace._direct_trace, *args)
    assert trace._direct_trace(*args) == slow
    assert DEFAULT_PLANNER.meta_kernels and trace._direct_trace(*args) == slow


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_reused_models_trace_like_fresh_ones(arch, fresh, all_chunks):
    """A model traced before (int8 layers restored, gradients dropped) traces like a freshly built one."""
    config = tiny_config(arch, num_hidden_layers=3, **({"head_dim": 32} if arch == "gemma2" else {}))
    key = trace.model_key(config, AdapterConfig(r=8), torch.float32)
    for every, int8 in ((1, True), (1, False), (0, False), (0, True)):
        args = (key, "eager", 2, 48, 3, every, int8, True, 0)
        assert trace._direct_trace(*args) == all_chunks(trace._direct_trace, *args)
    assert sorted(len(models) for models in DEFAULT_PLANNER.models.values()) == [1, 1]  # one per checkpointing


def test_plan_with_every_key_auto_is_unchanged(tiny_model_dir, tmp_path, fresh, all_chunks, monkeypatch):
    """A whole predict() (every planned key auto, a budget that needs tiling) equals the all-chunks one."""
    from finetune.plan import predict

    auto = "auto"
    recipe = Recipe.model_validate({
        "model": {"path": str(tiny_model_dir)}, "data": {"path": "unused", "max_seq_len": SEQ},
        "quantization": {"bits": auto}, "optimizer": {"name": auto},
        "training": {"micro_batch_size": auto, "gradient_accumulation_steps": auto, "effective_batch_size": 8},
        "memory": {"activation_checkpointing": auto, "offload": auto, "chunked_loss": auto, "tiled_mlp": auto,
                   "tiled_mlp_tokens": CHUNK, "gpu_memory_margin": 0}})
    from finetune.plan import search

    measured = search.cpu_compute()  # the CPU's speed is measured once per cache folder: keep one measurement
    monkeypatch.setattr(search, "cpu_compute", lambda: measured)
    fast = predict(recipe, gpu_memory="2MiB", device="cpu").to_dict()
    DEFAULT_PLANNER.traces.clear()
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "slow"))
    assert fast == all_chunks(predict, recipe, gpu_memory="2MiB", device="cpu").to_dict()
    evaluated = [fast, *fast["alternatives"], *(c for c in fast["rejected"] if c["breakdown"])]
    assert any(c["settings"]["tiled_mlp"] for c in evaluated)  # the budget makes the planner trace tiling


def test_warm_plan_loads_no_model_config(tiny_model_dir, tmp_path, fresh, monkeypatch):
    """Once the config's facts are in the disk cache a plan reads them there, equal to the plan from the
    transformers config, without loading it (importing its class is most of a warm plan); an edited
    config.json is a miss."""
    import json
    import shutil

    from finetune.plan import predict
    from finetune.plan.shapes import load_model_config

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    recipe = Recipe.model_validate({
        "model": {"path": str(model)}, "data": {"path": "unused", "max_seq_len": 64},
        "quantization": {"bits": "auto"}, "training": {"micro_batch_size": "auto"},
        "memory": {"activation_checkpointing": "auto", "gpu_memory_margin": 0}})
    reference = predict(recipe, model_config=load_model_config(str(model)), gpu_memory="8MiB", device="cpu")
    assert predict(recipe, gpu_memory="8MiB", device="cpu") == reference  # cold: facts computed and stored
    with monkeypatch.context() as m:
        m.setattr(trace, "load_model_config", lambda *a, **k: pytest.fail("config loaded despite the cache"))
        assert predict(recipe, gpu_memory="8MiB", device="cpu") == reference
        config = trace.planned_config(str(model))
        assert isinstance(config, trace.CachedConfig) and config.get_text_config().num_hidden_layers == 2
        assert config.get_text_config().max_position_embeddings == 2048  # the GPU-size sweep's context limit
    data = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**data, "num_hidden_layers": 3}))
    assert trace.planned_config(str(model)).get_text_config().num_hidden_layers == 3
    assert trace.planned_config(str(model)).rms_norm_eps == data["rms_norm_eps"]  # the rest: the real config


def test_trace_cache_keeps_the_most_recently_used_entries(tmp_path, monkeypatch):
    """Old entries (orphaned by an upgrade) are dropped once the folder is full; a hit counts as a use."""
    import os

    from finetune.plan import trace_cache

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(trace_cache, "MAX_ENTRIES", 3)

    def put(key: int) -> int:
        return trace_cache.cached("test", key, lambda: key * 10, lambda v: v, int)

    for key in range(3):
        put(key)
        path = trace_cache.entry_path("test", key)
        os.utime(path, ns=(key * 10**9, key * 10**9))  # entry k used at second k
    assert put(0) == 0  # a hit: entry 0 becomes the most recent
    put(3)  # the folder is full: the least recently used (entry 1) goes
    kept = {k for k in range(4) if trace_cache.entry_path("test", k).is_file()}
    assert kept == {0, 2, 3}


def test_a_full_trace_cache_scans_its_folder_once_per_batch_of_writes(tmp_path, monkeypatch):
    """Once full, a write drops the least recent entries down to MAX_ENTRIES - MAX_ENTRIES // 8, so writes to
    a full cache scan the folder once per MAX_ENTRIES // 8 of them (it used to scan on every write); the most
    recently used entries survive."""
    import os

    from finetune.plan import trace_cache

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(trace_cache, "MAX_ENTRIES", 64)  # batches of 8
    scans = []
    real_scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path=".": scans.append(path) or real_scandir(path))

    def put(key: int) -> None:
        trace_cache.cached("test", key, lambda: key, lambda v: v, int)
        used = key * 10**9  # entry k used at second k
        os.utime(trace_cache.entry_path("test", key), ns=(used, used))

    for key in range(64):
        put(key)
    assert len(scans) == 1  # the process's first write; then it counts its writes
    scans.clear()
    writes = 80
    for key in range(64, 64 + writes):
        put(key)
    assert 1 <= len(scans) <= writes // 8 + 1
    kept = {k for k in range(64 + writes) if trace_cache.entry_path("test", k).is_file()}
    assert len(kept) <= 64 and set(range(64 + writes - 56, 64 + writes)) <= kept  # the newest survive
    assert min(kept) >= 64 + writes - 64  # and only they: the least recent went
