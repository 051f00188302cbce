"""How many tokens an image becomes, from its size alone: each image processor's resize rule, torch-free.

The planner prices a vision-language run before any image is decoded or any model loads: from the image sizes
in the files' headers (`finetune.data.images.image_sizes`) and the model folder's preprocessor_config.json,
`image_inputs` gives what the real image processor (transformers' Pillow backend) would produce for one image:
the image tokens it expands to in the text (`tokens`), the shape of its `pixel_values` and its grid or tiles.
Per processor (`image_processor_type`, with or without its Fast/Pil suffix):

- Qwen2-VL, Qwen2.5-VL, Qwen3-VL (`Qwen2VLImageProcessor`): smart_resize to multiples of patch_size x
  merge_size within [min_pixels, max_pixels]; one token per merge_size x merge_size patches.
- Gemma 3 (`Gemma3ImageProcessor`): every image (and each pan-and-scan crop, off unless the config turns it on)
  resized to the fixed size and `mm_tokens_per_image` tokens (config.json; `image_seq_length` in
  processor_config.json; 256 when neither is given).
- Idefics3 and SmolVLM (`Idefics3ImageProcessor`, `SmolVLMImageProcessor`): the longest edge resized to
  size.longest_edge, then to whole tiles of max_image_size; rows x cols tiles plus the global image, each
  `image_seq_len` image tokens (processor_config.json; 169 for Idefics3, 64 for SmolVLM when not given), with
  the text the processor writes around them (`tiled_prompt_tokens`: each tile's `<fake_token_around_image>`
  and `<row_R_col_C>`, a newline after each row, the global image's markers).
- Llama 3.2 Vision (`MllamaImageProcessor`): the tile arrangement of at most max_image_tiles tiles that scales
  the image least; the text holds one image token, the vision tower sees max_image_tiles tiles (padded).
- Mistral 3 / Pixtral (`PixtralImageProcessor`): scaled down (never up) so the longest edge fits
  size.longest_edge, each side then up to whole blocks of patch_size x spatial_merge_size (the merge size is
  Mistral 3's config.json / processor_config.json key, 1 when not given, as PixtralProcessor defaults); one
  [IMG] per block, an [IMG_BREAK] after each row of blocks and [IMG_END] in place of the last row's break.

`data.max_pixels` narrows each processor's own limit (never widens it): `pixel_overrides` gives the keyword
arguments that make the real processor do the same, so the plan and the run resize alike.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from finetune.recipe.families import UnsupportedModel

MAX_SIDE = 4096  # Idefics3/SmolVLM: no side is resized past this (transformers' MAX_IMAGE_SIZE)


class ImageInputs(NamedTuple):
    """What one image becomes: its image tokens in the text, the shape of its pixel_values rows (one image's
    part of the processor's output) and its grid: (t, h, w) patches for Qwen, (rows, cols) tiles otherwise."""

    tokens: int
    pixel_values: tuple[int, ...]
    grid: tuple[int, ...]


def processor_kind(processor_config: dict[str, Any]) -> str:
    """The processor family of a preprocessor_config.json: qwen2_vl, gemma3, idefics3, mllama or pixtral."""
    name = str(processor_config.get("image_processor_type", ""))
    base = name.removesuffix("Fast").removesuffix("Pil")
    kind = _KINDS.get(base)
    if kind is None:
        raise UnsupportedModel(f"image processor {name or '(none)'!r} is not one whose image tokens finetune can "
                               f"count (known: {', '.join(sorted(_KINDS))})")
    return kind


def pixel_overrides(processor_config: dict[str, Any], max_pixels: int | None) -> dict[str, Any]:
    """Keyword arguments that make the image processor keep at most `max_pixels` pixels per image (None: its own
    limit), for its constructor or `from_pretrained`; {} when it has a fixed size (Gemma 3)."""
    kind = processor_kind(processor_config)
    if max_pixels is None or kind == "gemma3":
        return {}
    if kind == "qwen2_vl":
        low, high = _qwen_limits(processor_config)
        return {"min_pixels": low, "max_pixels": min(high, max_pixels)}
    if kind == "idefics3":
        tile = processor_config.get("max_image_size", {}).get("longest_edge", 364)
        edge = _longest_edge(processor_config)
        return {"size": {"longest_edge": min(edge, max(tile, math.isqrt(max_pixels) // tile * tile))}}
    if kind == "pixtral":  # the longest edge: the budget's square side, in whole merged blocks
        unit = _pixtral_unit(processor_config)
        own_edge = (processor_config.get("size") or {}).get("longest_edge", 1024)
        return {"size": {"longest_edge": min(own_edge, max(unit, math.isqrt(max_pixels) // unit * unit))}}
    tile = processor_config.get("size", {}).get("height", 560)
    own = processor_config.get("max_image_tiles", 4)
    return {"max_image_tiles": min(own, max(1, max_pixels // (tile * tile)))}


def image_tokens(processor_config: dict, width: int, height: int, max_pixels: int | None) -> int:
    """The image tokens one width x height image expands to in the text (see the module docstring)."""
    return image_inputs(processor_config, width, height, max_pixels).tokens


def image_inputs(processor_config: dict[str, Any], width: int, height: int, max_pixels: int | None) -> ImageInputs:
    """What the image processor makes of one width x height image under the budget `max_pixels`."""
    config = {**processor_config, **pixel_overrides(processor_config, max_pixels)}
    return _COUNTERS[processor_kind(config)](config, width, height)


def _qwen_limits(config: dict[str, Any]) -> tuple[int, int]:
    """(min_pixels, max_pixels) as the processor's constructor settles them: the top-level keys win over size."""
    size = config.get("size") or {}
    low = config.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56
    high = config.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or 28 * 28 * 1280
    return low, high


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


def _qwen(config: dict[str, Any], width: int, height: int) -> ImageInputs:
    patch, merge = config.get("patch_size", 14), config.get("merge_size", 2)
    temporal = config.get("temporal_patch_size", 2)
    low, high = _qwen_limits(config)
    h, w = smart_resize(height, width, patch * merge, low, high)
    rows, cols = h // patch, w // patch
    return ImageInputs(rows * cols // (merge * merge), (rows * cols, 3 * temporal * patch * patch), (1, rows, cols))


def _gemma3(config: dict[str, Any], width: int, height: int) -> ImageInputs:
    size = config.get("size") or {"height": 896, "width": 896}
    per_image = config.get("mm_tokens_per_image") or config.get("image_seq_length") or 256
    crops = _pan_and_scan_crops(config, width, height) if config.get("do_pan_and_scan") else 0
    return ImageInputs(per_image * (1 + crops), (1 + crops, 3, size["height"], size["width"]), (1 + crops,))


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


def _longest_edge(config: dict[str, Any]) -> int:
    return (config.get("size") or {}).get("longest_edge", 4 * 364)


def tiled_prompt_tokens(rows: int, cols: int, per_tile: int) -> int:
    """Idefics3 / SmolVLM: the tokens an image of rows x cols tiles (0 x 0: not split) takes in the text, as
    their processors write it: per tile `<fake_token_around_image><row_R_col_C>` and `per_tile` image tokens,
    "\n" after each row, then "\n<fake_token_around_image><global-img>", the whole image's `per_tile` image
    tokens and `<fake_token_around_image>`. The markers are one token each and the last row's newline and the
    global image's one "\n\n" token, as in SmolVLM-256M/500M's and SmolVLM2's tokenizers; SmolVLM-Instruct (2.2B)
    and Idefics3-8B add only <fake_token_around_image>, <image> and <end_of_utterance> as tokens, so their
    <row_R_col_C> and <global-img> are a few text tokens each there: this count is short by those."""
    return rows * (cols * (per_tile + 2) + 1) + per_tile + 3


def _idefics3(config: dict[str, Any], width: int, height: int) -> ImageInputs:
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


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    """Idefics3's first resize: the longest edge to max_len (up or down), the other to an even size."""
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
    """Idefics3's resize for the vision encoder: both sides up to whole tiles."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def _mllama(config: dict[str, Any], width: int, height: int) -> ImageInputs:
    tile = (config.get("size") or {}).get("height", 560)
    most = config.get("max_image_tiles", 4)
    arrangements = [(a, b) for a in range(1, most + 1) for b in range(1, most + 1) if a * b <= most]
    scales = [min(a * tile / height, b * tile / width) for a, b in arrangements]
    up = [s for s in scales if s >= 1]
    chosen = min(up) if up else max(s for s in scales if s < 1)
    rows, cols = min((arr for arr, s in zip(arrangements, scales, strict=True) if s == chosen), key=lambda x: x[0] * x[1])
    return ImageInputs(1, (most, 3, tile, tile), (rows, cols))


def _pixtral_unit(config: dict[str, Any]) -> int:
    """Pixtral's block side in pixels: the vision tower's patch times the projector's spatial merge."""
    patch = config.get("patch_size", 16)
    patch = patch.get("height", 16) if isinstance(patch, dict) else patch
    return patch * config.get("spatial_merge_size", 1)


def _pixtral(config: dict[str, Any], width: int, height: int) -> ImageInputs:
    unit = _pixtral_unit(config)
    if config.get("do_resize", True):
        edge = (config.get("size") or {}).get("longest_edge", 1024)
        ratio = max(height / edge, width / edge)
        if ratio > 1:  # transformers' get_resize_output_image_size: floor, so the image stays within the edge
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    rows, cols = (height - 1) // unit + 1, (width - 1) // unit + 1
    return ImageInputs(rows * (cols + 1), (3, rows * unit, cols * unit), (rows, cols))


_KINDS = {"Qwen2VLImageProcessor": "qwen2_vl", "Qwen2_5_VLImageProcessor": "qwen2_vl",
          "Qwen3VLImageProcessor": "qwen2_vl", "Gemma3ImageProcessor": "gemma3",
          "Idefics3ImageProcessor": "idefics3", "SmolVLMImageProcessor": "idefics3",
          "MllamaImageProcessor": "mllama", "PixtralImageProcessor": "pixtral"}
_COUNTERS = {"qwen2_vl": _qwen, "gemma3": _gemma3, "idefics3": _idefics3, "mllama": _mllama, "pixtral": _pixtral}
