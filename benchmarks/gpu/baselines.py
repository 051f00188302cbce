"""Stage c's baselines at the identical configuration: plain Hugging Face Trainer + PEFT, and TRL's SFTTrainer.

Same random-weight model and quantization (our loader), same tokenized data, micro-batch, accumulation,
checkpointing (non-reentrant), dtype, attention, optimizer (torch AdamW) and learning rate; tokens/s is read
the same way as for `finetune run` (non-padding tokens between consecutive step logs, median after step 1).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import TrainerCallback

from finetune.recipe.schema import Recipe

if TYPE_CHECKING:
    from finetune.model.load import LoadedModel


class StepRate(TrainerCallback):
    """Tokens/s between consecutive logs (logging_steps=1), as MetricsCallback computes them."""

    def __init__(self) -> None:
        self.rates: list[float] = []
        self._last: tuple[float, int] | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = (time.time(), state.num_input_tokens_seen)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:
            return
        now, tokens = time.time(), state.num_input_tokens_seen
        if self._last is not None:
            self.rates.append((tokens - self._last[1]) / max(now - self._last[0], 1e-9))
        self._last = (now, tokens)


def steady_tokens_per_s(rates: list[float]) -> float | None:
    """Median of the per-step rates, the first step (warm-up, allocator growth) left out when there are more."""
    rates = rates[1:] if len(rates) > 1 else rates
    return statistics.median(rates) if rates else None


def baseline_tokens_per_s(recipe: Recipe, framework: str, out_dir: Path, base: LoadedModel | None = None
                          ) -> float | None:
    """Train recipe.training.max_steps steps with `framework` ("hf_peft" or "trl") and return tokens/s; on
    `base` (the model `finetune run` trained on just before, handed back as loaded afterwards) when given."""
    from finetune.model.load import load_base
    from finetune.train.run import give_back

    lent = base or load_base(recipe.model, recipe.quantization)
    try:
        return _train(recipe, framework, out_dir, lent.model, lent.tokenizer)
    finally:
        give_back(lent)


def _train(recipe: Recipe, framework: str, out_dir: Path, model, tokenizer) -> float | None:
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from finetune.data import build_datasets

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    a, t = recipe.adapter, recipe.training
    lora = LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=a.dropout, target_modules=a.target_modules,
                      use_dora=a.type == "dora", task_type="CAUSAL_LM")
    data = build_datasets(recipe.data, tokenizer, t.seed)
    cuda = torch.cuda.is_available()
    common = dict(output_dir=str(out_dir), max_steps=t.max_steps, per_device_train_batch_size=int(t.micro_batch_size),
                  gradient_accumulation_steps=int(t.gradient_accumulation_steps), learning_rate=t.learning_rate,
                  logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, optim="adamw_torch",
                  bf16=cuda and torch.cuda.is_bf16_supported(), use_cpu=not cuda, dataloader_num_workers=0,
                  include_num_input_tokens_seen="non_padding", remove_unused_columns=False, seed=t.seed)
    rate = StepRate()

    def collate(rows: list) -> dict:  # HF Trainer and TRL take the collated dict (finetune's Batch reads as one)
        return dict(data.collator(rows))

    if framework == "hf_peft":
        trainer = Trainer(model=get_peft_model(model, lora), args=TrainingArguments(**common),
                          train_dataset=data.train, data_collator=collate, callbacks=[rate])
    else:
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**common, max_length=recipe.data.max_seq_len, packing=False,
                         dataset_kwargs={"skip_prepare_dataset": True})
        trainer = SFTTrainer(model=model, args=args, train_dataset=data.train, data_collator=collate,
                             processing_class=tokenizer, peft_config=lora, callbacks=[rate])
    trainer.train()
    return steady_tokens_per_s(rate.rates)
