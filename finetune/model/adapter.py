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
    return get_peft_model(model, lora_config(cfg))


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
