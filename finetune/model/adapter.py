"""What gets trained: LoRA / DoRA / rsLoRA adapters through peft, or every weight for full fine-tuning."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from finetune.errors import ModelLoadError
from finetune.model.moe import adapter_targets, stored_elements
from finetune.model.vision import freeze_vision, inputs_require_grad, vision_adapter
from finetune.recipe.init_from import KEY, StartAdapter, read_weights, start_adapter
from finetune.recipe.schema import AdapterConfig
from finetune.units import torch_dtype

TRAINED_ADAPTER = "default"  # peft's name for the adapter get_peft_model creates: the one trained and saved
REFERENCE_ADAPTER = "reference"  # adapter.init_from, reference forward in each step: a frozen copy of it


def lora_config(cfg: AdapterConfig, inference_mode: bool = False,
                targets: tuple[str | list[str], list[str]] | None = None, vision: dict[str, Any] | None = None):
    """peft's LoraConfig for the recipe; `targets`: (target_modules, target_parameters) as
    `finetune.model.moe.adapter_targets` resolves them for the model (else the recipe's target_modules);
    `vision`: a vision-language model's `finetune.model.vision.vision_adapter` keywords."""
    from peft import LoraConfig, TaskType

    modules, parameters = targets if targets is not None else (cfg.target_modules, [])
    vision = vision or {}
    saved = [*(cfg.modules_to_save or []), *vision.get("modules_to_save", [])] or None
    return LoraConfig(
        task_type=TaskType.CAUSAL_LM, r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
        target_modules=modules, target_parameters=parameters or None, use_dora=cfg.type == "dora",
        use_rslora=cfg.rslora, modules_to_save=saved, inference_mode=inference_mode,
        exclude_modules=vision.get("exclude_modules"),
    )


def apply_adapter(model: torch.nn.Module, cfg: AdapterConfig, *, checkpointing: bool,
                  reference: bool = False, digest: bool = False) -> torch.nn.Module:
    """Wrap the model for training; the base stays frozen unless adapter.type is full.

    adapter.init_from (resolved by `finetune.recipe.init_from.resolve_init_from`): the trained adapter starts
    from those weights; `reference` (dpo/kto with the reference forward in each step) also loads them as a
    frozen adapter named REFERENCE_ADAPTER, the reference model that `finetune.step.preference.
    reference_logps` switches to (TRL's ref_adapter_name: one base, one extra adapter). A precomputed
    reference needs no copy: its pass runs before the first step, while the trained adapter still holds the
    start weights. The file is read once for both; `digest`: its sha256 is taken for results.json
    (`init_from_record`). Only the trained adapter is saved."""
    if cfg.type == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        if cfg.vision == "frozen":
            freeze_vision(model)
        return model
    from peft import get_peft_model

    for p in model.parameters():
        p.requires_grad_(False)
    if checkpointing:
        # With a frozen base the embeddings output has no grad; checkpointed blocks then see no input that
        # requires grad. This hook makes the embedding output require grad (cheap, no extra memory).
        inputs_require_grad(model)
    targets = adapter_targets(model, cfg.target_modules, cfg.target_experts)
    vision = vision_adapter(model, cfg.vision)
    model = get_peft_model(model, lora_config(cfg, targets=targets, vision=vision))
    if cfg.init_from is not None:
        start = start_adapter(cfg.init_from)
        state = load_adapter_state(start, digest)
        load_adapter_weights(model, start.weights, state, TRAINED_ADAPTER)
        if reference:
            model.add_adapter(REFERENCE_ADAPTER, lora_config(cfg, inference_mode=True, targets=targets, vision=vision))
            load_adapter_weights(model, start.weights, state, REFERENCE_ADAPTER)
            model.set_adapter(TRAINED_ADAPTER)  # trainable again; the reference stays frozen
            # save_pretrained (the loop's checkpoints, the run's adapter/) writes only the trained adapter:
            # the reference is init_from itself, rebuilt from there on resume.
            model.save_pretrained = functools.partial(model.save_pretrained, selected_adapters=[TRAINED_ADAPTER])
    if cfg.dtype != "fp32":
        adapter_weights_to(model, torch_dtype(cfg.dtype))
    if not cfg.fp32_compute:
        adapters_in_input_dtype(model)
    return model


def adapter_weights_to(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """adapter.dtype: cast the trained parameters (LoRA/DoRA matrices, modules_to_save) and a frozen reference
    adapter to `dtype`, so their gradients and the optimizer state (created like the parameter) follow.
    peft makes adapters fp32 on a 16-bit base; this undoes that after the start weights are loaded.
    Returns the number of parameters cast."""
    count = 0
    for name, p in model.named_parameters():
        if (p.requires_grad or f".{REFERENCE_ADAPTER}." in name) and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            count += 1
    return count


def load_adapter_state(start: StartAdapter, digest: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of the start adapter's safetensors file, read once (`read_weights`, which hashes it with
    `digest`); an unreadable, truncated or foreign file is a ModelLoadError naming adapter.init_from."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(read_weights(start, digest))
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{KEY}: cannot read {start.weights}: {exc}",
                             hint="save the start adapter again (save_pretrained, safe_serialization=True)") from None


def load_adapter_weights(model: torch.nn.Module, weights: Path, state: dict[str, torch.Tensor],
                         name: str) -> None:
    """Load a saved adapter's tensors (`state`, from the file `weights`) into the adapter `name` of a peft
    model built with the same shape; tensors that do not fit the model (another base model, other layers)
    are a ModelLoadError naming adapter.init_from."""
    from peft import set_peft_model_state_dict

    try:
        result = set_peft_model_state_dict(model, state, adapter_name=name)
    except RuntimeError as exc:  # size mismatch: an adapter of a model with other dimensions
        first = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), str(exc)[:300])
        raise ModelLoadError(f"{KEY}: {weights.parent} does not fit this base model: {first}",
                             hint="start from an adapter trained on the recipe's model.path") from None
    unused = [k for k in result.unexpected_keys if "lora_" in k or "modules_to_save" in k]
    missing = [k for k in result.missing_keys if f".{name}." in k or k.endswith(f".{name}")]
    if unused or missing or not state:
        names = (unused or missing or ["(the file holds no tensors)"])[:3]
        raise ModelLoadError(f"{KEY}: {weights.parent} does not fit this base model: "
                             f"{'weights for layers it lacks' if unused else 'no weights for'} {', '.join(names)}",
                             hint="start from an adapter trained on the recipe's model.path")


def adapters_in_input_dtype(model: torch.nn.Module) -> int:
    """Run LoRA matmuls in the layer input's dtype, casting the (fp32) adapter weights instead of the input.

    Why: peft keeps adapters in fp32 and casts every adapted layer's input to fp32; autograd keeps that copy,
    2x the input's bytes in bf16, for each of the seven adapted projections of a decoder layer. Casting the
    r x d weights instead costs nothing per token and is what mixed precision does: fp32 master weights and
    fp32 gradients, 16-bit matmuls. DoRA layers keep peft's path (its weight norm needs fp32). Returns the
    number of layers changed.
    """
    from peft.tuners.lora import LoraLayer

    count = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer) or module.lora_variant or not hasattr(module, "lora_A"):
            continue
        module.cast_input_dtype_enabled = False
        for linear in (*module.lora_A.values(), *module.lora_B.values()):
            if type(linear) is torch.nn.Linear:
                linear.__class__ = WeightCastLinear
        count += 1
    return count


class WeightCastLinear(torch.nn.Linear):
    """A Linear that casts its weight (not its input) to the input's dtype: fp32 master weight, 16-bit matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), bias)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) element counts; 4-bit packed weights count as the elements they hold, and so do
    the expert weights a store holds in place of parameters (finetune.model.moe)."""
    trainable, total = 0, stored_elements(model)
    for p in model.parameters():
        n = p.numel()
        if p.dtype == torch.uint8 and hasattr(p, "quant_state"):
            n *= 2  # two 4-bit values per byte
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total
