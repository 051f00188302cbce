"""The plan of training.method grpo: its generation and training phases against the CPU tensor tracker around
finetune.rl.step on a tiny model (steady state: the optimizer state exists, the gradients were freed)."""

from __future__ import annotations

import pytest
import torch

from finetune.data.prompts import PromptExample
from finetune.memory.tracker import MemoryTracker
from finetune.plan.memory_model import predict_memory
from finetune.plan.search import model_spec
from finetune.plan.shapes import load_model_config
from finetune.recipe.schema import Recipe
from finetune.recipe.settings import Settings, read_settings
from finetune.rl.rewards import build_rewards
from finetune.rl.step import generate_and_score, grpo_forward_backward

PROMPT, COMPLETION, GROUP = 48, 96, 4


def _recipe(path, **training) -> Recipe:
    return Recipe.model_validate({
        "model": {"path": str(path)}, "data": {"path": "unused.jsonl", "max_seq_len": PROMPT + COMPLETION},
        "quantization": {"bits": None}, "adapter": {"r": 8, "dropout": 0.0},
        "training": {"method": "grpo", **training},
        "memory": {"activation_checkpointing": True, "chunked_loss": False, "tiled_mlp": False},
        "grpo": {"num_generations": GROUP, "max_completion_length": COMPLETION,
                 "rewards": [{"kind": "length", "max_chars": 40}]}})


def _tracked(model, optimizer, fn) -> int:
    tracker = MemoryTracker(vocab_size=model.config.vocab_size)
    tracker.register_model(model)
    tracker.register_optimizer(optimizer)
    try:
        with tracker:
            fn(tracker)
    finally:
        tracker.remove_hooks()
    return tracker.peak


@pytest.mark.parametrize(("micro_batch", "accumulation"), [(2, 4), (4, 1)])
def test_generation_and_training_phases_match_the_tracker(tiny_model_dir, tiny_tokenizer, micro_batch, accumulation):
    from finetune.train.measure import step_setup

    recipe, model, optimizer, _ = step_setup(_recipe(tiny_model_dir, micro_batch_size=micro_batch,
                                                     gradient_accumulation_steps=accumulation))
    spec = model_spec(recipe, load_model_config(recipe.model.path), "cpu")
    pred = predict_memory(spec, Settings(**read_settings(recipe)))
    assert pred.peak_bytes == max(pred.generation_bytes, pred.training_bytes)

    sequences = micro_batch * accumulation
    ids = torch.randint(10, 400, (sequences // GROUP, PROMPT), generator=torch.Generator().manual_seed(0))
    prompts = [PromptExample(f"p:{i}", "q", row.tolist(), {}) for i, row in enumerate(ids)]
    rewards = build_rewards(recipe.grpo)
    torch.manual_seed(0)
    micro_batches = sequences // micro_batch

    def train(rollout, tracker=None):
        for micro in rollout.micro_batches(micro_batches):
            grpo_forward_backward(model, micro, recipe.grpo)
        with tracker.optimizer_step() if tracker is not None else torch.no_grad():
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train(generate_and_score(model, tiny_tokenizer, prompts, recipe.grpo, rewards))  # the optimizer state exists
    held = []
    generation = _tracked(model, optimizer, lambda t: held.append(
        generate_and_score(model, tiny_tokenizer, prompts, recipe.grpo, rewards)))
    training = _tracked(model, optimizer, lambda t: train(held[0], t))
    assert pred.generation_bytes == pytest.approx(generation, rel=0.05)
    assert pred.training_bytes == pytest.approx(training, rel=0.05), (pred.training_bytes, training)
