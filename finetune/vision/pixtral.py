"""Mistral 3 / Pixtral (`PixtralImageProcessor`): scaled down (never up) so the longest edge fits
size.longest_edge, each side then up to whole blocks of patch_size x spatial_merge_size (the merge size is
Mistral 3's config.json / processor_config.json key, 1 when not given, as PixtralProcessor defaults); one [IMG]
per block, an [IMG_BREAK] after each row of blocks and [IMG_END] in place of the last row's break (the family's
`VisionLayout.breaks`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from finetune.vision import Grid, ImageInputs, ImageLayout

if TYPE_CHECKING:
    import torch


def _unit(config: dict[str, Any]) -> int:
    """The block side in pixels: the vision tower's patch times the projector's spatial merge."""
    patch = config.get("patch_size", 16)
    patch = patch.get("height", 16) if isinstance(patch, dict) else patch
    return patch * config.get("spatial_merge_size", 1)


def run_length(rows: int, cols: int) -> int:
    """An image's tokens: an [IMG] per block and a break (the last one the image's end) per row."""
    return rows * (cols + 1)


class Pixtral(ImageLayout):
    processors = ("PixtralImageProcessor",)

    def count(self, config: dict[str, Any], width: int, height: int) -> ImageInputs:
        unit = _unit(config)
        if config.get("do_resize", True):
            edge = (config.get("size") or {}).get("longest_edge", 1024)
            ratio = max(height / edge, width / edge)
            if ratio > 1:  # transformers' get_resize_output_image_size: floor, so the image stays within the edge
                height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        rows, cols = (height - 1) // unit + 1, (width - 1) // unit + 1
        return ImageInputs(run_length(rows, cols), (3, rows * unit, cols * unit), (rows, cols))

    def overrides(self, config: dict[str, Any], max_pixels: int) -> dict[str, Any]:
        """The longest edge: the budget's square side, in whole merged blocks."""
        unit = _unit(config)
        own_edge = (config.get("size") or {}).get("longest_edge", 1024)
        return {"size": {"longest_edge": min(own_edge, max(unit, math.isqrt(max_pixels) // unit * unit))}}

    def limit(self, model: Any, own: dict[str, Any]) -> int:
        """The long side's square (a bare config: the tower's)."""
        return ((own.get("size") or {}).get("longest_edge") or model.vision_config.image_size) ** 2

    def grid(self, model: Any, own: dict[str, Any], width: int, height: int, max_pixels: int | None) -> Grid:
        """(1, rows, blocks per row): merged patches."""
        vision = model.vision_config
        config = {"image_processor_type": "PixtralImageProcessor", "size": {"longest_edge": vision.image_size},
                  **own, "patch_size": vision.patch_size, "spatial_merge_size": model.spatial_merge_size}
        if max_pixels is not None:
            config = {**config, **self.overrides(config, max_pixels)}
        rows, cols = self.count(config, width, height).grid
        return (1, rows, cols)

    def tokens(self, model: Any, grid: Grid) -> int:
        return run_length(grid[1], grid[2])

    def place(self, ids: torch.Tensor, start: int, end: int, model: Any, grid: Grid) -> None:
        """Each row's break and the image's end are other tokens than the image's."""
        super().place(ids, start, end, model, grid)
        ids[:, start + grid[2]:end:grid[2] + 1] = 0

    def trace_inputs(self, model: Any, rows: int, seq_len: int, grids: Sequence[Grid]) -> dict[str, Any]:
        """Every image padded to the batch's largest; image_sizes (real) says its part."""
        import torch

        vision = model.vision_config
        unit = vision.patch_size * model.spatial_merge_size
        high, wide = unit * max(g[1] for g in grids), unit * max(g[2] for g in grids)
        return {"pixel_values": torch.empty(rows * len(grids), vision.num_channels, high, wide, device="meta"),
                "image_sizes": torch.tensor([[unit * g[1], unit * g[2]] for g in grids] * rows, dtype=torch.long)}

    def prepare(self, data: Any, model: Any, tokenizer: Any) -> None:
        """Resized to whole merged blocks, as PixtralProcessor has its image processor do; the break tokens."""
        unit = model.vision_config.patch_size * model.spatial_merge_size
        data.processor.patch_size = {"height": unit, "width": unit}
        data.breaks = tuple(tokenizer.convert_tokens_to_ids(token) for token in data.layout.breaks)

    def image_tokens(self, data: Any, paths: Sequence[str]) -> list[int]:
        return [run_length(rows, cols) for rows, cols in _rows(data, paths)]

    def image_ids(self, data: Any, paths: Sequence[str]) -> list[list[int]]:
        """Each image as PixtralProcessor writes it: [IMG] x cols then [IMG_BREAK], per row, the last row's break
        replaced by [IMG_END]."""
        row_break, end = data.breaks
        out = []
        for rows, cols in _rows(data, paths):
            run = ([data.image_token_id] * cols + [row_break]) * rows
            run[-1] = end
            out.append(run)
        return out


def _rows(data: Any, paths: Sequence[str]) -> list[tuple[int, int]]:
    """Each image's (rows, blocks per row) after the processor's resize; a block is one [IMG] token (the
    processor's patch_size, which `prepare` sets to the tower's patch times the projector's spatial merge)."""
    unit = data.processor.patch_size["height"]
    return [(int(h) // unit, int(w) // unit) for h, w in data.process(paths)["image_sizes"]]


LAYOUT = Pixtral()
