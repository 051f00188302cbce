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

from finetune.model.family import family_of
from finetune.model.source import config_location
from finetune.vision import Grid, ImageLayout, layout_of

__all__ = ["Grid", "image_grid", "image_input_bytes", "image_tokens", "is_vision", "planned_grids",
           "processor_config", "shown_rows", "trace_batch"]


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
    """The grid an image of `width` x `height` pixels becomes under the budget (its layout's resize rule)."""
    return _images(config).grid(config, processor, width, height, max_pixels)


def _images(config: Any) -> ImageLayout:
    layout = family_of(config).vision
    assert layout is not None
    return layout_of(layout)


def image_tokens(config: Any, grid: Grid) -> int:
    """The language model's tokens for one image's grid (the image tokens and the markers around them)."""
    return _images(config).tokens(config, grid)


def shown_rows(config: Any, rows: int, image_rows: int) -> int | None:
    """Of a micro-batch's `rows` examples, `image_rows` with images: how many the vision tower runs on as image
    rows (`ModelSpec.image_rows`); None: every row (the layout pads text rows with images, or all have some)."""
    return None if image_rows >= rows or _images(config).text_rows_show_images else image_rows


def trace_batch(config: Any, rows: int, seq_len: int, grids: tuple[Grid, ...]) -> dict[str, Any]:
    """A micro-batch of `rows` examples of `seq_len` tokens, each with the images of `grids` (their tokens
    first, each image's separated from the next by a text token, then text), as the data build's collator lays
    one out; pixel values on meta."""
    layout = family_of(config).vision
    assert layout is not None
    images = layout_of(layout)
    ids = torch.zeros(rows, seq_len, dtype=torch.long)
    start = 1
    for grid in grids:  # each image's tokens apart, as the chat template writes them: one run per image
        end = min(start + images.tokens(config, grid), seq_len - 1)
        images.place(ids, start, end, config, grid)
        start = end + 1
    labels = ids.masked_fill(ids == config.image_token_id, -100)
    batch: dict[str, Any] = {"input_ids": ids, "labels": labels, **images.trace_inputs(config, rows, seq_len, grids)}
    if layout.token_types is not None:
        batch[layout.token_types] = (ids == config.image_token_id).int()
    return batch


def image_input_bytes(config: Any, rows: int, seq_len: int, grids: tuple[Grid, ...]) -> int:
    """Bytes of the image inputs (pixel values and their index tensors) the collator makes for `rows` examples
    with the images of `grids`, as the trace lays them out: what a collated micro-batch holds besides its
    tokens while it waits for its turn in the step. Made on meta: their sizes, not hundreds of MB of values."""
    with torch.device("meta"):
        inputs = layout_of(family_of(config).vision).trace_inputs(config, rows, seq_len, grids)
    return sum(t.nbytes for t in inputs.values() if isinstance(t, torch.Tensor))


def planned_grids(config: Any, model_path: str, sizes: list[tuple[int, int]], max_pixels: int | None
                  ) -> tuple[Grid, ...]:
    """The grids of one example's images of (width, height) `sizes` (the data's largest), as the planner
    traces them."""
    processor = processor_config(model_path)
    return tuple(image_grid(config, processor, w, h, max_pixels) for w, h in sizes)


def is_vision(config: Any) -> bool:
    """Whether the planned model is a vision-language one (its trace takes images)."""
    return family_of(config).vision is not None
