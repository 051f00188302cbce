"""Records with images for a vision-language model: each image's token expanded to the count of features the
image processor gives it, labels masked there, and a collator that adds the model's image inputs.

The chat template renders an image part (`{"type": "image", "path": ...}` in a turn's content) as the model's
image placeholder, in which `VisionLayout.image_token` stands once per image; tokenized, that token is repeated
once per feature the vision tower gives the image (Qwen2.5-VL: the processor's image_grid_thw over the merge
size squared), as the model's own processor does. Those tokens never carry loss. The collator runs the image
processor (Pillow backend) on a batch's images and adds its outputs (pixel_values, image_grid_thw) and the
token-type ids the model reads, under their transformers names, so they go to forward as keyword arguments.

Until the data formats read images themselves, `with_image_parts` turns LLaMA-Factory records (`<image>`
markers in the turns and an `images` list, paths relative to the data file) into the canonical parts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.data.chat import IGNORE_INDEX, Encoded
from finetune.data.formats import Chat, Example, RecordError
from finetune.recipe.families import VisionLayout

# image processor outputs the model's forward does not take (the full processor drops them too)
_PROCESSOR_ONLY = {"num_crops"}
IMAGE_MARKER = "<image>"  # LLaMA-Factory's stand-in for the next image of the record's `images`


def _parts(content: str, images: list[str], used: list[int]) -> list[dict[str, Any]] | str:
    """A turn's text split at its `<image>` markers into text and image parts (images taken in order)."""
    if IMAGE_MARKER not in content:
        return content
    parts: list[dict[str, Any]] = []
    for i, text in enumerate(content.split(IMAGE_MARKER)):
        if i:
            if used[0] >= len(images):
                raise RecordError(f"more {IMAGE_MARKER} markers than images ({len(images)})")
            parts.append({"type": "image", "path": images[used[0]]})
            used[0] += 1
        if text:
            parts.append({"type": "text", "text": text})
    return parts


def with_image_parts(example: Example, record: Any, base: Path) -> Example:
    """`example` with the `<image>` markers of its turns replaced by image parts holding the record's `images`
    (absolute, relative paths taken from `base`, the data file's folder); unchanged without `images`."""
    images = record.get("images") if isinstance(record, dict) else None
    if not images or isinstance(example, str):
        return example
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        raise RecordError("'images' must be a list of image file paths")
    paths = [str(p if (p := Path(i)).is_absolute() else (base / p).resolve()) for i in images]
    used = [0]
    for turn in example.messages if isinstance(example, Chat) else example.prompt:
        if isinstance(turn.get("content"), str):
            turn["content"] = _parts(turn["content"], paths, used)
    if used[0] != len(paths):
        raise RecordError(f"{len(paths)} images but {used[0]} {IMAGE_MARKER} markers")
    return example


def images_of(example: Example) -> list[str]:
    """The image paths of a record's turns, in order (a preference record: its prompt's)."""
    if isinstance(example, str):
        return []
    turns = example.messages if isinstance(example, Chat) else example.prompt
    return [part["path"] for turn in turns if isinstance(turn.get("content"), list)
            for part in turn["content"] if part.get("type") == "image"]


@dataclass
class VisionData:
    """A vision-language model's image processor and image token, for the data build and its collator."""

    processor: Any  # the family's image processor (Pillow backend)
    layout: VisionLayout
    image_token_id: int
    written_id: int  # the token the chat template writes per image (image_token_id for Qwen-VL)
    wrap: tuple[list[int], list[int]] = ([], [])  # the tokens around an image's repeated tokens, in its place
    tokens_per_image: int | None = None  # a fixed count (Gemma 3's mm_tokens_per_image), else from the grid
    max_pixels: int | None = None  # data.max_pixels: the largest image budget (None: the processor's own)

    def process(self, paths: Sequence[str]) -> dict[str, Any]:
        """The image processor's outputs for these images (pixel_values, image_grid_thw, ...) as tensors."""
        from PIL import Image

        images = []
        for path in paths:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        kwargs: dict[str, Any] = {}
        if self.max_pixels is not None and self.layout.kind == "qwen2_vl":
            kwargs["size"] = {**dict(self.processor.size), "longest_edge": self.max_pixels}
        return dict(self.processor(images=images, return_tensors="pt", **kwargs))

    def image_tokens(self, paths: Sequence[str]) -> list[int]:
        """How many tokens each image stands for in the language model's input."""
        if self.tokens_per_image is not None:
            return [self.tokens_per_image] * len(paths)
        grid = self.process(paths)["image_grid_thw"]
        merge = self.processor.merge_size
        return [int(g.prod()) // merge ** 2 for g in grid]

    def expand(self, encoded: Encoded, paths: Sequence[str]) -> Encoded:
        """Each image's token in `encoded` (the written one) replaced by the image token repeated once per feature
        of its image (between the family's wrapping tokens), with no loss on them."""
        ids, labels = encoded
        if not paths:
            return encoded
        counts = iter(self.image_tokens(paths))
        out_ids: list[int] = []
        out_labels: list[int] = []
        for tok, label in zip(ids, labels, strict=True):
            if tok == self.written_id:
                n = next(counts, None)
                if n is None:
                    raise RecordError(f"the chat template wrote more image tokens than the record has images "
                                      f"({len(paths)})")
                before, after = self.wrap
                out_ids += [*before, *[self.image_token_id] * n, *after]
                out_labels += [IGNORE_INDEX] * (len(before) + n + len(after))
            else:
                out_ids.append(tok)
                out_labels.append(label)
        if next(counts, None) is not None:
            raise RecordError(f"the chat template wrote fewer image tokens than the record has images ({len(paths)})")
        return out_ids, out_labels

    def collator(self, base: Callable[[list[dict[str, Any]]], dict[str, Any]], rows_per_example: int = 1
                 ) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
        """`base` (the text collator) with the batch's image inputs added; `rows_per_example`: 2 for preference
        pairs, whose chosen and rejected rows share the prompt's images."""
        def collate(examples: list[dict[str, Any]]) -> dict[str, Any]:
            batch = base([{k: v for k, v in e.items() if k != "images"} for e in examples])
            paths = [p for e in examples for p in e.get("images") or []] * rows_per_example
            if paths:
                batch.update({k: v for k, v in self.process(paths).items() if k not in _PROCESSOR_ONLY})
            if self.layout.token_types is not None:
                batch[self.layout.token_types] = (batch["input_ids"] == self.image_token_id).int()
            return batch
        return collate
