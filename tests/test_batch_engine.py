"""effective_batch_size: auto (finetune/train/batch_engine.py): the accumulation ramps with the noise scale
without dropping or repeating examples, learning rate and beta2 follow the rules, --resume is exact."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from finetune.recipe import validate_recipe
from finetune.recipe.batch_rules import best_accumulation
from finetune.rundir import read_jsonl
from finetune.train import batch_engine
from finetune.train.batch_engine import BatchEngine
from finetune.train.loop import TrainLoop
from finetune.train.run import run
from tests.run_support import sums_data, tiny_lora_recipe


def _recipe(tmp_path, model_dir, name: str, **training) -> dict:
    return tiny_lora_recipe(model_dir, sums_data(tmp_path / "engine-data.jsonl", 40), tmp_path / name, {
        "training": {"max_steps": 14, "learning_rate": 1e-3, "lr_scheduler": "linear", "micro_batch_size": 2,
                     "gradient_accumulation_steps": 1, "noise_scale_split_every": 1, **training},
        "output": {"save_steps": 3, "save_total_limit": 20}})


@pytest.fixture
def whole_micro_batch(monkeypatch):
    """No batch-size warmup below the micro-batch (updates of the loader batch from the start, as with a
    layer-wise optimizer): for the tests of the accumulation that follows it."""
    monkeypatch.setattr(BatchEngine, "no_warmup", lambda self, geometry: "a test of the accumulation")


@pytest.fixture
def forced_ramp(monkeypatch):
    """Double the update batch (up to the micro-batch), then the accumulation (up to 4), at every decision,
    and decide after 2 observations, whatever the tiny model's noise scale is; record every loader batch's
    examples."""
    monkeypatch.setattr(batch_engine, "update_batch", lambda gns, per_sequence, current, micro: min(2 * current, micro))
    monkeypatch.setattr(batch_engine, "best_accumulation",
                        lambda gns, tokens, t_micro, t_opt, current, limit: min(2 * current, 4))
    monkeypatch.setattr(batch_engine, "MIN_OBSERVATIONS", 2)
    seen = {"rows": [], "updates": 0}
    run_step = TrainLoop.run_step

    def spy(self, step):
        seen["rows"] += [[tuple(r["input_ids"]) for r in rows] for rows in step.batches]
        return run_step(self, step)

    monkeypatch.setattr(TrainLoop, "run_step", spy)
    return seen


def test_a_ramp_changes_the_accumulation_without_dropping_or_repeating_examples_and_resumes_exactly(
        tmp_path, tiny_model_dir, forced_ramp, whole_micro_batch):
    fixed = run(validate_recipe(_recipe(tmp_path, tiny_model_dir, "fixed")))
    fixed_rows, forced_ramp["rows"] = forced_ramp["rows"], []
    recipe = _recipe(tmp_path, tiny_model_dir, "auto", effective_batch_size="auto")
    auto = run(validate_recipe(recipe))
    assert forced_ramp["rows"] == fixed_rows and len(fixed_rows) == 14  # the same examples, in the same order
    assert auto.steps == fixed.steps == 14
    rows = read_jsonl(auto.run_dir / "metrics.jsonl")
    events = [r for r in rows if r.get("event") == "batch_changed"]
    assert [(e["from"]["gradient_accumulation_steps"], e["to"]["gradient_accumulation_steps"]) for e in events] \
        == [(1, 2), (2, 4)]
    assert [e["to"]["effective_batch_size"] for e in events] == [4, 8]
    # learning rate x sqrt(batch ratio), beta2 ** ratio, against the starting batch of 2
    assert events[1]["learning_rate"] == pytest.approx(1e-3 * 2) and events[1]["beta2"] == pytest.approx(0.999 ** 4)
    lrs = {r["step"]: r["learning_rate"] for r in rows if "loss" in r}
    assert lrs[14] == pytest.approx(2 * 1e-3 / 14, rel=1e-3)  # the linear schedule in loader batches, scaled x2
    results = json.loads((auto.run_dir / "results.json").read_text())
    assert results["batch"]["effective_batch_size"] == 8 and len(results["batch"]["changes"]) == 2

    # --resume from a checkpoint taken at accumulation 2 (mid-ramp), as if the run had been killed after it
    mid, resumed, again_rows = _resume_mid_ramp(auto.run_dir, recipe, tmp_path / "resumed", "accumulation", 2)
    times = _engine_state(mid)["times"]  # the run's own step times, kept
    assert times["rest"] and all(t >= 0 for t in times["rest"] + times["forward"] + times["deferred"])
    assert resumed.steps == 14
    _assert_same_losses(again_rows, rows)
    assert [e["step"] for e in again_rows if e.get("event") == "batch_changed"] == [e["step"] for e in events]


def _resume_mid_ramp(run_dir: Path, recipe: dict, copy: Path, key: str, value: int) -> tuple:
    """--resume from the first checkpoint whose engine state has `key` == `value` (mid-ramp), in a copy of
    the run without the later checkpoints, as if it had been killed after that one: (the checkpoint, the
    resumed run, its metrics rows)."""
    mid = next(p for p in sorted((run_dir / "checkpoints").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
               if _engine_state(p)[key] == value)
    shutil.copytree(run_dir, copy)
    for p in (copy / "checkpoints").glob("checkpoint-*"):
        if int(p.name.split("-")[1]) > int(mid.name.split("-")[1]):
            shutil.rmtree(p)
    resumed = run(validate_recipe({**recipe, "output": {**recipe["output"], "dir": str(copy)}}), resume=True)
    return mid, resumed, read_jsonl(copy / "metrics.jsonl")


def _engine_state(checkpoint: Path) -> dict:
    """The batch engine's part of a checkpoint's train state, with the loop's batch geometry it changes."""
    state = torch.load(checkpoint / "train_state.pt", weights_only=True)
    return {**state["geometry"], **state["policies"]["batch_engine"]}


def _assert_same_losses(rows: list[dict], reference: list[dict]) -> None:
    """The same steps with the same losses as the uninterrupted run's metrics rows."""
    losses = {r["step"]: r["loss"] for r in reference if "loss" in r}
    again = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(again) == sorted(losses)
    for step in losses:
        assert again[step] == pytest.approx(losses[step], rel=1e-6), f"step {step}"


def test_a_layerwise_optimizer_accumulates_over_the_group(tmp_path, tiny_model_dir, forced_ramp, monkeypatch):
    """It would update inside each backward: at accumulation 1 the engine measures it with a two-batch group
    every noise_scale_split_every loader batches, and keeps its steps_per_update equal to each group, ramping to 4."""
    from finetune.optim import layerwise_of

    seen = []
    step_end = BatchEngine.on_step_end

    def spy(self, loop, step):
        if not step.deferred:  # the group just updated
            seen.append((loop.geometry.group, layerwise_of(loop.optimizer).steps_per_update))
        step_end(self, loop, step)

    monkeypatch.setattr(BatchEngine, "on_step_end", spy)
    recipe = _recipe(tmp_path, tiny_model_dir, "layerwise", effective_batch_size="auto", max_steps=16,
                     noise_scale_split_every=3)
    result = run(validate_recipe({**recipe, "optimizer": {"layerwise": True}}))
    assert result.state == "completed"
    assert all(size == steps for size, steps in seen)
    assert [size for size, _ in seen[:3]] == [1, 2, 1]  # at accumulation 1, a measuring pair every 3 batches
    assert seen[-1] == (4, 4)
    events = [r for r in read_jsonl(result.run_dir / "metrics.jsonl") if r.get("event") == "batch_changed"]
    assert [e["to"]["gradient_accumulation_steps"] for e in events] == [2, 4]
    # no warmup below the micro-batch: its updates happen inside backward, so they cannot end mid-batch
    assert [(e["from"]["update_batch"], e["to"]["update_batch"]) for e in events] == [(2, 2), (2, 2)]


def _timed(monkeypatch, t_micro: float, t_opt: float) -> list:
    """The engine's measured step times replaced by (t_micro, t_opt) (wall-clock times are not for tests);
    returns the arguments and result of every decision."""
    monkeypatch.setattr(BatchEngine, "step_times", lambda self: (t_micro, t_opt))
    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs, best_accumulation(*args, **kwargs)))
        return calls[-1][2]

    monkeypatch.setattr(batch_engine, "best_accumulation", spy)
    return calls


def test_a_cheap_optimizer_step_keeps_micro_batch_one_without_accumulation(tmp_path, tiny_model_dir, monkeypatch):
    """Micro-batch 1 is measured by a pair of loader batches every noise_scale_split_every updates (not by
    accumulating all the time); with a cheap update the batch never grows, and every example is seen once."""
    seen = []
    run_step = TrainLoop.run_step
    monkeypatch.setattr(TrainLoop, "run_step", lambda self, step: (
        seen.extend([tuple(r["input_ids"]) for r in rows] for rows in step.batches), run_step(self, step))[1])
    updates = []
    step_end = BatchEngine.on_step_end
    monkeypatch.setattr(BatchEngine, "on_step_end",
                        lambda self, loop, step: (updates.append(not step.deferred), step_end(self, loop, step)))
    calls = _timed(monkeypatch, t_micro=0.05, t_opt=0.0005)
    auto = run(validate_recipe(_recipe(tmp_path, tiny_model_dir, "auto1", micro_batch_size=1, max_steps=24,
                                       effective_batch_size="auto", noise_scale_split_every=3)))
    assert auto.steps == 24 and len(seen) == 24 and all(len(rows) == 1 for rows in seen)
    assert len(set(map(tuple, seen))) == 24  # 24 different examples: none dropped or repeated
    rows = read_jsonl(auto.run_dir / "metrics.jsonl")
    assert not [r for r in rows if r.get("event") == "batch_changed"]
    assert any(r.get("gns") for r in rows)  # measured from the pairs
    assert updates.count(False) == 8  # one pair every 3 updates: 8 of the 24 loader batches deferred
    assert calls and all(result == 1 for _, _, result in calls)


def test_an_expensive_optimizer_step_ramps_the_accumulation_by_the_formula(tmp_path, tiny_model_dir, monkeypatch,
                                                                          whole_micro_batch):
    """An update that costs 40 micro-batches (a large model's full fine-tuning with a slow optimizer): the
    accumulation becomes k* = sqrt(t_opt x gns / (t_micro x tokens per micro-batch)), rounded the better way,
    where the token slack allows it. The tiny model's noise scale is a few micro-batches, so with the default
    slack the cap holds the batch (k* > 1, no change); with the slack lifted the formula decides."""
    from finetune.recipe import batch_rules

    calls = _timed(monkeypatch, t_micro=0.01, t_opt=0.4)
    held = run(validate_recipe(_recipe(tmp_path, tiny_model_dir, "held", effective_batch_size="auto", max_steps=20)))
    assert not [r for r in read_jsonl(held.run_dir / "metrics.jsonl") if r.get("event") == "batch_changed"]
    assert calls and all(result == 1 for _, _, result in calls)
    assert any(math.sqrt(t_opt * gns / (t_micro * tokens)) >= 2 and batch_rules.token_cap(gns, tokens) == 1
               for (gns, tokens, t_micro, t_opt), _, _ in calls)  # the cap, not the formula, kept k = 1
    calls.clear()
    monkeypatch.setattr(batch_rules, "TOKEN_SLACK", 100.0)
    auto = run(validate_recipe(_recipe(tmp_path, tiny_model_dir, "costly", effective_batch_size="auto",
                                       max_steps=20)))
    events = [r for r in read_jsonl(auto.run_dir / "metrics.jsonl") if r.get("event") == "batch_changed"]
    assert events and events[0]["t_opt"] == 0.4 and events[0]["t_micro"] == 0.01
    (gns, tokens, t_micro, t_opt), kwargs, first = next(c for c in calls if c[2] > 1)
    assert first == events[0]["to"]["gradient_accumulation_steps"] and gns == events[0]["gns"]
    k_star = math.sqrt(t_opt * gns / (t_micro * tokens))
    assert 1 < first < kwargs["limit"] and first in (math.floor(k_star), math.ceil(k_star))
    assert events[0]["learning_rate"] == pytest.approx(1e-3 * min(math.sqrt(first), 4.0))  # the rules follow


def test_out_of_memory_inside_a_group_redoes_the_whole_group(tmp_path, tiny_model_dir, forced_ramp, monkeypatch,
                                                             whole_micro_batch):
    """The group's earlier loader batches are run again with the cheaper settings: the losses stay those of
    the run that never ran out of memory."""
    from finetune.train.recovery import FAULT_ENV

    recipe = _recipe(tmp_path, tiny_model_dir, "plain", effective_batch_size="auto", max_steps=10)
    plain = run(validate_recipe(recipe))
    monkeypatch.setenv(FAULT_ENV, "8")  # accumulation is 4 from step 7 on: step 8 is inside a group
    recovered = run(validate_recipe({**recipe, "output": {**recipe["output"], "dir": str(tmp_path / "oom")}}))
    monkeypatch.delenv(FAULT_ENV)
    rows = read_jsonl(recovered.run_dir / "metrics.jsonl")
    assert [r["to"] for r in rows if r.get("event") == "oom_recovered"] == \
        [{"micro_batch_size": 1, "gradient_accumulation_steps": 2}]
    expected = {r["step"]: r["loss"] for r in read_jsonl(plain.run_dir / "metrics.jsonl") if "loss" in r}
    got = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), f"step {step}"


# -- the batch-size warmup below the micro-batch (finetune/train/sub_updates.py) --------------------------------

def _forward_spy(monkeypatch) -> list:
    """Every forward-backward's rows (their real tokens) and loss, in order."""
    seen = []
    step = TrainLoop.forward_backward

    def spy(self, part):
        loss = step(self, part)
        batch = part.batch
        rows = [tuple(ids[mask.bool()].tolist())
                for ids, mask in zip(batch.input_ids, batch.attention_mask, strict=True)]
        seen.append((rows, float(loss)))
        return loss

    monkeypatch.setattr(TrainLoop, "forward_backward", spy)
    return seen


def _weights(run_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def test_sub_updates_of_one_sequence_train_exactly_as_micro_batch_one(tmp_path, tiny_model_dir, monkeypatch):
    """The key property: the warmup's updates ARE a smaller batch. Auto at micro-batch 4 held at one sequence
    per update gives the per-update losses and final weights of a plain run at micro-batch 1 (same data)."""
    monkeypatch.setattr(batch_engine, "update_batch", lambda gns, per_sequence, current, micro: current)
    seen = _forward_spy(monkeypatch)
    constant = {"lr_scheduler": "constant", "noise_scale_split_every": 1000}
    plain = run(validate_recipe(_recipe(tmp_path, tiny_model_dir, "plain1", micro_batch_size=1, max_steps=12,
                                        **constant)))
    plain_seen, seen[:] = list(seen), []
    auto = run(validate_recipe(_recipe(tmp_path, tiny_model_dir, "sub4", micro_batch_size=4, max_steps=3,
                                       effective_batch_size="auto", reference_batch_size=1, **constant)))
    assert plain.steps == 12 and auto.steps == 3
    assert [rows for rows, _ in seen] == [rows for rows, _ in plain_seen] and len(seen) == 12
    assert [loss for _, loss in seen] == pytest.approx([loss for _, loss in plain_seen], rel=1e-5)
    a, b = _weights(plain.run_dir), _weights(auto.run_dir)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-7), name
    events = [r for r in read_jsonl(auto.run_dir / "metrics.jsonl") if r.get("event") == "batch_changed"]
    assert [(e["step"], e["from"]["update_batch"], e["to"]["update_batch"]) for e in events] == [(0, 4, 1)]


def test_the_warmup_ramps_the_update_batch_then_accumulates_without_dropping_examples_and_resumes_exactly(
        tmp_path, tiny_model_dir, forced_ramp, monkeypatch):
    """Micro-batch 4: updates of 1, 2, then 4 sequences (each change a batch_changed event naming the update
    batch), then accumulation 2; every example once, in the loader's order; --resume from a checkpoint taken
    at update batch 2 reproduces the uninterrupted losses."""
    monkeypatch.setattr(batch_engine, "best_accumulation",
                        lambda gns, tokens, t_micro, t_opt, current, limit: min(2 * current, 2))
    seen = _forward_spy(monkeypatch)
    fixed = run(validate_recipe(_recipe(tmp_path, tiny_model_dir, "fixed4", micro_batch_size=4, max_steps=16,
                                        noise_scale_split_every=2)))
    fixed_rows, seen[:] = [row for rows, _ in seen for row in rows], []
    recipe = _recipe(tmp_path, tiny_model_dir, "warm", micro_batch_size=4, max_steps=16, noise_scale_split_every=2,
                     effective_batch_size="auto")
    auto = run(validate_recipe(recipe))
    assert auto.steps == fixed.steps == 16
    assert [row for rows, _ in seen for row in rows] == fixed_rows  # the same examples, in the same order
    assert all(len(rows) == 1 for rows, _ in seen[:4])  # the first loader batch: four chunks of one sequence
    rows = read_jsonl(auto.run_dir / "metrics.jsonl")
    events = [r for r in rows if r.get("event") == "batch_changed"]
    assert [(e["to"]["update_batch"], e["to"]["gradient_accumulation_steps"], e["to"]["effective_batch_size"])
            for e in events] == [(1, 1, 1), (2, 1, 2), (4, 1, 4), (4, 2, 8)]
    assert [e["from"]["update_batch"] for e in events] == [4, 1, 2, 4]
    # learning rate x sqrt(batch / 4): the recipe's learning rate is for one loader batch of 4
    assert [e["learning_rate"] for e in events] == pytest.approx([5e-4, 1e-3 / math.sqrt(2), 1e-3, 1e-3 * math.sqrt(2)])
    assert events[0]["step"] == 0 and events[0]["beta2"] == pytest.approx(0.999 ** 0.25)
    results = json.loads((auto.run_dir / "results.json").read_text())
    assert results["batch"]["effective_batch_size"] == 8 and results["batch"]["update_batch"] == 4

    seen[:] = []
    mid, resumed, again_rows = _resume_mid_ramp(auto.run_dir, recipe, tmp_path / "warm-resumed", "update_batch", 2)
    assert resumed.steps == 16
    assert [row for rows, _ in seen for row in rows] == fixed_rows[4 * int(mid.name.split("-")[1]):]
    _assert_same_losses(again_rows, rows)
    assert [e["to"] for e in again_rows if e.get("event") == "batch_changed"] == [e["to"] for e in events]


def test_out_of_memory_inside_a_sub_updated_step_redoes_only_the_updates_not_applied(
        tmp_path, tiny_model_dir, monkeypatch):
    """The failure is in the step's last update: its earlier updates were applied and are not run again; the
    losses and weights stay those of the run that never ran out of memory."""
    from finetune.train.recovery import FAULT_ENV

    monkeypatch.setattr(batch_engine, "update_batch", lambda gns, per_sequence, current, micro: current)
    seen = _forward_spy(monkeypatch)
    recipe = _recipe(tmp_path, tiny_model_dir, "plain", micro_batch_size=4, max_steps=4,
                     effective_batch_size="auto", noise_scale_split_every=3)
    plain = run(validate_recipe(recipe))
    plain_seen, seen[:] = list(seen), []
    monkeypatch.setenv(FAULT_ENV, "2")
    recovered = run(validate_recipe({**recipe, "output": {**recipe["output"], "dir": str(tmp_path / "oom")}}))
    monkeypatch.delenv(FAULT_ENV)
    rows = read_jsonl(recovered.run_dir / "metrics.jsonl")
    assert [r["to"] for r in rows if r.get("event") == "oom_recovered"] == \
        [{"micro_batch_size": 2, "gradient_accumulation_steps": 2}]
    # step 2's last update (one chunk of 1) ran twice, nothing else did
    retried = [i for i in range(1, len(seen)) if seen[i][0] == seen[i - 1][0]]
    assert len(seen) == len(plain_seen) + 1 and len(retried) == 1
    kept = seen[:retried[0]] + seen[retried[0] + 1:]
    assert [rows for rows, _ in kept] == [rows for rows, _ in plain_seen]
    assert [loss for _, loss in kept] == pytest.approx([loss for _, loss in plain_seen], rel=1e-5)
    a, b = _weights(plain.run_dir), _weights(recovered.run_dir)
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-7), name


def test_a_resume_with_a_recovery_s_accumulation_ends_the_warmup_with_a_recorded_change(
        tmp_path, tiny_model_dir, monkeypatch):
    """An out-of-memory recovery's settings (micro-batch 2 x 2 loader batches per loop step) leave no
    room for updates inside a loader batch on --resume: the run goes on with updates of the whole step, says
    so in a batch_changed row, and its learning rate follows the rules from the next step on."""
    from finetune.train.recovery import FAULT_ENV

    monkeypatch.setattr(batch_engine, "update_batch", lambda gns, per_sequence, current, micro: current)
    recipe = _recipe(tmp_path, tiny_model_dir, "warm-oom", micro_batch_size=4, max_steps=6, lr_scheduler="constant",
                     effective_batch_size="auto")
    monkeypatch.setenv(FAULT_ENV, "2")
    first = run(validate_recipe(recipe))
    monkeypatch.delenv(FAULT_ENV)
    copy = tmp_path / "warm-oom-resumed"
    shutil.copytree(first.run_dir, copy)
    for p in (copy / "checkpoints").glob("checkpoint-*"):
        if int(p.name.split("-")[1]) > 3:
            shutil.rmtree(p)
    resumed = run(validate_recipe({**recipe, "output": {**recipe["output"], "dir": str(copy)}}), resume=True)
    assert resumed.steps == 6
    rows = read_jsonl(copy / "metrics.jsonl")
    events = [r for r in rows if r.get("event") == "batch_changed"]
    assert [(e["step"], e["from"]["update_batch"], e["to"]["update_batch"]) for e in events] == [(0, 4, 1), (3, 1, 4)]
    lrs = {r["step"]: r["learning_rate"] for r in rows if "loss" in r}
    assert lrs[3] == pytest.approx(5e-4) and lrs[5] == lrs[6] == pytest.approx(1e-3)  # sqrt(1/4), then the recipe's


def test_kto_has_no_warmup_below_the_micro_batch(tmp_path, tiny_model_dir):
    """kto's reference point is the mean of its batch's answers: an update of one answer has no gradient, so
    the run keeps updates of the whole micro-batch (and records no warmup)."""
    from tests.test_preference_train import _recipe as preference_recipe

    result = run(preference_recipe(tmp_path, tiny_model_dir, "kto", training={
        "method": "kto", "micro_batch_size": 4, "effective_batch_size": "auto", "max_steps": 3}))
    rows = read_jsonl(result.run_dir / "metrics.jsonl")
    assert result.state == "completed" and not [r for r in rows if r.get("event") == "batch_changed"]
