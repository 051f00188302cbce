"""The training loop: one explicit loop over accelerate, with policies composed into it.

    for each step (`accumulation` loader batches):
        updates = the step's rows as updates of micro-batches (policies may re-plan: sub-updates, splits)
        for each update: forward/backward of each micro-batch (finetune.memory.step.forward_backward)
                         then, unless a policy defers it: gradient norm and clipping, divergence check,
                         optimizer step, gradients freed
        scheduler step; log, evaluate, save, stop, in that order, as their schedules say

Device placement, mixed precision and the gradient all-reduce of several processes (DDP, FSDP2, DeepSpeed)
are accelerate's (`Accelerator`); everything else is in plain sight here. What varies by feature (the
out-of-memory retry, sub-updates, grouping steps for `effective_batch_size: auto`, the noise-scale probe,
the memory tracker, the run directory's files) is a `finetune.train.policy.Policy`, called through the
hooks declared there; the loop never names one.

The data order is a function of (seed, epoch) alone and steps never cross an epoch, so a step's examples
follow from its number: resuming needs no sampler state, and a micro-batch changed by an out-of-memory
recovery (B/k rows, k times the accumulation) sees the same examples in the same steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from finetune.errors import FinetuneError
from finetune.memory.preference import PreferenceLoss, metric_means
from finetune.memory.step import compute_loss, forward_backward
from finetune.optim import layerwise_of
from finetune.train.noise_scale import labelled_tokens
from finetune.train.policy import Geometry, Objective, Part, Policy, Step, Update
from finetune.train.rng import rng_state, set_rng_state

EVAL_PREFIX = "eval_"


class TrainingDiverged(FinetuneError):
    """Loss, gradient norm or weights became NaN/inf: the run stops before that state is applied or saved."""


@dataclass(frozen=True)
class Schedule:
    """When the loop logs, evaluates and saves, and how it clips: fixed for a run."""

    max_steps: int
    logging_steps: int = 1
    eval_steps: int | None = None  # None: no evaluation during training
    save_steps: int | None = None  # None: no periodic checkpoint (the last step and a stop still save)
    max_grad_norm: float | None = None
    seed: int = 0


@dataclass
class LoopState:
    """The loop's own part of the train state."""

    step: int = 0  # completed steps
    epoch: float = 0.0
    tokens_seen: int = 0  # input tokens (non-padding) of every process
    log_history: list | None = None

    def state_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "tokens_seen": self.tokens_seen,
                "log_history": self.log_history or []}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.epoch = int(state["step"]), float(state["epoch"])
        self.tokens_seen, self.log_history = int(state["tokens_seen"]), list(state["log_history"])


def accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes num_items_in_batch (then its loss is a token sum over the whole
    accumulated batch, exact for any accumulation), as transformers decides it."""
    import inspect

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(inner, "accepts_loss_kwargs"):
        return bool(inner.accepts_loss_kwargs)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(inner.forward).parameters.values())


class TrainLoop:
    """One run's training: the model, optimizer and scheduler, the data, the schedule and the policies.

    `save(loop)` writes a checkpoint of the loop as it is and returns its folder
    (finetune.train.train_state.save_checkpoint, given by the caller so the loop holds no file layout);
    `should_stop()` is asked after each step (Ctrl-C); `kept()` says what a failure leaves to resume from.
    """

    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 accelerator: Any, train_data: Sequence, eval_data: Sequence | None,
                 collator: Callable[[list], dict], geometry: Geometry, schedule: Schedule,
                 policies: Sequence[Policy] = (), preference: PreferenceLoss | None = None,
                 objective: Objective | None = None,
                 chunked_loss: bool = False, offload: Any = None,
                 save: Callable[[TrainLoop], str] | None = None, should_stop: Callable[[], bool] = lambda: False,
                 learning_rate: float = 0.0, pad_token_id: int | None = None,
                 kept: Callable[[], str] = lambda: "no checkpoint is known"):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.accelerator = accelerator
        self.train_data, self.eval_data, self.collator = train_data, eval_data, collator
        self.geometry, self.schedule = geometry, schedule
        self.policies = list(policies)
        self.preference, self.chunked_loss, self.offload = preference, chunked_loss, offload
        self.objective = objective  # None: the loss of the collated batches (finetune.memory.step)
        self._save, self.should_stop = save, should_stop
        self.learning_rate, self.pad_token_id, self.kept = learning_rate, pad_token_id, kept
        self.state = LoopState(log_history=[])
        self.accepts_loss_kwargs = accepts_loss_kwargs(model)
        self.processes = accelerator.num_processes
        self.rank = accelerator.process_index
        self.stopped = False  # a should_stop() ended training early
        self._stop_due = self._save_due = False
        self.pending: list[Step] = []  # earlier steps whose gradients wait in .grad for a later update
        self.current: Step | None = None  # the step in progress
        self.undone = True  # the last dropped gradients changed no weight (a layer-wise optimizer may have)
        self.preference_metrics: dict[str, dict] = {"train": {}, "eval": {}}
        self._loss_sum: torch.Tensor | None = None  # step losses since the last log (a device tensor)
        self._logged_at = 0
        self._loss_finite: torch.Tensor | None = None
        self._last_norm: Any = None
        self._train_loss_total = 0.0
        self._tokens_since: torch.Tensor | int = 0
        self.sync_layerwise()

    # -- geometry ---------------------------------------------------------------------------------------
    def set_geometry(self, **changes: int) -> None:
        """Change the batch shape (an out-of-memory recovery's splits, a policy's group), keeping what depends
        on it in step: a layer-wise optimizer's backward count per update."""
        for key, value in changes.items():
            setattr(self.geometry, key, value)
        self.sync_layerwise()

    def sync_layerwise(self) -> None:
        layerwise = layerwise_of(self.optimizer)
        if layerwise is not None:
            g = self.geometry
            layerwise.steps_per_update = g.accumulation * g.splits * g.group

    # -- data -------------------------------------------------------------------------------------------
    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This process's loader batches of `epoch` (indices): a permutation seeded by (seed, epoch) cut in
        micro-batches, dealt round-robin to the processes (the last round padded from the start, as
        accelerate's even batches do)."""
        n, b = len(self.train_data), self.geometry.micro_batch
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.schedule.seed + epoch)).tolist()
        batches = [order[i:i + b] for i in range(0, n, b)]
        if self.processes > 1:
            rounds = math.ceil(len(batches) / self.processes)
            batches = (batches * self.processes)[:rounds * self.processes][self.rank::self.processes]
        return batches

    def _steps(self) -> Iterator[tuple[float, list[list[int]]]]:
        """(epoch at the step's end, its batches) from state.step on; steps never cross an epoch."""
        done, epoch = 0, 0
        while True:
            batches = self.epoch_batches(epoch)
            per_epoch = math.ceil(len(batches) / self.geometry.accumulation)
            for k in range(per_epoch):
                if done >= self.state.step:
                    a = self.geometry.accumulation
                    yield epoch + (k + 1) / per_epoch, batches[k * a:(k + 1) * a]
                done += 1
            epoch += 1

    def collate(self, rows: list[dict]) -> dict:
        return self.to_device(self.collator(rows))

    def to_device(self, batch: dict) -> dict:
        device = self.accelerator.device
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def step_items(self, collated: Sequence[dict]) -> torch.Tensor | None:
        """Labelled tokens of `collated` over every process (None when losses are means)."""
        if not self.accepts_loss_kwargs or not collated or "labels" not in collated[0]:
            return None
        items = sum(labelled_tokens(c) for c in collated)
        if self.processes > 1:
            items = self.accelerator.gather(items.reshape(1)).sum()
        return items

    # -- the loop ---------------------------------------------------------------------------------------
    def fit(self) -> None:
        """Train from state.step to max_steps (or until should_stop())."""
        for p in self.policies:
            p.on_train_begin(self)
        self._logged_at = self.state.step
        try:
            for epoch, indices in self._steps():
                if self.state.step >= self.schedule.max_steps:
                    break
                rows = [[self.train_data[i] for i in batch] for batch in indices]
                step = Step(number=self.state.step + 1, batches=rows, collated=[self.collate(r) for r in rows])
                self.run_step(step)
                self._count_tokens(step)
                self.state.step, self.state.epoch = step.number, epoch
                for p in self.policies:
                    p.on_step_end(self, step)
                self._after_step(step)
                if self.stopped:
                    break
        finally:
            for p in self.policies:
                p.on_train_end(self)

    def default_updates(self, step: Step) -> list[Update]:
        """The step as one update of its loader batches."""
        return [Update(micro_batches=list(step.batches), num_items=self.step_items(step.collated))]

    def run_step(self, step: Step) -> None:
        """The step's updates; an out-of-memory error in a forward/backward lets the policies make the step
        cheaper and runs it again from its first update not yet applied, with the RNG streams as they were."""
        self.current = step
        updates = self.default_updates(step)
        for p in self.policies:
            updates = p.plan_updates(self, step, updates)
        step.updates = updates
        for p in self.policies:
            p.on_step_begin(self, step)
        retry = False
        while True:
            try:
                self._run_updates(step, retry)
                return
            except torch.OutOfMemoryError as exc:
                failure = first_line(exc)
            # Outside the except block: the error's traceback (and the tensors its frames hold) is gone.
            self.drop_gradients()
            if not any(p.on_oom(self, step, failure, "step") for p in self.policies):
                raise torch.OutOfMemoryError(failure)
            retry = True

    def _run_updates(self, step: Step, retry: bool) -> None:
        first = self.pending[0] if self.pending else step
        if step.rng is None:
            step.rng = rng_state()
        if retry:  # the group's earlier steps (their losses were counted) and the updates not yet applied
            set_rng_state(first.rng if step.applied == 0 else step.rng)
            if step.applied == 0:
                for earlier in self.pending:
                    self._run_update(earlier, earlier.updates[-1], last_of_step=False)
            step.loss = step.loss if step.applied else None
        for j in range(step.applied, len(step.updates)):
            update, last = step.updates[j], j == len(step.updates) - 1
            loss = self._run_update(step, update, last_of_step=last)
            step.loss = loss * update.share if step.loss is None else step.loss + loss * update.share
            if last and any(p.defers(self, step) for p in self.policies):
                step.deferred = True
                self.pending.append(step)
                return
            self.apply_update(step, update)
            if not last:
                step.applied, step.rng = j + 1, rng_state()
        self.pending = []

    def _run_update(self, step: Step, update: Update, last_of_step: bool) -> torch.Tensor:
        """Forward/backward of every micro-batch of `update`, in parts of geometry.part_rows rows (all of it when
        the update says `whole`); the update's loss (a token mean, or the mean of its parts' means)."""
        size = self.geometry.part_rows
        whole = {**{id(rows): c for rows, c in zip(step.batches, step.collated, strict=True)}, **update.collated}
        parts: list[tuple[list, dict | None]] = []
        for mb in update.micro_batches:
            if len(mb) <= size or update.whole:
                parts.append((mb, whole.get(id(mb))))
            else:
                parts += [(mb[i:i + size], None) for i in range(0, len(mb), size)]
        total = None
        for i, (rows, collated) in enumerate(parts):
            inputs = collated if collated is not None else self.collate(rows)
            final = i == len(parts) - 1
            no_sync = self.processes > 1 and not final
            if self.processes > 1:  # DeepSpeed reduces (and steps) in the backward where this is True
                self.accelerator.sync_gradients = final
            with self.accelerator.no_sync(self.model) if no_sync else _null():
                loss = self._forward_backward(inputs, update.num_items, len(parts), last_of_step and final)
            total = loss if total is None else total + loss
        return total

    def _forward_backward(self, inputs: dict, num_items: torch.Tensor | None, count: int, last: bool) -> torch.Tensor:
        # Several processes: the loss is normalised by the labelled tokens of all of them and DDP/FSDP average
        # the gradients, so it is multiplied by their number (one process: 1), as transformers does.
        scale = self.processes if num_items is not None else 1
        part = Part(inputs, num_items, count, scale, last)

        def run() -> torch.Tensor:
            if self.objective is not None:
                return self.objective.forward_backward(self, part)
            return forward_backward(
                self.model, inputs, accumulation=count, num_items_in_batch=num_items,
                chunked_loss=self.chunked_loss and "labels" in inputs, autocast=self.accelerator.autocast,
                offload=self.offload, backward=lambda loss: self.backward(loss * scale if scale != 1 else loss),
                preference=self.preference, metrics=self.preference_metrics["train"])

        self.model.train()
        call = run
        for p in reversed(self.policies):
            call = _around(p, self, part, call)
        loss = call()
        loss = loss * scale if scale != 1 else loss
        finite = torch.isfinite(loss).all()
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        """accelerate's backward (fp16 loss scaling, DeepSpeed); the loss is already divided for the
        accumulation, so DeepSpeed must not divide it again."""
        from accelerate.utils import DistributedType

        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            self.accelerator.backward(loss, scale_wrt_gas=False)
        else:
            self.accelerator.backward(loss)

    def apply_update(self, step: Step, update: Update) -> None:
        """Clip (or measure) the gradient norm, check for divergence, step the optimizer, free the
        gradients. An out-of-memory error here is not retried: the policies decide what to say."""
        try:
            for p in self.policies:
                p.before_update(self, update)
            norm = self.grad_norm()
            self._check_finite(step, norm)
            self.optimizer.step()
        except torch.OutOfMemoryError as exc:
            failure = first_line(exc)
        else:
            self.model.zero_grad(set_to_none=True)
            self._last_norm = norm
            for p in self.policies:
                p.after_update(self, update, norm)
            return
        self.drop_gradients()
        if not any(p.on_oom(self, step, failure, "update") for p in self.policies):
            raise torch.OutOfMemoryError(failure)

    def grad_norm(self) -> torch.Tensor | float:
        """The norm before clipping (clipped to max_grad_norm when set); a layer-wise optimizer clips and
        measures inside its hooks, so the full gradient is never resident."""
        layerwise = layerwise_of(self.optimizer)
        if layerwise is not None:
            return layerwise.grad_norm()
        limit = self.schedule.max_grad_norm or float("inf")
        return self.accelerator.clip_grad_norm_(self.model.parameters(), limit)

    def _check_finite(self, step: Step, norm: Any) -> None:
        loss_finite, self._loss_finite = self._loss_finite, None
        if loss_finite is not None and not bool(loss_finite):
            self.diverged(step.number, "the training loss is NaN or inf")
        if norm is not None and not math.isfinite(float(norm)):
            self.diverged(step.number, f"the gradient norm is {float(norm)}")

    def diverged(self, step: int, what: str) -> None:
        raise TrainingDiverged(
            f"training diverged at step {step}: {what}; stopped ({self.kept()})",
            hint=f"lower training.learning_rate (now {self.learning_rate:g}), keep training.max_grad_norm "
                 "on, or check the data for broken examples")

    def drop_gradients(self) -> None:
        """Forget the gradients of the update in progress (and the pending group's) and free their memory."""
        layerwise = layerwise_of(self.optimizer)
        self.undone = layerwise is None or layerwise.discard_pending()
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        self._loss_finite = None
        free_cached_memory()

    # -- after the step: log, evaluate, save, stop --------------------------------------------------------
    def _count_tokens(self, step: Step) -> None:
        if step.tokens is not None:
            self._tokens_since = self._tokens_since + step.tokens
            return
        for batch in step.collated:
            if "attention_mask" in batch:
                n = batch["attention_mask"].sum()
            elif self.pad_token_id is not None and "input_ids" in batch:
                n = (batch["input_ids"] != self.pad_token_id).sum()
            else:
                n = batch["input_ids"].numel()
            self._tokens_since = self._tokens_since + n

    def _after_step(self, step: Step) -> None:
        self._loss_sum = step.loss if self._loss_sum is None else self._loss_sum + step.loss
        s, sched = self.state.step, self.schedule
        done = s >= sched.max_steps
        self._stop_due = self._stop_due or (not done and self.should_stop())
        lr = self.learning_rate_now()
        self.scheduler.step()
        if s % sched.logging_steps == 0 or done or self._stop_due:
            self.log_training(lr)
        if sched.eval_steps and self.eval_data is not None and (s % sched.eval_steps == 0 or done):
            self.evaluate()
        # A save or a stop asked for while a policy groups steps into one update waits for the group's end.
        self._save_due = self._save_due or bool(sched.save_steps and s % sched.save_steps == 0) or done \
            or self._stop_due
        if self._save_due and not self.pending:  # never with a group's gradients waiting in .grad
            self._save_due = False
            self.stopped = self._stop_due
            if self._save is not None:
                folder = self._save(self)
                for p in self.policies:
                    p.on_save(self, folder)

    def save_now(self) -> str | None:
        """A checkpoint of the completed steps, outside the schedule (an error path keeps what it can)."""
        return self._save(self) if self._save is not None else None

    def learning_rate_now(self) -> float:
        """The learning rate of the step just taken (its first parameter group)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def log_training(self, learning_rate: float) -> None:
        """A training row: the mean step loss since the last one (over every process), the last gradient
        norm, the learning rate used, tokens seen; the policies add to it and record it."""
        loss = self._loss_sum if self._loss_sum is not None else torch.tensor(0.0)
        tokens = torch.as_tensor(self._tokens_since, device=self.accelerator.device)
        if self.processes > 1:
            loss = self.accelerator.gather(loss.reshape(1)).mean()
            tokens = self.accelerator.gather(tokens.reshape(1)).sum()
        steps = max(self.state.step - self._logged_at, 1)
        value = float(loss) / steps
        self._train_loss_total += float(loss)
        self.state.tokens_seen += int(tokens)
        self._loss_sum, self._tokens_since, self._logged_at = None, 0, self.state.step
        norm = self._last_norm
        row = {"step": self.state.step, "epoch": round(self.state.epoch, 4), "loss": round(value, 6),
               "grad_norm": float(norm) if norm is not None else None, "learning_rate": learning_rate,
               "tokens_seen": self.state.tokens_seen}
        if self.preference_metrics["train"]:  # a preference loss's rewards, a MoE router's aux_loss
            row.update(metric_means(self.preference_metrics["train"]))
            self.preference_metrics["train"] = {}
        self._record(row)

    def _record(self, row: dict) -> None:
        for p in self.policies:
            p.log(self, row)
        self.state.log_history.append({k: v for k, v in row.items() if not isinstance(v, dict)})

    def evaluate(self) -> dict[str, float]:
        """Held-out loss (and a preference method's rewards, margins, accuracy) at the current weights: the
        mean per example of each micro-batch's loss, over every process; or the objective's held-out metrics
        (GRPO: rewards). Logged as an eval row. Out of memory here is a clear error, with the completed step
        saved."""
        try:
            return self._evaluate()
        except torch.OutOfMemoryError as exc:
            failure = first_line(exc)
        self.model.zero_grad(set_to_none=True)
        step = self.state.step
        kept = "no step had completed"
        if step > 0:
            self.save_now()
            kept = f"checkpoint-{step} holds step {step}"
        raise FinetuneError(
            f"out of memory in evaluation after step {step} at eval micro-batch {self.geometry.part_rows} "
            f"({failure}); {kept}",
            hint="lower training.micro_batch_size (evaluation uses it too) or free GPU memory, then run again "
                 "with --resume")

    def _evaluate(self) -> dict[str, float]:
        start = time.time()
        metrics = self.objective.evaluate(self) if self.objective is not None else self._held_out_loss()
        metrics[f"{EVAL_PREFIX}runtime"] = round(time.time() - start, 4)
        self._record({"step": self.state.step, "epoch": round(self.state.epoch, 4), **metrics})
        return metrics

    def _held_out_loss(self) -> dict[str, float]:
        self.model.eval()
        losses, counts = [], []
        b = self.geometry.part_rows
        data = self.eval_data
        indices = list(range(len(data)))[self.rank::self.processes] if self.processes > 1 else range(len(data))
        indices = list(indices)
        with torch.no_grad():
            for i in range(0, len(indices), b):
                inputs = self.collate([data[j] for j in indices[i:i + b]])
                with self.accelerator.autocast():
                    loss = compute_loss(self.model, inputs, chunked_loss=self.chunked_loss and "labels" in inputs,
                                        preference=self.preference, metrics=self.preference_metrics["eval"])
                rows = len(indices[i:i + b])
                losses.append(loss.detach().float() * rows)
                counts.append(rows)
        self.model.train()
        total = torch.stack(losses).sum() if losses else torch.tensor(0.0, device=self.accelerator.device)
        count = torch.tensor(float(sum(counts)), device=total.device)
        if self.processes > 1:
            total = self.accelerator.gather(total.reshape(1)).sum()
            count = self.accelerator.gather(count.reshape(1)).sum()
        metrics = {f"{EVAL_PREFIX}loss": float(total / count.clamp(min=1))}
        if self.preference is not None:
            metrics.update(metric_means(self.preference_metrics["eval"], EVAL_PREFIX))
            self.preference_metrics["eval"] = {}
        return metrics

    def train_metrics(self, runtime: float, first_step: int) -> dict[str, float]:
        """results.json's summary of the training: the mean step loss, speed, epochs."""
        steps = self.state.step - first_step
        return {"train_runtime": round(runtime, 4), "train_loss": self._train_loss_total / max(steps, 1),
                "train_steps_per_second": round(steps / max(runtime, 1e-9), 3), "epoch": self.state.epoch}

    # -- the train state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The loop's, the scheduler's and the policies' state (the optimizer's and the weights are written
        by finetune.train.train_state, which knows how to gather them from several processes)."""
        return {"loop": self.state.state_dict(), "geometry": self.geometry.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "policies": {type(p).__name__: p.state_dict() for p in self.policies}}

    def load_state_dict(self, state: dict) -> None:
        """The saved state back; of the geometry, what the run changed while training (the group, the
        update batch): the micro-batch and accumulation come from the recipe (with a recovery's settings)."""
        self.state.load_state_dict(state["loop"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.set_geometry(group=state["geometry"]["group"], update_batch=state["geometry"]["update_batch"])
        saved = state["policies"]
        for p in self.policies:
            if type(p).__name__ in saved:
                p.load_state_dict(saved[type(p).__name__])


def _around(policy: Policy, loop: TrainLoop, part: Part, inner: Callable[[], torch.Tensor]
            ) -> Callable[[], torch.Tensor]:
    return lambda: policy.around_micro_batch(loop, part, inner)


def _null():
    import contextlib

    return contextlib.nullcontext()


def first_line(exc: BaseException) -> str:
    """An out-of-memory error's message for a one-line report."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"


def free_cached_memory() -> None:
    """Collect what an error's frames held and hand CUDA's cached blocks back (after an out-of-memory error)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
