"""Mistral 3 (Mistral Small 3.1/3.2, Ministral 3's vision checkpoints): a Pixtral vision tower whose 2 x 2 merged
patches become [IMG] tokens row by row, an [IMG_BREAK] after each row and [IMG_END] after the image. The
torch-free counter equals the Pillow image processor's output; the data build's input_ids equal what
transformers' PixtralProcessor writes for the same chat (its rule reproduced from the image processor's output,
as the processor itself needs torchvision); the family trains through `finetune run`, DPO included, and chats
with an image."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# Mistral-Small-3.1-24B-Instruct-2503's preprocessor_config.json (the keys that decide sizes); its
# processor_config.json adds spatial_merge_size 2, which the counter reads beside them.
MISTRAL_SMALL = {"image_processor_type": "PixtralImageProcessor", "patch_size": {"height": 14, "width": 14},
                 "size": {"longest_edge": 1540}}
SIZES = [(40, 30), (640, 480), (1000, 200), (300, 1200), (1540, 1540), (1541, 700), (4032, 3024)]


@pytest.mark.parametrize("max_pixels", [None, 200_000, 10**9])
def test_image_tokens_equal_the_pixtral_processors_output(tmp_path, max_pixels):
    """Per image: [IMG] per 28 x 28 block of the resized image and a break per row, as PixtralProcessor expands
    the image processor's image_sizes; data.max_pixels narrows the longest edge, never past the model's own."""
    from PIL import Image
    from transformers import PixtralImageProcessorPil

    from finetune.data.image_tokens import image_inputs, image_tokens, pixel_overrides

    config = {**MISTRAL_SMALL, "spatial_merge_size": 2}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(MISTRAL_SMALL))
    processor = PixtralImageProcessorPil.from_pretrained(tmp_path, **pixel_overrides(config, max_pixels))
    for width, height in SIZES:
        out = processor(Image.new("RGB", (width, height), "red"), patch_size=28, return_tensors="np")
        h, w = (int(x) for x in out["image_sizes"][0])
        counted = image_inputs(config, width, height, max_pixels)
        assert counted == ((h // 28) * (w // 28 + 1), out["pixel_values"].shape[1:], (h // 28, w // 28)), (width, height)
        assert image_tokens(config, width, height, max_pixels) == counted.tokens
        assert max(h, w) <= processor.size["longest_edge"] and h * w <= (max_pixels or 1540 ** 2)
    edge = pixel_overrides(config, max_pixels)["size"]["longest_edge"] if max_pixels else 1540
    assert edge == {None: 1540, 200_000: 420, 10**9: 1540}[max_pixels]  # whole 28-pixel blocks, never above 1540


def test_a_smaller_pixel_budget_gives_fewer_image_tokens():
    from finetune.data.image_tokens import image_tokens

    config = {**MISTRAL_SMALL, "spatial_merge_size": 2}
    counts = [image_tokens(config, 4032, 3024, budget) for budget in (100_000, 400_000, 1_600_000, None)]
    assert counts == sorted(counts) and len(set(counts)) == 4
    assert counts[-1] == 42 * (55 + 1)  # 1540 x 1155 pixels: 55 blocks across, 42 rows, each row with its break
