"""Idefics3 and SmolVLM (`Idefics3ImageProcessor`, `SmolVLMImageProcessor`): the longest edge resized to
size.longest_edge, then to whole tiles of max_image_size; rows x cols tiles plus the global image, each
`image_seq_len` image tokens (processor_config.json; 169 for Idefics3, 64 for SmolVLM when not given), with the
text the processor writes around them (`tiled_prompt_tokens`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from finetune.vision import Grid, ImageInputs, ImageLayout

MAX_SIDE = 4096  # no side is resized past this (transformers' MAX_IMAGE_SIZE)
# the token their processors write before each tile's `<row_R_col_C>` (transformers' Idefics3Processor and
# SmolVLMProcessor: fake_image_token); the whole image's are the family's VisionLayout.wrap
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"


def tile_tokens(model: Any) -> int:
    """The language model's tokens per image tile (the tower's patches, pixel-shuffled scale_factor x
    scale_factor into one token each)."""
    vision = model.vision_config
    return (vision.image_size // vision.patch_size) ** 2 // model.scale_factor ** 2


def tiled_prompt_tokens(rows: int, cols: int, per_tile: int) -> int:
    """The tokens an image of rows x cols tiles (0 x 0: not split) takes in the text, as the processors write
    it: per tile `<fake_token_around_image><row_R_col_C>` and `per_tile` image tokens, "\n" after each row, then
    "\n<fake_token_around_image><global-img>", the whole image's `per_tile` image tokens and
    `<fake_token_around_image>`. The markers are one token each and the last row's newline and the global
    image's one "\n\n" token, as in SmolVLM-256M/500M's and SmolVLM2's tokenizers; SmolVLM-Instruct (2.2B) and
    Idefics3-8B add only <fake_token_around_image>, <image> and <end_of_utterance> as tokens, so their
    <row_R_col_C> and <global-img> are a few text tokens each there: this count is short by those."""
    return rows * (cols * (per_tile + 2) + 1) + per_tile + 3


def _longest_edge(config: dict[str, Any]) -> int:
    return (config.get("size") or {}).get("longest_edge", 4 * 364)


def _tiles(grid: Grid) -> int:
    """The pictures the vision tower sees for one image, its tiles and the whole image."""
    return grid[0] * grid[1] + 1 if grid[0] else 1


class Idefics3(ImageLayout):
    processors = ("Idefics3ImageProcessor", "SmolVLMImageProcessor")

    def count(self, config: dict[str, Any], width: int, height: int) -> ImageInputs:
        tile = (config.get("max_image_size") or {}).get("longest_edge", 364)
        kind = str(config.get("image_processor_type", ""))
        per_tile = config.get("image_seq_len") or (64 if kind.startswith("SmolVLM") else 169)
        if config.get("do_resize", True):
            height, width = _rescale_to_max_len(height, width, _longest_edge(config))
            height, width = _scale_below(height, width, MAX_SIDE)
        if not config.get("do_image_splitting", True):
            return ImageInputs(tiled_prompt_tokens(0, 0, per_tile), (1, 3, tile, tile), (0, 0))
        height, width = _to_tiles(height, width, tile)
        if height <= tile and width <= tile:
            return ImageInputs(tiled_prompt_tokens(0, 0, per_tile), (1, 3, height, width), (0, 0))
        rows, cols = (height - tile) // tile + 1, (width - tile) // tile + 1
        return ImageInputs(tiled_prompt_tokens(rows, cols, per_tile), (rows * cols + 1, 3, tile, tile), (rows, cols))

    def overrides(self, config: dict[str, Any], max_pixels: int) -> dict[str, Any]:
        """The longest edge: the budget's square side, in whole tiles."""
        tile = config.get("max_image_size", {}).get("longest_edge", 364)
        edge = _longest_edge(config)
        return {"size": {"longest_edge": min(edge, max(tile, math.isqrt(max_pixels) // tile * tile))}}

    def limit(self, model: Any, own: dict[str, Any]) -> int:
        """The long side's square (a bare config: 4 tiles')."""
        return ((own.get("size") or {}).get("longest_edge") or 4 * model.vision_config.image_size) ** 2

    def grid(self, model: Any, own: dict[str, Any], width: int, height: int, max_pixels: int | None) -> Grid:
        """(rows, cols, tile side in pixels); a bare config.json: the checkpoints' 4 tiles."""
        side = model.vision_config.image_size
        config = {"image_processor_type": "Idefics3ImageProcessor", "max_image_size": {"longest_edge": side},
                  "size": {"longest_edge": 4 * side}, **own}
        if max_pixels is not None:
            config = {**config, **self.overrides(config, max_pixels)}
        counted = self.count(config, width, height)
        return (*counted.grid, counted.pixel_values[-1])

    def tokens(self, model: Any, grid: Grid) -> int:
        return tiled_prompt_tokens(grid[0], grid[1], tile_tokens(model))

    def features(self, model: Any, grid: Grid) -> int:
        return _tiles(grid) * tile_tokens(model)

    def trace_inputs(self, model: Any, rows: int, seq_len: int, grids: Sequence[Grid]) -> dict[str, Any]:
        """Every tile of the batch in one sample, as the collator gives them; real pixels on the CPU: the forward
        tells padding tiles by their zero pixels and counts the rest."""
        import torch

        tiles, side = rows * sum(_tiles(g) for g in grids), max(g[2] for g in grids)
        return {"pixel_values": torch.ones(1, tiles, model.vision_config.num_channels, side, side),
                "pixel_attention_mask": torch.ones(1, tiles, side, side, dtype=torch.long)}

    def per_image(self, model: Any) -> int | None:
        return tile_tokens(model)

    def image_tokens(self, data: Any, paths: Sequence[str]) -> list[int]:
        """Its tiles' and the whole image's, with the markers around them."""
        return [len(_tiled_ids(data, p)) for p in paths]

    def image_ids(self, data: Any, paths: Sequence[str]) -> list[list[int]]:
        return [_tiled_ids(data, p) for p in paths]


def _tiled_ids(data: Any, path: str) -> list[int]:
    """The tokens one image becomes, as the processors write it (transformers' Idefics3Processor
    .replace_image_token, smolvlm's get_image_prompt_string; see `tiled_prompt_tokens`), tokenized as the
    processor's text is (the markers begin and end with a special token, so the text around them tokenizes
    alike); cached per tile arrangement."""
    out = data.process([path], return_row_col_info=True)
    rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
    if (rows, cols) not in data.cache:
        image = data.layout.image_token * data.tokens_per_image
        tiles = "".join("".join(f"{FAKE_IMAGE_TOKEN}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
                        for r in range(rows))
        before, after = data.layout.wrap  # <fake_token_around_image><global-img>, <fake_token_around_image>
        whole = f"{before}{image}{after}"
        data.cache[rows, cols] = data.encode(f"{tiles}\n{whole}" if rows else whole)
    return data.cache[rows, cols]


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    """The first resize: the longest edge to max_len (up or down), the other to an even size."""
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height and width > max_len:
        width, height = max_len, int(max_len / aspect)
    elif height > width and height > max_len:
        height, width = max_len, int(max_len * aspect)
    return max(height, 1), max(width, 1)


def _to_tiles(height: int, width: int, tile: int) -> tuple[int, int]:
    """The resize for the vision encoder: both sides up to whole tiles."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


LAYOUT = Idefics3()
