"""Vision-language models: the image processor that turns pictures into the model's pixel inputs, and what
`adapter.vision` trains of the vision tower and projector.

The full transformers processors of the Qwen-VL families need torchvision (their video processor), which the
CPU install does not have: images go through the family's image processor with its Pillow backend
(`VisionLayout.image_processor`), and the data build (`finetune.data.vision`) expands each image's token from
that processor's output, as the processor itself does.
"""

from __future__ import annotations

import re
import weakref
from functools import partial
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from finetune.data.vision import VisionData
from finetune.errors import ModelLoadError
from finetune.model.family import VISION_PARTS, family_of, vision_parts
from finetune.recipe.families import Family
from finetune.vision import layout_of


def load_image_processor(path: Path, family: Family) -> Any:
    """The Pillow image processor of a vision family's model folder (its preprocessor_config.json)."""
    import transformers

    assert family.vision is not None
    try:
        return getattr(transformers, family.vision.image_processor).from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model.path: cannot load the image processor of {path} "
                             f"({family.vision.image_processor}): {exc}",
                             hint="a vision-language model folder holds preprocessor_config.json beside config.json") from None


def vision_data(config: Any, path: Path, tokenizer: Any, max_pixels: int | None = None) -> VisionData | None:
    """What the data build needs to train a vision-language model on images (its image processor and image
    token, set up by its image layout), None for a text model."""
    family = family_of(config)
    if family.vision is None:
        return None
    layout = family.vision
    images = layout_of(layout)
    token = tokenizer.convert_tokens_to_ids(layout.image_token)
    written = tokenizer.convert_tokens_to_ids(layout.written or layout.image_token)
    wrap = tuple(tokenizer.encode(text, add_special_tokens=False) if text else [] for text in layout.wrap)
    data = VisionData(load_image_processor(path, family), layout, token, written, wrap, images.per_image(config),
                      max_pixels, encode=partial(tokenizer.encode, add_special_tokens=False))
    images.prepare(data, config, tokenizer)
    return data


# peft's exclude_modules as a regex over module names: anything inside a vision tower or projector.
_IN_VISION = rf"(.*\.)?({'|'.join(VISION_PARTS)})(\..*)?"


def vision_adapter(model: nn.Module, vision: str) -> dict[str, Any]:
    """peft LoraConfig keywords for `adapter.vision` on `model` ({} for a text model): frozen leaves the vision
    tower and projector out of the adapted modules; lora adapts their Linear layers like the language model's;
    full trains their weights whole and saves them with the adapter (peft's modules_to_save)."""
    parts = vision_parts(model)
    if not parts or vision == "lora":
        return {}
    out: dict[str, Any] = {"exclude_modules": _IN_VISION}
    if vision == "full":
        out["modules_to_save"] = sorted({name.rsplit(".", 1)[-1] for name in parts})
    return out


def freeze_vision(model: nn.Module) -> int:
    """Full fine-tuning with adapter.vision frozen: the vision tower and projector keep their weights. Returns
    the count of parameters frozen."""
    count = 0
    for part in vision_parts(model).values():
        for p in part.parameters():
            p.requires_grad_(False)
            count += 1
    return count


def in_vision(name: str) -> bool:
    """Whether a module or parameter name lies inside a vision tower or projector (the planner's parameter
    table names them as the model does)."""
    return re.fullmatch(_IN_VISION, name) is not None


# a vision-language model's token embedding -> the hook that makes its output require grad (inputs_require_grad)
_GRAD_HOOKS: weakref.WeakKeyDictionary[nn.Module, RemovableHandle] = weakref.WeakKeyDictionary()


def _output_requires_grad(module: nn.Module, inputs: Any, output: Any) -> None:
    output.requires_grad_(True)


def trains_vision(model: nn.Module) -> bool:
    """Whether any weight of the vision tower or projector trains (adapter.vision lora or full: LoRA beside
    them or their own weights); False for a text model and for a frozen tower."""
    return any(p.requires_grad for part in vision_parts(model).values() for p in part.parameters())


def inputs_require_grad(model: nn.Module) -> None:
    """A frozen base under activation checkpointing: the token embeddings' output requires grad, so each
    checkpointed layer sees an input that does (transformers' enable_input_require_grads, which its
    activation_checkpointing_enable also calls). transformers hooks every sub-model's input embedding, a vision
    tower's patch embedding too, so a frozen tower would record its graph and keep its activations for a
    backward that reaches no trained weight (6 GiB at Llama-3.2-11B-Vision, 0.44 GiB at Qwen2.5-VL-3B): with
    the tower frozen only the language model's token embedding is hooked. A tower that trains (adapter.vision
    lora or full) keeps transformers' hooks, and with them its graph and gradients. Called again once the
    adapter is in place (`finetune.step.training_step.enable_checkpointing`), when the tower's LoRA weights exist."""
    embedding = model.get_input_embeddings()
    model.disable_input_require_grads()
    if not vision_parts(model) or trains_vision(model):
        _unhook(embedding)
        model.enable_input_require_grads()
    elif embedding not in _GRAD_HOOKS:
        _GRAD_HOOKS[embedding] = embedding.register_forward_hook(_output_requires_grad)


def _unhook(embedding: nn.Module) -> None:
    handle = _GRAD_HOOKS.pop(embedding, None)
    if handle is not None:
        handle.remove()


def inputs_require_grad_off(model: nn.Module) -> None:
    """Undo `inputs_require_grad` (a lent model handed back as it was loaded)."""
    model.disable_input_require_grads()
    _unhook(model.get_input_embeddings())
