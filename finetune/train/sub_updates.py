"""Updates smaller than the loader batch: the batch-size warmup of `effective_batch_size: auto`.

More in docs/training.md, "Sub-updates of the warmup (finetune/train/sub_updates.py)".
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
