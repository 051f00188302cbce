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

`FINETUNE_FAULT_OOM_AT_STEP=N[,M...]` (tests): raise torch.OutOfMemoryError inside the forward of the
last micro-batch of optimizer step N, once per listed N (list N twice to fail its retry too).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from finetune.console import console
from finetune.errors import FinetuneError
from finetune.memory.layer_recompute import apply_layer_recompute
from finetune.memory.offload import activation_offload, decoder_layers, preflight_offload
from finetune.optim import layerwise_of
from finetune.plan import predict
from finetune.recipe.load import recipe_to_yaml
from finetune.recipe.schema import Recipe
from finetune.rundir import RunDir, atomic_write_json, atomic_write_text
from finetune.train.checkpoints import numbered
from finetune.train.oom_ladder import Cheaper, cheaper, measured_gpu_memory, settings_of, with_settings
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
    """FINETUNE_FAULT_OOM_AT_STEP as a count of injected failures per optimizer step (empty when unset)."""
    spec = os.environ.get(FAULT_ENV, "").strip()
    try:
        return Counter(int(s) for s in spec.split(",") if s.strip())
    except ValueError:
        raise FinetuneError(f"{FAULT_ENV}={spec!r} is not a comma-separated list of step numbers",
                            hint=f"e.g. {FAULT_ENV}=3 or {FAULT_ENV}=3,3,7; unset it for normal runs") from None


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
        self._rng: tuple | None = None

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Keep the update's loader batches: a retry runs them all again."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._update, self._done = batches, 0
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
                        self._split_step(model, earlier, num_items_in_batch)
                loss = self._split_step(model, inputs, num_items_in_batch)
                break
            except torch.OutOfMemoryError as exc:
                failure = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
            # Outside the except block: the error's traceback (and the tensors its frames hold) is gone.
            self._recover(model, failure)
            retry = True
        self._done += 1
        return loss

    def _split_step(self, model, inputs: dict, num_items_in_batch) -> torch.Tensor:
        last = inputs is self._update[-1]
        if self.splits == 1:
            with self._fault(model, last):
                return super().training_step(model, inputs, num_items_in_batch)
        size = self.args.per_device_train_batch_size // self.splits
        rows = inputs[ROWS].rows
        parts = [rows[i:i + size] for i in range(0, len(rows), size)]
        # Without num_items_in_batch the Trainer divides each loss by this: the update's micro-batch count.
        self.current_gradient_accumulation_steps = sum(-(-len(b[ROWS].rows) // size) for b in self._update)
        total = None
        for i, part in enumerate(parts):
            with self._fault(model, last and i == len(parts) - 1):
                loss = super().training_step(model, self.data_collator.collator(part), num_items_in_batch)
            total = loss if total is None else total + loss
        return total

    def _fault(self, model, last: bool):
        """FINETUNE_FAULT_OOM_AT_STEP: a one-shot hook that raises in the last decoder layer's forward."""
        step = self.state.global_step + 1
        if not last or not self._faults.get(step):
            return contextlib.nullcontext()
        self._faults[step] -= 1
        return _FaultHook(decoder_layers(model)[-1], step)

    def _recover(self, model, failure: str) -> None:
        """Drop the failed step, free its memory and switch to the next cheaper plan (or give up)."""
        step = self.state.global_step + 1
        layerwise = layerwise_of(self.optimizer)
        undone = layerwise is None or layerwise.discard_pending()
        model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        self._loss_finite = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        budget = measured_gpu_memory()
        choice = cheaper(self.recipe, self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps,
                         self.splits, lambda r: predict(r, gpu_memory=budget))
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

    def _switch(self, model, choice: Cheaper) -> None:
        old, new = self.recipe.memory, choice.recipe.memory
        if new.activation_checkpointing is True and old.activation_checkpointing is not True:
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                                  every_n_layers=new.checkpoint_every_n_layers)
            if self.recipe.adapter.type != "full":
                self.model.enable_input_require_grads()  # a frozen base: see finetune.model.adapter.apply_adapter
        if new.offload != old.offload:
            if self.offload is not None:
                self.offload.close()
            preflight_offload(model, new, self.run_root, self.args.per_device_train_batch_size // choice.splits,
                              self.recipe.data.max_seq_len)
            self.offload = activation_offload(model, new, self.run_root)
        if new.tiled_mlp is True and old.tiled_mlp is not True:
            apply_layer_recompute(model, False, new.tiled_mlp_tokens)
        layerwise = layerwise_of(self.optimizer)
        if layerwise is not None:
            layerwise.steps_per_update = self.args.gradient_accumulation_steps * choice.splits
        self.recipe, self.splits = choice.recipe, choice.splits

    def _give_up(self, model, step: int, failure: str, needed: int | None, budget: int | None) -> None:
        """No cheaper plan: save the last completed step (nothing of this one was applied) and stop."""
        _set_rng_state(self._rng)
        if self.state.global_step > 0:
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
            f"out of memory at step {step} with the leanest settings left{free}: {need}; {kept}",
            hint="free GPU memory (close other programs on the GPU), or use a smaller model or quantization.bits: "
                 "4, then run again with --resume")


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


def record_recovery(run_dir: RunDir, max_steps: int) -> Callable[[dict, Recipe], None]:
    """on_recovery for a run directory: metrics.jsonl row, train.log, status.json, the console, and the new
    settings in recipe.yaml and oom_recovery.json (which --resume keeps, even for keys that were not auto)."""
    def record(event: dict, recipe: Recipe) -> None:
        run_dir.append_metrics(event)
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
        run_dir.write_status("running", step=event["step"] - 1, max_steps=max_steps, oom_recovered=event)

    return record


def _changes(event: dict) -> str:
    return ", ".join(f"{k} {event['from'][k]} -> {v}" for k, v in event["to"].items())


def recovered_settings(run_root: Path) -> dict[str, Any]:
    """The settings earlier out-of-memory recoveries of this run chose ({} when none)."""
    path = RunDir(run_root).recovered
    if not path.is_file():
        return {}
    return dict(json.loads(path.read_text()).get("settings", {}))


def keep_recovered(recipe: Recipe, saved: Recipe, run_root: Path) -> Recipe:
    """On resume, what a recovery set wins over the recipe given now (which would run out of memory again)."""
    keys = recovered_settings(run_root)
    return with_settings(recipe, {k: settings_of(saved)[k] for k in keys}) if keys else recipe
