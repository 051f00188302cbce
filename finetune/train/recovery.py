"""Out-of-memory recovery: an optimizer step that runs out of memory is redone, exactly, with a cheaper plan.

Why exact: the loader keeps the run's batch size and the update's batches are run again split into smaller
micro-batches, so the schedule, the optimizer state and the examples continue as if the run had used the
smaller micro-batch from the start.

More in docs/memory.md, "In the code: finetune/train/recovery.py".
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from finetune.console import console
from finetune.errors import FinetuneError
from finetune.memory.device_memory import usable_gpu_memory
from finetune.memory.layer_recompute import apply_layer_recompute
from finetune.memory.offload import activation_offload, offload_dir_for, preflight_offload
from finetune.memory.offload_disk import OffloadDirError
from finetune.memory.weight_store import host_room, offload_weights
from finetune.model.family import decoder_layers
from finetune.model.vision import inputs_require_grad
from finetune.plan import predict
from finetune.recipe.load import recipe_to_yaml
from finetune.recipe.resolved import resolve
from finetune.recipe.schema import Recipe
from finetune.recipe.settings import read_settings, write_settings
from finetune.recipe.settings import table as settings_table
from finetune.rundir import RunDir, atomic_write_json, atomic_write_text
from finetune.step.training_step import enable_checkpointing
from finetune.train.oom_ladder import Cheaper, cheaper, settings_of
from finetune.train.peak_memory import PeakMemory
from finetune.train.plan_files import save_plan
from finetune.train.policy import Geometry, Part, Policy, Step, Update
from finetune.units import format_bytes

FAULT_ENV = "FINETUNE_FAULT_OOM_AT_STEP"


def fault_steps() -> Counter:
    """FINETUNE_FAULT_OOM_AT_STEP as a count of injected failures per (optimizer step, "forward"|"optimizer")."""
    spec = os.environ.get(FAULT_ENV, "").strip()
    faults: Counter = Counter()
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        step, _, where = item.partition(":")
        if not step.isdigit() or where not in ("", "optimizer"):
            raise FinetuneError(f"{FAULT_ENV}={spec!r}: {item!r} is not a step number or STEP:optimizer",
                                hint=f"e.g. {FAULT_ENV}=3, {FAULT_ENV}=3,3,7 or {FAULT_ENV}=2:optimizer; "
                                     "unset it for normal runs")
        faults[(int(step), where or "forward")] += 1
    return faults


class OOMRecovery(Policy):
    """The loop's steps survive running out of memory (see the module docstring).

    `recipe`: the run's resolved recipe (the ladder's starting point; `self.recipe` is the recipe as it trains
    now: the recovered memory settings with the micro-batch and accumulation of the loop's geometry, the one
    record of them); on_recovery(event, recipe) is told each switch to a cheaper plan (and
    the final give-up) so the run directory can record it; run_root is where a newly turned-on disk offload
    keeps its files (the new ActivationOffload goes to the loop through `set_memory`; the run closes the last).
    """

    def __init__(self, recipe: Recipe, run_root: Path, on_recovery: Callable[[dict, Recipe], None]):
        self._settings = recipe  # its memory settings; the batch is the loop geometry's once training began
        self._geometry: Geometry | None = None
        self.run_root = run_root
        self.on_recovery = on_recovery
        self._faults = fault_steps()
        self._counts: dict[int, float | None] = {}

    @property
    def recipe(self) -> Recipe:
        """The recipe as the run trains now: the recovered settings, the micro-batch and accumulation of the
        loop's geometry (a loader batch in `splits` parts is micro-batch/splits, splits times the
        accumulation)."""
        g = self._geometry
        if g is None:
            return self._settings
        return write_settings(self._settings, {"micro_batch_size": g.part_rows,
                                               "gradient_accumulation_steps": g.accumulation * g.splits})

    def on_train_begin(self, loop) -> None:
        self._geometry = loop.geometry

    def around_micro_batch(self, loop, part: Part, run) -> torch.Tensor:
        """FINETUNE_FAULT_OOM_AT_STEP: a one-shot hook that raises in the last decoder layer's forward of the
        step's last micro-batch."""
        step = loop.state.step + 1
        if not part.last or not self._faults.get((step, "forward")):
            return run()
        self._faults[(step, "forward")] -= 1
        with _FaultHook(decoder_layers(loop.model)[-1], step):
            return run()

    def before_update(self, loop, update: Update) -> None:
        self._counts = _step_counts(_raw(loop.optimizer))
        step = loop.state.step + 1
        if self._faults.get((step, "optimizer")) and loop.is_last_update(update):
            self._faults[(step, "optimizer")] -= 1
            raise torch.OutOfMemoryError(f"{FAULT_ENV}: injected out-of-memory error in optimizer step {step}")

    def on_oom(self, loop, step: Step, failure: str, phase: str) -> bool:
        if phase == "update":
            self._update_failed(loop, step, failure, applied=_undo_lazy_state(_raw(loop.optimizer), self._counts))
        return self._recover(loop, step, failure)

    def _ladder(self, loop, recipe: Recipe, splits: int, budget: int | None, unusable=frozenset()) -> Cheaper:
        g = loop.geometry
        return cheaper(recipe, g.micro_batch, g.accumulation, splits,
                       lambda r: predict(r, gpu_memory=budget, training_only=True), unusable)

    def _update_failed(self, loop, step: Step, failure: str, applied: bool) -> None:
        """An OOM in the update: no retry (the gradients are gone once freed); stop with the smallest budget."""
        budget = usable_gpu_memory()
        recipe, splits = self.recipe, loop.geometry.splits
        while True:  # the leanest rung's budget, by the planner
            choice = self._ladder(loop, recipe, splits, budget)
            if choice.recipe is None:
                break
            recipe, splits = choice.recipe, choice.splits
        self._give_up(loop, step, failure, choice.min_budget_bytes, budget, save=not applied,
                      where="in the optimizer update, which is not retried")

    def _recover(self, loop, step: Step, failure: str) -> bool:
        """Switch to the next cheaper plan (or give up); the loop then runs the step again."""
        budget = usable_gpu_memory()
        choice = self._next_plan(loop, budget)
        if choice.recipe is None:
            self._give_up(loop, step, failure, choice.min_budget_bytes, budget)
        before, after = settings_of(self.recipe), settings_of(choice.recipe)
        event = {"event": "oom_recovered" if loop.undone else "oom_unrecoverable", "step": step.number,
                 "error": failure, "from": {k: v for k, v in before.items() if after[k] != v},
                 "to": {k: v for k, v in after.items() if before[k] != v}}
        if budget is not None:
            event["gpu_memory_bytes"] = budget
        if not loop.undone:  # the cheaper settings are recorded for --resume, which restarts from the checkpoint
            self.on_recovery(event, choice.recipe)
            raise FinetuneError(
                f"out of memory at step {step.number} ({failure}) after the layer-wise optimizer had already "
                "updated some weights inside backward; that cannot be undone, so the run stops without saving them",
                hint=f"run again with --resume: it continues from the last checkpoint with {_changes(event)}")
        self._switch(loop, choice)
        self.on_recovery(event, self.recipe)
        return True

    def _next_plan(self, loop, budget: int | None) -> Cheaper:
        """The next rung; one that turns on an offload tier whose preflight fails (a full or unwritable
        offload_dir) is passed over, with the tier left out of the rest of the ladder."""
        unusable: set[str] = set()
        while True:
            choice = self._ladder(loop, self.recipe, loop.geometry.splits, budget, frozenset(unusable))
            new = choice.recipe
            if new is None or new.memory.offload == self.recipe.memory.offload:
                return choice
            try:
                preflight_offload(loop.model, new.memory, self.run_root, loop.geometry.micro_batch // choice.splits,
                                  new.data.max_seq_len)
                return choice
            except OffloadDirError as exc:
                console.print(f"[yellow]out-of-memory recovery: offload {new.memory.offload} is unusable "
                              f"({exc.message}); trying the next alternative")
                unusable.add(new.memory.offload)

    def _switch(self, loop, choice: Cheaper) -> None:
        old, new = resolve(self.recipe).settings, resolve(choice.recipe).settings
        model = loop.accelerator.unwrap_model(loop.model)
        if new.activation_checkpointing and not old.activation_checkpointing:
            enable_checkpointing(model, True, new.checkpoint_every_n_layers)
            if self.recipe.adapter.type != "full":
                inputs_require_grad(model)  # a frozen base: see finetune.model.adapter.apply_adapter
        if new.offload != old.offload:
            loop.set_memory(offload=activation_offload(loop.model, choice.recipe.memory, self.run_root))
        if new.chunked_loss != old.chunked_loss:
            loop.set_memory(chunked_loss=new.chunked_loss)
        if new.tiled_mlp and not old.tiled_mlp:
            apply_layer_recompute(loop.model, False, choice.recipe.memory.tiled_mlp_tokens)
        if new.offload_weights != old.offload_weights:  # the run closes the store (weight_store_of) when it ends
            memory = choice.recipe.memory
            offload_weights(model, new.offload_weights, new.offload_weights_ahead,
                            host_room(memory.offload_cpu_limit), offload_dir_for(memory, self.run_root),
                            resident=new.offload_weights_resident)
        loop.set_geometry(splits=choice.splits)
        self._settings = choice.recipe

    def _give_up(self, loop, step: Step, failure: str, needed: int | None, budget: int | None,
                 save: bool = True, where: str = "with the leanest settings left") -> None:
        """No cheaper plan: save the last completed step (when nothing of this one was applied) and stop."""
        loop.rewind_rng(step)
        if not save or step.applied:
            kept = "the optimizer had already changed part of the model, so nothing is saved now; " + loop.kept()
        elif loop.state.step > 0:
            loop.save_now()
            kept = loop.kept()
        else:
            kept = "no step had completed, so there is no checkpoint"
        self.on_recovery({"event": "oom_gave_up", "step": step.number, "error": failure, "needed_bytes": needed},
                         self.recipe)
        free = f" ({format_bytes(budget)} usable now)" if budget is not None else ""
        need = f"the planner's leanest settings need a budget of {format_bytes(needed)}" if needed \
            else "the planner could not name a budget that works"
        raise FinetuneError(
            f"out of memory at step {step.number} {where}{free}: {need}; {kept}",
            hint="free GPU memory (close other programs on the GPU), or use a smaller model or quantization.bits: "
                 "4, then run again with --resume")


def _raw(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)


def _step_counts(optimizer: torch.optim.Optimizer) -> dict[int, float | None]:
    """Each parameter state's `step` counter (None without one), to tell whether an update began."""
    return {id(p): float(s["step"]) if "step" in s else None for p, s in optimizer.state.items()}


def _undo_lazy_state(optimizer: torch.optim.Optimizer, before: dict[int, float | None]) -> bool:
    """After an OOM in optimizer.step(): True when it may have changed something. Torch optimizers count
    `step` before they touch a weight, so unchanged counters mean nothing was applied; the state created
    lazily for the first step (counter 0) is dropped again so a checkpoint holds the state before it."""
    applied = False
    for p in list(optimizer.state):
        state = optimizer.state[p]
        count = float(state["step"]) if "step" in state else None
        if id(p) not in before:
            if count == 0:
                del optimizer.state[p]
            else:
                applied = True
        elif count is None or count != before[id(p)]:
            applied = True
    return applied


class _FaultHook:
    """Raises torch.OutOfMemoryError from `layer`'s forward, once (a checkpointed recompute is not hit)."""

    def __init__(self, layer: torch.nn.Module, step: int):
        self.layer, self.step, self.handle = layer, step, None

    def _raise(self, module, args, output):
        self.handle.remove()
        raise torch.OutOfMemoryError(f"{FAULT_ENV}: injected out-of-memory error at step {self.step}")

    def __enter__(self):
        self.handle = self.layer.register_forward_hook(self._raise)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def record_recovery(run_dir: RunDir, max_steps: int, peak: PeakMemory,
                    status_fields: dict) -> Callable[[dict, Recipe], None]:
    """on_recovery for a run directory: metrics.jsonl row, train.log, status.json, the console, and the new
    settings in recipe.yaml and oom_recovery.json (which --resume keeps, even for keys that were not auto).
    A recovery also re-plans: plan.json/plan.png and the peak check follow the new settings."""
    def record(event: dict, recipe: Recipe) -> None:
        # The row carries the last completed step (what a resume's checkpoint holds, so the row survives
        # its truncation); oom_step is the step that ran out of memory.
        run_dir.append_metrics({**event, "step": event["step"] - 1, "oom_step": event["step"]})
        if "to" not in event:
            run_dir.log_line(f"out of memory at step {event['step']}: no cheaper plan left")
            return
        done = "retrying the step" if event["event"] == "oom_recovered" else "stopping; --resume continues"
        line = f"out of memory at step {event['step']}; {done} with {_changes(event)}"
        run_dir.log_line(line)
        console.print(f"[yellow]{line}")
        atomic_write_text(run_dir.recipe, recipe_to_yaml(recipe))
        saved = recovered_settings(run_dir.root)
        saved.update(event["to"])
        atomic_write_json(run_dir.recovered, {"settings": saved})
        status_fields["oom_recovered"] = event  # kept in every later status.json
        run_dir.write_status("running", step=event["step"] - 1, max_steps=max_steps, **status_fields)
        if event["event"] == "oom_recovered":
            peak.restart(_replan(run_dir, recipe))

    return record


def _replan(run_dir: RunDir, recipe: Recipe) -> int | None:
    """The plan of the recovered settings, saved over the run's plan; its predicted peak (None without one).
    The training step's alone: a precomputed reference's pass is over by now."""
    try:
        plan = predict(recipe, training_only=True)
    except Exception as exc:  # noqa: BLE001 - a model the planner cannot trace: train on without a plan
        run_dir.log_line(f"no memory plan for the recovered settings: {type(exc).__name__}: {exc}")
        return None
    save_plan(run_dir, plan)
    return plan.peak_bytes


def _changes(event: dict) -> str:
    return ", ".join(f"{k} {event['from'][k]} -> {v}" for k, v in event["to"].items())


def recovered_settings(run_root: Path) -> dict[str, Any]:
    """The settings earlier out-of-memory recoveries of this run chose, by setting name ({} when none;
    files of earlier versions, keyed by recipe key, are read too)."""
    path = RunDir(run_root).recovered
    if not path.is_file():
        return {}
    by_key = {s.key: s.name for s in settings_table()}
    return {by_key.get(k, k): v for k, v in json.loads(path.read_text()).get("settings", {}).items()}


def keep_recovered(recipe: Recipe, saved: Recipe, run_root: Path) -> Recipe:
    """On resume, what a recovery set wins over the recipe given now (which would run out of memory again)."""
    keys = recovered_settings(run_root)
    chosen = read_settings(saved)
    return write_settings(recipe, {name: chosen[name] for name in keys if name in chosen}) if keys else recipe
