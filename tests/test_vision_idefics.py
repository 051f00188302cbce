"""SmolVLM / Idefics3 prompts: each image becomes exactly the tokens transformers' own processor writes for it (per
tile `<fake_token_around_image><row_R_col_C>` and its image tokens, a newline after each row, then the whole image
between `<fake_token_around_image><global-img>` and `<fake_token_around_image>`), with no loss on any of them, and
the planner counts those same tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.data.chat import IGNORE_INDEX
from finetune.recipe.schema import DataConfig
from finetune.testing import vision_model

ARCHS = ["idefics3", "smolvlm"]
# a wide picture (2 x 2 tiles at the tiny model's 112-pixel long side), a thin one (1 x 2 tiles)
SIZES = [(84, 56), (112, 20)]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, vision_model(request.param, tmp_path_factory.mktemp(request.param) / "model")


def _data(folder: Path, sizes: list[tuple[int, int]]) -> Path:
    """One LLaMA-Factory record with a picture of each size, the question and its answer."""
    from PIL import Image

    names = []
    for i, size in enumerate(sizes):
        Image.new("RGB", size, (30 + 90 * i, 120, 200)).save(folder / f"p{i}.png")
        names.append(f"p{i}.png")
    path = folder / "data.json"
    path.write_text(json.dumps([{"messages": [
        {"role": "user", "content": "<image>" * len(sizes) + "What colour is it?"},
        {"role": "assistant", "content": "It is blue."}], "images": names}]))
    return path


def _built(model: Path, data: Path, max_pixels: int | None) -> tuple[list[int], list[int]]:
    from transformers import AutoConfig, AutoTokenizer

    from finetune.data import build_datasets
    from finetune.model.vision import vision_data

    tokenizer = AutoTokenizer.from_pretrained(model)
    vision = vision_data(AutoConfig.from_pretrained(model), model, tokenizer, max_pixels)
    row = build_datasets(DataConfig(path=str(data), max_seq_len=512), tokenizer, 0, "sft", None, vision).train[0]
    return row["input_ids"], row["labels"]


def _reference(arch: str, model: Path, data: Path, max_pixels: int | None) -> list[int]:
    """transformers' own input_ids for the record: Idefics3Processor itself; for SmolVLM, whose processor needs
    num2words and a video processor, its module's get_image_prompt_string with the rows and cols its image
    processor gives, tokenized whole as SmolVLMProcessor does."""
    from PIL import Image
    from transformers import (
        AutoTokenizer,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        SmolVLMImageProcessorPil,
    )
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    from finetune.data.image_tokens import pixel_overrides

    record = json.loads(data.read_text())[0]
    images = [Image.open(data.parent / name).convert("RGB") for name in record["images"]]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "What colour is it?"}]
    tokenizer = AutoTokenizer.from_pretrained(model)
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}, {
        "role": "assistant", "content": [{"type": "text", "text": "It is blue."}]}], tokenize=False)
    preprocessor = json.loads((model / "preprocessor_config.json").read_text())
    overrides = pixel_overrides(preprocessor, max_pixels)
    per_tile = 4  # the tiny tower: 56-pixel tiles of 14-pixel patches, pixel-shuffled 2 x 2
    if arch == "idefics3":
        processor = Idefics3Processor(Idefics3ImageProcessorPil.from_pretrained(model, **overrides), tokenizer,
                                      image_seq_len=per_tile)
        return processor(text=text, images=[images])["input_ids"][0]
    tiles = SmolVLMImageProcessorPil.from_pretrained(model, **overrides)(images=images, return_row_col_info=True)
    for rows, cols in zip(tiles["rows"][0], tiles["cols"][0], strict=True):
        text = text.replace("<image>", get_image_prompt_string(
            rows, cols, per_tile, "<fake_token_around_image>", "<image@>", "<global-img>"), 1)
    return tokenizer(text.replace("<image@>", "<image>"))["input_ids"]


@pytest.mark.parametrize("sizes", [SIZES[:1], SIZES], ids=["one-image", "two-images"])
@pytest.mark.parametrize("max_pixels", [None, 56 * 56], ids=["split", "whole"])
def test_the_input_ids_are_the_processors_own(tmp_path, tiny, sizes, max_pixels):
    arch, model = tiny
    data = _data(tmp_path, sizes)
    ids, labels = _built(model, data, max_pixels)
    reference = _reference(arch, model, data, max_pixels)
    assert ids == reference
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    row_1_col_1 = tokenizer.convert_tokens_to_ids("<row_1_col_1>")
    assert (row_1_col_1 in ids) == (max_pixels is None)  # split into tiles, or the whole image alone
    trained = [t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX]
    assert tokenizer.decode(trained) == " It is blue.<end_of_utterance>"  # the answer alone: no marker trains


@pytest.mark.parametrize("max_pixels", [None, 56 * 56])
def test_the_planner_counts_the_tokens_the_data_build_writes(tmp_path, tiny, max_pixels):
    """The torch-free counter (from the header's size) and the plan's count (from its grid) equal the tokens
    each image adds to the built input, markers and newlines included."""
    from transformers import AutoConfig, AutoTokenizer

    from finetune.data.image_tokens import image_tokens
    from finetune.plan.vision import image_tokens as planned_tokens
    from finetune.plan.vision import planned_grids, processor_config

    _, model = tiny
    data = _data(tmp_path, SIZES)
    ids, _ = _built(model, data, max_pixels)
    tokenizer = AutoTokenizer.from_pretrained(model)
    text = tokenizer.apply_chat_template([
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What colour is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "It is blue."}]}], tokenize=False)
    written = tokenizer(text, add_special_tokens=False)["input_ids"]  # one <image> per picture
    preprocessor = processor_config(str(model))  # with processor_config.json's image_seq_len: 4 per tile
    counted = [image_tokens(preprocessor, w, h, max_pixels) for w, h in SIZES]
    config = AutoConfig.from_pretrained(model)
    planned = [planned_tokens(config, g) for g in planned_grids(config, str(model), SIZES, max_pixels)]
    assert counted == planned
    assert len(ids) == len(written) - len(SIZES) + sum(planned)


def test_text_only_turns_reach_a_template_that_reads_content_parts(tmp_path, tiny):
    """SmolVLM's published chat template renders a plain-string content as nothing: a text-only record mixed in
    with image records, and a prompt without an image, reach it as text parts, so their words are read and the
    answer trains."""
    from transformers import AutoConfig, AutoTokenizer

    from finetune.data import build_datasets
    from finetune.model.chat import build_prompt
    from finetune.model.vision import vision_data

    _, model = tiny
    data = _data(tmp_path, SIZES[:1])
    records = json.loads(data.read_text()) + [{"messages": [
        {"role": "user", "content": "What is two and two?"}, {"role": "assistant", "content": "Four."}]}]
    data.write_text(json.dumps(records))
    tokenizer = AutoTokenizer.from_pretrained(model)
    vision = vision_data(AutoConfig.from_pretrained(model), model, tokenizer)
    rows = build_datasets(DataConfig(path=str(data), max_seq_len=512, validation_split=0.0), tokenizer, 0, "sft",
                          None, vision).train
    text_row = next(r for r in rows if not r.get("images"))
    assert "What is two and two?" in tokenizer.decode(text_row["input_ids"])
    trained = [t for t, label in zip(text_row["input_ids"], text_row["labels"], strict=True) if label != IGNORE_INDEX]
    assert tokenizer.decode(trained) == " Four.<end_of_utterance>"
    prompt = build_prompt(tokenizer, [{"role": "user", "content": "What is two and two?"}])
    assert prompt == "<|im_start|>User: What is two and two?<end_of_utterance>\nAssistant:"
