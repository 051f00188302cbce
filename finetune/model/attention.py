"""Which attention kernel a model trains with, and `chunked`: attention that never holds s x s scores, on any device.

Why: eager attention materialises every head's s x s scores (and keeps them for backward), so its memory grows
with the square of the context; SDPA fuses that away but takes neither soft-capping (Gemma 2) nor attention sinks
(gpt-oss), and keeps packed documents or sliding windows apart only through a dense [b, 1, s, s] mask.
`model.attn_implementation: auto` takes the first kernel of `KERNELS` that runs on the target device, is
installed, is supported by the model class and handles every feature of the family (`features`) without an
s x s tensor; eager only where none does, with the reason printed.

More in docs/memory.md, "The attention kernel (finetune/model/attention.py)".
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from finetune.model.family import SLIDING, family_of, text_config

CHUNKED = "chunked"
CHUNK_BYTES = 64 << 20  # one block's fp32 scores (batch x heads x rows x keys x 4 B) at most this...
MIN_ROWS = 64  # ...but at least this many query rows per block

# What a family's attention may need beyond causal softmax attention.
SOFTCAP, SINKS, SLIDING_WINDOW, PACKED = "soft-capping", "attention sinks", "sliding window", "packed documents"


@dataclass(frozen=True)
class Kernel:
    """One attention implementation (transformers' name), where it trains and what it takes without s x s."""

    name: str
    devices: tuple[str, ...]
    handles: frozenset[str]  # features it runs without an s x s tensor
    supported_by: str | None = None  # the model class flag transformers sets where the class runs it
    package: str | None = None  # a package it needs installed

    def available(self, model_class: type | None, device: str) -> bool:
        installed = self.package is None or importlib.util.find_spec(self.package) is not None
        from finetune.compat import model_supports
        return device in self.devices and installed and model_supports(model_class, self.supported_by)


_ALL = frozenset({SOFTCAP, SINKS, SLIDING_WINDOW, PACKED})
# Best first. flex attention: on CUDA only (no backward on CPU); sinks through its log-sum-exp, soft-capping as a
# score modification, windows and documents as a block mask. flash-attention 2: no sinks.
KERNELS = (
    Kernel("flash_attention_2", ("cuda",), frozenset({SOFTCAP, SLIDING_WINDOW, PACKED}), "_supports_flash_attn",
           "flash_attn"),
    Kernel("sdpa", ("cuda", "cpu"), frozenset(), "_supports_sdpa"),
    Kernel("flex_attention", ("cuda",), _ALL, "_supports_flex_attn"),
    Kernel(CHUNKED, ("cuda", "cpu"), _ALL, "_supports_attention_backend"),
)


def features(config: Any, packing: bool) -> tuple[str, ...]:
    """What the family's attention needs (soft-capping, sinks, sliding windows) and the data (packed documents)."""
    text = text_config(config)
    found = []
    if getattr(text, "attn_logit_softcapping", None):
        found.append(SOFTCAP)
    if family_of(config).attention_sinks:
        found.append(SINKS)
    types = getattr(text, "layer_types", None)
    if (SLIDING in types) if types else (getattr(text, "sliding_window", None) is not None
                                          and getattr(text, "use_sliding_window", True) is not False):
        found.append(SLIDING_WINDOW)
    if packing:
        found.append(PACKED)
    return tuple(found)


def choose(config: Any, model_class: type | None, device: str, packing: bool) -> tuple[str, str | None]:
    """The kernel `auto` trains with on `device` (cpu | cuda), and why eager where it falls back to eager."""
    needs = features(config, packing)
    for kernel in KERNELS:
        if kernel.handles.issuperset(needs) and kernel.available(model_class, device):
            return kernel.name, None
    what = ", ".join(needs) or "this architecture"
    return "eager", (f"eager attention (s x s scores per head): no kernel here runs {what} on {device} for "
                     f"{getattr(model_class, '__name__', 'this model')}")


def _rows(batch: int, heads: int, keys: int, queries: int) -> int:
    return max(MIN_ROWS, min(queries, CHUNK_BYTES // max(1, batch * heads * keys * 4)))


@dataclass(frozen=True)
class BlockwiseMask:
    """The attention mask as transformers describes it (mask function, offsets, 2-D padding mask), evaluated one
    block of query rows at a time: never [b, 1, s, s] at once."""

    batch_size: int
    kv_length: int
    q_offset: Any
    kv_offset: Any
    mask_function: Any
    attention_mask: torch.Tensor | None

    def rows(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """[batch, 1, stop - start, kv_length] booleans: which keys rows start..stop attend to."""
        from transformers.masking_utils import sdpa_mask

        return sdpa_mask(batch_size=self.batch_size, q_length=stop - start, kv_length=self.kv_length,
                         q_offset=self.q_offset + start, kv_offset=self.kv_offset, mask_function=self.mask_function,
                         attention_mask=self.attention_mask, allow_is_causal_skip=False, device=device)


def blockwise_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
                   mask_function: Any = None, attention_mask: torch.Tensor | None = None, **_: Any) -> BlockwiseMask:
    """transformers' mask interface for `chunked`: the mask's description, built per block by the attention."""
    from transformers.masking_utils import causal_mask_function

    return BlockwiseMask(batch_size, kv_length, q_offset, kv_offset, mask_function or causal_mask_function,
                         attention_mask)


def _block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor | None,
           mask: BlockwiseMask | torch.Tensor | None, start: int, scale: float, softcap: float | None,
           dropout: float, training: bool) -> torch.Tensor:
    """Eager attention for query rows start.. (query [b, kv_heads, group, rows, d]; key, value [b, kv_heads, 1,
    keys, d]), as the families' eager functions compute it: scaled scores, soft-cap, mask, sinks in the softmax."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if isinstance(mask, BlockwiseMask):
        allowed = mask.rows(start, start + query.shape[-2], query.device)[:, :, None]
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    elif mask is not None:  # a prepared 4-D mask (a caller's own): additive or boolean
        part = mask[:, :, None, start:start + query.shape[-2], :key.shape[-2]]
        scores = scores.masked_fill(~part, torch.finfo(scores.dtype).min) if part.dtype == torch.bool else scores + part
    if sinks is not None:
        b, kv_heads, group, rows, _ = scores.shape
        sink = sinks.reshape(1, kv_heads, group, 1, 1).to(scores.dtype).expand(b, kv_heads, group, rows, 1)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    probs = torch.nn.functional.dropout(probs.to(value.dtype), p=dropout, training=training)
    return torch.matmul(probs, value)


def chunked_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: BlockwiseMask | torch.Tensor | None, scaling: float | None = None,
                      dropout: float = 0.0, softcap: float | None = None, s_aux: torch.Tensor | None = None,
                      **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for `chunked` (module docstring): query [b, heads, s, d], key and value
    [b, kv_heads, keys, d]; returns the output as [b, s, heads, d] and no attention weights."""
    from torch.utils.checkpoint import checkpoint

    b, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(b, kv_heads, heads // kv_heads, length, dim)
    k, v = key[:, :, None], value[:, :, None]
    scale = dim ** -0.5 if scaling is None else scaling
    rows = _rows(b, heads, key.shape[-2], length)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    blocks = []
    for start in range(0, length, rows):
        args = (q[..., start:start + rows, :], k, v, s_aux, attention_mask, start, scale, softcap, dropout,
                module.training)
        blocks.append(checkpoint(_block, *args, use_reentrant=False) if grad else _block(*args))
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-2)
    return out.reshape(b, heads, length, -1).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `chunked` an attention implementation transformers knows (its public registries; idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CHUNKED, chunked_attention)
    AttentionMaskInterface.register(CHUNKED, blockwise_mask)
