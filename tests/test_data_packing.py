"""Packed batches give every example the same loss as running it alone (no attention across examples)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from finetune.data import build_datasets
from finetune.recipe.schema import DataConfig


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every next-token prediction (0 where the label is -100), one row."""
    return F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=-100, reduction="none")


def per_example(losses: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict[tuple, float]:
    """Sum of token losses for each packed example, keyed by its input_ids."""
    starts = (position_ids[0] == 0).nonzero().flatten().tolist() + [position_ids.shape[1]]
    padded = torch.cat([torch.zeros(1), losses])  # losses[i] belongs to the token at i + 1
    return {tuple(input_ids[0, a:b].tolist()): padded[a:b].sum().item() for a, b in zip(starts, starts[1:], strict=False)}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_equals_separate_loss(tmp_path, tiny_model_dir, tiny_tokenizer, attn):
    from transformers import AutoModelForCausalLM

    records = [{"instruction": f"What is {i} plus {i}?", "output": f"The answer is {2 * i}. " * (1 + i % 3)}
               for i in range(6)]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records))
    bundle = build_datasets(DataConfig(path=str(path), max_seq_len=128, packing=True), tiny_tokenizer, seed=0)
    assert bundle.train.column_names == ["input_ids", "labels", "position_ids"]
    assert bundle.stats["train_sequences"] < bundle.stats["train_examples"] == 6
    unpacked = build_datasets(DataConfig(path=str(path), max_seq_len=128), tiny_tokenizer, seed=0)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn)
    model.train()  # the training setting, where config.use_cache=True would create a cache and hide the packing
    assert model.config.use_cache
    batch = bundle.collator([bundle.train[i] for i in range(len(bundle.train))])
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
    with torch.no_grad():
        packed = per_example(token_losses(model(**batch).logits, batch["labels"]),
                             batch["input_ids"], batch["position_ids"])
        crossing = per_example(token_losses(model(input_ids=batch["input_ids"]).logits, batch["labels"]),
                               batch["input_ids"], batch["position_ids"])
        alone = {}
        for ids, labels in zip(unpacked.train["input_ids"], unpacked.train["labels"], strict=True):
            logits = model(input_ids=torch.tensor([ids])).logits
            alone[tuple(ids)] = token_losses(logits, torch.tensor([labels])).sum().item()
    assert packed.keys() == alone.keys() and len(alone) == 6
    for key, loss in alone.items():
        assert packed[key] == pytest.approx(loss, rel=1e-4, abs=1e-4)
    # the comparison is sensitive: one causal mask over the whole row changes the later examples' losses
    assert sum(abs(crossing[k] - alone[k]) > 1e-3 for k in alone) >= 2
