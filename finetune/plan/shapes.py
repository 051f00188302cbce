"""Model dimensions and exact parameter shapes from a config, without weights.

Why a `meta` model: counting parameters by formula breaks on every architecture detail (fused projections,
extra norms, tied heads, biases); building one decoder layer on the `meta` device costs milliseconds and gives
the exact shapes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from finetune.compat import attn_implementation, set_attn_implementation
from finetune.errors import ModelLoadError
from finetune.model.building import BUILDING
from finetune.model.family import attention_kinds, decoder_layers, dense_mlp, family_of, text_config
from finetune.model.source import config_location
from finetune.recipe.families import check_config_file
from finetune.recipe.schema import Recipe
from finetune.units import dtype_name, torch_dtype


def target_dtype(recipe: Recipe, device: str) -> torch.dtype:
    """The compute dtype on the device planned for (a GPU planned for is assumed to support bf16)."""
    return torch_dtype(dtype_name(recipe.model.dtype, device))


def load_model_config(path: str, trust_remote_code: bool = False) -> Any:
    """A transformers config from a folder holding config.json, a config.json file, or a .gguf file, of a
    family the tool describes (else UnsupportedModel: one line naming the architecture, exit 2)."""
    from transformers import AutoConfig

    p = config_location(path)
    path = str(p)
    check_config_file(p)  # an unknown model_type is named before transformers lists every one it knows
    try:
        if p.suffix == ".gguf":  # the metadata alone: no conversion of the weights to plan
            config = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
        elif p.is_file() and p.suffix == ".json":
            import json

            data = json.loads(p.read_text())
            config = AutoConfig.for_model(data.pop("model_type"), **data)
        else:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        why = " ".join(str(exc).split())  # transformers' hub errors run over several lines: the error is one
        raise ModelLoadError(f"cannot read a model config from {path}: {why}",
                             hint="model.path must be a folder with config.json, a config.json, a .gguf file or pkg:PACKAGE/FILE") from None
    # A vision-language checkpoint of a family that trains its text model: the planner sees what loads.
    return text_config(config) if family_of(config).text_of_vision else config


def with_layers(config: Any, layers: int) -> Any:
    """A copy of `config` with `layers` decoder layers: the real model's first `layers - 1` and its last (the
    top layer, next to the head, is the one backward recomputes first: its kind matters to the peak). Per-layer
    lists (layer_types) and per-layer overrides (Gemma 4's per_layer_config) follow the layers kept."""
    total = text_config(config).num_hidden_layers
    keep = list(range(layers)) if layers >= total or layers < 2 else [*range(layers - 1), total - 1]
    return select_layers(config, keep)


def select_layers(config: Any, keep: list[int]) -> Any:
    """A copy of `config` whose layer i is the real model's layer keep[i] (a vision-language model: its language
    model's layers; the vision tower stays whole)."""
    if text_config(config) is not config and family_of(config).vision is not None:
        cfg = copy.copy(config)
        cfg.text_config = select_layers(text_config(config), keep)
        return cfg
    overrides = getattr(config, "per_layer_config", None)
    if overrides:  # heterogeneous configs validate their per-layer entries: rebuild from the remapped dict
        data = config.to_dict()
        by_index = {str(k): v for k, v in (data.get("per_layer_config") or {}).items()}
        data["per_layer_config"] = {str(i): by_index[str(s)] for i, s in enumerate(keep) if str(s) in by_index}
        data["num_hidden_layers"] = len(keep)
        if data.get("layer_types"):
            data["layer_types"] = [data["layer_types"][s] for s in keep]
        if data.get("cross_attention_layers") is not None:
            data["cross_attention_layers"] = _kept(data["cross_attention_layers"], keep)
        cfg = type(config).from_dict(data)
        set_attn_implementation(cfg, attn_implementation(config))
        return cfg
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = len(keep)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [config.layer_types[s] for s in keep]
    if getattr(cfg, "cross_attention_layers", None) is not None:
        cfg.cross_attention_layers = _kept(config.cross_attention_layers, keep)
    return cfg


def _kept(indices: list[int], keep: list[int]) -> list[int]:
    """Llama 3.2 Vision's cross_attention_layers (layer indices) in the copy that keeps the layers `keep`."""
    return [i for i, s in enumerate(keep) if s in indices]


def kind_variants(config: Any, real: Callable[[], Any]) -> list[tuple[Any, float]]:
    """Uniform stand-ins of a model whose layers above the first are of several kinds (sliding-window and full
    attention, LFM2's convolutions and attention, Qwen3.5's linear and full attention, Llama 3.2 Vision's
    cross-attention and self-attention), each with its weight.

    Why: the planner traces copies of 2 and 3 layers (or blocks) and extrapolates linearly in the layer count,
    which prices every added layer like the copy's added one, and the top layer's recomputation like the
    copy's top one. Variant k keeps the real first layer and makes every layer above it of kind k. The weighted
    sum of the variants' prices, weights the share of each kind among those layers, is the real model's for
    what adds up over layers (weights, the activations each layer keeps); with checkpointing the largest of
    the variants' activations is (the same checkpointed inputs, the costliest kind's recomputation). A model of
    one kind above its first layer is its own single variant.
    `real()`: the transformers config, asked for only where variants are made (the planner's cached configs
    know layer_types without loading it)."""
    text = text_config(config)
    if not (getattr(text, "layer_types", None) or getattr(text, "cross_attention_layers", None)):  # one kind
        return [(config, 1.0)]
    above = attention_kinds(config)[1:]
    if len(set(above)) < 2:
        return [(config, 1.0)]
    config = real()
    return [(select_layers(config, [0, *[1 + above.index(k)] * len(above)]), above.count(k) / len(above))
            for k in sorted(set(above))]


@dataclass
class ModelShapes:
    """Parameter counts the speed model needs (element counts, not bytes)."""

    num_layers: int
    layer_linear: int  # elements of the quantizable Linear weights in ONE decoder layer
    layer_other: int  # norms, biases: per layer, never quantized
    outside: int  # embeddings, final norm, lm_head (counted once if tied)
    mlp_linear: int  # elements of the Linear weights in ONE decoder layer's MLP (what tiled_mlp recomputes)

    @property
    def total(self) -> int:
        return self.num_layers * (self.layer_linear + self.layer_other) + self.outside


def _meta_model(config: Any, layers: int):
    from finetune.model.load import auto_model

    with torch.device("meta"), BUILDING:
        return auto_model(config).from_config(with_layers(config, layers), dtype=torch.float32)


def model_shapes(config: Any) -> ModelShapes:
    """Exact shapes from a one-layer copy on `meta`."""
    model = _meta_model(config, 1)
    layer = decoder_layers(model)[0]
    linear = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    mlp = dense_mlp(layer, family_of(config))
    mlp_linear = sum(m.weight.numel() for m in mlp.modules() if isinstance(m, torch.nn.Linear)) if mlp else 0
    layer_total = sum(p.numel() for p in layer.parameters())
    outside = sum({id(p): p.numel() for p in model.parameters()}.values()) - layer_total
    text = text_config(config)
    return ModelShapes(num_layers=text.num_hidden_layers, layer_linear=linear, layer_other=layer_total - linear,
                       outside=outside, mlp_linear=mlp_linear)
