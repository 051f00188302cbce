"""Out-of-memory recovery in `finetune run`, driven by FINETUNE_FAULT_OOM_AT_STEP on the CPU.

Exactness claim: a run that runs out of memory at step N and retries it with micro-batch B/2 and twice the
accumulation logs the same losses as a run that used B/2 from the start (the same examples in each step,
the same sum); only float summation order differs, so losses agree to rel 1e-5.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import yaml

from finetune.cli import main
from finetune.optim.layerwise import LayerwiseOptimizer
from finetune.recipe import validate_recipe
from finetune.rundir import RunDir, read_jsonl
from finetune.train.checkpoints import FAULT_ENV as CHECKPOINT_FAULT_ENV
from finetune.train.recovery import FAULT_ENV
from finetune.train.run import run
from tests.run_support import sums_data, tiny_lora_recipe

ROOT = Path(__file__).resolve().parents[1]
REL = 1e-5  # float summation order only (see the module docstring)


def _uniform_data(tmp_path: Path, n: int = 16) -> Path:
    """`n` records of the same length (no padding)."""
    path = tmp_path / "oom-data-uniform.jsonl"
    row = {"messages": [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "It is 4."}]}
    path.write_text((json.dumps(row) + "\n") * n)
    return path


def _recipe(tmp_path: Path, model_dir: Path, name: str, **sections) -> dict:
    return tiny_lora_recipe(model_dir, sums_data(tmp_path / "oom-data.jsonl", 16), tmp_path / name,
                            {"training": {"max_steps": 4, "learning_rate": 1e-2}}, sections)


def _run(monkeypatch, recipe: dict, fault: str | None = None):
    if fault:
        monkeypatch.setenv(FAULT_ENV, fault)
    else:
        monkeypatch.delenv(FAULT_ENV, raising=False)
    result = run(validate_recipe(recipe))
    monkeypatch.delenv(FAULT_ENV, raising=False)
    return result, read_jsonl(result.run_dir / "metrics.jsonl")


def _oom(row: dict) -> bool:
    """An out-of-memory event row (metrics.jsonl also has checkpoint_saved events)."""
    return str(row.get("event", "")).startswith("oom")


def _losses(rows: list[dict]) -> dict[int, float]:
    steps = [r["step"] for r in rows if "loss" in r]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


_REFERENCES: dict[str, dict[int, float]] = {}


def _reference(tmp_path_factory, model_dir: Path, monkeypatch, **sections) -> dict[int, float]:
    """Losses of an uninterrupted run at the smaller micro-batch (cached: several tests compare with it)."""
    key = json.dumps(sections, sort_keys=True)
    sections.pop("tag", None)  # only tells cached references apart
    if key not in _REFERENCES:
        tmp = tmp_path_factory.mktemp("reference")
        _, rows = _run(monkeypatch, _recipe(tmp, model_dir, "reference", **sections))
        _REFERENCES[key] = _losses(rows)
    return _REFERENCES[key]


@pytest.mark.parametrize("case", [
    pytest.param(dict(training={"micro_batch_size": 4, "gradient_accumulation_steps": 1}, fault="3",
                      smaller={"micro_batch_size": 2, "gradient_accumulation_steps": 2}), id="accumulation-1"),
    # accumulation > 1 (the earlier micro-batch's partial gradients are dropped) with disk offload, for a
    # model that takes no loss kwargs: the Trainer divides each micro-batch mean by the micro-batch count.
    # A mean over 2 examples weighs tokens unlike 2 single-example means, so the data is uniform here.
    pytest.param(dict(training={"micro_batch_size": 2, "gradient_accumulation_steps": 2}, fault="2",
                      memory={"offload": "disk", "offload_min_size": 0}, no_loss_kwargs=True,
                      smaller={"micro_batch_size": 1, "gradient_accumulation_steps": 4}), id="accumulation-2-disk"),
    # layer-wise: immediate updates in backward before the OOM, accumulate mode after (no clipping, so the
    # two modes apply the same update and the reference is comparable from step 1)
    pytest.param(dict(training={"micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_grad_norm": None},
                      optimizer={"layerwise": True}, fault="2",
                      smaller={"micro_batch_size": 1, "gradient_accumulation_steps": 2}), id="layerwise"),
])
def test_recovered_run_equals_a_run_at_the_smaller_micro_batch(tmp_path, tmp_path_factory, tiny_model_dir,
                                                               monkeypatch, case):
    sections = {k: v for k, v in case.items() if k not in ("fault", "smaller", "no_loss_kwargs")}
    if case.get("no_loss_kwargs"):
        from finetune.train import loop

        monkeypatch.setattr(loop, "accepts_loss_kwargs", lambda model: False)
        sections["data"] = {"path": str(_uniform_data(tmp_path))}
    from finetune.train.peak_memory import PeakMemory
    from finetune.train.recovery import OOMRecovery

    switch, restart, seen = OOMRecovery._switch, PeakMemory.restart, {}

    def spy_switch(self, loop, choice):
        switch(self, loop, choice)
        seen["eval_batch"] = loop.geometry.part_rows

    def spy_restart(self, predicted):
        restart(self, predicted)
        seen["predicted"], seen["warned"] = self.predicted, self.warned

    monkeypatch.setattr(OOMRecovery, "_switch", spy_switch)
    monkeypatch.setattr(PeakMemory, "restart", spy_restart)
    result, rows = _run(monkeypatch, _recipe(tmp_path, tiny_model_dir, "oom", **sections), case["fault"])
    assert result.state == "completed" and result.steps == 4

    events = [r for r in rows if r.get("event") == "oom_recovered"]
    step = int(case["fault"])
    smaller = case["smaller"]
    # the row carries the last completed step (what a resume keeps), oom_step the failed one
    assert [(e["step"], e["oom_step"]) for e in events] == [(step - 1, step)]
    assert events[0]["to"] == smaller  # by the settings table's names
    assert seen["eval_batch"] == smaller["micro_batch_size"]  # evaluation follows the new micro-batch
    plan = json.loads((result.run_dir / "plan.json").read_text())  # re-planned for the new settings
    assert plan["settings"]["micro_batch_size"] == smaller["micro_batch_size"]
    assert seen["predicted"] == plan["peak_bytes"] and seen["warned"] is False
    status = json.loads((result.run_dir / "status.json").read_text())
    assert status["state"] == "completed" and status["oom_recovered"]["step"] == step  # not overwritten
    saved = yaml.safe_load((result.run_dir / "recipe.yaml").read_text())
    assert {k: saved["training"][k] for k in smaller} == smaller
    assert "out of memory at step" in (result.run_dir / "train.log").read_text()
    offload_dir = result.run_dir / "offload"
    assert not offload_dir.exists() or not any(p.is_file() for p in offload_dir.rglob("*")), "offload files left"

    reference = _reference(tmp_path_factory, tiny_model_dir, monkeypatch,
                           **{**sections, "training": {**sections["training"], **smaller}},
                           **({"tag": {"no_loss_kwargs": True}} if case.get("no_loss_kwargs") else {}))
    losses = _losses(rows)
    assert sorted(losses) == [1, 2, 3, 4]
    for s in losses:
        assert losses[s] == pytest.approx(reference[s], rel=REL), f"step {s}"


def test_kill_right_after_a_recovery_then_resume_continues_with_the_recovered_settings(tmp_path, tiny_model_dir,
                                                                                         monkeypatch):
    """The recipe says micro-batch 4 (not auto); the recovery's 2 x 2 must win on --resume. With dropout on,
    the resumed steps 3-4 (a loader at micro-batch 2, RNG from checkpoint-2) equal the ones the killed run
    logged after its in-process recovery: the same examples, and the RNG put back to the step's start."""
    recipe = _recipe(tmp_path, tiny_model_dir, "killed", adapter={"dropout": 0.1},
                     training={"micro_batch_size": 4, "gradient_accumulation_steps": 1},
                     output={"save_steps": 2})
    path = tmp_path / "killed.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", FAULT_ENV: "3",
           CHECKPOINT_FAULT_ENV: "hang@4"}
    proc = subprocess.Popen([sys.executable, "-m", "finetune", "run", str(path)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    hang = tmp_path / "killed" / "checkpoints" / ".staging" / "checkpoint-4" / "FAULT_HANG"
    deadline = time.time() + 240
    while not hang.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert json.loads(RunDir(tmp_path / "killed").recovered.read_text())["settings"] == {
        "micro_batch_size": 2, "gradient_accumulation_steps": 2}
    before_kill = _losses(read_jsonl(tmp_path / "killed" / "metrics.jsonl"))
    assert sorted(before_kill) == [1, 2, 3, 4]

    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert main(["run", str(path), "--resume"]) == 0  # resumes from checkpoint-2
    saved = yaml.safe_load((tmp_path / "killed" / "recipe.yaml").read_text())
    assert (saved["training"]["micro_batch_size"], saved["training"]["gradient_accumulation_steps"]) == (2, 2)
    resumed = _losses(read_jsonl(tmp_path / "killed" / "metrics.jsonl"))
    assert sorted(resumed) == [1, 2, 3, 4]
    for s in resumed:
        assert resumed[s] == pytest.approx(before_kill[s], rel=REL), f"step {s}"


def test_at_micro_batch_1_the_alternatives_come_in_order_then_a_clear_error_and_a_checkpoint(
        tmp_path, tiny_model_dir, monkeypatch, capsys):
    recipe = _recipe(tmp_path, tiny_model_dir, "ladder",
                     training={"micro_batch_size": 1, "gradient_accumulation_steps": 2},
                     memory={"tiled_mlp_tokens": 16, "offload_min_size": 0})
    path = tmp_path / "ladder.yaml"
    path.write_text(yaml.safe_dump(recipe))
    monkeypatch.setenv(FAULT_ENV, "2,2,2,2,2,2")  # step 2 fails six times: five alternatives, then none left
    code = main(["run", str(path)])
    out = capsys.readouterr()
    assert code != 0
    assert "Traceback" not in out.out + out.err
    assert "out of memory at step 2" in out.err and "need a budget of" in out.err and "checkpoint-1" in out.err

    run_dir = tmp_path / "ladder"
    rows = read_jsonl(run_dir / "metrics.jsonl")
    changes = [r["to"] for r in rows if r.get("event") == "oom_recovered"]
    assert changes == [{"activation_checkpointing": True}, {"offload": "disk"},
                       {"chunked_loss": True}, {"tiled_mlp": True}, {"offload_weights": "disk"}]
    assert [r["event"] for r in rows if _oom(r)][-1] == "oom_gave_up"
    assert sorted(_losses(rows)) == [1]
    assert (run_dir / "checkpoints" / "checkpoint-1").is_dir()
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
    assert not any(p.is_file() for p in (run_dir / "offload").rglob("*")), "offload files left"

    monkeypatch.delenv(FAULT_ENV)  # more memory now: --resume continues from checkpoint-1 with the leanest plan
    assert main(["run", str(path), "--resume"]) == 0
    saved = yaml.safe_load((run_dir / "recipe.yaml").read_text())["memory"]
    assert (saved["activation_checkpointing"], saved["offload"], saved["chunked_loss"], saved["tiled_mlp"],
            saved["offload_weights"]) == (True, "disk", True, True, "disk")
    resumed = read_jsonl(run_dir / "metrics.jsonl")
    assert sorted(_losses(resumed)) == [1, 2, 3, 4]
    # the events of the interrupted run (logged at the checkpoint's step 1) survive the resume's truncation
    assert [r["event"] for r in resumed if _oom(r)] == [r["event"] for r in rows if _oom(r)]


def test_with_every_other_rung_on_the_recovery_streams_the_weights(tmp_path, tmp_path_factory, tiny_model_dir,
                                                                   monkeypatch):
    """Checkpointing, activation offload, chunked loss and tiled MLP already on at micro-batch 1: an out-of-memory
    error turns on weight streaming (disk, on a CPU run) for the live model; the step is redone and the run trains
    the losses of an uninterrupted run, its weight files gone at the end."""
    memory = {"activation_checkpointing": True, "offload": "disk", "offload_min_size": 0, "chunked_loss": True,
              "tiled_mlp": True, "tiled_mlp_tokens": 16}
    training = {"micro_batch_size": 1, "gradient_accumulation_steps": 2}
    reference = _reference(tmp_path_factory, tiny_model_dir, monkeypatch, training=training, memory=memory)
    result, rows = _run(monkeypatch, _recipe(tmp_path, tiny_model_dir, "streamed", training=training, memory=memory),
                        "2")
    assert [r["to"] for r in rows if r.get("event") == "oom_recovered"] == [{"offload_weights": "disk"}]
    losses = _losses(rows)
    assert sorted(losses) == [1, 2, 3, 4]
    for s in losses:
        assert losses[s] == pytest.approx(reference[s], rel=REL), f"step {s}"
    assert not any(p.is_file() for p in (result.run_dir / "offload").rglob("*")), "offload files left"


@pytest.mark.parametrize("where", ["optimizer", "clip"])
def test_oom_in_the_optimizer_update_saves_the_last_step_and_names_the_smallest_budget(
        tmp_path, tiny_model_dir, monkeypatch, capsys, where):
    """FINETUNE_FAULT_OOM_AT_STEP=2:optimizer (or gradient clipping running out of memory): the update of
    step 2 changed nothing, so checkpoint-1 is saved, the message names a budget, and the event row survives."""
    path = tmp_path / "update.yaml"
    path.write_text(yaml.safe_dump(_recipe(tmp_path, tiny_model_dir, "update", training={"max_steps": 2})))
    if where == "optimizer":
        monkeypatch.setenv(FAULT_ENV, "2:optimizer")
    else:
        from finetune.train.loop import TrainLoop

        clip = TrainLoop.grad_norm

        def failing_clip(self):
            if self.state.step == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated in clipping)")
            return clip(self)

        monkeypatch.setattr(TrainLoop, "grad_norm", failing_clip)
    assert main(["run", str(path)]) != 0
    err = capsys.readouterr().err
    assert "out of memory at step 2" in err and "optimizer update" in err and "need a budget of" in err
    assert "checkpoint-1" in err and "Traceback" not in err
    run_dir = tmp_path / "update"
    assert (run_dir / "checkpoints" / "checkpoint-1").is_dir()
    events = [r for r in read_jsonl(run_dir / "metrics.jsonl") if _oom(r)]
    assert [(e["event"], e["step"], e["oom_step"]) for e in events] == [("oom_gave_up", 1, 2)]


def test_an_offload_tier_whose_preflight_fails_mid_recovery_is_passed_over(tmp_path, tiny_model_dir, monkeypatch):
    """The disk rung's offload_dir check fails (full disk, say): the recovery takes the next rung instead."""
    import finetune.train.recovery as recovery
    from finetune.memory.offload_disk import OffloadDirError

    def full(model, memory, *args, **kwargs):
        if memory.offload == "disk":
            raise OffloadDirError("memory.offload_dir: 0 bytes free (simulated)")

    monkeypatch.setattr(recovery, "preflight_offload", full)
    result, rows = _run(monkeypatch, _recipe(tmp_path, tiny_model_dir, "preflight", training={
        "max_steps": 2, "micro_batch_size": 1, "gradient_accumulation_steps": 1}), "2,2")
    assert result.state == "completed" and result.steps == 2
    assert [r["to"] for r in rows if r.get("event") == "oom_recovered"] == [
        {"activation_checkpointing": True}, {"chunked_loss": True}]


def test_out_of_memory_in_evaluation_is_a_clear_error_with_the_completed_step_saved(
        tmp_path, tiny_model_dir, monkeypatch, capsys):
    from finetune.train.objectives import LossObjective

    def oom(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (simulated in evaluation)")

    monkeypatch.setattr(LossObjective, "evaluate", oom)
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(_recipe(tmp_path, tiny_model_dir, "eval", training={"max_steps": 1},
                                           data={"validation_split": 0.25})))
    assert main(["run", str(path)]) != 0
    err = capsys.readouterr().err
    assert "out of memory in evaluation after step 1 at eval micro-batch" in err and "Traceback" not in err
    assert (tmp_path / "eval" / "checkpoints" / "checkpoint-1").is_dir()


def test_the_cpu_tracker_peak_restarts_after_a_recovery():
    """PeakMemory.restart: the failed attempt's high-water mark does not stay the run's peak."""
    from finetune.memory.tracker import MemoryTracker
    from finetune.train.peak_memory import PeakMemory

    callback = PeakMemory(predicted_peak_bytes=10)
    callback.tracker, callback.warned = MemoryTracker(), True
    with callback.tracker:
        big = torch.ones(1 << 16)
        del big
        kept = torch.ones(16)
        high = callback.peak()["peak_bytes"]
        callback.restart(predicted_peak_bytes=1234)
        low = callback.peak()["peak_bytes"]
    assert high >= (1 << 16) * 4 > low >= kept.numel() * 4
    assert (callback.predicted, callback.warned) == (1234, False)


def test_oom_recovery_json_of_earlier_versions_keyed_by_recipe_key_is_still_read(tmp_path):
    from finetune.train.recovery import recovered_settings

    RunDir(tmp_path).recovered.write_text(json.dumps({"settings": {"training.micro_batch_size": 2,
                                                                    "memory.offload": "disk"}}))
    assert recovered_settings(tmp_path) == {"micro_batch_size": 2, "offload": "disk"}


def test_an_adamw_step_that_runs_out_of_memory_while_allocating_its_state_changed_nothing(monkeypatch):
    """AdamW creates its state (step 0) in _init_group before updating any weight; an OOM there leaves the
    weights untouched, and the lazily created state is dropped. A finished step counts as applied."""
    from finetune.train.recovery import _step_counts, _undo_lazy_state

    model = torch.nn.Linear(4, 2)
    model(torch.ones(3, 4)).sum().backward()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    before = [p.detach().clone() for p in model.parameters()]

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated: the update's temporaries do not fit")

    monkeypatch.setattr(sys.modules["torch.optim.adam"], "adam", oom)  # AdamW.step is Adam.step: _init_group, then adam()
    counts = _step_counts(opt)
    with pytest.raises(torch.OutOfMemoryError):
        opt.step()
    assert len(opt.state) == 2  # the state was allocated before the update
    assert not _undo_lazy_state(opt, counts) and not opt.state
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    monkeypatch.undo()
    opt.step()
    assert _undo_lazy_state(opt, counts)


def test_layerwise_immediate_updates_cannot_be_discarded_once_a_hook_ran():
    """Why the recovery refuses (with a message) an OOM that hits a layer-wise backward mid-way: the hooks
    that already ran updated their weights. Before any hook ran, or in accumulate mode, it can retry."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    params = [{"params": list(model.parameters())}]
    opt = LayerwiseOptimizer(params, lambda groups, seed_offset: torch.optim.SGD(groups, lr=0.1))
    assert opt.discard_pending()  # nothing ran yet
    model(torch.ones(2, 4)).sum().backward()
    assert not opt.discard_pending()  # weights moved inside backward
    opt.remove_hooks()

    accumulate = LayerwiseOptimizer([{"params": list(model.parameters())}],
                                    lambda groups, seed_offset: torch.optim.SGD(groups, lr=0.1), steps_per_update=2)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 4)).sum().backward()
    assert accumulate.discard_pending()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_out_of_memory_outside_the_step_is_a_clear_error(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """An optimizer update or evaluation that runs out of memory cannot be redone: a message, no traceback."""
    import finetune.train.run as run_module

    def oom(recipe, run_dir, *args, **kwargs):
        run_dir.append_metrics({"step": 1, "loss": 1.0})  # after a step: the folder is kept (none would be)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(run_module, "_plan_build_train", oom)
    path = tmp_path / "outside.yaml"
    path.write_text(yaml.safe_dump(_recipe(tmp_path, tiny_model_dir, "outside")))
    assert main(["run", str(path)]) != 0
    err = capsys.readouterr().err
    assert "out of memory outside the forward/backward" in err and "Tried to allocate 2.00 GiB" in err
    assert "Traceback" not in err
    assert json.loads((tmp_path / "outside" / "status.json").read_text())["state"] == "failed"


def test_layerwise_oom_after_weights_moved_stops_clearly_and_resume_continues_cheaper(
        tmp_path, tmp_path_factory, tiny_model_dir, monkeypatch, capsys):
    """A real OOM in the middle of a layer-wise (immediate) backward: weights already updated cannot be
    restored, so the run stops with a message; --resume redoes the step from checkpoint-1, cheaper."""
    sections = dict(training={"micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_grad_norm": None},
                    optimizer={"layerwise": True})
    path = tmp_path / "lw.yaml"
    path.write_text(yaml.safe_dump(_recipe(tmp_path, tiny_model_dir, "lw", output={"save_steps": 1}, **sections)))
    hook, calls = LayerwiseOptimizer._hook, []

    def failing_hook(self, p):
        calls.append(p)
        if len(calls) == len(self.inner) + 2:  # step 2, after its first weight was updated
            raise torch.OutOfMemoryError("CUDA out of memory (simulated inside backward)")
        hook(self, p)

    monkeypatch.setattr(LayerwiseOptimizer, "_hook", failing_hook)
    assert main(["run", str(path)]) != 0
    err = capsys.readouterr().err
    assert "layer-wise optimizer had already updated" in err and "--resume" in err and "Traceback" not in err
    monkeypatch.setattr(LayerwiseOptimizer, "_hook", hook)
    assert not (tmp_path / "lw" / "checkpoints" / "checkpoint-2").exists()

    assert main(["run", str(path), "--resume"]) == 0
    losses = _losses(read_jsonl(tmp_path / "lw" / "metrics.jsonl"))
    reference = _reference(tmp_path_factory, tiny_model_dir, monkeypatch,
                           **{**sections, "training": {**sections["training"], "micro_batch_size": 1,
                                                       "gradient_accumulation_steps": 2}})
    assert sorted(losses) == [1, 2, 3, 4]
    for s in losses:
        assert losses[s] == pytest.approx(reference[s], rel=REL), f"step {s}"


def test_the_ladder_keeps_the_effective_batch_and_skips_what_is_on_or_predicted_not_to_fit(tmp_path, tiny_model_dir):
    from types import SimpleNamespace

    from finetune.train.oom_ladder import cheaper, rungs, settings_of

    recipe = validate_recipe(_recipe(tmp_path, tiny_model_dir, "ladder-unit",
                                     training={"micro_batch_size": 6, "gradient_accumulation_steps": 3}))
    fits = lambda r: SimpleNamespace(fits=True)  # noqa: E731
    seen = []
    for splits in (1, 2):  # 6 -> 3 (k=2) -> 1 (k=6): the next divisor of 6, effective batch 18 throughout
        step = cheaper(recipe, 6, 3, splits, fits)
        t = step.recipe.training
        seen.append((step.splits, t.micro_batch_size, t.gradient_accumulation_steps))
    assert seen == [(2, 3, 6), (6, 1, 18)]

    on_cuda = [list(r.items())[0] for r in rungs(recipe, "cuda")]  # the tier table's order
    assert on_cuda == [("activation_checkpointing", True), ("offload", "cpu"),
                       ("offload", "disk"), ("chunked_loss", True),  # 64 tokens: tiling is a no-op
                       ("offload_weights", "cpu")]  # last: streaming the weights costs link time
    assert ("offload_weights", "disk") in [list(r.items())[0] for r in rungs(recipe, "cpu")]
    several = validate_recipe(_recipe(tmp_path, tiny_model_dir, "ladder-unit", distributed={"gpus": 2}))
    assert "offload_weights" not in {k for r in rungs(several, "cuda") for k in r}  # the schema refuses it
    assert ("offload", "cpu") not in [list(r.items())[0] for r in rungs(recipe, "cpu")]  # RAM is the device
    assert ("offload", "disk") not in [list(r.items())[0] for r in rungs(recipe, "cuda", frozenset({"disk"}))]
    # At micro-batch 1 a rung the planner says does not fit is passed over; the next one is taken with it.
    one = validate_recipe(_recipe(tmp_path, tiny_model_dir, "ladder-unit", training={"micro_batch_size": 1}))
    predicted = lambda r: SimpleNamespace(fits=r.memory.offload == "disk")  # noqa: E731
    step = cheaper(one, 1, 1, 1, predicted)
    assert {k: v for k, v in settings_of(step.recipe).items() if settings_of(one)[k] != v} == {
        "activation_checkpointing": True, "offload": "disk"}
    never = lambda r: SimpleNamespace(fits=False, min_budget_bytes=123 << 20, peak_bytes=0)  # noqa: E731
    assert cheaper(one, 1, 1, 1, never).recipe is None and cheaper(one, 1, 1, 1, never).min_budget_bytes == 123 << 20


def _capped_cuda(cap: int) -> types.SimpleNamespace:
    """A test double of torch.cuda's memory queries: an 80 GiB GPU with 60 GiB free, this process's
    allocator capped by set_per_process_memory_fraction to `cap` bytes."""
    total = 80 << 30
    return types.SimpleNamespace(is_available=lambda: True, mem_get_info=lambda: (60 << 30, total),
                                 memory_reserved=lambda: 1 << 30, get_per_process_memory_fraction=lambda: cap / total)


def test_usable_gpu_memory_respects_a_per_process_cap(monkeypatch):
    from finetune.memory import device_memory
    from finetune.plan import search

    monkeypatch.setattr(device_memory, "torch", types.SimpleNamespace(cuda=_capped_cuda(8 << 30)))
    assert device_memory.usable_gpu_memory() == 8 << 30  # not the 61 GiB free + reserved
    assert search._free_memory("cuda") == 8 << 30  # gpu_memory: auto budgets the same cap
    monkeypatch.setattr(device_memory, "torch", types.SimpleNamespace(cuda=_capped_cuda(80 << 30)))
    assert device_memory.usable_gpu_memory() == 61 << 30  # no cap: free plus what the allocator holds


def test_recovery_under_a_per_process_cap_plans_within_the_cap(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """A cap below what every cheaper plan needs: recovery gives up (as the capped GPU would) instead of
    re-planning with the whole GPU's free memory and retrying a plan that cannot fit under the cap."""
    from finetune.memory import device_memory

    cap = 768 << 20  # the tiny model's leanest plan needs more (on CPU the planner predicts ~0.5 GiB + margin)
    monkeypatch.setattr(device_memory, "torch", types.SimpleNamespace(cuda=_capped_cuda(cap)))
    recipe = _recipe(tmp_path, tiny_model_dir, "capped", training={"micro_batch_size": 1, "gradient_accumulation_steps": 2})
    path = tmp_path / "capped.yaml"
    path.write_text(yaml.safe_dump(recipe))
    monkeypatch.setenv(FAULT_ENV, "2")
    assert main(["run", str(path)]) != 0
    assert "768.00 MiB usable now" in capsys.readouterr().err
    events = [r for r in read_jsonl(tmp_path / "capped" / "metrics.jsonl") if _oom(r)]
    assert [e["event"] for e in events] == ["oom_gave_up"]
