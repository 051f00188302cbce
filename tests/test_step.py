"""One training step everywhere (finetune.step.training_step), the planner's trace cache and concurrent planning."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

import finetune.step.training_step as step
from finetune.plan import DEFAULT_PLANNER, trace, trace_cache
from finetune.recipe.schema import Recipe


def _recipe(model_dir: Path, tmp_path: Path, **memory) -> Recipe:
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": "The quick brown fox jumps over the lazy dog. " * 8})
                              for _ in range(4)) + "\n")
    return Recipe.model_validate({
        "model": {"path": str(model_dir)}, "quantization": {"bits": None},
        "adapter": {"type": "lora", "r": 4, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 32, "format": "text"},
        "training": {"max_steps": 1, "micro_batch_size": 2, "gradient_accumulation_steps": 2},
        "memory": {"activation_checkpointing": True, "chunked_loss": False, "tiled_mlp": False, **memory},
        "output": {"dir": str(tmp_path / "run"), "save_steps": 100}})


@pytest.fixture
def fresh_traces(tmp_path, monkeypatch):
    """An empty trace cache on disk and in memory, so the planner really traces."""
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    DEFAULT_PLANNER.clear()
    yield
    DEFAULT_PLANNER.clear()


def test_plan_measure_and_run_use_the_same_step(tiny_model_dir, tmp_path, monkeypatch, fresh_traces):
    """`finetune plan` traces, `finetune measure` runs and `finetune run` trains through one function:
    every loss computed by each path is computed inside step.forward_backward."""
    from finetune.plan import predict
    from finetune.train.measure import measure
    from finetune.train.run import run

    calls: list[str] = []
    inner = step.compute_loss

    def counting(*args, **kwargs):
        import sys

        caller = sys._getframe(1).f_code
        calls.append("forward_backward" if caller is step.forward_backward.__code__ else caller.co_name)
        return inner(*args, **kwargs)

    monkeypatch.setattr(step, "compute_loss", counting)
    recipe = _recipe(tiny_model_dir, tmp_path)
    counts = {}
    for name, do in [("plan", lambda: predict(recipe, device="cpu")), ("measure", lambda: measure(recipe, steps=1)),
                     ("run", lambda: run(recipe))]:
        calls.clear()
        do()
        counts[name] = list(calls)
    assert counts["plan"] and set(counts["plan"]) == {"forward_backward"}  # the two-layer model traced whole
    assert counts["measure"] == ["forward_backward"] * 2  # one step of two micro-batches
    assert counts["run"] == ["forward_backward"] * 2


def _tiny_params(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model


def test_optimizer_update_clips_steps_schedules_and_frees():
    """The Trainer's update order: norm before clipping, clipped step, scheduler advanced, no gradient left."""
    model = _tiny_params(0)
    reference = _tiny_params(0)
    x = torch.randn(4, 8)
    for m in (model, reference):
        (m(x).pow(2).sum() * 100).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    expected_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    norm = step.optimizer_update(model, opt, sched, max_grad_norm=1.0)
    assert float(norm) == pytest.approx(float(expected_norm))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p, q) and p.grad is None
    assert sched.get_last_lr() == [0.05]


def test_loss_scaling_matches_the_trainer():
    """Without num_items_in_batch the mean loss is divided by the accumulation; with it, the model's summed
    loss is divided by the batch's labelled tokens instead (the Trainer's exact gradient accumulation)."""
    from transformers import AutoModelForCausalLM

    from finetune.testing import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=64))
    ids = torch.randint(0, 64, (2, 8))
    batch = {"input_ids": ids, "labels": ids}
    mean = model(**batch).loss.detach()
    assert step.forward_backward(model, batch, accumulation=4) == pytest.approx(float(mean) / 4, rel=1e-5)
    summed = step.forward_backward(model, batch, accumulation=4, num_items_in_batch=torch.tensor(28))
    assert float(summed) == pytest.approx(float(mean) * 14 / 28, rel=1e-5)  # 14 labelled tokens of 28


def test_concurrent_plans_equal_sequential(tiny_model_dir, tmp_path, fresh_traces):
    """Two threads planning at once (the UI's handlers) get what one at a time gets, and leave torch and
    transformers as they were (the trace patches nothing process-wide)."""
    import transformers.masking_utils as masking

    from finetune.plan import predict

    recipes = [_recipe(tiny_model_dir, tmp_path, activation_checkpointing=ckpt) for ckpt in (True, False)]
    before = (torch.nn.functional.scaled_dot_product_attention, masking.find_packed_sequence_indices)
    sequential = [predict(r, gpu_memory="4GiB", device="cpu").to_dict() for r in recipes]
    DEFAULT_PLANNER.clear()
    trace_cache.cache_folder().rename(tmp_path / "first-cache")
    results: list = [None, None]
    barrier = threading.Barrier(2)

    def plan(i: int) -> None:
        barrier.wait()
        results[i] = predict(recipes[i], gpu_memory="4GiB", device="cpu").to_dict()

    threads = [threading.Thread(target=plan, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == sequential
    assert (torch.nn.functional.scaled_dot_product_attention, masking.find_packed_sequence_indices) == before


def test_cache_hit_miss_invalidation_and_corrupt_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path))
    computed = []

    def get(key):
        return trace_cache.cached("trace", key, lambda: computed.append(key) or {"v": len(computed)},
                                  lambda v: v, lambda v: {"v": int(v["v"])})

    assert get(["a", 1]) == {"v": 1}
    assert get(["a", 1]) == {"v": 1} and computed == [["a", 1]]  # hit: from disk, not recomputed
    assert get(["a", 2]) == {"v": 2}  # a changed setting misses
    real = trace_cache.versions()
    monkeypatch.setattr(trace_cache, "versions", lambda: {**real, "torch": "0.0"})
    assert get(["a", 1]) == {"v": 3}  # a changed library version misses
    path = trace_cache.entry_path("trace", ["a", 1])
    for corrupt in ("{not json", json.dumps({"value": {"v": "x"}}), ""):
        path.write_text(corrupt)
        before = len(computed)
        assert get(["a", 1]) == {"v": before + 1}  # ignored and rewritten
        assert json.loads(path.read_text())["value"] == {"v": before + 1}
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_trace_from_the_disk_cache_equals_a_fresh_trace(tmp_path, monkeypatch, fresh_traces):
    from finetune.recipe.schema import AdapterConfig
    from finetune.testing import tiny_config

    config = tiny_config("qwen2")
    args = (config, AdapterConfig(r=4), torch.float32, "sdpa", "cpu", 1, 64, 2, 1)
    first = trace.trace_step(*args)
    DEFAULT_PLANNER.traces.clear()
    monkeypatch.setattr(trace, "_direct_trace", lambda *a: pytest.fail("traced again despite the disk cache"))
    assert trace.trace_step(*args) == first


def test_model_facts_come_from_the_disk_cache(monkeypatch, fresh_traces):
    """A warm plan must not build the model (nor import its modeling code) to learn its shapes."""
    from finetune.testing import tiny_config

    first = trace.model_facts(tiny_config("llama"), "auto")
    monkeypatch.setattr(trace, "model_shapes", lambda *a: pytest.fail("shapes computed again despite the cache"))
    assert trace.model_facts(tiny_config("llama"), "auto") == first


@pytest.mark.parametrize("bf16", [True, False])
def test_mixed_precision_follows_the_dtype_table(monkeypatch, bf16):
    """run and measure autocast as model.dtype resolves (finetune.units.dtype_name); CPU never autocasts."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    got = {d: step.mixed_precision(d, cuda=True) for d in ("auto", "bf16", "fp16", "fp32")}
    assert got == {"auto": "bf16" if bf16 else "fp16", "bf16": "bf16" if bf16 else None, "fp16": "fp16",
                   "fp32": None}
    assert step.mixed_precision("auto", cuda=False) is None
