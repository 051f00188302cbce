"""FinetuneTrainer's optimizer wiring.

create_optimizer -> build_optimizer; in layer-wise mode the optimizer clips and measures the norm itself, so
_clip_grad_norm/_get_grad_norm return its grad_norm(). Checks: a logged non-zero grad norm, and resume from
a checkpoint (optimizer state loaded with weights_only) ending on the same weights as an uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch
from transformers import TrainingArguments, default_data_collator

from finetune.recipe import validate_recipe
from finetune.train.trainer import FinetuneTrainer
from tests.test_optim import _one_thread, config, examples, load_model  # noqa: F401


def _run(model_dir, out, opt, accumulation, resume=None):
    model = load_model(model_dir)
    data = [{"input_ids": ids[0], "labels": ids[0]} for ids in examples(8, seed=7)]
    args = TrainingArguments(
        output_dir=str(out), max_steps=4, per_device_train_batch_size=1, gradient_accumulation_steps=accumulation,
        learning_rate=1e-2, lr_scheduler_type="linear", max_grad_norm=1.0, save_strategy="steps", save_steps=2,
        logging_steps=1, use_cpu=True, report_to="none", disable_tqdm=True, seed=0, data_seed=0,
        dataloader_num_workers=0)
    recipe = validate_recipe({"model": {"path": str(model_dir)}, "data": {"path": "unused.jsonl"},
                              "optimizer": opt.model_dump()})
    trainer = FinetuneTrainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                              recipe=recipe)
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer


@pytest.mark.parametrize(("opt", "accumulation"), [
    (config("galore", update_proj_gap=2), 2), (config("apollo", layerwise=True), 2),
    (config("galore", layerwise=True, update_proj_gap=2), 2), (config("apollo_mini", layerwise=True), 1),
    (config("muon"), 2)],
    ids=["galore", "apollo-layerwise", "galore-layerwise", "apollo_mini-layerwise-no-accumulation", "muon-hybrid"])
def test_trainer_logs_grad_norm_and_resumes_exactly(tiny_model_dir, tmp_path, opt, accumulation):
    full, trainer = _run(tiny_model_dir, tmp_path / "a", opt, accumulation)
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(norms) == 4 and all(n > 0 for n in norms)
    resumed, _ = _run(tiny_model_dir, tmp_path / "b", opt, accumulation, resume=str(tmp_path / "a" / "checkpoint-2"))
    for (name, x), y in zip(full.named_parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)
