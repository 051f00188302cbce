"""What the tool needs to know about a loaded model, discovered from the model itself.

Every part of the tool that reaches into a model's structure asks here: the repeated decoder layers (activation
checkpointing, offload, recomputed norms, the tiled MLP, the planner's window hooks and what bitsandbytes
quantizes), each layer's position-wise MLP (what the tiled MLP runs in chunks) and attention kind (full,
sliding-window, linear, convolution); the embedding and LM head are transformers' own accessors
(`get_input_embeddings`, `get_decoder`, `get_output_embeddings`: the chunked loss's `head_of`). Discovery is
generic; what differs per family and cannot be discovered is in
the family table, `finetune.recipe.families` (torch-free), which `family_of` reads.

Mixture-of-experts layers: a family whose entry sets `experts` names a function `experts_of(layer)` (in
finetune/model/moe.py); `expert_block` calls it, and `dense_mlp` leaves such a block out.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from finetune.recipe.families import Family, check_config_data

# Attention kinds of a decoder layer (the values of transformers' config.layer_types, as the planner sees them).
FULL, SLIDING, LINEAR, CONV = "full_attention", "sliding_attention", "linear_attention", "conv"
CROSS = "cross_attention"  # Llama 3.2 Vision's layers that attend to the image features, not to the text


def text_config(config: Any) -> Any:
    """The text part of a config (a multimodal config's text_config; a text config itself)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def family_of(config: Any) -> Family:
    """The family of a transformers config, or UnsupportedModel (one line, exit 2) naming what is missing."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return check_config_data(data, getattr(config, "name_or_path", "") or "")


# The attribute names transformers gives a vision-language model's image encoder and the projector into the
# language model's embedding space (Qwen-VL's `visual` holds both; Gemma 3, Mllama: vision_tower / vision_model and
# multi_modal_projector; Idefics3 / SmolVLM: vision_model and connector).
VISION_PARTS = ("visual", "vision_tower", "vision_model", "multi_modal_projector", "connector")


def vision_parts(model: nn.Module) -> dict[str, nn.Module]:
    """A vision-language model's vision tower and projector by module name (through peft wrappers); {} for a
    text model. These stay in 16 bits (never quantized) and frozen unless adapter.vision says otherwise."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in VISION_PARTS and not any(name.startswith(f"{n}.") for n in found):
            found[name] = module
    return found


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks of the language model, in forward order (works through peft wrappers): the
    longest ModuleList of transformers' GradientCheckpointingLayer outside the vision tower, which every decoder
    layer of the supported families derives from."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    best: list[nn.Module] = []
    vision = {id(m) for part in vision_parts(model).values() for m in part.modules()}
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best) and id(module) not in vision:
            if all(isinstance(m, GradientCheckpointingLayer) for m in module):
                best = list(module)
    if not best:
        raise ValueError(f"no decoder layers found in {type(model).__name__} (no list of GradientCheckpointingLayer)")
    return best


def in_decoder_layers(model: nn.Module) -> set[int]:
    """ids of every module inside a decoder layer (what bitsandbytes quantizes and offload hooks see)."""
    return {id(m) for layer in decoder_layers(model) for m in layer.modules()}


@functools.cache
def _experts_function(reference: str) -> Callable[[nn.Module], nn.Module | None]:
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


def expert_block(layer: nn.Module, family: Family | None) -> nn.Module | None:
    """The mixture-of-experts block of a decoder layer (through the family's `experts` hook), None when dense."""
    if family is None or family.experts is None:
        return None
    return _experts_function(family.experts)(layer)


def dense_mlp(layer: nn.Module, family: Family | None = None) -> nn.Module | None:
    """The layer's position-wise feed-forward block (what the tiled MLP runs in chunks), or None where the
    layer has none or routes tokens to experts. Found by the names the families use (`mlp`, LFM2's
    `feed_forward`) and the class-name convention of transformers' dense MLPs (LlamaMLP, Lfm2MLP, ...)."""
    if expert_block(layer, family) is not None:
        return None
    for name in ("mlp", "feed_forward"):
        block = getattr(layer, name, None)
        if isinstance(block, nn.Module) and type(block).__name__.endswith("MLP"):
            return block
    return None


def attention_kinds(config: Any) -> list[str]:
    """Each decoder layer's kind: full_attention, sliding_attention, linear_attention (Qwen3.5's Gated
    DeltaNet), conv (LFM2's short convolutions) or cross_attention (Llama 3.2 Vision's cross_attention_layers),
    from the config's layer_types where it has them."""
    text = text_config(config)
    kinds = getattr(text, "layer_types", None)
    if kinds:
        return [str(k) for k in kinds]
    crossed = getattr(text, "cross_attention_layers", None)
    if crossed:
        return [CROSS if i in crossed else FULL for i in range(text.num_hidden_layers)]
    sliding = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    return [SLIDING if sliding else FULL] * text.num_hidden_layers
