"""The planner's view of a vision-language model's images: the image grids one example brings (from the image
sizes in the data's headers and the processor's resize rule) and the traced batch that carries them.

The trace runs the whole model (vision tower, projector, language model) on the meta device. The few
index tensors whose values the forward reads (image_grid_thw, the token ids that say where the image tokens
are, the token types the multimodal rotary positions come from) stay on the CPU, where their values exist;
the trace's kernel mode (`finetune.plan.trace`) moves what they produce onto the meta device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from finetune.data.image_tokens import image_inputs, tiled_prompt_tokens
from finetune.model.family import family_of
from finetune.model.source import config_location
from finetune.model.vision import tile_tokens

# an image's (temporal, height, width) patches, as image_grid_thw holds it; Idefics3: (rows, cols, tile side in
# pixels), its rows x cols tiles (0 x 0: not split) and the whole image; Llama 3.2 Vision: (tiles, tile
# rows, tile columns) it fills
Grid = tuple[int, int, int]


def processor_config(model_path: str) -> dict[str, Any]:
    """The model folder's preprocessor_config.json ({} where there is none: a bare config.json), with
    processor_config.json's image_seq_len where it has one (SmolVLM's tokens per tile)."""
    try:
        folder = config_location(model_path)
    except Exception:  # noqa: BLE001 - a hub name or a missing path: the vision config's defaults
        return {}
    folder = folder if folder.is_dir() else folder.parent
    preprocessor, processor = (_json_file(folder / name) for name in ("preprocessor_config.json", "processor_config.json"))
    return {**preprocessor, **{k: v for k, v in processor.items() if k == "image_seq_len"}}


def _json_file(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text()) if file.is_file() else {}
    except (OSError, ValueError):
        return {}


def image_grid(config: Any, processor: dict[str, Any], width: int, height: int, max_pixels: int | None) -> Grid:
    """The patch grid an image of `width` x `height` pixels becomes (the Qwen-VL processors' resize rule: a
    multiple of patch x merge on each side, the pixel count within min/max pixels; Gemma 3: every image at the
    vision tower's fixed size)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    vision = config.vision_config
    if _kind(config) == "gemma3":
        side = vision.image_size // vision.patch_size
        return (1, side, side)
    if _kind(config) == "idefics3":  # (rows, cols, tile side in pixels)
        own = {"image_processor_type": "Idefics3ImageProcessor", "max_image_size": {"longest_edge": vision.image_size},
               "size": {"longest_edge": 4 * vision.image_size}, **processor}  # a bare config.json: the checkpoints' 4 tiles
        counted = image_inputs(own, width, height, max_pixels)
        return (*counted.grid, counted.pixel_values[-1])
    if _kind(config) == "pixtral":  # (1, rows, blocks per row): merged patches, the resize rule of the counter
        own = {"image_processor_type": "PixtralImageProcessor", "size": {"longest_edge": vision.image_size},
               **processor, "patch_size": vision.patch_size, "spatial_merge_size": config.spatial_merge_size}
        return (1, *image_inputs(own, width, height, max_pixels).grid)
    if _kind(config) == "mllama":  # a bare config.json: the tower's tile size and count
        own = {"image_processor_type": "MllamaImageProcessor", "max_image_tiles": vision.max_num_tiles,
               "size": {"height": vision.image_size, "width": vision.image_size}, **processor}
        rows, cols = image_inputs(own, width, height, max_pixels).grid
        return (rows * cols, rows, cols)
    patch = processor.get("patch_size", vision.patch_size)
    merge = processor.get("merge_size", vision.spatial_merge_size)
    size = processor.get("size") or {}
    low = size.get("shortest_edge", processor.get("min_pixels", 56 * 56))
    high = max_pixels or size.get("longest_edge", processor.get("max_pixels", 28 * 28 * 1280))
    h, w = smart_resize(height, width, factor=patch * merge, min_pixels=low, max_pixels=high)
    return (1, h // patch, w // patch)


def _kind(config: Any) -> str:
    layout = family_of(config).vision
    assert layout is not None
    return layout.kind


def image_tokens(config: Any, grid: Grid) -> int:
    """The language model's tokens for one image's grid (its patches merged merge x merge; Gemma 3: its fixed
    mm_tokens_per_image; Idefics3: its tiles' and the whole image's, with the markers its processor writes)."""
    if _kind(config) == "gemma3":
        return config.mm_tokens_per_image
    if _kind(config) == "idefics3":
        return tiled_prompt_tokens(grid[0], grid[1], tile_tokens(config))
    if _kind(config) == "pixtral":  # an [IMG] per block, a break (the last one the image's end) per row
        return grid[1] * (grid[2] + 1)
    if _kind(config) == "mllama":  # its one token; the image's tiles reach the text by cross-attention
        return 1
    merge = config.vision_config.spatial_merge_size
    return grid[0] * grid[1] * grid[2] // merge ** 2


def trace_batch(config: Any, rows: int, seq_len: int, grids: tuple[Grid, ...]) -> dict[str, Any]:
    """A micro-batch of `rows` examples of `seq_len` tokens, each with the images of `grids` (their tokens
    first, each image's separated from the next by a text token, then text), as the data build's collator lays
    one out; pixel values on meta."""
    layout = family_of(config).vision
    assert layout is not None
    vision = config.vision_config
    image = config.image_token_id
    ids = torch.zeros(rows, seq_len, dtype=torch.long)
    start = 1
    for grid in grids:  # each image's tokens apart, as the chat template writes them: one run per image
        end = min(start + image_tokens(config, grid), seq_len - 1)
        ids[:, start:min(end, start + _features(config, grid))] = image  # Idefics3's markers are text
        if layout.kind == "pixtral":  # each row's break and the image's end are other tokens than the image's
            ids[:, start + grid[2]:end:grid[2] + 1] = 0
        start = end + 1
    labels = ids.masked_fill(ids == image, -100)
    batch: dict[str, Any] = {"input_ids": ids, "labels": labels}
    if layout.kind == "gemma3":  # whole images at the tower's size
        side = vision.image_size
        batch["pixel_values"] = torch.empty(rows * len(grids), vision.num_channels, side, side, device="meta")
    elif layout.kind == "idefics3":  # every tile of the batch in one sample, as the collator gives them
        # real pixels on the CPU: the forward tells padding tiles by their zero pixels and counts the rest
        tiles, side = rows * sum(_tiles(g) for g in grids), max(g[2] for g in grids)
        batch["pixel_values"] = torch.ones(1, tiles, vision.num_channels, side, side)
        batch["pixel_attention_mask"] = torch.ones(1, tiles, side, side, dtype=torch.long)
    elif layout.kind == "pixtral":  # every image padded to the batch's largest; image_sizes (real) says its part
        unit = vision.patch_size * config.spatial_merge_size
        high, wide = unit * max(g[1] for g in grids), unit * max(g[2] for g in grids)
        batch["pixel_values"] = torch.empty(rows * len(grids), vision.num_channels, high, wide, device="meta")
        batch["image_sizes"] = torch.tensor([[unit * g[1], unit * g[2]] for g in grids] * rows, dtype=torch.long)
    elif layout.kind == "mllama":  # every row's images, each padded to the tower's tiles, read from their token on
        tiles, images = vision.max_num_tiles, len(grids)
        batch["pixel_values"] = torch.empty(rows, images, tiles, vision.num_channels, vision.image_size,
                                            vision.image_size, device="meta")
        batch["aspect_ratio_ids"] = torch.ones(rows, images, dtype=torch.long, device="meta")
        batch["aspect_ratio_mask"] = torch.ones(rows, images, tiles, dtype=torch.long, device="meta")
        batch["cross_attention_mask"] = torch.ones(rows, seq_len, images, tiles, dtype=torch.long, device="meta")
    else:  # the processor's flattened patches and each image's grid
        patches = rows * sum(t * h * w for t, h, w in grids)
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        batch["pixel_values"] = torch.empty(patches, width, dtype=torch.float32, device="meta")
        batch["image_grid_thw"] = torch.tensor([list(g) for g in grids] * rows, dtype=torch.long)
    if layout.token_types is not None:
        batch[layout.token_types] = (ids == image).int()
    return batch


def _tiles(grid: Grid) -> int:
    """Idefics3: the pictures the vision tower sees for one image, its tiles and the whole image."""
    return grid[0] * grid[1] + 1 if grid[0] else 1


def _features(config: Any, grid: Grid) -> int:
    """How many of an image's tokens are image tokens (the vision tower's features; Idefics3 writes its markers
    around them, the others none)."""
    if _kind(config) == "idefics3":
        return _tiles(grid) * tile_tokens(config)
    return image_tokens(config, grid)


def planned_grids(config: Any, model_path: str, sizes: list[tuple[int, int]], max_pixels: int | None
                  ) -> tuple[Grid, ...]:
    """The grids of one example's images of (width, height) `sizes` (the data's largest), as the planner
    traces them."""
    processor = processor_config(model_path)
    return tuple(image_grid(config, processor, w, h, max_pixels) for w, h in sizes)


def is_vision(config: Any) -> bool:
    """Whether the planned model is a vision-language one (its trace takes images)."""
    return family_of(config).vision is not None
