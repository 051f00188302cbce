"""Model dimensions and exact parameter shapes from a config, without weights.

Why a `meta` model: counting parameters by formula breaks on every architecture detail (fused projections,
extra norms, tied heads, biases); building one decoder layer on the `meta` device costs milliseconds and gives
the exact shapes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from finetune.errors import ModelLoadError
from finetune.model.family import decoder_layers, dense_mlp, family_of, text_config
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
        raise ModelLoadError(f"cannot read a model config from {path}: {exc}",
                             hint="model.path must be a folder with config.json, a config.json, a .gguf file or pkg:PACKAGE/FILE") from None
    family_of(config)
    return config


def with_layers(config: Any, layers: int) -> Any:
    """A copy of `config` with `layers` decoder layers (per-layer lists such as layer_types cut to match)."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(config.layer_types)[:layers]
    return cfg


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
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(with_layers(config, layers), dtype=torch.float32)


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
