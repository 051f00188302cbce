"""Out-of-memory recovery: an optimizer step that runs out of memory is redone, exactly, with a cheaper plan.

How the retry stays exact: the loader keeps the batch size the run started with, and every loader batch
carries its example rows (`SplittableCollator`). After an out-of-memory error inside update N the step's
partial gradients are dropped (nothing of it was applied: the optimizer steps only after the last
micro-batch), the RNG streams are put back to where update N began, and the update's loader batches are
run again, each split into k sub-micro-batches collated exactly as a loader of micro-batch B/k would
collate them. With num_items_in_batch the summed loss is the same sum; without it each sub-batch's mean
is divided by the update's sub-batch count, as a run at micro-batch B/k does. So the LR schedule, the
optimizer state, the examples and their order continue as if the run had used micro-batch B/k and k
times the accumulation from the start (tests/test_oom_recovery.py checks this against such a run).

The next plan comes from finetune.train.oom_ladder: half the micro-batch down to 1, then checkpointing,
offload, chunked loss, tiled MLP. When nothing is left the run saves a checkpoint of the last completed
step and stops with the smallest budget the planner says would work.

Layer-wise optimizers: with accumulation > 1 they apply nothing before optimizer.step(), so the retry is
exact (GaLore's pending projected sums are dropped too). With accumulation 1 weights move inside backward:
an OOM before the first hook ran is retried (in accumulate mode, as the accumulation doubles); one after
cannot be undone, so the run stops with a message and records the cheaper settings for --resume.

An OOM in the update itself (gradient clipping, optimizer.step(), e.g. AdamW allocating its state on step 1)
is not retried: the run stops with the smallest budget. When the optimizer changed nothing yet (no state's
`step` counter moved; the lazily created state is dropped again) it first saves a checkpoint of the last
completed step; otherwise the last saved checkpoint is what --resume continues from.

`FINETUNE_FAULT_OOM_AT_STEP=N[,M...]` (tests): raise torch.OutOfMemoryError inside the forward of the
last micro-batch of optimizer step N, once per listed N (list N twice to fail its retry too); `N:optimizer`
raises it in optimizer step N's optimizer.step() instead, before the optimizer runs.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import types
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from finetune.console import console
from finetune.errors import FinetuneError
from finetune.memory.device_memory import usable_gpu_memory
from finetune.memory.layer_recompute import apply_layer_recompute
from finetune.memory.offload import activation_offload, decoder_layers, preflight_offload
from finetune.memory.offload_disk import OffloadDirError
from finetune.memory.tracker_callback import PeakMemoryCallback
from finetune.optim import layerwise_of
from finetune.plan import predict
from finetune.recipe.load import recipe_to_yaml
from finetune.recipe.schema import Recipe
from finetune.recipe.settings import read_settings, write_settings
from finetune.recipe.settings import table as settings_table
from finetune.rundir import RunDir, atomic_write_json, atomic_write_text
from finetune.train.callbacks import MetricsCallback
from finetune.train.checkpoints import numbered
from finetune.train.oom_ladder import Cheaper, cheaper, settings_of
from finetune.train.plan_files import save_plan
from finetune.train.trainer import FinetuneTrainer
from finetune.units import format_bytes

FAULT_ENV = "FINETUNE_FAULT_OOM_AT_STEP"
ROWS = "finetune_rows"  # batch key holding the loader batch's example rows; never reaches the model
class _Rows:
    """The rows of one loader batch; opaque to accelerate's device transfer (no `.to`, not a container)."""

    __slots__ = ("rows",)

    def __init__(self, rows: list):
        self.rows = rows


class SplittableCollator:
    """The data's collator, plus the rows each batch was made of, so a batch can be re-collated in parts."""

    def __init__(self, collator: Callable[[list], dict]):
        self.collator = collator

    def __call__(self, features: list) -> dict:
        batch = self.collator(features)
        batch[ROWS] = _Rows(list(features))
        return batch


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


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    python, numpy_state, cpu, cuda = state
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class RecoveringTrainer(FinetuneTrainer):
    """FinetuneTrainer whose optimizer steps survive running out of memory (see the module docstring).

    on_recovery(event, recipe) is told each switch to a cheaper plan (and the final give-up) so the run
    directory can record it; run_root is where a newly turned-on disk offload keeps its files.
    """

    def __init__(self, *args, data_collator: Callable[[list], dict], run_root: Path,
                 on_recovery: Callable[[dict, Recipe], None], **kwargs):
        super().__init__(*args, data_collator=SplittableCollator(data_collator), **kwargs)
        self.run_root = run_root
        self.on_recovery = on_recovery
        self.splits = 1
        self._faults = fault_steps()
        self._update: list[dict] = []
        self._done = 0  # loader batches of the current update already run
        self._items: dict[int, Any] = {}  # num_items_in_batch of earlier loader batches not of this Trainer step
        self._rng: tuple | None = None

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Keep the update's loader batches: a retry runs them all again."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._update, self._done, self._items = batches, 0, {}
        return batches, num_items

    def _prepare_inputs(self, inputs):
        return super()._prepare_inputs({k: v for k, v in inputs.items() if k != ROWS})

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Forward + backward of one loader batch (in `splits` parts); on OOM, redo the update cheaper."""
        if self._done == 0:
            self._rng = _rng_state()  # after a resume's RNG reload, which follows get_batch_samples
        retry = False
        while True:
            failure = None
            try:
                if retry:
                    _set_rng_state(self._rng)
                    for earlier in self._update[:self._done]:  # their losses were already counted
                        self._split_step(model, earlier, self._items.get(id(earlier), num_items_in_batch))
                loss = self._split_step(model, inputs, num_items_in_batch)
                break
            except torch.OutOfMemoryError as exc:
                failure = _first_line(exc)
            # Outside the except block: the error's traceback (and the tensors its frames hold) is gone.
            self._recover(model, failure)
            retry = True
        self._done += 1
        return loss

    def _noise_split_due(self) -> bool:
        """An update of a single micro-batch runs as two halves (the same gradient) every
        training.noise_scale_split_every steps, so the noise-scale probe sees two batch sizes
        (finetune/train/noise_scale.py). Not with a layer-wise optimizer in immediate mode: it would step on
        each half."""
        layerwise = layerwise_of(self.optimizer)
        return not (self.noise_probe is None or len(self._update) > 1 or len(self._update[0][ROWS].rows) < 2
                    or (layerwise is not None and layerwise.steps_per_update == 1)
                    or (self.state.global_step + 1) % self.recipe.training.noise_scale_split_every)

    def _split_step(self, model, inputs: dict, num_items_in_batch) -> torch.Tensor:
        last = inputs is self._update[-1]
        if self.splits > 1:
            size = self.args.per_device_train_batch_size // self.splits
        elif self._noise_split_due():
            size = -(-len(inputs[ROWS].rows) // 2)
        else:
            with self._fault(model, last):
                return super().training_step(model, inputs, num_items_in_batch)
        # Without num_items_in_batch the Trainer divides each loss by this: the update's micro-batch count.
        self.current_gradient_accumulation_steps = sum(-(-len(b[ROWS].rows) // size) for b in self._update)
        return self._run_parts(model, inputs[ROWS].rows, size, num_items_in_batch, last)

    def _run_parts(self, model, rows: list, size: int, num_items_in_batch, last: bool) -> torch.Tensor:
        """Forward + backward of `rows` in parts of `size`, each collated as a loader of micro-batch `size`
        would collate it; the summed loss. `last`: its last part is the update's last micro-batch (the fault
        hook's place)."""
        parts = [rows[i:i + size] for i in range(0, len(rows), size)]
        total = None
        for i, part in enumerate(parts):
            with self._fault(model, last and i == len(parts) - 1):
                loss = super().training_step(model, self.data_collator.collator(part), num_items_in_batch)
            total = loss if total is None else total + loss
        return total

    def _fault(self, model, last: bool):
        """FINETUNE_FAULT_OOM_AT_STEP: a one-shot hook that raises in the last decoder layer's forward."""
        step = self.state.global_step + 1
        if not last or not self._faults.get((step, "forward")):
            return contextlib.nullcontext()
        self._faults[(step, "forward")] -= 1
        return _FaultHook(decoder_layers(model)[-1], step)

    def create_optimizer(self, model=None):
        """Also route an OOM inside optimizer.step() to the give-up path (the Trainer calls step() bare)."""
        fresh = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if fresh:
            update = optimizer.step

            def guarded(opt, *args, **kwargs):
                return self._guarded_update(opt, update, *args, **kwargs)

            # A bound method: torch's LR scheduler re-wraps optimizer.step through its __func__.
            optimizer.step = types.MethodType(guarded, optimizer)
        return optimizer

    def _clip_grad_norm(self, model):
        try:
            return super()._clip_grad_norm(model)
        except torch.OutOfMemoryError as exc:
            failure = _first_line(exc)
        self._update_failed(model, failure, applied=False)  # clipping only scales gradients

    def _guarded_update(self, optimizer, update, *args, **kwargs):
        step = self.state.global_step + 1
        counts = _step_counts(optimizer)
        try:
            if self._faults.get((step, "optimizer")):
                self._faults[(step, "optimizer")] -= 1
                raise torch.OutOfMemoryError(f"{FAULT_ENV}: injected out-of-memory error in optimizer step {step}")
            return update(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            failure = _first_line(exc)
        applied = _undo_lazy_state(optimizer, counts)
        self._update_failed(self.model_wrapped, failure, applied=applied)

    def _update_failed(self, model, failure: str, applied: bool) -> None:
        """An OOM in the update: no retry (the gradients are gone once freed); stop with the smallest budget."""
        model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        budget = usable_gpu_memory()
        recipe, splits = self.recipe, self.splits
        while True:  # the leanest rung's budget, by the planner
            choice = cheaper(recipe, self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps,
                             splits, lambda r: predict(r, gpu_memory=budget, training_only=True))
            if choice.recipe is None:
                break
            recipe, splits = choice.recipe, choice.splits
        self._give_up(model, self.state.global_step + 1, failure, choice.min_budget_bytes, budget,
                      save=not applied, where="in the optimizer update, which is not retried")

    def _recover(self, model, failure: str) -> None:
        """Drop the failed step, free its memory and switch to the next cheaper plan (or give up)."""
        step = self.state.global_step + 1
        layerwise = layerwise_of(self.optimizer)
        undone = layerwise is None or layerwise.discard_pending()
        model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        self._loss_finite = None
        if self.noise_probe is not None:
            self.noise_probe.discard()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        budget = usable_gpu_memory()
        choice = self._next_plan(model, budget)
        if choice.recipe is None:
            self._give_up(model, step, failure, choice.min_budget_bytes, budget)
        before, after = settings_of(self.recipe), settings_of(choice.recipe)
        event = {"event": "oom_recovered" if undone else "oom_unrecoverable", "step": step, "error": failure,
                 "from": {k: v for k, v in before.items() if after[k] != v},
                 "to": {k: v for k, v in after.items() if before[k] != v}}
        if budget is not None:
            event["gpu_memory_bytes"] = budget
        if not undone:  # the cheaper settings are recorded for --resume, which restarts from the checkpoint
            self.on_recovery(event, choice.recipe)
            raise FinetuneError(
                f"out of memory at step {step} ({failure}) after the layer-wise optimizer had already updated "
                "some weights inside backward; that cannot be undone, so the run stops without saving them",
                hint=f"run again with --resume: it continues from the last checkpoint with {_changes(event)}")
        self._switch(model, choice)
        self.on_recovery(event, self.recipe)

    def _next_plan(self, model, budget: int | None) -> Cheaper:
        """The next rung; one that turns on an offload tier whose preflight fails (a full or unwritable
        offload_dir) is passed over, with the tier left out of the rest of the ladder."""
        unusable: set[str] = set()
        while True:
            choice = cheaper(self.recipe, self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps,
                             self.splits, lambda r: predict(r, gpu_memory=budget, training_only=True),
                             frozenset(unusable))
            new = choice.recipe
            if new is None or new.memory.offload == self.recipe.memory.offload:
                return choice
            try:
                preflight_offload(model, new.memory, self.run_root,
                                  self.args.per_device_train_batch_size // choice.splits, new.data.max_seq_len)
                return choice
            except OffloadDirError as exc:
                console.print(f"[yellow]out-of-memory recovery: offload {new.memory.offload} is unusable "
                              f"({exc.message}); trying the next alternative")
                unusable.add(new.memory.offload)

    def _switch(self, model, choice: Cheaper) -> None:
        old, new = self.recipe.memory, choice.recipe.memory
        if new.activation_checkpointing is True and old.activation_checkpointing is not True:
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                                  every_n_layers=new.checkpoint_every_n_layers)
            if self.recipe.adapter.type != "full":
                self.model.enable_input_require_grads()  # a frozen base: see finetune.model.adapter.apply_adapter
        self.args.per_device_eval_batch_size = self.args.per_device_train_batch_size // choice.splits
        if hasattr(self, "_eval_dataloaders"):  # cached (persistent workers) at the old micro-batch
            del self._eval_dataloaders
        if new.offload != old.offload:
            if self.offload is not None:
                self.offload.close()
            self.offload = activation_offload(model, new, self.run_root)
        if new.tiled_mlp is True and old.tiled_mlp is not True:
            apply_layer_recompute(model, False, new.tiled_mlp_tokens)
        layerwise = layerwise_of(self.optimizer)
        if layerwise is not None:
            layerwise.steps_per_update = self.args.gradient_accumulation_steps * choice.splits
        self.recipe, self.splits = choice.recipe, choice.splits

    def _applied_in_step(self) -> bool:
        """Whether the Trainer step in progress already changed the weights (a subclass's updates inside a
        step): then the last completed step's checkpoint can no longer be written from them."""
        return False

    def _give_up(self, model, step: int, failure: str, needed: int | None, budget: int | None,
                 save: bool = True, where: str = "with the leanest settings left") -> None:
        """No cheaper plan: save the last completed step (when nothing of this one was applied) and stop."""
        _set_rng_state(self._rng)
        if not save or self._applied_in_step():
            last = numbered(Path(self.args.output_dir))
            kept = ("the optimizer had already changed part of the model, so nothing is saved now; "
                    + (f"{last[0].name} is the last checkpoint" if last else "no checkpoint was saved before"))
        elif self.state.global_step > 0:
            self._save_checkpoint(model, trial=None)
            last = numbered(Path(self.args.output_dir))
            kept = f"{last[0].name} holds step {self.state.global_step}" if last else "no checkpoint"
        else:
            kept = "no step had completed, so there is no checkpoint"
        self.on_recovery({"event": "oom_gave_up", "step": step, "error": failure, "needed_bytes": needed},
                         self.recipe)
        free = f" ({format_bytes(budget)} usable now)" if budget is not None else ""
        need = f"the planner's leanest settings need a budget of {format_bytes(needed)}" if needed \
            else "the planner could not name a budget that works"
        raise FinetuneError(
            f"out of memory at step {step} {where}{free}: {need}; {kept}",
            hint="free GPU memory (close other programs on the GPU), or use a smaller model or quantization.bits: "
                 "4, then run again with --resume")


    def evaluate(self, *args, **kwargs):
        """An OOM in evaluation: a clear message (and the completed step saved), not a traceback."""
        try:
            return super().evaluate(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            failure = _first_line(exc)
        step = self.state.global_step
        kept = "no step had completed"
        if step > 0:
            if not (Path(self.args.output_dir) / f"checkpoint-{step}").is_dir():
                self._save_checkpoint(self.model_wrapped, trial=None)
            kept = f"checkpoint-{step} holds step {step}"
        raise FinetuneError(
            f"out of memory in evaluation after step {step} at eval micro-batch "
            f"{self.args.per_device_eval_batch_size} ({failure}); {kept}",
            hint="lower training.micro_batch_size (evaluation uses it too) or free GPU memory, then run again "
                 "with --resume")


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


def record_recovery(run_dir: RunDir, max_steps: int, peak: PeakMemoryCallback,
                    metrics: MetricsCallback) -> Callable[[dict, Recipe], None]:
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
        metrics.status_fields["oom_recovered"] = event  # kept in every later status.json
        run_dir.write_status("running", step=event["step"] - 1, max_steps=max_steps, **metrics.status_fields)
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
