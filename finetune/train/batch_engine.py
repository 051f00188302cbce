"""`training.effective_batch_size: auto`: the batch grows with the measured gradient noise scale.

The warmup first (finetune/train/sub_updates.py): the critical batch starts near 0 and grows (Critical
Batch Size Revisited), so the run starts with updates of ONE sequence even where the loader batch (the
micro-batch m) is larger: each Trainer step's loader batch runs as m/u updates of u sequences. u grows to
the largest power of two dividing m whose predicted token overhead next to one sequence stays within
TOKEN_SLACK (batch_rules.update_batch), at the same decision points as the accumulation below, until it is m;
from then on the engine works as described next. Not with a layer-wise optimizer (it updates inside
backward: an update cannot end inside a loader batch), nor for kto (its reference point is its batch's
mean), nor where the Trainer accumulates loader batches (an out-of-memory recovery's settings on --resume):
those start at u = m, as before.

The micro-batch stays the planner's fastest fit and the Trainer keeps one loader batch per Trainer step, so
`max_steps`, the data order, the LR schedule and the run length stay defined in loader batches (fixed
tokens): a ramp never changes which examples are seen or how many. The engine accumulates A consecutive
Trainer steps into one optimizer update: on the first A-1 of a group the optimizer update is deferred (the
gradients are set aside by reference, no copy, and handed back to autograd before the next backward;
clipping waits), and the last one applies the mean of the group's loader-batch gradients. The scheduler
still steps every Trainer step, so the learning rate follows the schedule in tokens.

When to accumulate: finetune/recipe/batch_rules.py (best_accumulation). On one device accumulation buys no
throughput; it only spreads the optimizer step's fixed cost over more micro-batches, and McCandlish et al.'s
model prices the larger batch in tokens, so the engine times its own steps (StepTimes: forward-backward and
the rest of an updating step, on the device's timeline: CUDA events, no host sync) and, at the end of a group
once the noise scale has MIN_OBSERVATIONS fresh observations since the last change, accumulates the k that
minimises the predicted wall time to a loss, k* = sqrt(t_opt x gns / (t_micro x tokens per micro-batch)),
ramping up only (the critical batch grows during training, Critical Batch Size Revisited), up to
MAX_ACCUMULATION. A cheap optimizer step (LoRA, small models) keeps k = 1. Each change rescales the learning
rate and beta2 by the same module's rules against the starting batch and is recorded (`on_change`: a
`batch_changed` row in metrics.jsonl, shaped like the out-of-memory events).

A step that cannot be split in two for the noise-scale probe (one sequence, or a layer-wise optimizer that
updates inside backward) is measured by taking two loader batches into one update once every
training.noise_scale_split_every loader batches while the accumulation is 1, instead of accumulating all the
time (the pair keeps the learning rate and beta2 of one loader batch). Splitting one sequence by tokens would
not do: the halves of a sequence are correlated, and the two-batch estimator assumes independent parts.

Learning rate and beta2 follow the rules for u x accumulation sequences (the run's first change, to u = 1,
is recorded at step 0); each batch_changed event names the update batch u in `from` and `to`.

Checkpoints fall on group boundaries only (a save or stop asked for mid-group waits for the group's last
step), and hold the accumulation and the update batch in batch_engine.json, so `--resume` continues exactly.
An out-of-memory retry inside a group re-runs the group's earlier loader batches too
(finetune/train/recovery.py); one inside a step of several updates re-runs only those not applied yet.
"""

from __future__ import annotations

import json
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

from finetune.console import console
from finetune.optim import layerwise_of
from finetune.recipe.batch_rules import (
    MAX_ACCUMULATION,
    StepTimes,
    advise,
    best_accumulation,
    scale_for_batch,
    update_batch,
)
from finetune.rundir import RunDir, atomic_write_json
from finetune.train.callbacks import MetricsCallback
from finetune.train.noise_scale import labelled_tokens
from finetune.train.sub_updates import SubUpdatingTrainer

MIN_OBSERVATIONS = 5  # fresh noise-scale observations between two changes
ENGINE_FILE = "batch_engine.json"  # in each checkpoint folder


class _Clock:
    """Marks on the device's timeline: CUDA events (resolved later, no host sync per step) or the host clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def done(self, end) -> bool:
        """Whether the device has reached mark `end` (reading it then waits for nothing)."""
        return not self.cuda or end.query()

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000


class BatchEngineTrainer(SubUpdatingTrainer):
    """RecoveringTrainer whose update batch and accumulation follow the noise scale when effective_batch_size
    is auto (see the module docstring); with a fixed batch it behaves exactly as RecoveringTrainer."""

    def __init__(self, *args, on_batch_change: Callable[[dict], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine_on = self.recipe.training.effective_batch_size == "auto"
        self.on_batch_change = on_batch_change
        # A step that cannot be split (one sequence, or a layer-wise optimizer updating inside backward) is
        # measured by a two-batch group every noise_scale_split_every loader batches (module docstring).
        self._unsplittable = self.args.gradient_accumulation_steps == 1 and (
            self.args.per_device_train_batch_size == 1 or self.recipe.optimizer.layerwise)
        self.accumulation = 1
        self._size = 1  # loader batches of the group in progress (accumulation, or 2 for a measuring pair)
        self.times = StepTimes(update_in_backward=self.recipe.optimizer.layerwise)
        self._clock = _Clock(self.args.device)
        self._marks: list = []  # [start, forward-backward end] of this Trainer step
        self._timed: list[tuple] = []  # (start, forward-backward end, end, updated), resolved when deciding
        self._group: list[tuple[dict, object]] = []  # this group's earlier loader batches, for an OOM retry
        self._stash: dict[torch.Tensor, torch.Tensor] = {}
        self._observations_at_change = self._decided_at = 0
        # labelled tokens per loader batch, on average: a device scalar until a decision reads it (no sync per batch)
        self._tokens, self._batches = 0, 0
        self._pending_save = self._pending_stop = False
        self._base: tuple[list[float], tuple[float, float]] | None = None  # starting LRs and betas
        self._last_norm = None
        self._current: list[tuple[dict, object]] = []
        self._meaned = False
        self._start_event: dict | None = None  # the warmup's first batch change, recorded at step 0
        if self.engine_on:  # the warmup starts at one sequence per update where it can (module docstring)
            why_not = self._no_warmup()
            self.update_batch = self._step_batch() if why_not else 1
            if why_not and self._step_batch() > 1:
                console.print(f"batch warmup: off ({why_not}); updates of the whole micro-batch from the start")

    def _no_warmup(self) -> str | None:
        """Why updates smaller than the loader batch cannot run here (None: they can)."""
        if self.recipe.optimizer.layerwise:
            return "a layer-wise optimizer updates inside backward, so an update cannot end inside a micro-batch"
        if self.recipe.training.method == "kto":
            return "kto's reference point is the mean of its batch's answers: a batch of one learns nothing"
        if self.args.gradient_accumulation_steps > 1:
            return (f"the Trainer accumulates {self.args.gradient_accumulation_steps} loader batches per step "
                    "(an out-of-memory recovery's settings)")
        if self.accelerator.num_processes > 1:
            return "several processes"
        return None

    # -- grouping ---------------------------------------------------------------------------------
    def _deferring(self) -> bool:
        """This Trainer step ends without an optimizer update (the group goes on)."""
        return (self.engine_on and len(self._group) + 1 < self._size
                and self.state.global_step + 1 < self.state.max_steps)

    def _group_size(self) -> int:
        """Loader batches of the group starting now: the accumulation, or a measuring pair (module docstring)."""
        every = self.recipe.training.noise_scale_split_every
        pair = (self.accumulation == 1 and self._unsplittable and self.noise_probe is not None
                and (self.state.global_step // every) != (self.state.global_step + 2) // every)
        return 2 if pair else self.accumulation

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        self._marks = [self._clock.mark()]
        if self._start_event is not None:  # a resumed run recorded it at its step 0 already
            if self.state.global_step == 0 and self.on_batch_change is not None:
                self.on_batch_change(self._start_event)
            self._start_event = None
        if self.engine_on:
            if not self._group and self._size != (size := self._group_size()):
                self._size = size
                self._sync_layerwise()
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.engine_on and self._group:  # an OOM retry re-runs the group's earlier batches too
            self._items = {id(b): n for b, n in self._group}
            self._update, self._done = [b for b, _ in self._group] + batches, len(self._group)
        self._current = [(b, num_items) for b in batches]
        return batches, num_items

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._stash:  # hand the group's gradients back to autograd before this backward
            for p, grad in self._stash.items():
                p.grad = grad
            self._stash = {}
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._marks[1:] = [self._clock.mark()]
        return loss

    def _recover(self, model, failure: str) -> None:
        self._stash = {}  # dropped with the rest: the retry re-runs the whole group
        self._marks = []  # a step with a retry is not timed
        super()._recover(model, failure)

    def _clip_grad_norm(self, model):
        if self._deferring():
            return None
        self._observe_noise()  # of the group's sum, before its mean and clipping
        self._group_mean()
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if self._deferring():
            return self._last_norm
        self._observe_noise()
        self._group_mean()
        self._last_norm = super()._get_grad_norm(model, grad_norm)
        return self._last_norm

    @torch.no_grad()
    def _group_mean(self) -> None:
        """The group's update is the mean of its loader batches' gradients (each already a token mean)."""
        size = len(self._group) + 1
        if self.engine_on and size > 1 and not self._meaned:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(size)
            self._meaned = True

    def _sync_layerwise(self) -> None:
        """A layer-wise optimizer accumulates over the whole group (it would step inside each backward)."""
        layerwise = layerwise_of(self.optimizer)
        if layerwise is not None:
            layerwise.steps_per_update = self.args.gradient_accumulation_steps * self.splits * self._size

    def create_optimizer(self, model=None):
        fresh = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if fresh:  # every run times its steps (the advice in results.json uses them); auto also groups
            if self.engine_on:
                self._sync_layerwise()
                if self.sub_updating():  # before the scheduler exists: it takes these learning rates as its base
                    self._base = ([g["lr"] for g in optimizer.param_groups], tuple(self.recipe.optimizer.betas))
                    self._start_event = self._changed((self._step_batch(), 1), None, None, step=0)
            update = optimizer.step

            def grouped(opt, *args, **kwargs):
                if self._sub_stepping:  # an update inside the Trainer step (sub_updates.py)
                    return update(*args, **kwargs)
                for batch, _ in self._current if self.engine_on else ():  # after a resume restored the count
                    if "labels" in batch:
                        self._tokens = self._tokens + labelled_tokens(batch)
                        self._batches += 1
                if self._deferring():
                    self._group.extend(self._current)
                    self._stash = {p: p.grad for p in self.model.parameters() if p.grad is not None}
                    self._time(updated=False)
                    return None
                result = update(*args, **kwargs)
                self._group, self._meaned = [], False
                if self._updates is not None:  # a step of several updates is not timed (StepTimes: one each)
                    self._marks = []
                self._time(updated=True)
                if self.engine_on:
                    self._decide()
                return result

            optimizer.step = types.MethodType(grouped, optimizer)  # bound, as the LR scheduler expects
        return optimizer

    def _step_batch(self) -> int:
        """Sequences per Trainer step (micro-batch x the Trainer's accumulation, which an out-of-memory
        recovery may have traded for a smaller micro-batch): the unit the engine multiplies."""
        return self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps

    def _switch(self, model, choice) -> None:
        super()._switch(model, choice)
        if self.engine_on:
            self._sync_layerwise()

    # -- the decision ---------------------------------------------------------------------------------
    def _time(self, updated: bool) -> None:
        if len(self._marks) == 2:
            self._timed.append((*self._marks, self._clock.mark(), updated))
        self._marks = []
        if len(self._timed) >= 256:  # a run that seldom decides: resolve the older events now
            self._resolve_marks(wait=True)

    def step_times(self) -> tuple[float, float] | None:
        """(t_micro, t_opt) in seconds from the steps the device has finished (see StepTimes); a decision does
        not stall the GPU on the step just launched."""
        self._resolve_marks(wait=False)
        return self.times.estimate()

    def _resolve_marks(self, wait: bool) -> None:
        """Turn the finished steps' marks (with `wait`, all of them) into StepTimes samples."""
        pending = []
        for start, middle, end, updated in self._timed:
            if wait or self._clock.done(end):
                self.times.add(self._clock.seconds(start, middle), self._clock.seconds(middle, end), updated)
            else:
                pending.append((start, middle, end, updated))
        self._timed = pending

    def _times_state(self) -> dict:
        self._resolve_marks(wait=True)
        return self.times.state_dict()

    def _decide(self) -> None:
        observed = self.noise_scale.steps
        if observed - self._observations_at_change < MIN_OBSERVATIONS or not self._batches \
                or observed == self._decided_at:  # decide only on a new observation (its step synced anyway)
            return
        self._decided_at = observed
        values = self.noise_scale.values() or {}
        times = self.step_times()
        old = (self.update_batch, self.accumulation)
        if self.sub_updating():  # the warmup: the update batch grows first, accumulation waits
            per_sequence = float(self._tokens) / self._batches / self.args.per_device_train_batch_size
            self.update_batch = update_batch(values.get("gns"), per_sequence, self.update_batch, self._step_batch())
        else:
            self.accumulation = best_accumulation(
                values.get("gns"), float(self._tokens) / self._batches * self.args.gradient_accumulation_steps,
                *(times or (None, None)), current=self.accumulation, limit=MAX_ACCUMULATION)
        if (self.update_batch, self.accumulation) == old:
            return
        self._observations_at_change = observed
        event = self._changed(old, values.get("gns"), times, step=self.state.global_step + 1)
        if self.on_batch_change is not None:
            self.on_batch_change(event)

    def _changed(self, old: tuple[int, int], gns: float | None, times, step: int) -> dict:
        """Apply the rules for the batch now chosen; the `batch_changed` event from `old` (update batch,
        accumulation). The effective batch is update batch x accumulation (the update batch is the loader
        batch once the warmup reached it)."""
        def batch(update: int, accumulation: int) -> dict:
            return {"update_batch": update, "gradient_accumulation_steps": accumulation,
                    "effective_batch_size": update * accumulation}

        lr, beta2 = self._apply_rules(self.update_batch * self.accumulation)
        return {"event": "batch_changed", "step": step, "from": batch(*old),
                "to": batch(self.update_batch, self.accumulation), "gns": gns, "learning_rate": lr, "beta2": beta2,
                "t_micro": times and times[0], "t_opt": times and times[1]}

    def _apply_rules(self, batch: int) -> tuple[float, float | None]:
        """Peak learning rate and beta2 for `batch` sequences, from the recipe's values, which are for its
        reference_batch_size (one Trainer step's batch when the recipe names none)."""
        reference = self.recipe.training.reference_batch_size or self._step_batch()
        groups = self.optimizer.param_groups
        scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)  # accelerate may wrap it
        if self._base is None:
            self._base = (list(scheduler.base_lrs), tuple(self.recipe.optimizer.betas))
        base_lrs, betas = self._base
        rule = scale_for_batch(1.0, betas, self.recipe.optimizer.name, reference, batch)
        if scheduler is None:  # the optimizer is being created: the scheduler will take these as its base
            for group, lr in zip(groups, base_lrs, strict=True):
                group["lr"] = lr * rule.new_learning_rate
        else:  # the optimizer's learning rates too: a change on resume applies before the scheduler's next step
            new = [lr * rule.new_learning_rate for lr in base_lrs]
            for group, old, lr in zip(groups, scheduler.base_lrs, new, strict=True):
                group["lr"] *= lr / old
            scheduler.base_lrs = new
        if rule.new_betas is not None:
            for group in groups:
                if "betas" in group:
                    group["betas"] = (group["betas"][0], rule.new_betas[1])
        return base_lrs[0] * rule.new_learning_rate, rule.new_betas[1] if rule.new_betas else None

    # -- checkpoints on group boundaries --------------------------------------------------------------
    def _maybe_log_save_evaluate(self, *args, **kwargs):
        if self.engine_on:
            if self._group:  # mid-group: a save or a stop waits for the group's last step
                self._pending_save |= self.control.should_save
                self._pending_stop |= self.control.should_training_stop
                self.control.should_save = self.control.should_training_stop = False
            elif self._pending_save or self._pending_stop:
                self.control.should_save |= self._pending_save
                self.control.should_training_stop |= self._pending_stop
                self._pending_save = self._pending_stop = False
        return super()._maybe_log_save_evaluate(*args, **kwargs)

    def _save_rng_state(self, output_dir) -> None:
        super()._save_rng_state(output_dir)
        if self.engine_on:
            atomic_write_json(Path(output_dir) / ENGINE_FILE, {
                "accumulation": self.accumulation, "observations_at_change": self._observations_at_change,
                "update_batch": self.update_batch, "since_pair": self._since_pair,
                "decided_at": self._decided_at,
                "tokens": int(self._tokens), "batches": self._batches, "size": self._size,
                "times": self._times_state(),
                "base": self._base and {"lrs": self._base[0], "betas": list(self._base[1])}})

    def _load_rng_state(self, checkpoint) -> None:
        super()._load_rng_state(checkpoint)
        path = Path(checkpoint) / ENGINE_FILE if checkpoint else None
        if self.engine_on and path is not None and path.is_file():
            saved = json.loads(path.read_text())
            self.accumulation = saved["accumulation"]
            if self.sub_updating():  # a checkpoint of an older version has none: it had no warmup
                self.update_batch = min(saved.get("update_batch", self._step_batch()), self._step_batch())
                self._since_pair = saved.get("since_pair", 0)
            self._size = saved.get("size", self.accumulation)  # a checkpoint of an older version has neither
            if "times" in saved:
                self.times.load_state_dict(saved["times"])
            self._sync_layerwise()
            self._observations_at_change = saved["observations_at_change"]
            self._decided_at = saved.get("decided_at", 0)  # a checkpoint of an older version has none
            self._tokens, self._batches = saved["tokens"], saved["batches"]
            if saved["base"]:
                self._base = (saved["base"]["lrs"], tuple(saved["base"]["betas"]))
            if saved.get("update_batch", self.update_batch) < self.update_batch:  # the warmup cannot go on here
                console.print(f"batch warmup: ended on resume ({self._no_warmup()})")
                event = self._changed((saved["update_batch"], self.accumulation), None, None, self.state.global_step)
                if self.on_batch_change is not None:
                    self.on_batch_change(event)


def record_batch_change(run_dir: RunDir, metrics: MetricsCallback) -> Callable[[dict], None]:
    """on_batch_change for a run directory: a metrics.jsonl event row (the UI marks "batch changed"),
    train.log, the console, and the batch in every later status.json."""
    def record(event: dict) -> None:
        run_dir.append_metrics(event)
        gns = f" (noise scale {event['gns']:.4g} tokens)" if event["gns"] else ""
        line = (f"batch changed after step {event['step']}: effective batch {event['from']['effective_batch_size']} "
                f"-> {event['to']['effective_batch_size']}{gns}, learning rate {event['learning_rate']:.3g}"
                + (f", beta2 {event['beta2']:.6g}" if event["beta2"] else ""))
        run_dir.log_line(line)
        console.print(line)
        metrics.status_fields["batch_changed"] = event

    return record


def batch_summary(trainer: BatchEngineTrainer, rows: list[dict], stats: dict) -> dict:
    """results.json's account of the batch: what was used (and every change), the noise scale over time and
    the advice for the next run (finetune.recipe.batch_rules.advise; `finetune plan --advice` applies it)."""
    micro = trainer.args.per_device_train_batch_size // trainer.splits
    accumulation = (trainer.accumulation if trainer.engine_on else 1) * trainer.args.gradient_accumulation_steps \
        * trainer.splits
    series = [[r["step"], r["gns"]] for r in rows if r.get("gns") and "event" not in r]
    values = trainer.noise_scale.values() or {}
    trainer._resolve_marks(wait=True)  # the run is over: every step's marks
    times = trainer.times.estimate()  # per Trainer step: its forward-backwards are that many loader batches
    scheduler = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)
    betas = next((tuple(g["betas"]) for g in trainer.optimizer.param_groups if "betas" in g),
                 tuple(trainer.recipe.optimizer.betas))
    tokens_per_sequence = stats.get("loss_tokens", 0) / max(stats.get("train_sequences") or 1, 1)
    # Still in the warmup: updates of update_batch sequences, each loader batch several of them.
    used = trainer.update_batch if trainer.engine_on and trainer.sub_updating() else micro * accumulation
    return {
        "batch": {"micro_batch_size": micro, "gradient_accumulation_steps": accumulation,
                  "effective_batch_size": used, "auto": trainer.engine_on,
                  **({"update_batch": trainer.update_batch} if trainer.engine_on else {}),
                  "changes": [r for r in rows if r.get("event") == "batch_changed"]},
        "noise_scale": {"unit": "labelled tokens", "final": values.get("gns"), "grad_sq": values.get("grad_sq"),
                        "trace_sigma": values.get("trace_sigma"), "tokens_per_sequence": round(tokens_per_sequence, 2),
                        "series": series[:: max(1, len(series) // 200)]},
        "advice": advise(values.get("gns"), tokens_per_sequence, trainer.args.per_device_train_batch_size,
                         used, float(scheduler.base_lrs[0]), betas, trainer.recipe.optimizer.name,
                         times and (times[0] / trainer.args.gradient_accumulation_steps, times[1])),
    }
