"""How an image becomes tokens, one module per image layout: the one place that knows the vision kinds.

A vision-language family names its layout in its `VisionLayout.kind` (finetune/recipe/families.py); the module
of that name here (qwen2_vl, gemma3, idefics3, pixtral, mllama) holds everything that differs per layout, as one
`ImageLayout`: the torch-free token counter from an image's size (the processor's resize rule, checked against
the real processor), the pixel overrides and the model's own limit, the grid and inputs the planner traces, the
tokens an image stands for in the text and the collator's image inputs. data/, model/ and plan/ call the kind
through `layout_of` and hold no branch on it; a new layout is one module here plus its family entry
(docs/architecture.md, "How to add a vision family").

Importing this package (and a layout module) imports neither torch nor transformers: the data checks count
image tokens torch-free; the trace and collator parts import them when called.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple

from finetune.recipe.families import FAMILIES, UnsupportedModel, VisionLayout

if TYPE_CHECKING:
    import torch

# an image's (temporal, height, width) patches, as image_grid_thw holds it; Idefics3: (rows, cols, tile side in
# pixels), its rows x cols tiles (0 x 0: not split) and the whole image; Llama 3.2 Vision: (tiles, tile
# rows, tile columns) it fills; Mistral 3: (1, rows, blocks per row); Gemma 3: (1, side, side) patches
Grid = tuple[int, int, int]


class ImageInputs(NamedTuple):
    """What one image becomes: its image tokens in the text, the shape of its pixel_values rows (one image's
    part of the processor's output) and its grid: (t, h, w) patches for Qwen, (rows, cols) tiles otherwise."""

    tokens: int
    pixel_values: tuple[int, ...]
    grid: tuple[int, ...]


class ImageLayout:
    """The protocol every layout module implements (its `LAYOUT`). `config`: the preprocessor_config.json keys
    (with data.max_pixels's overrides applied); `model`: the model's config; `data`: the run's
    finetune.data.vision.VisionData (its processor, token ids and tokenizer)."""

    processors: tuple[str, ...] = ()  # the image_processor_type names it counts (without Fast/Pil)
    fixed_size = False  # every image at one size: data.max_pixels changes nothing
    # the collator gives a batch's text rows image inputs too (padded to the batch's most images), which the vision
    # tower runs: such a row costs what an image row does
    text_rows_show_images = False

    # ---- the torch-free counter (data checks, planner) ----
    def count(self, config: dict[str, Any], width: int, height: int) -> ImageInputs:
        """What the processor makes of one width x height image (the module's resize rule)."""
        raise NotImplementedError

    def overrides(self, config: dict[str, Any], max_pixels: int) -> dict[str, Any]:
        """Keyword arguments that make the processor keep at most `max_pixels` pixels per image, never more
        than its own limit (for its constructor or from_pretrained)."""
        return {}

    def call_overrides(self, config: dict[str, Any], max_pixels: int) -> dict[str, Any]:
        """The same, for a call of an already loaded processor (`config`: its to_dict())."""
        return self.overrides(config, max_pixels)

    def limit(self, model: Any, own: dict[str, Any]) -> int | None:
        """The most pixels the model's processor keeps of one image (`own`: preprocessor_config.json, {} for a
        bare config.json); None: no limit it states (the largest budget)."""
        raise NotImplementedError

    # ---- the planner's trace ----
    def grid(self, model: Any, own: dict[str, Any], width: int, height: int, max_pixels: int | None) -> Grid:
        """The grid one image of this size becomes, as the trace lays it out (`own` as in `limit`)."""
        raise NotImplementedError

    def tokens(self, model: Any, grid: Grid) -> int:
        """The language model's tokens for one image's grid (the counter's rule)."""
        raise NotImplementedError

    def features(self, model: Any, grid: Grid) -> int:
        """How many of those are image tokens (the vision tower's features; the rest are markers)."""
        return self.tokens(model, grid)

    def place(self, ids: torch.Tensor, start: int, end: int, model: Any, grid: Grid) -> None:
        """Write one image's tokens into the traced ids[:, start:end] (image tokens first, markers as text)."""
        ids[:, start:min(end, start + self.features(model, grid))] = model.image_token_id

    def trace_inputs(self, model: Any, rows: int, seq_len: int, grids: Sequence[Grid]) -> dict[str, Any]:
        """The image inputs of a traced micro-batch of `rows` rows with these images each (pixels on meta)."""
        raise NotImplementedError

    # ---- the data build and its collator ----
    def per_image(self, model: Any) -> int | None:
        """A fixed count of image tokens per image (per tile for Idefics3); None: from each image's grid."""
        return None

    def prepare(self, data: Any, model: Any, tokenizer: Any) -> None:
        """Set the run's loaded processor and token ids as this layout needs them (after VisionData is made)."""

    def image_ids(self, data: Any, paths: Sequence[str]) -> list[list[int]]:
        """Each image's tokens in the language model's input, in place of the one the chat template wrote: the
        image token repeated per feature, between the family's wrapping tokens."""
        before, after = data.wrap
        return [[*before, *[data.image_token_id] * n, *after] for n in self.image_tokens(data, paths)]

    def image_tokens(self, data: Any, paths: Sequence[str]) -> list[int]:
        """How many tokens each image stands for in the language model's input (the processor's output)."""
        raise NotImplementedError

    def batch_inputs(self, data: Any, batch: Mapping[str, Any], rows: Sequence[Sequence[str]]) -> dict[str, Any]:
        """The image inputs the collator adds to a text batch (`rows`: each row's image paths)."""
        paths = [p for row in rows for p in row]
        return data.processed(paths) if paths else {}


def layout_of(vision: VisionLayout) -> ImageLayout:
    """The image layout a family's VisionLayout names (its `kind`)."""
    return _layout(vision.kind)


@cache
def _layout(kind: str) -> ImageLayout:
    return importlib.import_module(f"{__name__}.{kind}").LAYOUT


def kinds() -> tuple[str, ...]:
    """The layouts the family table names, in its order."""
    return tuple(dict.fromkeys(f.vision.kind for f in FAMILIES if f.vision is not None))


def for_processor(processor_config: dict[str, Any]) -> ImageLayout:
    """The layout whose processor a preprocessor_config.json names (its image_processor_type)."""
    name = str(processor_config.get("image_processor_type", ""))
    base = name.removesuffix("Fast").removesuffix("Pil")
    known = {p: _layout(kind) for kind in kinds() for p in _layout(kind).processors}
    if base not in known:
        raise UnsupportedModel(f"image processor {name or '(none)'!r} is not one whose image tokens finetune can "
                               f"count (known: {', '.join(sorted(known))})")
    return known[base]

