"""The micro-batches a plan prices: the largest ones the run will really form.

Why: the run's steps follow from (the epoch's permutation, the examples' lengths, the seed, the epoch, the
batching) alone (finetune.data.batching), so the planner can cut the very micro-batches the run will train on,
instead of assuming the worst a random draw could make (micro_batch_size rows at the longest example, padded).
That worst case is far off where the data is small or grouped: a step of the longest examples cut to
data.max_seq_len has no padding, so transformers builds no attention mask for it (SDPA: an all-ones
attention_mask is skipped), and the two longest records of six may share the step's last, smaller
micro-batch. What one micro-batch costs grows with its rows x row tokens (activations), its rows x row tokens
squared where it is padded (the [rows, 1, s, s] mask), and its images' tokens over the rows that show images (a
text row beside an image row brings no image to the vision tower); the candidates are those no other
micro-batch exceeds in all of these (`largest`), and the plan prices each and keeps the highest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from finetune.data.batching import Batching, run_micro_batches
from finetune.plan.vision import Grid
from finetune.recipe.schema import Recipe

MOST_EPOCHS = 16  # epochs cut at most; a longer run is planned at the bound (some epoch reaches it anyway)


@dataclass(frozen=True)
class PricedBatch:
    """A micro-batch as the plan traces it: `rows` examples padded to `row` tokens; `padded`: some row is
    shorter (the collator's attention mask then holds zeros); `grids`: the image grids of its example with
    the most image tokens, () for text; `image_rows`: its examples with images (each priced with those
    grids), the others priced as text."""

    rows: int
    row: int
    padded: bool
    grids: tuple[Grid, ...] = ()
    image_tokens: int = 0  # those grids' tokens
    image_rows: int = 0

    def dominates(self, other: PricedBatch) -> bool:
        """At least as large in every part of a micro-batch's memory (module docstring)."""
        return (self.rows * self.row >= other.rows * other.row and self.padded >= other.padded
                and self.rows * self.row ** 2 >= other.rows * other.row ** 2
                and self.image_rows * self.image_tokens >= other.image_rows * other.image_tokens)


def largest(batches: Sequence[PricedBatch]) -> list[PricedBatch]:
    """The micro-batches no other dominates: one of them is the largest, whatever the model."""
    kept: list[PricedBatch] = []
    # a dominating micro-batch sorts first, so checking those kept suffices (dominance is transitive)
    for b in sorted(set(batches), key=lambda b: (-b.rows * b.row, -b.row, -b.padded,
                                            -b.image_rows * b.image_tokens)):
        if not any(o.dominates(b) for o in kept):
            kept.append(b)
    return kept


def run_batches(recipe: Recipe, micro_batch: int, accumulation: int, batching: str, lengths: Sequence[int],
                rows: Sequence[tuple[int, tuple[Grid, ...], int]] | None = None,
                rows_per_example: int = 1) -> list[PricedBatch] | None:
    """The candidates for the largest micro-batch `recipe` forms at this batch shape and batching (`largest`),
    over every step it makes (max_steps, or its epochs); None where they cannot be known: a run of more than
    MOST_EPOCHS epochs. `lengths`: every training example's tokens, as the run groups them; `rows`: each
    example's padded row tokens, image grids and their tokens where they differ (image records, expanded);
    `rows_per_example` 2: a preference pair, whose chosen and rejected rows are padded together (padded)."""
    t = recipe.training
    cut = Batching(batching, micro_batch, accumulation, recipe.distributed.gpus,
                   micro_batch * max(lengths) if batching == "token_budget" else None, t.effective_batch_tokens)
    indices = run_micro_batches(lengths, cut, t.seed, t.epochs, t.max_steps, MOST_EPOCHS)
    if indices is None:
        return None
    rows = rows or [(n, (), 0) for n in lengths]
    priced = set()
    for mb in indices:
        row = max(rows[i][0] for i in mb)
        _, grids, tokens = max((rows[i] for i in mb), key=lambda r: r[2])
        priced.add(PricedBatch(len(mb), row, rows_per_example > 1 or any(rows[i][0] < row for i in mb), grids, tokens,
                               sum(rows[i][2] > 0 for i in mb)))
    return largest(list(priced))
