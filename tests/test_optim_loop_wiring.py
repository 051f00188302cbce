"""The training loop's optimizer wiring.

build_optimizer's optimizer; in layer-wise mode the optimizer clips and measures the norm itself, so the
loop's grad_norm() returns its grad_norm(). Checks: a logged non-zero grad norm, and resume from a checkpoint
(train state loaded with weights_only) ending on the same weights as an uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch
from transformers import default_data_collator

from finetune.recipe import validate_recipe
from finetune.recipe.resolved import resolve
from finetune.train.setup import simple_loop
from finetune.train.train_state import load_checkpoint
from tests.test_optim import _one_thread, config, examples, load_model  # noqa: F401


def _run(model_dir, out, opt, accumulation, resume=None):
    model = load_model(model_dir)
    data = [{"input_ids": ids[0], "labels": ids[0]} for ids in examples(8, seed=7)]
    recipe = validate_recipe({
        "model": {"path": str(model_dir)}, "data": {"path": "unused.jsonl", "batching": "random"}, "optimizer": opt.model_dump(),
        "training": {"max_steps": 4, "micro_batch_size": 1, "gradient_accumulation_steps": accumulation,
                     "learning_rate": 1e-2, "lr_scheduler": "linear", "warmup_ratio": 0.0, "max_grad_norm": 1.0,
                     "logging_steps": 1, "seed": 0, "noise_scale": False},
        "memory": {"activation_checkpointing": False, "chunked_loss": False, "tiled_mlp": False}, "output": {"save_steps": 2}})
    loop = simple_loop(resolve(recipe), model, data, default_data_collator, 4, checkpoints=out)
    if resume:
        load_checkpoint(loop, resume)
    loop.fit()
    return model, loop


@pytest.mark.parametrize(("opt", "accumulation"), [
    (config("galore", update_proj_gap=2), 2), (config("apollo", layerwise=True), 2),
    (config("galore", layerwise=True, update_proj_gap=2), 2), (config("apollo_mini", layerwise=True), 1),
    (config("muon"), 2)],
    ids=["galore", "apollo-layerwise", "galore-layerwise", "apollo_mini-layerwise-no-accumulation", "muon-hybrid"])
def test_loop_logs_grad_norm_and_resumes_exactly(tiny_model_dir, tmp_path, opt, accumulation):
    full, loop = _run(tiny_model_dir, tmp_path / "a", opt, accumulation)
    norms = [h["grad_norm"] for h in loop.state.log_history if "grad_norm" in h]
    assert len(norms) == 4 and all(n > 0 for n in norms)
    resumed, _ = _run(tiny_model_dir, tmp_path / "b", opt, accumulation, resume=tmp_path / "a" / "checkpoint-2")
    for (name, x), y in zip(full.named_parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)
