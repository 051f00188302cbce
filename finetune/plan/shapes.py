"""Model dimensions and exact parameter shapes from a config, without weights.

Why a `meta` model: counting parameters by formula breaks on every architecture detail (fused projections,
extra norms, tied heads, biases); building one decoder layer on the `meta` device costs milliseconds and gives
the exact shapes, including which Linear modules peft's `all-linear` adapts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from finetune.errors import ModelLoadError
from finetune.recipe.schema import AdapterConfig, Recipe
from finetune.units import dtype_name, torch_dtype


def target_dtype(recipe: Recipe, device: str) -> torch.dtype:
    """The compute dtype on the device planned for (a GPU planned for is assumed to support bf16)."""
    return torch_dtype(dtype_name(recipe.model.dtype, device))


def load_model_config(path: str, trust_remote_code: bool = False) -> Any:
    """A transformers config from a folder holding config.json, a config.json file, or a .gguf file."""
    from transformers import AutoConfig

    from finetune.model.random_weights import random_folder
    from finetune.model.source import package_file

    p = package_file(path) if path.startswith("pkg:") else random_folder(path) or Path(path)
    path = str(p)
    try:
        if p.suffix == ".gguf":  # the metadata alone: no conversion of the weights to plan
            return AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
        if p.is_file() and p.suffix == ".json":
            import json

            data = json.loads(p.read_text())
            return AutoConfig.for_model(data.pop("model_type"), **data)
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read a model config from {path}: {exc}",
                             hint="model.path must be a folder with config.json, a config.json, a .gguf file or pkg:PACKAGE/FILE") from None


def with_layers(config: Any, layers: int) -> Any:
    """A copy of `config` with `layers` decoder layers (per-layer lists such as layer_types cut to match)."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(config.layer_types)[:layers]
    return cfg


@dataclass
class ModelShapes:
    """Parameter counts split the way the memory model needs them (element counts, not bytes)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    linear_shapes: list[tuple[int, int]]  # (out, in) of each quantizable Linear in ONE decoder layer
    layer_other: int  # norms, biases: per layer, never quantized
    outside: int  # embeddings, final norm, lm_head (counted once if tied)
    lora_per_layer: int = 0  # trainable adapter elements per layer
    tie_word_embeddings: bool = False
    mlp_linear: int = 0  # elements of the Linear weights in ONE decoder layer's MLP (what tiled_mlp recomputes)
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def layer_linear(self) -> int:
        return sum(o * i for o, i in self.linear_shapes)

    @property
    def total(self) -> int:
        return self.num_layers * (self.layer_linear + self.layer_other) + self.outside

    @property
    def largest_linear(self) -> int:
        return max(o * i for o, i in self.linear_shapes)

    @property
    def largest_param(self) -> int:
        return max(self.largest_linear, self.vocab_size * self.hidden_size)


def _meta_model(config: Any, layers: int):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(with_layers(config, layers), dtype=torch.float32)


def model_shapes(config: Any, adapter: AdapterConfig | None = None) -> ModelShapes:
    """Exact shapes from a one-layer copy on `meta`; LoRA elements from peft applied to that copy."""
    model = _meta_model(config, 1)
    layers_attr = model.model.layers
    layer = layers_attr[0]
    linear = [(m.out_features, m.in_features) for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    mlp = getattr(layer, "mlp", None)
    mlp_linear = sum(m.weight.numel() for m in mlp.modules() if isinstance(m, torch.nn.Linear)) if mlp else 0
    layer_total = sum(p.numel() for p in layer.parameters())
    all_params = {id(p): p.numel() for p in model.parameters()}
    outside = sum(all_params.values()) - layer_total
    lora = 0
    if adapter is not None and adapter.type in ("lora", "dora"):
        from finetune.model.adapter import apply_adapter

        peft_model = apply_adapter(model, adapter, checkpointing=False)
        lora = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelShapes(
        model_type=text.model_type, vocab_size=text.vocab_size, hidden_size=text.hidden_size,
        num_layers=text.num_hidden_layers, linear_shapes=linear,
        layer_other=layer_total - sum(o * i for o, i in linear),
        outside=outside, lora_per_layer=lora, tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        mlp_linear=mlp_linear,
    )
