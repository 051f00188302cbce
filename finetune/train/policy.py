"""What a training policy may do inside the loop (finetune/train/loop.py), and the values it acts on.

A policy is one class with any of the hooks below; the loop calls each hook on every policy in the order
they were given and never knows a policy by name. Each hook's contract is its one-line docstring. A policy
changes the loop only through `Loop.set_geometry` (the batch shape, the one record every policy reads)
and `Loop.set_memory` (the memory savers); `Loop` is all of the loop (finetune.train.loop.TrainLoop) that
policies and objectives see. A policy that keeps state across a checkpoint declares its
`key` and returns the state from `state_dict` (plain values and tensors: the train state is loaded with
torch's weights-only loader) and takes it back in `load_state_dict`.

The objective (`Objective`) is what a training method computes; every method's implements it
(finetune/train/objectives.py) and the loop calls it blind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from finetune.data.batch import Batch
    from finetune.rl.step import MicroBatch as RolloutBatch

Rows = list[dict]  # examples of a loader batch as the dataset gives them, before collation


@dataclass
class Micro:
    """One micro-batch of an update: its rows, and its batch once made. Rows longer than
    `Geometry.part_rows` run in parts of that many rows, each collated as a loader of that micro-batch would
    (an out-of-memory recovery's splits); a micro-batch without rows is an objective's own batch, sized by
    the policy that made it (GRPO's completions) and run as it is."""

    rows: Rows = field(default_factory=list)
    batch: Batch | RolloutBatch | None = None  # the collated rows (made when first needed), or the objective's


@dataclass
class Update:
    """One optimizer update: its micro-batches (each one forward/backward, or a few after a recovery), its
    labelled tokens and its share of the step's logged loss."""

    micro_batches: list[Micro]
    num_items: torch.Tensor | None = None  # labelled tokens of the update (all processes); None: mean losses
    share: float | torch.Tensor = 1.0  # weight of this update's loss in the step's loss


@dataclass
class Step:
    """One loop step: `accumulation` loader batches, the unit of max_steps, the schedule and checkpoints."""

    number: int  # 1-based: the step being run (the completed count is loop.state.step)
    batches: list[Rows]  # the loader batches, as rows
    collated: list[Batch]  # the same, collated (what the model sees when a batch runs whole)
    updates: list[Update] = field(default_factory=list)
    applied: int = 0  # updates of this step already applied (a retry starts after them)
    rng: tuple | None = None  # the RNG streams where the first update not yet applied began
    loss: torch.Tensor | None = None  # the step's loss (its updates' losses weighted by share)
    deferred: bool = False  # its update is kept for the next step (a policy grouped steps)
    tokens: torch.Tensor | None = None  # non-padding tokens it trained on, when not its batches' (GRPO: completions)


@dataclass
class Part:
    """One forward/backward as the objective and the policies see it: its batch, and how its loss enters the
    update."""

    batch: Batch | RolloutBatch
    num_items: torch.Tensor | None  # labelled tokens of the whole update (all processes), or None: mean losses
    count: float  # the divisor of a mean loss: the update's rows / this part's (forward/backwards when equal)
    scale: int  # processes the loss is multiplied by (their gradients are averaged)
    last: bool  # the step's last one

    def weight(self, tokens: torch.Tensor) -> torch.Tensor | float:
        """Its gradient's share of the update, given its labelled `tokens` (a device scalar: no sync)."""
        return self.scale * tokens / self.num_items if self.num_items is not None else 1 / self.count

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as backward takes it: times the processes whose gradients are averaged."""
        return loss * self.scale if self.scale != 1 else loss


@dataclass
class Geometry:
    """The live batch shape, owned by the loop (changed only through `Loop.set_geometry`) and
    checkpointed. Sequences per update = micro_batch x accumulation x group x processes, or update_batch
    while that is smaller than the loader batch."""

    micro_batch: int  # rows per loader batch (fixed for a run: the data order is in loader batches)
    accumulation: int  # loader batches per loop step
    processes: int = 1
    splits: int = 1  # each loader batch runs in this many parts (an out-of-memory recovery's smaller micro-batch)
    group: int = 1  # loop steps per optimizer update (effective_batch_size: auto)
    update_batch: int | None = None  # sequences per update inside a loader batch (auto's warmup); None: all
    completion_rows: int | None = None  # completions per forward/backward of a method that generates (GRPO)

    @property
    def part_rows(self) -> int:
        """Rows per forward/backward."""
        return self.micro_batch // self.splits

    def state_dict(self) -> dict:
        return dict(self.__dict__)


class Objective(Protocol):
    """What a training method computes (torchtune's `_loss_fn`): every method's (finetune/recipe/methods.py
    names its factory) implements it, and the loop calls it blind for each forward/backward, for held-out
    evaluation and for its part of a training row."""

    evaluates_before: bool  # its held-out metrics are worth taking before training too (rewards)

    def forward_backward(self, loop: Loop, part: Part) -> torch.Tensor:
        """Forward and backward of `part.batch` (backward through `loop.backward(part.scaled(loss))`); the
        loss as scaled for backward, detached."""

    def evaluate(self, loop: Loop) -> dict[str, float]:
        """Held-out metrics at the current weights, named with the `eval_` prefix; progress (and a stop asked
        for) through `loop.evaluation_progress`."""

    def training_metrics(self, loop: Loop) -> dict[str, float]:
        """What a training row adds (a preference method's rewards, GRPO's): means since the last row."""


class Policy:
    """Base class: every hook does nothing. Override the ones the policy needs. A policy with state declares
    `key`, the stable name its state is saved under in a checkpoint (not the class name, so renaming the class
    keeps a resume's state)."""

    key: ClassVar[str | None] = None

    def on_train_begin(self, loop: Loop) -> None:
        """Once, after a resume's state is loaded and before the first step."""

    def plan_updates(self, loop: Loop, step: Step, updates: list[Update]) -> list[Update]:
        """How the step's rows run as updates (given: what earlier policies made of it); return them."""
        return updates

    def on_step_begin(self, loop: Loop, step: Step) -> None:
        """The step's batches are fetched and planned; nothing of it ran."""

    def around_micro_batch(self, loop: Loop, part: Part, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run one forward/backward (`run`, returns its loss), adding what the policy needs around it."""
        return run()

    def defers(self, loop: Loop, step: Step) -> bool:
        """Whether the step's last update waits for the next step (its gradients stay in .grad)."""
        return False

    def before_update(self, loop: Loop, update: Update) -> None:
        """Gradients of the update are complete: nothing clipped, measured or applied yet."""

    def after_update(self, loop: Loop, update: Update, grad_norm: torch.Tensor | float | None) -> None:
        """The update was applied and the gradients freed."""

    def on_step_end(self, loop: Loop, step: Step) -> None:
        """The step is complete (state.step counts it); before logging, evaluation and saving."""

    def on_oom(self, loop: Loop, step: Step, failure: str, phase: str) -> bool:
        """Out of memory in `phase` ("step": a forward/backward, "update": clipping or optimizer.step, the
        gradients already dropped): True if the loop should run the step again (the policy made it cheaper);
        False to let the next policy (or the loop, which raises) handle it."""
        return False

    def log(self, loop: Loop, row: dict) -> None:
        """Add to a training or evaluation log row, or record it (rows go through the policies in order)."""

    def on_save(self, loop: Loop, folder: str) -> None:
        """A checkpoint of state.step was published at `folder`."""

    def on_train_end(self, loop: Loop) -> None:
        """Training ended (also after an error: release what the policy holds)."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the policy (under `key`)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take back what state_dict returned (a checkpoint without it: start afresh)."""


class Loop(Protocol):
    """What policies and objectives see of the training loop (finetune.train.loop.TrainLoop implements it): its
    parts and state to read, and the two ways to change it, `set_geometry` and `set_memory`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    accelerator: Any  # accelerate's Accelerator
    state: Any  # finetune.train.loop.LoopState: step, epoch, tokens seen, log history
    geometry: Geometry
    schedule: Any  # finetune.train.loop.Schedule
    memory: Any  # finetune.train.loop.MemorySettings
    data: Any  # finetune.train.loop.LoopData
    objective: Objective
    policies: list[Policy]
    processes: int
    rank: int
    stopped: bool
    undone: bool

    def set_geometry(self, **changes: int | None) -> None: ...
    def set_memory(self, **changes: Any) -> None: ...
    @property
    def offload(self) -> Any: ...
    @property
    def steps_waiting(self) -> int: ...
    def is_last_update(self, update: Update) -> bool: ...
    def rewind_rng(self, step: Step) -> None: ...
    def kept(self) -> str: ...
    def collate(self, rows: list[dict]) -> Batch: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def diverged(self, step: int, what: str) -> None: ...
    def save_now(self) -> str | None: ...
    def evaluate(self, label: str | None = None) -> dict[str, float] | None: ...
    def evaluation_progress(self, total: int, unit: str) -> contextlib.AbstractContextManager[
        Callable[[int], None]]: ...
    def train_metrics(self, runtime: float, first_step: int) -> dict[str, float]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def fit(self) -> None: ...
