"""The planner's price of GRPO's generation phase against the CPU tensor tracker around HF `model.generate` with
a static (preallocated) KV cache, plain sampling as TRL's GRPO samples (temperature 1, no top-k/top-p)."""

from __future__ import annotations

import pytest
import torch

from finetune.memory.tracker import MemoryTracker
from finetune.plan.generation import generation_memory
from finetune.testing import tiny_config


def _measured_peak(model, sequences: int, prompt: int, completion: int) -> int:
    """The tracked peak, weights included, of generating `completion` tokens for `sequences` prompts."""
    model.eval()
    tracker = MemoryTracker(vocab_size=model.config.vocab_size)
    tracker.register_model(model)
    ids = torch.randint(5, model.config.vocab_size, (sequences, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), tracker:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=completion,
                             cache_implementation="static", pad_token_id=3, eos_token_id=None, top_k=0, top_p=1.0)
    tracker.remove_hooks()
    assert out.shape == (sequences, prompt + completion)  # every token was generated
    return tracker.peak


def _weights(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_prefill_bound_generation_on_the_tiny_model(tiny_model_dir):
    """8 completions of 64 tokens after a 32-token prompt: the prefill's MLP is the transient peak."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    priced = generation_memory(model.config, 8, 32, 64, cache_bytes=4, compute_bytes=4)
    assert priced.prefill > priced.sampling_logits
    predicted = _weights(model) + priced.total
    measured = _measured_peak(model, 8, 32, 64)
    assert predicted == pytest.approx(measured, rel=0.05)
    # the cache is most of what generation adds: pricing without it misses by far more than 5%
    assert _weights(model) + priced.total - priced.kv_cache < 0.8 * measured


def test_sampling_bound_generation_with_a_large_vocabulary():
    """16 completions with a 32k vocabulary: the fp32 logit copies of sampling are the transient peak."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=32000), dtype=torch.float32)
    priced = generation_memory(model.config, 16, 4, 32, cache_bytes=4, compute_bytes=4)
    assert priced.sampling_logits > priced.prefill
    assert _weights(model) + priced.total == pytest.approx(_measured_peak(model, 16, 4, 32), rel=0.05)


def test_cache_follows_config_json_fields():
    """From config.json alone: layers x KV heads x head dim, at the cache dtype, for every cached token."""
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
              "intermediate_size": 1536, "vocab_size": 49152}  # SmolLM2-135M
    priced = generation_memory(config, 8, 100, 156)
    assert priced.kv_cache == 2 * 30 * 3 * 64 * 8 * 255 * 2
    assert priced.sampling_logits == 4 * 8 * 49152 * 4
    assert generation_memory({**config, "head_dim": 128}, 8, 100, 156).kv_cache == 2 * priced.kv_cache
