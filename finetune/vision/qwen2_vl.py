"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL (`Qwen2VLImageProcessor`): smart_resize to multiples of patch_size x
merge_size within [min_pixels, max_pixels]; one token per merge_size x merge_size patches.

The one copy of the resize rule: the data checks count with it, the planner traces its grid and the run's
processor is called with the same limit (data.max_pixels narrows the processor's own, never widens it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from finetune.vision import Grid, ImageInputs, ImageLayout

# Qwen2.5-VL checkpoints' own max_pixels, the plan's limit for a bare config.json (no preprocessor_config.json)
CHECKPOINT_MAX_PIXELS = 16384 * 28 * 28


def limits(config: dict[str, Any]) -> tuple[int, int]:
    """(min_pixels, max_pixels) as the processor's constructor settles them: the top-level keys win over size."""
    size = config.get("size") or {}
    low = config.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56
    return low, _declared(config) or 28 * 28 * 1280


def _declared(config: dict[str, Any]) -> int | None:
    size = config.get("size") or {}
    return config.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize: both sides multiples of `factor`, the area within [min_pixels, max_pixels], the
    aspect ratio kept as well as that allows (transformers' smart_resize; ratios over 200 are refused there)."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class QwenVL(ImageLayout):
    processors = ("Qwen2VLImageProcessor", "Qwen2_5_VLImageProcessor", "Qwen3VLImageProcessor")

    def count(self, config: dict[str, Any], width: int, height: int) -> ImageInputs:
        patch, merge = config.get("patch_size", 14), config.get("merge_size", 2)
        temporal = config.get("temporal_patch_size", 2)
        low, high = limits(config)
        h, w = smart_resize(height, width, patch * merge, low, high)
        rows, cols = h // patch, w // patch
        return ImageInputs(_merged((1, rows, cols), merge), (rows * cols, 3 * temporal * patch * patch), (1, rows, cols))

    def overrides(self, config: dict[str, Any], max_pixels: int) -> dict[str, Any]:
        low, high = limits(config)
        return {"min_pixels": low, "max_pixels": min(high, max_pixels)}

    def call_overrides(self, config: dict[str, Any], max_pixels: int) -> dict[str, Any]:
        """A loaded processor takes its limits as `size` (min_pixels / max_pixels in a call are deprecated)."""
        low, high = limits(config)
        return {"size": {**(config.get("size") or {}), "shortest_edge": low, "longest_edge": min(high, max_pixels)}}

    def limit(self, model: Any, own: dict[str, Any]) -> int:
        return _declared(own) or CHECKPOINT_MAX_PIXELS

    def _own(self, model: Any, own: dict[str, Any]) -> dict[str, Any]:
        """The processor keys the counter reads, a bare config.json's from the vision tower and checkpoints."""
        vision = model.vision_config
        bare = {} if _declared(own) else {"max_pixels": CHECKPOINT_MAX_PIXELS}
        return {"patch_size": vision.patch_size, "merge_size": vision.spatial_merge_size, **bare, **own}

    def grid(self, model: Any, own: dict[str, Any], width: int, height: int, max_pixels: int | None) -> Grid:
        config = self._own(model, own)
        if max_pixels is not None:
            config = {**config, **self.overrides(config, max_pixels)}
        t, h, w = self.count(config, width, height).grid
        return (t, h, w)

    def tokens(self, model: Any, grid: Grid) -> int:
        return _merged(grid, model.vision_config.spatial_merge_size)

    def trace_inputs(self, model: Any, rows: int, seq_len: int, grids: Sequence[Grid]) -> dict[str, Any]:
        """The processor's flattened patches and each image's grid."""
        import torch

        vision = model.vision_config
        patches = rows * sum(t * h * w for t, h, w in grids)
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        return {"pixel_values": torch.empty(patches, width, dtype=torch.float32, device="meta"),
                "image_grid_thw": torch.tensor([list(g) for g in grids] * rows, dtype=torch.long)}

    def image_tokens(self, data: Any, paths: Sequence[str]) -> list[int]:
        grids = data.process(paths)["image_grid_thw"]
        return [_merged(tuple(int(x) for x in g), data.processor.merge_size) for g in grids]


def _merged(grid: Sequence[int], merge: int) -> int:
    """An image's tokens: its patches merged merge x merge into one each."""
    return math.prod(grid) // merge ** 2


LAYOUT = QwenVL()
