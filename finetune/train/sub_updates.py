"""Updates smaller than the loader batch: the batch-size warmup of `effective_batch_size: auto`.

The critical batch starts near 0 and grows during training (Critical Batch Size Revisited), so early on the
planner's micro-batch m (its fastest fit) is a larger batch than the data is worth: at equal tokens a batch
of one sequence reaches a lower loss than one of 32 (benchmarks/results/batch_size.txt). The loader still
yields m sequences per loop step (the data order, max_steps and the LR schedule stay in loader batches,
so in tokens), but the step runs them as m/u consecutive UPDATES of u sequences: forward-backward of a
chunk of u (re-collated exactly as a loader of micro-batch u would, the rows SplittableCollator keeps),
gradient clipping, the divergence check, optimizer step, gradients freed (finetune/train/loop.py runs each
`Update`; the scheduler steps once per loop step, so each sub-update of a step uses its learning rate). Each update's loss is the token mean of its own chunk (num_items_in_batch of the chunk), so a step of
sub-updates of one sequence trains exactly as a run at micro-batch 1 with the learning rate and beta2 the
rules give one sequence (tests/test_batch_engine.py). The step's logged loss stays the token mean of its
loader batch. After an out-of-memory recovery (`splits`) each chunk runs in the recovery's smaller parts.
Steps of several updates are not timed (batch_rules.StepTimes assumes one update per step).

The noise scale at u < m: every training.noise_scale_split_every updates two consecutive chunks share one
update (two micro-batches for GradNormProbe), as a pair of loader batches measures micro-batch 1; the pair
keeps the learning rate of u. The batch engine (batch_engine.py) chooses u (batch_rules.update_batch) and
the learning rate and beta2 for it.

An out-of-memory retry (the loop) re-runs the step from its first update not yet applied, with the RNG
streams as they were there: applied updates are never applied twice. A give-up after some updates of the
step were applied saves no checkpoint (the weights are no longer the last completed step's).
"""

from __future__ import annotations

from finetune.train.policy import Rows


def plan_sub_updates(rows: Rows, size: int, split_every: int, measuring: bool, since_pair: int
                     ) -> tuple[list[list[Rows]], int]:
    """The step's updates as lists of chunks: chunks of `size` rows, one per update, except that every
    `split_every` updates two consecutive chunks share one (the noise-scale measurement, when `measuring`);
    also the updates since the last pair, to carry into the next step."""
    chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
    updates, i = [], 0
    while i < len(chunks):
        pair = measuring and since_pair >= split_every - 1 and i + 1 < len(chunks)
        updates.append(chunks[i:i + 2] if pair else chunks[i:i + 1])
        since_pair = 0 if pair else since_pair + 1
        i += len(updates[-1])
    return updates, since_pair
