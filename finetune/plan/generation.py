"""The memory of GRPO's generation phase, beside the weights the plan already prices.

Generating `num_sequences` completions (num_generations per prompt x prompts) with a static, preallocated KV
cache holds, on top of the weights:

- the KV cache: 2 (keys, values) x layers x KV heads x head dim x sequences x (prompt + completion - 1) tokens
  (the last sampled token is never fed back) at the cache dtype, allocated whole before the first token;
- the larger of two transients:
  - prefill: the prompt's forward over sequences x prompt tokens, whose peak is the MLP (gate, up and their
    activation: 3 x intermediate) plus the hidden states alive around it (embedding output, residual, norm:
    `PREFILL_HIDDEN_COPIES` x hidden), at the compute dtype. The logits of the prefill are the last position's
    only (transformers passes logits_to_keep=1), and attention scores live inside the SDPA kernel;
  - sampling: the last position's logits, `LOGITS_COPIES` copies of sequences x vocab in fp32 (the model's
    output, generate's fp32 copy, the processed scores and the softmax probabilities).

The training search can then take the larger of this and the training step's peak. Checked against the CPU
tensor tracker around `model.generate` on the tiny model (tests/test_generation_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOGITS_COPIES = 4
PREFILL_HIDDEN_COPIES = 4
FP32 = 4


@dataclass(frozen=True)
class GenerationMemory:
    """Bytes the generation phase needs beyond the weights."""

    kv_cache: int
    prefill: int
    sampling_logits: int

    @property
    def total(self) -> int:
        """The peak above the weights: the cache plus the larger transient."""
        return self.kv_cache + max(self.prefill, self.sampling_logits)


def _dims(config: Any) -> dict[str, int]:
    """Layers, KV heads, head dim, hidden, intermediate and vocabulary sizes from a config or config.json dict."""
    if not isinstance(config, dict):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        config = text.to_dict()
    config = config.get("text_config") or config
    heads = config["num_attention_heads"]
    return {"layers": config["num_hidden_layers"], "kv_heads": config.get("num_key_value_heads") or heads,
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads, "hidden": config["hidden_size"],
            "intermediate": config["intermediate_size"], "vocab": config["vocab_size"]}


def generation_memory(config: Any, num_sequences: int, prompt_tokens: int, completion_tokens: int, *,
                      cache_bytes: int = 2, compute_bytes: int = 2) -> GenerationMemory:
    """Price generating `num_sequences` completions of `completion_tokens` after `prompt_tokens` (the longest
    prompt: sequences are padded to it). `cache_bytes`/`compute_bytes`: bytes per element of the KV cache and
    of the activations (2 for bf16/fp16)."""
    d = _dims(config)
    cached = max(prompt_tokens + completion_tokens - 1, 0)
    kv = 2 * d["layers"] * d["kv_heads"] * d["head_dim"] * num_sequences * cached * cache_bytes
    prefill = num_sequences * prompt_tokens * (3 * d["intermediate"] + PREFILL_HIDDEN_COPIES * d["hidden"]
                                               + cached + 1) * compute_bytes  # + the mask over the whole cache
    logits = LOGITS_COPIES * num_sequences * d["vocab"] * FP32
    return GenerationMemory(kv, prefill, logits)
