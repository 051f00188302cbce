"""Gemma 3 (`Gemma3ImageProcessor`): every image (and each pan-and-scan crop, off unless the config turns it on)
resized to the fixed size and `mm_tokens_per_image` tokens (config.json; `image_seq_length` in
processor_config.json; 256 when neither is given), written between the family's wrapping text."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from finetune.vision import Grid, ImageInputs, ImageLayout


class Gemma3(ImageLayout):
    processors = ("Gemma3ImageProcessor",)
    fixed_size = True

    def count(self, config: dict[str, Any], width: int, height: int) -> ImageInputs:
        size = config.get("size") or {"height": 896, "width": 896}
        per_image = config.get("mm_tokens_per_image") or config.get("image_seq_length") or 256
        crops = _pan_and_scan_crops(config, width, height) if config.get("do_pan_and_scan") else 0
        return ImageInputs(per_image * (1 + crops), (1 + crops, 3, size["height"], size["width"]), (1 + crops,))

    def limit(self, model: Any, own: dict[str, Any]) -> int:
        """The one size the vision tower sees."""
        return model.vision_config.image_size ** 2

    def grid(self, model: Any, own: dict[str, Any], width: int, height: int, max_pixels: int | None) -> Grid:
        side = model.vision_config.image_size // model.vision_config.patch_size
        return (1, side, side)

    def tokens(self, model: Any, grid: Grid) -> int:
        return model.mm_tokens_per_image

    def trace_inputs(self, model: Any, rows: int, seq_len: int, grids: Sequence[Grid]) -> dict[str, Any]:
        """Whole images at the tower's size."""
        import torch

        vision = model.vision_config
        side = vision.image_size
        return {"pixel_values": torch.empty(rows * len(grids), vision.num_channels, side, side, device="meta")}

    def per_image(self, model: Any) -> int | None:
        return getattr(model, "mm_tokens_per_image", None)

    def image_tokens(self, data: Any, paths: Sequence[str]) -> list[int]:
        return [data.tokens_per_image] * len(paths)


def _pan_and_scan_crops(config: dict[str, Any], width: int, height: int) -> int:
    """Gemma 3's pan and scan: how many crops an image of this aspect ratio is cut into (0: none)."""
    min_crop = config.get("pan_and_scan_min_crop_size", 256)
    most = config.get("pan_and_scan_max_num_crops", 4)
    ratio = config.get("pan_and_scan_min_ratio_to_activate", 1.2)
    long, short = max(width, height), min(width, height)
    if long / short < ratio:
        return 0
    crops = min(most, max(2, min(int(math.floor(long / min_crop)), int(math.floor(long / short + 0.5)))))
    across, down = (crops, 1) if width >= height else (1, crops)
    if min(int(math.ceil(width / across)), int(math.ceil(height / down))) < min_crop:
        return 0
    return crops


LAYOUT = Gemma3()
