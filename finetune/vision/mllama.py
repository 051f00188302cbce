"""Llama 3.2 Vision (`MllamaImageProcessor`): the tile arrangement of at most max_image_tiles tiles that scales
the image least; the text holds one image token, the vision tower sees max_image_tiles tiles (padded) and the
text reads them through cross-attention layers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from finetune.vision import Grid, ImageInputs, ImageLayout

if TYPE_CHECKING:
    import torch


class Mllama(ImageLayout):
    processors = ("MllamaImageProcessor",)
    text_rows_show_images = True  # every row padded to the batch's most images (`cross_attention_inputs`)

    def count(self, config: dict[str, Any], width: int, height: int) -> ImageInputs:
        tile = (config.get("size") or {}).get("height", 560)
        most = config.get("max_image_tiles", 4)
        arrangements = [(a, b) for a in range(1, most + 1) for b in range(1, most + 1) if a * b <= most]
        scales = [min(a * tile / height, b * tile / width) for a, b in arrangements]
        up = [s for s in scales if s >= 1]
        chosen = min(up) if up else max(s for s in scales if s < 1)
        rows, cols = min((arr for arr, s in zip(arrangements, scales, strict=True) if s == chosen),
                         key=lambda x: x[0] * x[1])
        return ImageInputs(1, (most, 3, tile, tile), (rows, cols))

    def overrides(self, config: dict[str, Any], max_pixels: int) -> dict[str, Any]:
        tile = config.get("size", {}).get("height", 560)
        own = config.get("max_image_tiles", 4)
        return {"max_image_tiles": min(own, max(1, max_pixels // (tile * tile)))}

    def limit(self, model: Any, own: dict[str, Any]) -> int:
        """Its tiles' pixels (a bare config: the tower's)."""
        vision = model.vision_config
        return ((own.get("size") or {}).get("height") or vision.image_size) ** 2 * own.get("max_image_tiles",
                                                                                          vision.max_num_tiles)

    def grid(self, model: Any, own: dict[str, Any], width: int, height: int, max_pixels: int | None) -> Grid:
        """(tiles, tile rows, tile columns); a bare config.json: the tower's tile size and count."""
        vision = model.vision_config
        config = {"image_processor_type": "MllamaImageProcessor", "max_image_tiles": vision.max_num_tiles,
                  "size": {"height": vision.image_size, "width": vision.image_size}, **own}
        if max_pixels is not None:
            config = {**config, **self.overrides(config, max_pixels)}
        rows, cols = self.count(config, width, height).grid
        return (rows * cols, rows, cols)

    def tokens(self, model: Any, grid: Grid) -> int:
        """Its one token; the image's tiles reach the text by cross-attention."""
        return 1

    def trace_inputs(self, model: Any, rows: int, seq_len: int, grids: Sequence[Grid]) -> dict[str, Any]:
        """Every row's images, each padded to the tower's tiles, read from their token on."""
        import torch

        vision = model.vision_config
        tiles, images = vision.max_num_tiles, len(grids)
        return {"pixel_values": torch.empty(rows, images, tiles, vision.num_channels, vision.image_size,
                                            vision.image_size, device="meta"),
                "aspect_ratio_ids": torch.ones(rows, images, dtype=torch.long, device="meta"),
                "aspect_ratio_mask": torch.ones(rows, images, tiles, dtype=torch.long, device="meta"),
                "cross_attention_mask": torch.ones(rows, seq_len, images, tiles, dtype=torch.long, device="meta")}

    def per_image(self, model: Any) -> int | None:
        return 1

    def image_tokens(self, data: Any, paths: Sequence[str]) -> list[int]:
        return [1] * len(paths)

    def batch_inputs(self, data: Any, batch: Mapping[str, Any], rows: Sequence[Sequence[str]]) -> dict[str, Any]:
        return cross_attention_inputs(data, batch["input_ids"], rows)


def cross_attention_inputs(data: Any, input_ids: torch.Tensor, rows: Sequence[Sequence[str]]) -> dict[str, Any]:
    """The image inputs per row of `input_ids`: each row's images (`rows`: their paths) as pixel_values [rows,
    images, tiles, channels, height, width], every image padded to the vision tower's tiles and every row to the
    most images; aspect_ratio_ids / aspect_ratio_mask (each image's tile arrangement, as the model's own list
    numbers them); and cross_attention_mask [rows, tokens, images, tiles]: the tokens from an image's token on
    read that image's tiles, as transformers' MllamaProcessor builds it. {} when no row has an image: the model
    then skips its cross-attention layers."""
    import numpy as np
    import torch

    from finetune.compat import mllama_processing

    get_all_supported_aspect_ratios, get_cross_attention_token_mask, convert_sparse_cross_attention_mask_to_dense \
        = mllama_processing()

    if not any(rows):
        return {}
    tiles = data.processor.max_image_tiles  # the model folder's own: the vision tower's max_num_tiles
    arrangements = get_all_supported_aspect_ratios(tiles)
    most = max(len(paths) for paths in rows)
    processed: dict[tuple[str, ...], dict[str, Any]] = {}  # a pair's chosen and rejected rows share images
    pixels = ids = mask = None
    num_tiles: list[list[int]] = []
    for i, paths in enumerate(rows):
        if not paths:
            num_tiles.append([])
            continue
        if tuple(paths) not in processed:
            processed[tuple(paths)] = data.process(paths)
        out = processed[tuple(paths)]
        values = out["pixel_values"][0]  # [images, tiles under data.max_pixels, channels, height, width]
        if pixels is None:
            pixels = values.new_zeros((len(rows), most, tiles, *values.shape[2:]))
            ids = torch.zeros(len(rows), most, dtype=torch.long)
            mask = torch.zeros(len(rows), most, tiles, dtype=torch.long)
            mask[:, :, 0] = 1  # padding images keep one tile, as the processor pads them
        narrowed = get_all_supported_aspect_ratios(values.shape[1])  # data.max_pixels may narrow the tiles
        pixels[i, :len(paths), :values.shape[1]] = values
        ids[i, :len(paths)] = torch.tensor([arrangements.index(narrowed[int(a) - 1]) + 1
                                            for a in out["aspect_ratio_ids"][0]])
        mask[i, :len(paths), :values.shape[1]] = out["aspect_ratio_mask"][0]
        num_tiles.append(list(out["num_tiles"][0]))
    tokens = [get_cross_attention_token_mask(row.tolist(), data.image_token_id) for row in input_ids]
    cross = np.zeros((len(rows), input_ids.shape[1], most, tiles), dtype=np.int64)
    if any(tokens):
        dense = convert_sparse_cross_attention_mask_to_dense(tokens, num_tiles, tiles, input_ids.shape[1])
        cross[:, :, :dense.shape[2]] = dense[:, :, :most]
    return {"pixel_values": pixels, "aspect_ratio_ids": ids, "aspect_ratio_mask": mask,
            "cross_attention_mask": torch.from_numpy(cross)}


LAYOUT = Mllama()
