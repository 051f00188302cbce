"""Updates smaller than the loader batch: the batch-size warmup of `effective_batch_size: auto`.

The critical batch starts near 0 and grows during training (Critical Batch Size Revisited), so early on the
planner's micro-batch m (its fastest fit) is a larger batch than the data is worth: at equal tokens a batch
of one sequence reaches a lower loss than one of 32 (benchmarks/results/batch_size.txt). The loader still
yields m sequences per Trainer step (the data order, max_steps and the LR schedule stay in loader batches,
so in tokens), but the step runs them as m/u consecutive UPDATES of u sequences: forward-backward of a
chunk of u (re-collated exactly as a loader of micro-batch u would, the rows SplittableCollator keeps),
gradient clipping, the divergence check, optimizer step, gradients freed; the last chunk's update is the
Trainer's own (so the scheduler steps once per Trainer step and each sub-update of a step uses its learning
rate). Each update's loss is the token mean of its own chunk (num_items_in_batch of the chunk), so a step of
sub-updates of one sequence trains exactly as a run at micro-batch 1 with the learning rate and beta2 the
rules give one sequence (tests/test_batch_engine.py). The step's logged loss stays the token mean of its
loader batch. After an out-of-memory recovery (`splits`) each chunk runs in the recovery's smaller parts.
Steps of several updates are not timed (batch_rules.StepTimes assumes one update per step).

The noise scale at u < m: every training.noise_scale_split_every updates two consecutive chunks share one
update (two micro-batches for GradNormProbe), as a pair of loader batches measures micro-batch 1; the pair
keeps the learning rate of u. The batch engine (batch_engine.py) chooses u (batch_rules.update_batch) and
the learning rate and beta2 for it.

An out-of-memory retry (recovery.py) re-runs the step from its first update not yet applied, with the RNG
streams as they were there: applied updates are never applied twice. A give-up after some updates of the
step were applied saves no checkpoint (the weights are no longer the last completed step's).
"""

from __future__ import annotations

import torch

from finetune.train.noise_scale import labelled_tokens
from finetune.train.recovery import ROWS, RecoveringTrainer, _rng_state


class SubUpdatingTrainer(RecoveringTrainer):
    """RecoveringTrainer that runs each loader batch as updates of `update_batch` sequences while that is
    smaller than the loader batch (see the module docstring); update_batch is None or the loader batch:
    one update per Trainer step, as RecoveringTrainer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.update_batch: int | None = None
        self._since_pair = 0  # updates since the last measuring pair of chunks
        self._updates: list[list[list]] | None = None  # this step's updates, each a list of chunks of rows
        self._applied = 0  # updates of this step already applied
        self._step_loss: torch.Tensor | None = None  # their losses, weighted as parts of the step's mean
        self._sub_stepping = False  # an optimizer step of an update inside the Trainer step

    def sub_updating(self) -> bool:
        """Whether Trainer steps run as several updates now (the warmup is below the loader batch)."""
        return self.update_batch is not None and self.update_batch < self.args.per_device_train_batch_size

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        self._updates, self._applied, self._step_loss = None, 0, None
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _applied_in_step(self) -> bool:
        return self._applied > 0

    def _split_step(self, model, inputs: dict, num_items_in_batch) -> torch.Tensor:
        if not self.sub_updating() or len(self._update) != 1:
            return super()._split_step(model, inputs, num_items_in_batch)
        rows = inputs[ROWS].rows
        if self._updates is None:  # planned once per step: a retry continues the same updates
            self._updates = self._plan(rows)
        size = self.args.per_device_train_batch_size // self.splits  # an OOM recovery's forward parts
        for j in range(self._applied, len(self._updates)):
            chunks, last = self._updates[j], j == len(self._updates) - 1
            collated = [self.data_collator.collator(c) for c in chunks]
            items = None
            if num_items_in_batch is not None:
                items = sum(labelled_tokens(c) for c in collated).to(getattr(num_items_in_batch, "device", "cpu"))
            self.current_gradient_accumulation_steps = sum(-(-len(c) // size) for c in chunks)
            loss = None
            for i, chunk in enumerate(chunks):
                part = self._run_parts(model, chunk, size, items, last and i == len(chunks) - 1)
                loss = part if loss is None else loss + part
            share = items / num_items_in_batch if items is not None else sum(map(len, chunks)) / len(rows)
            self._step_loss = loss * share if self._step_loss is None else self._step_loss + loss * share
            if not last:
                self._sub_update(model)
                self._applied, self._rng = j + 1, _rng_state()  # a retry starts here, as it was
        return self._step_loss

    def _plan(self, rows: list) -> list[list[list]]:
        """The step's updates: chunks of update_batch rows, one per update, except that every
        noise_scale_split_every updates two consecutive chunks share one (the noise-scale measurement)."""
        u, every = self.update_batch, self.recipe.training.noise_scale_split_every
        chunks = [rows[i:i + u] for i in range(0, len(rows), u)]
        updates, i = [], 0
        while i < len(chunks):
            pair = self.noise_probe is not None and self._since_pair >= every - 1 and i + 1 < len(chunks)
            updates.append(chunks[i:i + 2] if pair else chunks[i:i + 1])
            self._since_pair = 0 if pair else self._since_pair + 1
            i += len(updates[-1])
        return updates

    def _sub_update(self, model) -> None:
        """An update inside the Trainer step, as the Trainer makes its own (without the scheduler step and
        the step's callbacks): clipping and the noise-scale observation, the divergence check, the step."""
        grad_norm = self._clip_grad_norm(model) if self.args.max_grad_norm > 0 else None
        self._get_grad_norm(model, grad_norm=grad_norm)
        self._sub_stepping = True
        try:
            self.optimizer.step()
        finally:
            self._sub_stepping = False
        model.zero_grad()
