"""Packing and batch collation.

Packing uses TRL's `pack_dataset` (Best Fit Decreasing: whole examples are binned into rows of at most
max_seq_len tokens, never split). Each packed row gets `position_ids` that restart at 0 for every example.
Batches of packed rows are collated padding-free by TRL's `DataCollatorForLanguageModeling`: the rows are
concatenated into one sequence with `position_ids` and no `attention_mask` (plus the `cu_seq_lens_*` that
flash-attention's variable-length kernel reads). transformers 5 detects the packed sequences from the
position_ids (`masking_utils.find_packed_sequence_indices`) and keeps them apart in the mask it gives the
attention kernel: the kernel `model.attn_implementation: auto` picks for packed data (`chunked`, flex attention,
flash-attention: finetune.model.attention) takes it without a dense mask; only sdpa and eager, named in the
recipe, get a block-diagonal [1, 1, s, s] one. That detection is skipped when a KV cache exists, and models create one in training when
`config.use_cache` is true, so packed batches also carry `use_cache=False`.
Unpacked batches are padded on the right: `input_ids` with the pad token, `labels` with -100, plus
`attention_mask`. A run's collator (`make_collator`) returns them typed, as `finetune.data.batch.Batch`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from finetune.compat import lm_collator
from finetune.data.batch import Batch

DataCollatorForLanguageModeling = lm_collator()  # trl's, through compat (trl exports it from its trainer only)


def pack(dataset: Any, max_seq_len: int) -> Any:
    """Pack a dataset of input_ids/labels into rows of <= max_seq_len tokens with restarting position_ids."""
    import datasets
    from trl import pack_dataset

    bars_were_on = datasets.is_progress_bar_enabled()  # in-memory maps take milliseconds: no progress bars
    datasets.disable_progress_bars()
    try:
        packed = pack_dataset(dataset, seq_length=max_seq_len, strategy="bfd")
        return packed.map(
            lambda row: {"position_ids": [p for n in row["seq_lengths"] for p in range(n)]},
            remove_columns=["seq_lengths"],
        )
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()


@dataclass
class PackedCollator(DataCollatorForLanguageModeling):
    """TRL's padding-free collator fed with our `position_ids` column (TRL expects `seq_lengths`).

    Trainer drops dataset columns the model's forward does not take, so `position_ids` (a forward argument)
    survives where `seq_lengths` would not; the example boundaries are recovered from where positions restart.
    """

    padding_free: bool = True

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        rows = [
            {"input_ids": e["input_ids"], "labels": e["labels"], "seq_lengths": _seq_lengths(e["position_ids"])}
            for e in examples
        ]
        batch = super().torch_call(rows)
        batch["use_cache"] = False
        return batch


def _seq_lengths(position_ids: list[int]) -> list[int]:
    starts = [i for i, p in enumerate(position_ids) if p == 0] + [len(position_ids)]
    return [b - a for a, b in itertools.pairwise(starts)]


@dataclass
class PreferenceCollator(DataCollatorForLanguageModeling):
    """Preference examples as one right-padded batch: for pairs, the chosen sequences then the rejected ones
    (2 x micro-batch rows, one forward for both, as `finetune.step.preference` expects); for kto, the
    sequences and a boolean `kto_label` per row. Examples with a `ref_logps` column (precomputed reference
    log-probabilities, one per sequence of the example) give `ref_logps` per row, in the same order."""

    pairs: bool = True

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        prefixes = ("chosen_", "rejected_") if self.pairs else ("",)
        rows = [{"input_ids": e[f"{p}input_ids"], "labels": e[f"{p}labels"]} for p in prefixes for e in examples]
        batch = super().torch_call(rows)
        if not self.pairs:
            batch["kto_label"] = torch.tensor([bool(e["kto_label"]) for e in examples])
        if examples and "ref_logps" in examples[0]:
            batch["ref_logps"] = torch.tensor([e["ref_logps"][i] for i in range(len(prefixes)) for e in examples],
                                              dtype=torch.float32)
        return batch


@dataclass(frozen=True)
class BatchCollator:
    """A collator whose batches are typed (`finetune.data.batch.Batch`): the TRL collator's dict, any key beyond
    the named fields in `Batch.extra`."""

    collate: Callable[[list[dict[str, Any]]], Mapping[str, Any]]

    def __call__(self, examples: list[dict[str, Any]]) -> Batch:
        return Batch.of(self.collate(examples))


def make_collator(tokenizer: Any, packed: bool, kind: str = "sft") -> BatchCollator:
    """The collator for this data: padding-free for packed rows, right-padding with attention_mask otherwise;
    kind pair or kto (finetune.data.build.data_kind): preference batches."""
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    if kind != "sft":
        return BatchCollator(PreferenceCollator(pad_token_id=pad, pairs=kind == "pair"))
    return BatchCollator(PackedCollator(pad_token_id=pad) if packed else DataCollatorForLanguageModeling(pad_token_id=pad))
