"""The speed model of training.method grpo prices the step's generation and scoring beside its training
(finetune.plan.cost_model.Rollout), so a GRPO plan's tokens/s and ETA are those of the whole step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune.plan import predict
from finetune.plan.cost_model import Rollout, Weights, figures_of, rollout_seconds
from finetune.recipe.schema import Recipe

GPU = figures_of("cuda")
QWEN = Weights(params=494_000_000, quantized=0, bits=0, dtype_bytes=2, num_layers=24, hidden=896)  # Qwen2.5-0.5B
KV_PER_TOKEN = 2 * 24 * 2 * 64 * 2  # keys and values x 24 layers x 2 KV heads x 64 dims x bf16


def _seconds(weights: Weights = QWEN, micro_batch: int = 4, **rollout) -> float:
    base = {"sequences": 8, "calls": 1, "prompt_tokens": 512, "completion_tokens": 256, "kv_bytes_per_token": KV_PER_TOKEN,
            "scoring_passes": 0}
    return rollout_seconds(Rollout(**{**base, **rollout}), weights, GPU, micro_batch)


def test_a_decode_step_is_bound_by_bytes_and_launches_so_more_sequences_cost_little():
    """Twice the completions per generate call take about the same time: generation's tokens/s nearly doubles
    (why the step's completions are generated in one batch)."""
    assert _seconds(sequences=16) < 1.1 * _seconds(sequences=8)
    assert _seconds(sequences=8) < _seconds(sequences=16) < _seconds(sequences=256)  # the KV cache, the compute


def test_every_completion_token_is_one_more_decode_step_and_every_part_one_more_generate_call():
    ratio = _seconds(completion_tokens=256) / _seconds(completion_tokens=128)
    assert 1.8 < ratio < 2.0  # the prefill is shared
    assert _seconds(sequences=4, calls=2) == pytest.approx(2 * _seconds(sequences=4))  # 8 completions in halves


def test_quantized_weights_are_dequantized_in_the_prefill_and_every_decode_step():
    quantized = replace(QWEN, quantized=360_000_000, bits=4)
    extra = _seconds(quantized) - _seconds()
    one_pass = 360_000_000 * (4 / 8 + 2) / GPU["mem_bw"]
    assert extra == pytest.approx(one_pass * (1 + 256))


def test_scoring_passes_add_forwards_and_iterations_share_the_rollout():
    plain, scored = _seconds(), _seconds(scoring_passes=2)
    assert scored > plain
    assert _seconds(scoring_passes=2, iterations=2) == pytest.approx(scored / 2)


def _recipe(path, method: str, completion: int = 32, bits: int | None = None) -> Recipe:
    grpo = {"num_generations": 4, "max_completion_length": completion, "rewards": [{"kind": "length", "max_chars": 9}]}
    return Recipe.model_validate({
        "model": {"path": str(path)}, "data": {"path": "unused.jsonl", "max_seq_len": 96},
        "quantization": {"bits": bits}, "adapter": {"r": 8},
        "training": {"method": method, "micro_batch_size": 4, "gradient_accumulation_steps": 2},
        "memory": {"activation_checkpointing": True, "chunked_loss": False, "tiled_mlp": False},
        **({"grpo": grpo} if method == "grpo" else {})})


def test_a_grpo_plan_is_slower_than_sft_by_its_generation_and_more_so_with_longer_completions(tiny_model_dir):
    """At the same sequences per step and max_seq_len, GRPO adds the rollout; 64 completion tokens of the 96
    are more decode steps than 16; the planner's pick fits either way."""
    def tokens_per_s(recipe: Recipe) -> float:
        plan = predict(recipe, gpu_memory="24GiB", device="cuda")
        assert plan.fits
        return plan.tokens_per_s

    sft = tokens_per_s(_recipe(tiny_model_dir, "sft"))
    short = tokens_per_s(_recipe(tiny_model_dir, "grpo", completion=16))
    long = tokens_per_s(_recipe(tiny_model_dir, "grpo", completion=64))
    assert long < short < sft


def test_auto_generation_batch_splits_the_generation_only_where_the_steps_all_at_once_does_not_fit():
    """Llama-3.1-8B QLoRA GRPO, 32 completions of 2048 tokens per step: at once their KV cache alone is 16 GiB,
    so on a 24 GiB card the planner generates them in parts (whole groups) and says so in the speed; on an
    80 GiB card all at once, the fastest. A fixed value is priced as given."""
    from pathlib import Path

    config = Path(__file__).parent / "fixtures" / "configs" / "llama-3.1-8b.json"
    recipe = Recipe.model_validate({
        "model": {"path": str(config)}, "data": {"path": "unused.jsonl", "max_seq_len": 4096},
        "training": {"method": "grpo", "micro_batch_size": 1, "gradient_accumulation_steps": 32},
        "grpo": {"num_generations": 16, "max_completion_length": 2048,
                 "rewards": [{"kind": "length", "max_chars": 9}]}})
    assert recipe.grpo.generation_batch_size == "auto"  # the default
    small, large = (predict(recipe, gpu_memory=size, device="cuda") for size in ("24GiB", "80GiB"))
    assert small.fits and small.settings["generation_batch_size"] == 16 and small.peak_bytes <= 23.5 * 2**30
    assert large.fits and large.settings["generation_batch_size"] is None
    assert large.generation_bytes > small.generation_bytes and large.tokens_per_s > small.tokens_per_s
    whole = recipe.model_copy(update={"grpo": recipe.grpo.model_copy(update={"generation_batch_size": None})})
    assert not predict(whole, gpu_memory="24GiB", device="cuda").fits
    run = small.apply(recipe)  # what the run generates at once
    assert run.recipe.grpo.generation_batch_size == run.settings.generation_batch_size == 16
