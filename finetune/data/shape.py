"""The data's shape, as the memory plan needs it: how long each training example is, and its images.

Why one small value object: the plan prices the micro-batches the run will form, and those are made of the
user's examples, not of `data.max_seq_len`-token rows. Everything the planner (and a batching that groups or
budgets examples by length) needs to know of the data lives here; `finetune.data.build.data_shape` makes it
from the same pipeline as the run's data (read, sample, split, tokenize, fit to max_seq_len), and it is cached
under the data's fingerprint (records, tokenizer, template, the data keys), so a re-plan does not tokenize again.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

Size = tuple[int, int]  # an image's (width, height)


@dataclass(frozen=True)
class DataShape:
    """Every training example of a run, in the order the data build keeps them.

    `lengths`: each example's tokens as the run trains it (fitted to data.max_seq_len; a preference pair: the
    longer of its two sequences, which the collator pads together; an image record: its text tokens with the
    one token the chat template writes per image, the image tokens not expanded, since they depend on the
    pixel budget the plan picks). `images`: each example's image sizes (() for a text example), so the planner
    counts image tokens at each budget."""

    lengths: tuple[int, ...]
    images: tuple[tuple[Size, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.lengths:
            raise ValueError("a DataShape needs at least one example")
        if self.images and len(self.images) != len(self.lengths):
            raise ValueError("DataShape.images needs one entry per example")

    @property
    def examples(self) -> int:
        return len(self.lengths)

    @property
    def longest(self) -> int:
        """The longest example's tokens (image records: before their images are expanded)."""
        return max(self.lengths)

    @property
    def has_images(self) -> bool:
        return any(self.images)

    def padded_row(self, max_seq_len: int) -> int:
        """The row length of the longest micro-batch padded to its longest row (the run's collator without
        packing): the micro-batch that holds the longest example, at most max_seq_len. The bound the planner's
        search prices, whatever the batching (finetune.plan.batches then prices the run's real micro-batches)."""
        return min(self.longest, max_seq_len)

    def histogram(self, edges: Sequence[int]) -> list[int]:
        """How many examples have at most edges[0] tokens, at most edges[1] (and more than edges[0]), ...; the
        last count holds those longer than edges[-1]."""
        import bisect

        counts = [0] * (len(edges) + 1)
        for n in self.lengths:
            counts[bisect.bisect_left(edges, n)] += 1
        return counts

    def to_json(self) -> str:
        return json.dumps({"lengths": list(self.lengths), "images": [[list(s) for s in x] for x in self.images]})

    @classmethod
    def from_json(cls, text: str) -> DataShape:
        data = json.loads(text)
        return cls(tuple(data["lengths"]), tuple(tuple(tuple(s) for s in x) for x in data.get("images", [])))
