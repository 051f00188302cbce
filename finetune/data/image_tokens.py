"""How many tokens an image becomes, from its size alone, torch-free.

The planner and the data checks price a vision-language run before any image is decoded or any model loads:
from the image sizes in the files' headers (`finetune.data.images.image_sizes`) and the model folder's
preprocessor_config.json, `image_inputs` gives what the real image processor (transformers' Pillow backend)
would produce for one image: the image tokens it expands to in the text (`tokens`), the shape of its
`pixel_values` and its grid or tiles. The processor's resize rule is its layout's (finetune/vision/, one module
per layout, found from the config's `image_processor_type`).

`data.max_pixels` narrows each processor's own limit (never widens it): `pixel_overrides` gives the keyword
arguments that make the real processor do the same, so the plan and the run resize alike.
"""

from __future__ import annotations

from typing import Any

from finetune.vision import ImageInputs, for_processor

__all__ = ["ImageInputs", "image_inputs", "image_tokens", "pixel_overrides"]


def pixel_overrides(processor_config: dict[str, Any], max_pixels: int | None) -> dict[str, Any]:
    """Keyword arguments that make the image processor keep at most `max_pixels` pixels per image (None: its own
    limit), for its constructor or `from_pretrained`; {} when it has a fixed size (Gemma 3)."""
    layout = for_processor(processor_config)
    return {} if max_pixels is None else layout.overrides(processor_config, max_pixels)


def image_tokens(processor_config: dict, width: int, height: int, max_pixels: int | None) -> int:
    """The image tokens one width x height image expands to in the text."""
    return image_inputs(processor_config, width, height, max_pixels).tokens


def image_inputs(processor_config: dict[str, Any], width: int, height: int, max_pixels: int | None) -> ImageInputs:
    """What the image processor makes of one width x height image under the budget `max_pixels`."""
    layout = for_processor(processor_config)
    return layout.count({**processor_config, **pixel_overrides(processor_config, max_pixels)}, width, height)
