"""Causal-LM loss computed in chunks of tokens so the full (tokens x vocab) logits never exist.

Each chunk runs LM head -> (soft-cap) -> fp32 cross-entropy under a non-reentrant checkpoint: its logits are
freed as soon as its loss is known and recomputed in backward, one chunk at a time. Only tokens with a label
are sent through the head. Loss and gradients match transformers' `ForCausalLMLoss` (label shift,
ignore_index=-100, mean or `num_items_in_batch` normalisation, Gemma-2 final logit soft-capping) up to
floating-point summation order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from finetune.errors import FinetuneError
from finetune.model.family import vision_parts
from finetune.model.moe import aux_loss_coef, router_aux_loss

IGNORE_INDEX = -100
CHUNK_LOGITS_BYTES = 64 << 20  # fp32 logits of one chunk when chunk_size is not given
# Config fields of heads that rescale logits in ways this loss does not reproduce (Cohere, Granite).
UNSUPPORTED_HEAD_FIELDS = ("logit_scale", "logits_scaling")


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk so one chunk's fp32 logits take about 64 MiB (a power of two in 64..8192)."""
    tokens = max(64, min(8192, CHUNK_LOGITS_BYTES // (4 * vocab_size)))
    return 1 << (tokens.bit_length() - 1)


def head_logits(head: nn.Module, hidden: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The LM head's logits as the model computes them (Gemma-2's final soft-capping included)."""
    logits = head(hidden)
    if softcap is not None:  # the same ops, in the same dtype, as Gemma-2's forward
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _chunk_loss_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                    softcap: float | None) -> torch.Tensor:
    return F.cross_entropy(head_logits(head, hidden, softcap).float(), labels, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor,
                          num_items_in_batch: torch.Tensor | int | None = None, chunk_size: int | None = None,
                          softcap: float | None = None, vocab_size: int | None = None) -> torch.Tensor:
    """Cross-entropy of `head(hidden)` against `labels` (already aligned: position i predicts labels[i]).

    Mean over labelled tokens, or sum / `num_items_in_batch` when given (HF Trainer's exact gradient
    accumulation). `chunk_size` tokens go through the head at a time (default: from `vocab_size`).
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).to(hidden.device)
    keep = (labels != IGNORE_INDEX).nonzero().squeeze(1)  # one host sync per step
    hidden, labels = hidden.index_select(0, keep), labels.index_select(0, keep)
    if chunk_size is None:
        chunk_size = default_chunk_size(vocab_size or getattr(head, "out_features", 32000))
    total = hidden.sum() * 0.0  # keeps the graph (and dtype promotion) when no token has a label
    total = total.float()
    for start in range(0, hidden.shape[0], chunk_size):
        total = total + checkpoint(_chunk_loss_sum, head, hidden[start:start + chunk_size],
                                   labels[start:start + chunk_size], softcap, use_reentrant=False)
    if num_items_in_batch is None:
        return total / keep.numel()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (LoRA layers stay injected in it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def head_of(model: nn.Module) -> tuple[nn.Module, nn.Module, float | None, int]:
    """The decoder, LM head, final soft-cap and vocabulary size of a (peft-wrapped) causal LM; refuses heads
    whose logit scaling these chunked computations do not reproduce. The decoder returns the hidden states the
    head reads (a vision-language model: of the images and the text)."""
    base = _unwrap(model)
    config = base.config.get_text_config()
    scaled = [f for f in UNSUPPORTED_HEAD_FIELDS if getattr(config, f, None) not in (None, 1, 1.0)]
    if scaled:
        raise FinetuneError(
            f"memory.chunked_loss does not support {type(base).__name__}: its LM head applies {scaled[0]}",
            hint="Set memory.chunked_loss: false for this model.")
    # A vision-language model's decoder is its language model alone, which takes the pixels as unused keyword
    # arguments: the images would never reach it. Its base model runs the vision tower, projector and language model.
    decoder = base.base_model if vision_parts(base) else base.get_decoder()
    return decoder, base.get_output_embeddings(), getattr(config, "final_logit_softcapping", None), config.vocab_size


def causal_lm_loss(model: nn.Module, inputs: Mapping[str, Any], num_items_in_batch: torch.Tensor | int | None = None,
                   chunk_size: int | None = None, metrics: dict[str, list[float]] | None = None) -> torch.Tensor:
    """The causal-LM training loss of `model` on a batch, without materialising the logits.

    `inputs` is the Trainer's batch (input_ids, attention_mask, labels, optionally position_ids or
    shift_labels); works for plain and peft-wrapped models (LoRA on lm_head or lm_head in modules_to_save).
    A mixture-of-experts model with a load-balancing loss adds router_aux_loss_coef x that loss, as its own
    forward does, and `metrics` gets it as AUX_LOSS.
    """
    decoder, head, softcap, vocab = head_of(model)
    inputs = dict(inputs)
    labels = inputs.pop("labels")
    shift_labels = inputs.pop("shift_labels", None)
    if shift_labels is None:  # position i predicts token i+1, exactly as ForCausalLMLoss shifts
        shift_labels = shift(labels)
    inputs.setdefault("use_cache", False)
    coef = aux_loss_coef(model)
    if coef is not None:
        inputs["output_router_logits"] = True
    out = decoder(**inputs)
    loss = chunked_cross_entropy(out[0], head, shift_labels, num_items_in_batch, chunk_size, softcap=softcap,
                                 vocab_size=vocab)
    if coef is None:
        return loss
    aux = router_aux_loss(model, out.router_logits, inputs.get("attention_mask"))
    add_metric(metrics, AUX_LOSS, aux)
    return loss + coef * aux.to(loss.device)


AUX_LOSS = "aux_loss"  # the metrics.jsonl name of a MoE router's load-balancing loss


def add_metric(metrics: dict[str, list[float]] | None, name: str, value: torch.Tensor | None) -> None:
    """Add one micro-batch's value to `metrics` (name -> [sum, count], the loop logs the mean)."""
    if metrics is not None and value is not None:
        total = metrics.setdefault(name, [0.0, 0])
        total[0] += float(value.detach()) if not value.is_meta else 0.0
        total[1] += 1


def shift(labels: torch.Tensor) -> torch.Tensor:
    """Labels aligned with the positions that predict them (position i predicts token i+1)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
