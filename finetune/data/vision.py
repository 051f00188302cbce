"""Records with images for a vision-language model: each image's token expanded to the count of features the
image processor gives it, labels masked there, and a collator that adds the model's image inputs.

The chat template renders an image part (`{"type": "image", "path": ...}` in a turn's content) as the model's
image placeholder, in which `VisionLayout.image_token` stands once per image; tokenized, that token is repeated
once per feature the vision tower gives the image (Qwen2.5-VL: the processor's image_grid_thw over the merge
size squared), as the model's own processor does. Those tokens never carry loss. The collator runs the image
processor (Pillow backend) on a batch's images and adds its outputs (pixel_values, image_grid_thw) and the
token-type ids the model reads, under their transformers names, so they go to forward as keyword arguments.

The records' image parts come from the data formats (`finetune.data.formats`: LLaMA-Factory's `<image>`
markers and content parts, read into canonical parts with absolute paths).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from finetune.data.chat import IGNORE_INDEX, Encoded
from finetune.data.formats import RecordError
from finetune.data.images import open_image
from finetune.recipe.families import VisionLayout
from finetune.vision import ImageLayout, layout_of

if TYPE_CHECKING:
    from finetune.data.batch import Batch

# image processor outputs the model's forward does not take (the full processor drops them too)
_PROCESSOR_ONLY = {"num_crops"}


@dataclass
class VisionData:
    """A vision-language model's image processor and image token, for the data build and its collator; how an
    image becomes tokens is its layout's (finetune/vision/, `images`)."""

    processor: Any  # the family's image processor (Pillow backend)
    layout: VisionLayout
    image_token_id: int
    written_id: int  # the token the chat template writes per image (image_token_id for Qwen-VL)
    wrap: tuple[list[int], list[int]] = ([], [])  # the tokens around an image's repeated tokens, in its place
    # a fixed count per image (Gemma 3's mm_tokens_per_image) or per tile (Idefics3), else from the grid
    tokens_per_image: int | None = None
    max_pixels: int | None = None  # data.max_pixels: the largest image budget (None: the processor's own)
    # Pixtral (Mistral 3): the ids of the token after each row of an image's blocks and of the one after the image
    breaks: tuple[int, ...] = ()
    # the tokenizer on plain text, without special tokens added (Idefics3: the markers around its tiles)
    encode: Callable[[str], list[int]] | None = None
    cache: dict[Any, list[int]] = field(default_factory=dict, init=False, repr=False)  # the layout's, per run

    @property
    def images(self) -> ImageLayout:
        return layout_of(self.layout)

    def process(self, paths: Sequence[str], **extra: Any) -> dict[str, Any]:
        """The image processor's outputs for these images (pixel_values, image_grid_thw, ...) as tensors;
        `extra`: more of the processor's keywords (return_row_col_info)."""
        images = [open_image(path) for path in paths]
        kwargs = {} if self.max_pixels is None else self.images.call_overrides(self.processor.to_dict(),
                                                                                self.max_pixels)
        return dict(self.processor(images=images, return_tensors="pt", **kwargs, **extra))

    def processed(self, paths: Sequence[str]) -> dict[str, Any]:
        """The processor's outputs the model's forward takes."""
        return {k: v for k, v in self.process(paths).items() if k not in _PROCESSOR_ONLY}

    def image_tokens(self, paths: Sequence[str]) -> list[int]:
        """How many tokens each image stands for in the language model's input."""
        return self.images.image_tokens(self, paths)

    def expand(self, encoded: Encoded, paths: Sequence[str]) -> Encoded:
        """Each image's token in `encoded` (the written one) replaced by the image token repeated once per feature
        of its image (between the family's wrapping tokens; Idefics3: its tiles' markers), with no loss on them."""
        ids, labels = encoded
        if not paths:
            return encoded
        images = iter(self.image_ids(paths))
        out_ids: list[int] = []
        out_labels: list[int] = []
        for tok, label in zip(ids, labels, strict=True):
            if tok == self.written_id:
                image = next(images, None)
                if image is None:
                    raise RecordError(f"the chat template wrote more image tokens than the record has images "
                                      f"({len(paths)})")
                out_ids += image
                out_labels += [IGNORE_INDEX] * len(image)
            else:
                out_ids.append(tok)
                out_labels.append(label)
        if next(images, None) is not None:
            raise RecordError(f"the chat template wrote fewer image tokens than the record has images ({len(paths)})")
        return out_ids, out_labels

    def image_ids(self, paths: Sequence[str]) -> list[list[int]]:
        """Each image's tokens in the language model's input, in place of the one the chat template wrote."""
        return self.images.image_ids(self, paths)

    def collator(self, base: Callable[[list[dict[str, Any]]], Mapping[str, Any]], rows_per_example: int = 1
                 ) -> Callable[[list[dict[str, Any]]], Batch]:
        """`base` (the text collator) with the batch's image inputs added; `rows_per_example`: 2 for preference
        pairs, whose chosen and rejected rows share the prompt's images."""
        from finetune.data.batch import Batch  # torch: the data checks import this module torch-free

        def collate(examples: list[dict[str, Any]]) -> Batch:
            batch = dict(base([{k: v for k, v in e.items() if k != "images"} for e in examples]))  # a Batch reads as a mapping
            rows = [list(e.get("images") or []) for e in examples] * rows_per_example
            batch.update(self.images.batch_inputs(self, batch, rows))
            if self.layout.token_types is not None:
                batch[self.layout.token_types] = (batch["input_ids"] == self.image_token_id).int()
            return Batch.of(batch)  # the image inputs go to Batch.extra, passed to the model's forward
        return collate
