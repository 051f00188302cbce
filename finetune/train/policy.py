"""What a training policy may do inside the loop (finetune/train/loop.py), and the values it acts on.

A policy is one class with any of the hooks below; the loop calls each hook on every policy in the order
they were given and never knows a policy by name. Each hook's contract is its one-line docstring. A policy
that keeps state across a checkpoint returns it from `state_dict` (plain values and tensors: the train
state is loaded with torch's weights-only loader) and takes it back in `load_state_dict`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from finetune.train.loop import TrainLoop

Rows = list[dict]  # examples of a loader batch as the dataset gives them, before collation


@dataclass
class Update:
    """One optimizer update: its micro-batches (each a list of rows: one forward/backward, run in parts of at
    most `Geometry.part_rows` rows), its labelled tokens and its share of the step's logged loss."""

    micro_batches: list[Rows]
    num_items: torch.Tensor | None = None  # labelled tokens of the update (all processes); None: mean losses
    share: float | torch.Tensor = 1.0  # weight of this update's loss in the step's loss
    collated: dict[int, dict] = field(default_factory=dict)  # id(micro-batch) -> its inputs, when already made
    whole: bool = False  # each micro-batch runs as one forward/backward (the policy sized it; GRPO's completions)


@dataclass
class Step:
    """One loop step: `accumulation` loader batches, the unit of max_steps, the schedule and checkpoints."""

    number: int  # 1-based: the step being run (the completed count is loop.state.step)
    batches: list[Rows]  # the loader batches, as rows
    collated: list[dict]  # the same, collated (what the model sees when a batch runs whole)
    updates: list[Update] = field(default_factory=list)
    applied: int = 0  # updates of this step already applied (a retry starts after them)
    rng: tuple | None = None  # the RNG streams where the first update not yet applied began
    loss: torch.Tensor | None = None  # the step's loss (its updates' losses weighted by share)
    deferred: bool = False  # its update is kept for the next step (a policy grouped steps)
    tokens: torch.Tensor | None = None  # non-padding tokens it trained on, when not its batches' (GRPO: completions)


@dataclass
class Part:
    """One forward/backward as the policies see it: its inputs, and how its loss enters the update."""

    inputs: dict
    num_items: torch.Tensor | None  # labelled tokens of the whole update (all processes), or None: mean losses
    count: int  # forward/backwards of the update (the divisor of mean losses)
    scale: int  # processes the loss is multiplied by (their gradients are averaged)
    last: bool  # the step's last one

    def weight(self, tokens: torch.Tensor) -> torch.Tensor | float:
        """Its gradient's share of the update, given its labelled `tokens` (a device scalar: no sync)."""
        return self.scale * tokens / self.num_items if self.num_items is not None else 1 / self.count


@dataclass
class Geometry:
    """The live batch shape, owned by the loop (changed only through `TrainLoop.set_geometry`) and
    checkpointed. Sequences per update = micro_batch x accumulation x group x processes, or update_batch
    while that is smaller than the loader batch."""

    micro_batch: int  # rows per loader batch (fixed for a run: the data order is in loader batches)
    accumulation: int  # loader batches per loop step
    processes: int = 1
    splits: int = 1  # each loader batch runs in this many parts (an out-of-memory recovery's smaller micro-batch)
    group: int = 1  # loop steps per optimizer update (effective_batch_size: auto)
    update_batch: int | None = None  # sequences per update inside a loader batch (auto's warmup); None: all

    @property
    def part_rows(self) -> int:
        """Rows per forward/backward."""
        return self.micro_batch // self.splits

    def state_dict(self) -> dict:
        return dict(self.__dict__)


class Objective(Protocol):
    """A training method that is not a loss over the data's collated batches (GRPO: generate, score, then a
    loss over the completions): the loop calls it for each forward/backward and for held-out evaluation. It
    is usually also a policy (its plan_updates makes the completions the updates' micro-batches)."""

    def forward_backward(self, loop: TrainLoop, part: Part) -> torch.Tensor:
        """Forward and backward of `part.inputs` (what the method's update put in Update.collated); the
        loss as scaled for backward, detached."""

    def evaluate(self, loop: TrainLoop) -> dict[str, float]:
        """Held-out metrics at the current weights, named with the `eval_` prefix."""


class Policy:
    """Base class: every hook does nothing. Override the ones the policy needs."""

    def on_train_begin(self, loop: TrainLoop) -> None:
        """Once, after a resume's state is loaded and before the first step."""

    def plan_updates(self, loop: TrainLoop, step: Step, updates: list[Update]) -> list[Update]:
        """How the step's rows run as updates (given: what earlier policies made of it); return them."""
        return updates

    def on_step_begin(self, loop: TrainLoop, step: Step) -> None:
        """The step's batches are fetched and planned; nothing of it ran."""

    def around_micro_batch(self, loop: TrainLoop, part: Part, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run one forward/backward (`run`, returns its loss), adding what the policy needs around it."""
        return run()

    def defers(self, loop: TrainLoop, step: Step) -> bool:
        """Whether the step's last update waits for the next step (its gradients stay in .grad)."""
        return False

    def before_update(self, loop: TrainLoop, update: Update) -> None:
        """Gradients of the update are complete: nothing clipped, measured or applied yet."""

    def after_update(self, loop: TrainLoop, update: Update, grad_norm: torch.Tensor | float | None) -> None:
        """The update was applied and the gradients freed."""

    def on_step_end(self, loop: TrainLoop, step: Step) -> None:
        """The step is complete (state.step counts it); before logging, evaluation and saving."""

    def on_oom(self, loop: TrainLoop, step: Step, failure: str, phase: str) -> bool:
        """Out of memory in `phase` ("step": a forward/backward, "update": clipping or optimizer.step, the
        gradients already dropped): True if the loop should run the step again (the policy made it cheaper);
        False to let the next policy (or the loop, which raises) handle it."""
        return False

    def log(self, loop: TrainLoop, row: dict) -> None:
        """Add to a training or evaluation log row, or record it (rows go through the policies in order)."""

    def on_save(self, loop: TrainLoop, folder: str) -> None:
        """A checkpoint of state.step was published at `folder`."""

    def on_train_end(self, loop: TrainLoop) -> None:
        """Training ended (also after an error: release what the policy holds)."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the policy."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take back what state_dict returned (a checkpoint without it: start afresh)."""
