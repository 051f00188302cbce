"""What gets trained: LoRA / DoRA / rsLoRA adapters through peft, or every weight for full fine-tuning."""

from __future__ import annotations

import torch

from finetune.recipe.schema import AdapterConfig


def lora_config(cfg: AdapterConfig):
    from peft import LoraConfig, TaskType

    return LoraConfig(
        task_type=TaskType.CAUSAL_LM, r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules, use_dora=cfg.type == "dora", use_rslora=cfg.rslora,
        modules_to_save=cfg.modules_to_save,
    )


def apply_adapter(model: torch.nn.Module, cfg: AdapterConfig, *, checkpointing: bool) -> torch.nn.Module:
    """Wrap the model for training; the base stays frozen unless adapter.type is full."""
    if cfg.type == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    from peft import get_peft_model

    for p in model.parameters():
        p.requires_grad_(False)
    if checkpointing:
        # With a frozen base the embeddings output has no grad; checkpointed blocks then see no input that
        # requires grad. This hook makes the embedding output require grad (cheap, no extra memory).
        model.enable_input_require_grads()
    model = get_peft_model(model, lora_config(cfg))
    if not cfg.fp32_compute:
        adapters_in_input_dtype(model)
    return model


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
    """(trainable, total) element counts; 4-bit packed weights count as the elements they hold."""
    trainable = total = 0
    for p in model.parameters():
        n = p.numel()
        if p.dtype == torch.uint8 and hasattr(p, "quant_state"):
            n *= 2  # two 4-bit values per byte
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total
