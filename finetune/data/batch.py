"""One collated micro-batch as a typed value: what a run's collator makes (finetune.data.packing.BatchCollator)
and every objective (finetune/train/objectives.py) reads.

The named fields are what every causal-LM batch may have; `extra` holds further keyword inputs of the model's
forward, passed through untouched: a vision-language batch's `pixel_values` / `image_grid_thw`, a packed
batch's `cu_seq_lens_*` and `use_cache`. A collator may return a `Batch` or a dict of the same names
(`Batch.of`, which the training loop applies: the names below become fields, any other key goes to `extra`),
so a new data kind's collator needs no wrapper. `kto_label` and `ref_logps` are a preference method's targets, never
model inputs.

A `Batch` also reads as a mapping of its present values (field names and `extra`'s keys), so the code that
takes a collated dict (the step of finetune.step.training_step, the planner's trace, the memory tracker's step
signature) takes it as it is.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch


@dataclass(eq=False)
class Batch(Mapping[str, Any]):
    """A collated micro-batch (module docstring)."""

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # further model inputs: pixel_values, image_grid_thw, ...
    kto_label: torch.Tensor | None = None  # kto: each row's answer is desirable
    ref_logps: torch.Tensor | None = None  # a precomputed reference's sequence log-probabilities, per row

    @classmethod
    def of(cls, collated: Mapping[str, Any]) -> Batch:
        """A collator's output as a Batch (a Batch is returned as it is)."""
        if isinstance(collated, Batch):
            return collated
        named = {k: v for k, v in collated.items() if k in _FIELDS}
        return cls(**named, extra={k: v for k, v in collated.items() if k not in _FIELDS})

    def to(self, device: torch.device | str) -> Batch:
        """The batch with its tensors on `device` (extra's too)."""
        def move(v: Any) -> Any:
            return v.to(device) if isinstance(v, torch.Tensor) else v

        return Batch(**{f: move(getattr(self, f)) for f in _FIELDS},
                     extra={k: move(v) for k, v in self.extra.items()})

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    def real_tokens(self, pad_token_id: int | None) -> torch.Tensor | int:
        """Input tokens that are not padding (the attention mask's, else those unlike the pad token)."""
        if self.attention_mask is not None:
            return self.attention_mask.sum()
        if pad_token_id is not None:
            return (self.input_ids != pad_token_id).sum()
        return self.input_ids.numel()

    # -- the mapping view ---------------------------------------------------------------------------------
    def _items(self) -> dict[str, Any]:
        present = {f: getattr(self, f) for f in _FIELDS if getattr(self, f) is not None}
        return {**present, **self.extra}

    def __getitem__(self, key: str) -> Any:
        if key in _FIELDS and getattr(self, key) is not None:
            return getattr(self, key)
        return self.extra[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    def __contains__(self, key: object) -> bool:
        return (key in _FIELDS and getattr(self, key) is not None) or key in self.extra


_FIELDS = tuple(f.name for f in fields(Batch) if f.name != "extra")
