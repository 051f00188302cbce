"""The memory of GRPO's generation phase, beside the weights the plan already prices.

Generating `num_sequences` completions (num_generations per prompt x prompts) with a static, preallocated KV
cache holds the KV cache and the larger of the prefill's activations and the sampling's logits, on top of the
weights.

More in docs/rl.md, "How generation memory is priced (finetune/plan/generation.py)".
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
