"""The training loop: one explicit loop over accelerate, with policies composed into it.

Why one loop of our own: every feature that varies (out-of-memory retry, sub-updates, batch growth, the
noise-scale probe, the memory tracker, the run's files) is a `finetune.train.policy.Policy` called through
declared hooks, and what a method computes is its `Objective`, so the loop names neither; accelerate keeps
device placement, mixed precision and the all-reduce. The step-by-step picture: docs/architecture.md, "The
training loop". Why one module of ~680 lines: the step, its retry and the state it checkpoints are one order of
hook calls, read together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from finetune.data.batch import Batch
from finetune.data.batching import Batching, cut, epoch_order, example_length
from finetune.data.batching import epoch_steps as cut_epoch
from finetune.errors import FinetuneError
from finetune.optim import layerwise_of
from finetune.train.noise_scale import labelled_tokens
from finetune.train.policy import Geometry, Micro, Objective, Part, Policy, Rows, Step, Update
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
    learning_rate: float = 0.0  # the recipe's, named in the advice of a divergence


@dataclass(frozen=True)
class TrainParts:
    """What trains: the model and optimizer (prepared by accelerate), the scheduler and the accelerator."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    accelerator: Any


@dataclass(frozen=True)
class LoopData:
    """The examples and how a loader batch of them becomes a `Batch` (a collator may return a Batch or a dict
    of its names, finetune.data.batch)."""

    train: Sequence
    eval: Sequence | None = None
    collator: Callable[[list], Batch | Mapping[str, Any]] = Batch.of
    pad_token_id: int | None = None  # tokens counted as seen leave it out where a batch has no attention mask
    batching: str = "random"  # data.batching as resolved (finetune.data.batching)
    step_tokens: int | None = None  # training.effective_batch_tokens: steps of real tokens, not examples


@dataclass(frozen=True)
class MemorySettings:
    """The memory savers of each forward/backward; an out-of-memory recovery changes them through
    `TrainLoop.set_memory`."""

    chunked_loss: bool = False
    offload: Any = None  # an ActivationOffload entered around each forward/backward (the run closes the last)


def _never() -> bool:
    return False


def _nothing_kept() -> str:
    return "no checkpoint is known"


class EvaluationStopped(Exception):
    """A stop asked for during an evaluation (Ctrl-C): it ends there (TrainLoop.evaluation_progress)."""


@dataclass(frozen=True)
class RunHooks:
    """The run around the loop: `save(loop)` writes a checkpoint and returns its folder
    (finetune.train.train_state.save_checkpoint, so the loop holds no file layout); `should_stop()` is asked
    after each step (Ctrl-C); `kept()` says what a failure leaves to resume from."""

    save: Callable[[TrainLoop], str] | None = None
    should_stop: Callable[[], bool] = _never
    kept: Callable[[], str] = _nothing_kept


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
    """One run's training: what trains, the data, the batch geometry, the schedule, the method's objective and
    the policies. Policies read the loop and change it only through `set_geometry` and `set_memory`."""

    def __init__(self, parts: TrainParts, data: LoopData, geometry: Geometry, schedule: Schedule,
                 objective: Objective, *, policies: Sequence[Policy] = (), memory: MemorySettings = MemorySettings(),
                 hooks: RunHooks = RunHooks()):
        self.model, self.optimizer = parts.model, parts.optimizer
        self.scheduler, self.accelerator = parts.scheduler, parts.accelerator
        self.data, self.geometry, self.schedule = data, geometry, schedule
        self.objective, self.memory, self.hooks = objective, memory, hooks
        self.policies = list(policies)
        _check_keys(self.policies)
        self.state = LoopState(log_history=[])
        self.accepts_loss_kwargs = accepts_loss_kwargs(parts.model)
        self.processes = parts.accelerator.num_processes
        self.rank = parts.accelerator.process_index
        self.stopped = False  # a should_stop() ended training early
        self.undone = True  # the last dropped gradients changed no weight (a layer-wise optimizer may have)
        self._stop_due = self._save_due = False
        self._eval_label = "evaluation"  # the running evaluation's, for its progress
        self._saved_step = 0  # the step of the newest checkpoint this loop knows of
        self._pending: list[Step] = []  # earlier steps whose gradients wait in .grad for a later update
        self._current: Step | None = None  # the step in progress
        self._loss_sum: torch.Tensor | None = None  # step losses since the last log (a device tensor)
        self._logged_at = 0
        self._loss_finite: torch.Tensor | None = None
        self._last_norm: Any = None
        self._train_loss_total = 0.0
        self._tokens_since: torch.Tensor | int = 0
        self.sync_layerwise()

    # -- what policies may change -------------------------------------------------------------------------
    def set_geometry(self, **changes: int | None) -> None:
        """Change the batch shape (an out-of-memory recovery's splits or GRPO's completions per
        forward/backward, a policy's group), keeping what depends on it in step: a layer-wise optimizer's
        backward count per update. The geometry is the one record of the batch shape: every policy reads it."""
        for key, value in changes.items():
            if not hasattr(self.geometry, key):
                raise AttributeError(f"Geometry has no field {key!r}")
            setattr(self.geometry, key, value)
        self.sync_layerwise()

    def set_memory(self, **changes: Any) -> None:
        """Change the memory savers (an out-of-memory recovery's); an offload replaced is closed first."""
        offload = changes.get("offload", self.memory.offload)
        if offload is not self.memory.offload and self.memory.offload is not None:
            self.memory.offload.close()
        self.memory = dataclasses.replace(self.memory, **changes)

    def sync_layerwise(self) -> None:
        layerwise = layerwise_of(self.optimizer)
        if layerwise is not None:
            g = self.geometry
            layerwise.steps_per_update = g.accumulation * g.splits * g.group

    @property
    def offload(self) -> Any:
        """The activation offload in use (None: none), which the run closes at the end."""
        return self.memory.offload

    @property
    def steps_waiting(self) -> int:
        """Earlier steps whose gradients wait in .grad for the update of a later step (a policy's group)."""
        return len(self._pending)

    def is_last_update(self, update: Update) -> bool:
        """Whether `update` is the last of the step in progress."""
        return self._current is not None and update is self._current.updates[-1]

    def rewind_rng(self, step: Step) -> None:
        """Put the RNG streams back where the first update of `step` not yet applied began (the group's first
        step's start while earlier steps of a group wait)."""
        first = self._pending[0] if self._pending else step
        state = first.rng if step.applied == 0 else step.rng
        if state is not None:
            set_rng_state(state)

    def kept(self) -> str:
        """What a failure now leaves to resume from, in words."""
        return self.hooks.kept()

    # -- data -------------------------------------------------------------------------------------------
    def epoch_steps(self, epoch: int) -> list[list[list[int]]]:
        """This process's steps of `epoch`, each its loader batches (indices): a permutation seeded by (seed,
        epoch), cut as data.batching says (finetune.data.batching: random micro-batches dealt round-robin to
        the processes, or steps of examples grouped by length, or those under a token budget)."""
        by_length = self.data.batching != "random" or self.data.step_tokens is not None
        return cut_epoch(epoch_order(len(self.data.train), self.schedule.seed, epoch),
                         self.lengths if by_length else (), self.batching(), self.schedule.seed, epoch, self.rank)

    def batching(self) -> Batching:
        """The epoch's cut at the current geometry; token_budget's budget is the micro-batch's rows at the
        longest example (the tokens the plan prices for a micro-batch)."""
        g = self.geometry
        budget = g.micro_batch * max(self.lengths) if self.data.batching == "token_budget" else None
        return Batching(self.data.batching, g.micro_batch, g.accumulation, self.processes, budget,
                        self.data.step_tokens)

    @functools.cached_property
    def lengths(self) -> list[int]:
        """Every training example's padded tokens (finetune.data.batching.example_length)."""
        return example_lengths(self.data.train)

    def _steps(self) -> Iterator[tuple[float, list[list[int]]]]:
        """(epoch at the step's end, its batches) from state.step on; steps never cross an epoch."""
        done, epoch = 0, 0
        while True:
            steps = self.epoch_steps(epoch)
            for k, batches in enumerate(steps):
                if done >= self.state.step:
                    yield epoch + (k + 1) / len(steps), batches
                done += 1
            epoch += 1

    def collate(self, rows: list[dict]) -> Batch:
        """`rows` as one Batch on the device."""
        return Batch.of(self.data.collator(rows)).to(self.accelerator.device)

    def step_items(self, collated: Sequence[Batch]) -> torch.Tensor | None:
        """Labelled tokens of `collated` over every process (None when losses are means)."""
        if not self.accepts_loss_kwargs or not collated or collated[0].labels is None:
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
        self._logged_at = self._saved_step = self.state.step
        try:
            for epoch, indices in self._steps():
                if self.state.step >= self.schedule.max_steps:
                    break
                rows = [[self.data.train[i] for i in batch] for batch in indices]
                step = Step(number=self.state.step + 1, batches=rows, collated=[self.collate(r) for r in rows])
                self.run_step(step)
                self._count_tokens(step)
                self.state.step, self.state.epoch = step.number, epoch
                for p in self.policies:
                    p.on_step_end(self, step)
                self._after_step(step)
                if self.stopped:
                    break
                # The finished step's batches (a vision model's pixels, often larger than the step's
                # activations) are freed before the next step's are collated: only one step's inputs live.
                del step
                self._current = None
        finally:
            for p in self.policies:
                p.on_train_end(self)

    def default_updates(self, step: Step) -> list[Update]:
        """The step as one update of its loader batches."""
        micro = [Micro(rows, batch) for rows, batch in zip(step.batches, step.collated, strict=True)]
        return [Update(micro_batches=micro, num_items=self.step_items(step.collated))]

    def run_step(self, step: Step) -> None:
        """The step's updates (`run_update` each). Wrapped around them: an out-of-memory error in a
        forward/backward lets the policies make the step cheaper and runs it again from its first update not
        yet applied (with a group's waiting steps first), the RNG streams as they were there."""
        self._current = step
        updates = self.default_updates(step)
        for p in self.policies:
            updates = p.plan_updates(self, step, updates)
        step.updates = updates
        for p in self.policies:
            p.on_step_begin(self, step)
        if step.rng is None:
            step.rng = rng_state()
        while True:
            try:
                for j in range(step.applied, len(step.updates)):
                    last = j == len(step.updates) - 1
                    if not self.run_update(step, step.updates[j], last_of_step=last):
                        return  # deferred: its gradients wait for a later step's update
                    if not last:
                        step.applied, step.rng = j + 1, rng_state()
                self._pending = []
                return
            except torch.OutOfMemoryError as exc:
                failure = first_line(exc)
            # Outside the except block: the error's traceback (and the tensors its frames hold) is gone.
            self.drop_gradients()
            if not any(p.on_oom(self, step, failure, "step") for p in self.policies):
                raise torch.OutOfMemoryError(failure)
            self._redo_waiting(step)

    def run_update(self, step: Step, update: Update, last_of_step: bool) -> bool:
        """One optimizer update, the happy path (nanoGPT's micro-step loop): the forward/backward of each part of
        its micro-batches, their gradients summed in .grad; then, unless a policy keeps them for a later step
        (returns False), clip, check for divergence, step the optimizer and free the gradients."""
        loss = None
        for part, final in self.parts(update, last_of_step):
            with self._syncing(final):
                part_loss = self.forward_backward(part)
            loss = part_loss if loss is None else loss + part_loss
        step.loss = loss * update.share if step.loss is None else step.loss + loss * update.share
        if last_of_step and any(p.defers(self, step) for p in self.policies):
            step.deferred = True
            self._pending.append(step)
            return False
        self.apply_update(step, update)
        return True

    def _redo_waiting(self, step: Step) -> None:
        """Before a retry: the RNG streams put back, and when the step is retried from its start, the
        gradients of the group's waiting steps made again (their losses were counted already)."""
        self.rewind_rng(step)
        if step.applied:
            return
        for earlier in self._pending:
            for part, final in self.parts(earlier.updates[-1], last_of_step=False):
                with self._syncing(final):
                    self.forward_backward(part)
        step.loss = None

    def parts(self, update: Update, last_of_step: bool) -> Iterator[tuple[Part, bool]]:
        """The update's forward/backwards, in order, and whether each is its last: each micro-batch whole when
        it has at most geometry.part_rows rows (or none: an objective's own batch), else in parts of that many
        rows, each collated when it is reached."""
        micro: list[Micro] = []
        for mb in update.micro_batches:
            pieces = self.cut_rows(mb.rows)
            micro += [mb] if len(pieces) <= 1 else [Micro(rows) for rows in pieces]
        # Several processes: the loss is normalised by the labelled tokens of all of them and DDP/FSDP average
        # the gradients, so it is multiplied by their number (one process: 1), as transformers does.
        scale = self.processes if update.num_items is not None else 1
        # A mean loss (per example) enters with its rows' share of the update, so micro-batches of different
        # rows (token_budget's, an epoch's last) give the mean over the update's examples.
        rows = sum(len(mb.rows) for mb in micro) if all(mb.rows for mb in micro) else 0
        for i, mb in enumerate(micro):
            batch = mb.batch if mb.batch is not None else self.collate(mb.rows)
            final = i == len(micro) - 1
            count = rows / len(mb.rows) if rows else len(micro)
            yield Part(batch, update.num_items, count, scale, last_of_step and final), final

    def cut_rows(self, rows: Rows) -> list[Rows]:
        """`rows` as forward/backwards: parts of geometry.part_rows rows; token_budget micro-batches in parts
        of at most part_rows x the longest example's tokens (its budget, split as an out-of-memory recovery
        splits the micro-batch)."""
        size = self.geometry.part_rows
        if self.data.batching != "token_budget" or not rows:
            return [rows[i:i + size] for i in range(0, len(rows), size)]
        lengths = [example_length(r) for r in rows]
        return [[rows[i] for i in part] for part in cut(range(len(rows)), lengths, len(rows), size * max(self.lengths))]

    def _syncing(self, final: bool) -> contextlib.AbstractContextManager:
        """Several processes: gradients are all-reduced in the update's last backward only."""
        if self.processes == 1:
            return contextlib.nullcontext()
        self.accelerator.sync_gradients = final  # DeepSpeed reduces (and steps) in the backward where True
        return contextlib.nullcontext() if final else self.accelerator.no_sync(self.model)

    def forward_backward(self, part: Part) -> torch.Tensor:
        """One forward/backward: the objective's, with every policy's `around_micro_batch` around it; the loss
        as scaled for backward."""
        self.model.train()
        call = functools.partial(self.objective.forward_backward, self, part)
        for p in reversed(self.policies):
            call = _around(p, self, part, call)
        loss = part.scaled(call())
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
            hint=f"lower training.learning_rate (now {self.schedule.learning_rate:g}), keep training.max_grad_norm "
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
            self._tokens_since = self._tokens_since + batch.real_tokens(self.data.pad_token_id)

    def _after_step(self, step: Step) -> None:
        self._loss_sum = step.loss if self._loss_sum is None else self._loss_sum + step.loss
        s, sched = self.state.step, self.schedule
        done = s >= sched.max_steps
        self._stop_due = self._stop_due or (not done and self.hooks.should_stop())
        lr = self.learning_rate_now()
        self.scheduler.step()
        if s % sched.logging_steps == 0 or done or self._stop_due:
            self.log_training(lr)
        if sched.eval_steps and self.data.eval is not None and (s % sched.eval_steps == 0 or done) \
                and not self._stop_due:  # a stop asked for: the checkpoint, not an evaluation first
            self.evaluate("final evaluation" if done else None)
        # A save or a stop asked for while a policy groups steps into one update waits for the group's end.
        self._save_due = self._save_due or bool(sched.save_steps and s % sched.save_steps == 0) or done \
            or self._stop_due
        if self._save_due and not self._pending:  # never with a group's gradients waiting in .grad
            self._save_due = False
            self.stopped = self._stop_due
            if self.hooks.save is not None:
                folder = self.hooks.save(self)
                self._saved_step = self.state.step
                for p in self.policies:
                    p.on_save(self, folder)

    def save_now(self) -> str | None:
        """A checkpoint of the completed steps, outside the schedule (an error path keeps what it can)."""
        if self.hooks.save is None:
            return None
        folder = self.hooks.save(self)
        self._saved_step = self.state.step
        return folder

    def learning_rate_now(self) -> float:
        """The learning rate of the step just taken (its first parameter group)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def log_training(self, learning_rate: float) -> None:
        """A training row: the mean step loss since the last one (over every process), the last gradient
        norm, the learning rate used, tokens seen, the objective's metrics; the policies add to it and record
        it."""
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
        row.update(self.objective.training_metrics(self))  # a preference loss's rewards, a MoE router's aux_loss
        self._record(row)

    def _record(self, row: dict) -> None:
        for p in self.policies:
            p.log(self, row)
        self.state.log_history.append({k: v for k, v in row.items() if not isinstance(v, dict)})

    def evaluate(self, label: str | None = None) -> dict[str, float] | None:
        """The objective's held-out metrics at the current weights (a loss, a preference method's rewards,
        GRPO's rewards), logged as an eval row; `label` names the phase in its progress (default: "evaluation
        at step N"). None when a stop was asked for during it (Ctrl-C, `evaluation_progress`): nothing is
        logged, and during training the step is saved and the loop stops. Out of memory here is a clear
        error, with the completed step saved."""
        self._eval_label = label or f"evaluation at step {self.state.step}"
        try:
            start = time.time()
            metrics = self.objective.evaluate(self)
        except EvaluationStopped:
            self.model.train()  # as an evaluation that ends leaves it
            self._stop_due = self.state.step < self.schedule.max_steps  # the last step: training is complete
            return None
        except KeyboardInterrupt:  # a second Ctrl-C: the completed steps are kept first (one process: several
            # would each save at their own point)
            if self.processes == 1 and self.state.step > self._saved_step and not self._pending:
                self.save_now()
            raise
        except torch.OutOfMemoryError as exc:
            failure = first_line(exc)
        else:
            metrics[f"{EVAL_PREFIX}runtime"] = round(time.time() - start, 4)
            self._record({"step": self.state.step, "epoch": round(self.state.epoch, 4), **metrics})
            return metrics
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

    @contextlib.contextmanager
    def evaluation_progress(self, total: int, unit: str) -> Iterator[Callable[[int], None]]:
        """What an objective's `evaluate` reports to: `advance(n)` after each n of its `total` `unit` (this
        process's). Rank 0 says the phase has begun, then shows its progress (a bar on a terminal, else a line
        each tenth or 30 s: finetune.console.progress_bar). A stop asked for (Ctrl-C) ends the evaluation at
        the next `advance` (EvaluationStopped, caught by `evaluate`); with several processes it runs to its
        end, as each would stop at another point while the others wait in a gather."""
        from finetune.console import console, progress_bar

        label = self._eval_label
        if self.rank != 0:
            bar = None
        else:
            console.print(f"{label}: {total:,} {unit}", markup=False, highlight=False)
            bar = progress_bar(label)
            bar.start()
            task = bar.add_task(label, total=total)

        def advance(n: int) -> None:
            if bar is not None:
                bar.update(task, advance=n)
            if self.processes == 1 and self.hooks.should_stop():
                raise EvaluationStopped(label)

        try:
            yield advance
        finally:
            if bar is not None:
                bar.stop()

    def train_metrics(self, runtime: float, first_step: int) -> dict[str, float]:
        """results.json's summary of the training: the mean step loss, speed, epochs."""
        steps = self.state.step - first_step
        return {"train_runtime": round(runtime, 4), "train_loss": self._train_loss_total / max(steps, 1),
                "train_steps_per_second": round(steps / max(runtime, 1e-9), 3), "epoch": self.state.epoch}

    # -- the train state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The loop's, the scheduler's and the policies' state, each policy's under its `key` (the optimizer's
        and the weights are written by finetune.train.train_state, which knows how to gather them from several
        processes)."""
        return {"loop": self.state.state_dict(), "geometry": self.geometry.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "policies": {p.key: p.state_dict() for p in self.policies if p.key is not None}}

    def load_state_dict(self, state: dict) -> None:
        """The saved state back; of the geometry, what the run changed while training (the group, the
        update batch, GRPO's completions per forward/backward): the micro-batch and accumulation come from the
        recipe (with a recovery's settings). A policy's state saved under its class name (checkpoints of
        earlier versions) is found too."""
        self.state.load_state_dict(state["loop"])
        self.scheduler.load_state_dict(state["scheduler"])
        geometry = state["geometry"]
        self.set_geometry(**{k: geometry[k] for k in ("group", "update_batch", "completion_rows") if k in geometry})
        saved = state["policies"]
        for p in self.policies:
            own = saved.get(p.key) if p.key is not None else None
            if own is None:
                own = saved.get(type(p).__name__)
            if own is not None:
                p.load_state_dict(own)


def example_lengths(train: Sequence) -> list[int]:
    """Every training example's padded tokens (finetune.data.batching.example_length), for a batching by
    length."""
    columns = getattr(train, "column_names", None) or []
    if "input_ids" in columns:  # a datasets.Dataset: the column at once, not row by row
        return [len(ids) for ids in train["input_ids"]]
    lengths = [example_length(row) for row in train]
    if any(n is None for n in lengths):
        raise ValueError("a batching by length needs examples with input_ids")
    return [n for n in lengths if n is not None]


def _check_keys(policies: Sequence[Policy]) -> None:
    """Every policy with state declares its own checkpoint key (Policy.key)."""
    keys = [p.key for p in policies if p.key is not None]
    if len(set(keys)) != len(keys):
        raise ValueError(f"two policies share a checkpoint key: {sorted(keys)}")
    for p in policies:
        if p.key is None and type(p).state_dict is not Policy.state_dict:
            raise ValueError(f"{type(p).__name__} keeps state (state_dict) but declares no checkpoint `key`")


def _around(policy: Policy, loop: TrainLoop, part: Part, inner: Callable[[], torch.Tensor]
            ) -> Callable[[], torch.Tensor]:
    return lambda: policy.around_micro_batch(loop, part, inner)


def first_line(exc: BaseException) -> str:
    """An out-of-memory error's message for a one-line report."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"


def free_cached_memory() -> None:
    """Collect what an error's frames held and hand CUDA's cached blocks back (after an out-of-memory error)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
