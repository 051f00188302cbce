"""The planner's typed seams: a rejection's kind (not its text) is what callers act on, and the planner's
in-memory caches belong to a `Planner` whose `clear()` empties them."""

from __future__ import annotations

import pytest

from finetune import api
from finetune.plan import DEFAULT_PLANNER, Candidate, Plan, Planner, predict, trace_cache
from finetune.recipe.schema import Recipe
from finetune.reports import GPUSizeRow, GPUSizes, Machine, SpeedEstimate
from finetune.units import format_bytes

GIB = 1 << 30


def _recipe(model_dir, **memory) -> Recipe:
    return Recipe.model_validate({
        "model": {"path": str(model_dir)}, "data": {"path": "unused.jsonl", "max_seq_len": 64},
        "quantization": {"bits": None}, "training": {"micro_batch_size": "auto"},
        "memory": {"activation_checkpointing": "auto", "gpu_memory_margin": 0, **memory}})


def test_every_rejection_has_a_kind_that_matches_its_reason(tiny_model_dir):
    plan = predict(_recipe(tiny_model_dir), gpu_memory=1_000_000, device="cpu")
    assert not plan.fits and {c.kind for c in plan.rejected} == {"over_budget", "over_budget_floor"}
    for c in plan.rejected:
        assert c.kind in ("over_budget", "over_budget_floor"), c
        assert c.reason.startswith("needs at least " if c.kind == "over_budget_floor" else "needs ")
        assert bool(c.breakdown) == (c.kind == "over_budget")  # a lower bound is no traced peak
    assert all(c.kind is None and c.reason is None for c in plan.alternatives)
    assert {c["kind"] for c in plan.to_dict()["rejected"]} <= {"over_budget", "over_budget_floor"}  # in plan.json


def _candidate(peak: int, kind: str, reason: str) -> Candidate:
    return Candidate({"micro_batch_size": 1}, peak, {"activations": peak}, 1.0, reason, kind)


def test_the_gpu_size_table_counts_only_rejections_of_kind_over_budget(tiny_model_dir, monkeypatch):
    """An offload without room is no length the GPU trains, whatever its text says; the kind decides."""
    rejected = [_candidate(1 * GIB, "offload_space", "needs 1 GiB of host RAM"),  # text that looks like a budget
                _candidate(5 * GIB, "over_budget", f"needs {format_bytes(5 * GIB)}, budget 1 B"),
                _candidate(2 * GIB, "host_ram", "needs 2 GiB of RAM")]
    plan = Plan("cuda", {}, 9 * GIB, {}, 1, False, 0.0, rejected=rejected, min_budget_bytes=9 * GIB)
    monkeypatch.setattr("finetune.plan.predict", lambda *a, **k: plan)
    sweep = api.plan_gpu_sizes(_recipe(tiny_model_dir), sizes_gb=(4, 6), ladder=(64,))
    assert set(sweep) == GPUSizes.__required_keys__ and set(sweep["sizes"][0]) == GPUSizeRow.__required_keys__
    assert [row["longest_context"] for row in sweep["sizes"]] == [None, 64]
    assert set(sweep["context_need_bytes"].values()) == {5 * GIB}
    plan.rejected = rejected[::2]  # nothing over the budget: the planner's own minimum
    assert set(api.plan_gpu_sizes(_recipe(tiny_model_dir), sizes_gb=(4,), ladder=(64,))["context_need_bytes"]
               .values()) == {9 * GIB}


@pytest.fixture
def counted_traces(monkeypatch):
    """Every trace the planner computes, past its memory (the disk cache is bypassed)."""
    traced: list[str] = []

    def cached(kind, key, compute, encode, decode):
        traced.append(kind)
        return compute()

    monkeypatch.setattr(trace_cache, "cached", cached)
    return traced


def test_clear_empties_the_planner_and_the_next_plan_traces_again(tiny_model_dir, counted_traces):
    planner, recipe = Planner(), _recipe(tiny_model_dir)
    first = predict(recipe, gpu_memory="1GiB", device="cpu", planner=planner)
    traces = counted_traces.count("trace")
    assert traces > 0 and planner.held() > 0 and len(planner.traces) == traces
    held_by_default = DEFAULT_PLANNER.held()
    assert predict(recipe, gpu_memory="1GiB", device="cpu", planner=planner) == first
    assert counted_traces.count("trace") == traces, "the second plan comes from the planner's memory"
    planner.clear()
    assert planner.held() == 0
    assert predict(recipe, gpu_memory="1GiB", device="cpu", planner=planner) == first
    assert counted_traces.count("trace") == 2 * traces, "after clear() every trace is computed again"
    assert DEFAULT_PLANNER.held() == held_by_default, "a planner of its own leaves the default's caches alone"


def test_module_predict_uses_the_default_planner(tiny_model_dir, counted_traces):
    DEFAULT_PLANNER.clear()
    predict(_recipe(tiny_model_dir), gpu_memory="1GiB", device="cpu")
    assert len(DEFAULT_PLANNER.traces) == counted_traces.count("trace") > 0
    DEFAULT_PLANNER.clear()
    assert DEFAULT_PLANNER.held() == 0


@pytest.mark.parametrize("tps", [None, 1234.5, 1e12])  # no estimate, an estimate, over the ceiling
def test_reports_have_the_keys_their_typed_dicts_name(tps):
    assert set(api.speed_estimate({"device": "cuda", "tokens_per_s": tps})) == SpeedEstimate.__required_keys__
    assert set(api.this_machine()) == Machine.__required_keys__


def test_concurrent_plans_leave_torch_default_dtype_alone(tiny_model_dir, counted_traces, monkeypatch):
    """torch's default dtype is process-wide and transformers sets it while it builds a model: plans traced in
    bfloat16 and float32 at once (the UI's handlers) once left a whole test worker on bfloat16, so every later
    model and tensor came out in it. Each plan also equals the one made alone. (Setting the dtype is slowed
    down here so that the threads' builds overlap on every run, not one run in three.)"""
    import threading
    import time

    import torch

    set_dtype = torch.set_default_dtype
    monkeypatch.setattr(torch, "set_default_dtype", lambda dtype: (set_dtype(dtype), time.sleep(0.005)))

    recipes = [_recipe(tiny_model_dir).model_copy(update={"model": _recipe(tiny_model_dir).model.model_copy(
        update={"dtype": dtype})}) for dtype in ("bf16", "fp32", "fp16", "fp32")]
    alone = [predict(r, gpu_memory=GIB, device="cpu", planner=Planner()).peak_bytes for r in recipes]
    peaks: dict[int, int] = {}

    def plan(i: int) -> None:
        for _ in range(2):
            peaks[i] = predict(recipes[i], gpu_memory=GIB, device="cpu", planner=Planner()).peak_bytes

    threads = [threading.Thread(target=plan, args=(i,)) for i in range(len(recipes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.get_default_dtype() == torch.float32
    assert [peaks[i] for i in range(len(recipes))] == alone
