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
from finetune.data.image_tokens import pixel_overrides
from finetune.data.images import open_image
from finetune.recipe.families import VisionLayout

if TYPE_CHECKING:
    import torch

    from finetune.data.batch import Batch

# image processor outputs the model's forward does not take (the full processor drops them too)
_PROCESSOR_ONLY = {"num_crops"}
# Idefics3 / SmolVLM: the token their processors write before each tile's `<row_R_col_C>` (transformers'
# Idefics3Processor and SmolVLMProcessor: fake_image_token); the whole image's are the family's VisionLayout.wrap
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"


@dataclass
class VisionData:
    """A vision-language model's image processor and image token, for the data build and its collator."""

    processor: Any  # the family's image processor (Pillow backend)
    layout: VisionLayout
    image_token_id: int
    written_id: int  # the token the chat template writes per image (image_token_id for Qwen-VL)
    wrap: tuple[list[int], list[int]] = ([], [])  # the tokens around an image's repeated tokens, in its place
    # a fixed count per image (Gemma 3's mm_tokens_per_image) or per tile (Idefics3), else from the grid
    tokens_per_image: int | None = None
    max_pixels: int | None = None  # data.max_pixels: the largest image budget (None: the processor's own)
    # Pixtral (Mistral 3): the ids of the token after each row of an image's blocks and of the one after the image
    breaks: tuple[int, int] | None = None
    # the tokenizer on plain text, without special tokens added (Idefics3: the markers around its tiles)
    encode: Callable[[str], list[int]] | None = None
    _tiled: dict[tuple[int, int], list[int]] = field(default_factory=dict, init=False, repr=False)

    def process(self, paths: Sequence[str], **extra: Any) -> dict[str, Any]:
        """The image processor's outputs for these images (pixel_values, image_grid_thw, ...) as tensors;
        `extra`: more of the processor's keywords (return_row_col_info)."""
        images = [open_image(path) for path in paths]
        kwargs: dict[str, Any] = {}
        if self.max_pixels is not None and self.layout.kind == "qwen2_vl":
            kwargs["size"] = {**dict(self.processor.size), "longest_edge": self.max_pixels}
        elif self.max_pixels is not None:
            kwargs = pixel_overrides(self.processor.to_dict(), self.max_pixels)
        return dict(self.processor(images=images, return_tensors="pt", **kwargs, **extra))

    def image_tokens(self, paths: Sequence[str]) -> list[int]:
        """How many tokens each image stands for in the language model's input."""
        if self.layout.kind == "idefics3":  # its tiles' and the whole image's, with the markers around them
            return [len(self.tiled_ids(p)) for p in paths]
        if self.layout.kind == "pixtral":  # an [IMG] per block and a break (the last one the end) per row
            return [rows * (cols + 1) for rows, cols in self.rows(paths)]
        if self.tokens_per_image is not None:
            return [self.tokens_per_image] * len(paths)
        grid = self.process(paths)["image_grid_thw"]
        merge = self.processor.merge_size
        return [int(g.prod()) // merge ** 2 for g in grid]

    def rows(self, paths: Sequence[str]) -> list[tuple[int, int]]:
        """Pixtral: each image's (rows, blocks per row) after the processor's resize; a block is one [IMG] token
        (the processor's patch_size, which `finetune.model.vision.vision_data` sets to the tower's patch times the
        projector's spatial merge, as transformers' PixtralProcessor passes it)."""
        unit = self.processor.patch_size["height"]
        return [(int(h) // unit, int(w) // unit) for h, w in self.process(paths)["image_sizes"]]

    def image_run(self, rows: int, cols: int) -> list[int]:
        """Pixtral: one image's tokens, as PixtralProcessor writes them: [IMG] x cols then [IMG_BREAK], per row,
        the last row's break replaced by [IMG_END]."""
        assert self.breaks is not None
        row_break, end = self.breaks
        run = ([self.image_token_id] * cols + [row_break]) * rows
        run[-1] = end
        return run

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
        if self.layout.kind == "idefics3":
            return [self.tiled_ids(p) for p in paths]
        if self.breaks is not None:  # Pixtral: its rows with their breaks
            return [self.image_run(*g) for g in self.rows(paths)]
        before, after = self.wrap
        return [[*before, *[self.image_token_id] * n, *after] for n in self.image_tokens(paths)]

    def tiled_ids(self, path: str) -> list[int]:
        """Idefics3 / SmolVLM: the tokens one image becomes, as their processors write it (transformers'
        Idefics3Processor.replace_image_token, smolvlm's get_image_prompt_string): for an image split into rows x
        cols tiles, per tile `<fake_token_around_image><row_R_col_C>` and its image tokens, "\n" after each row,
        then "\n<fake_token_around_image><global-img>", the whole image's tokens and `<fake_token_around_image>`;
        an image not split is that last part alone. Tokenized as the processor's text is (the markers begin and
        end with a special token, so the text around them tokenizes alike)."""
        assert self.encode is not None and self.tokens_per_image is not None
        out = self.process([path], return_row_col_info=True)
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        if (rows, cols) not in self._tiled:
            image = self.layout.image_token * self.tokens_per_image
            tiles = "".join("".join(f"{FAKE_IMAGE_TOKEN}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
                            for r in range(rows))
            before, after = self.layout.wrap  # <fake_token_around_image><global-img>, <fake_token_around_image>
            whole = f"{before}{image}{after}"
            self._tiled[rows, cols] = self.encode(f"{tiles}\n{whole}" if rows else whole)
        return self._tiled[rows, cols]

    def collator(self, base: Callable[[list[dict[str, Any]]], Mapping[str, Any]], rows_per_example: int = 1
                 ) -> Callable[[list[dict[str, Any]]], Batch]:
        """`base` (the text collator) with the batch's image inputs added; `rows_per_example`: 2 for preference
        pairs, whose chosen and rejected rows share the prompt's images."""
        from finetune.data.batch import Batch  # torch: the data checks import this module torch-free

        def collate(examples: list[dict[str, Any]]) -> Batch:
            batch = dict(base([{k: v for k, v in e.items() if k != "images"} for e in examples]))  # a Batch reads as a mapping
            if self.layout.kind == "mllama":  # per row: its own images and the tokens that read them
                rows = [list(e.get("images") or []) for e in examples] * rows_per_example
                batch.update(self.cross_attention_inputs(batch["input_ids"], rows))
                return Batch.of(batch)
            paths = [p for e in examples for p in e.get("images") or []] * rows_per_example
            if paths:
                batch.update({k: v for k, v in self.process(paths).items() if k not in _PROCESSOR_ONLY})
            if self.layout.token_types is not None:
                batch[self.layout.token_types] = (batch["input_ids"] == self.image_token_id).int()
            return Batch.of(batch)  # the image inputs go to Batch.extra, passed to the model's forward
        return collate

    def cross_attention_inputs(self, input_ids: torch.Tensor, rows: Sequence[Sequence[str]]) -> dict[str, Any]:
        """Llama 3.2 Vision's image inputs, per row of `input_ids`: each row's images (`rows`: their paths) as
        pixel_values [rows, images, tiles, channels, height, width], every image padded to the vision tower's
        tiles and every row to the most images; aspect_ratio_ids / aspect_ratio_mask (each image's tile
        arrangement, as the model's own list numbers them); and cross_attention_mask [rows, tokens, images, tiles]:
        the tokens from an image's token on read that image's tiles, as transformers' MllamaProcessor builds it.
        {} when no row has an image: the model then skips its cross-attention layers."""
        import numpy as np
        import torch
        from transformers.models.mllama.image_processing_pil_mllama import get_all_supported_aspect_ratios
        from transformers.models.mllama.processing_mllama import (
            convert_sparse_cross_attention_mask_to_dense,
            get_cross_attention_token_mask,
        )

        if not any(rows):
            return {}
        tiles = self.processor.max_image_tiles  # the model folder's own: the vision tower's max_num_tiles
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
                processed[tuple(paths)] = self.process(paths)
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
        tokens = [get_cross_attention_token_mask(row.tolist(), self.image_token_id) for row in input_ids]
        cross = np.zeros((len(rows), input_ids.shape[1], most, tiles), dtype=np.int64)
        if any(tokens):
            dense = convert_sparse_cross_attention_mask_to_dense(tokens, num_tiles, tiles, input_ids.shape[1])
            cross[:, :, :dense.shape[2]] = dense[:, :, :most]
        return {"pixel_values": pixels, "aspect_ratio_ids": ids, "aspect_ratio_mask": mask,
                "cross_attention_mask": torch.from_numpy(cross)}
