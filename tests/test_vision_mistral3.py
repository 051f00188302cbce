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

from tests.run_support import run_plan

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
    edge = {None: None, 200_000: 420, 10**9: 1540}[max_pixels]  # whole 28-pixel blocks, never above the own 1540
    assert pixel_overrides(config, max_pixels) == ({} if edge is None else {"size": {"longest_edge": edge}})


def test_a_smaller_pixel_budget_gives_fewer_image_tokens():
    from finetune.data.image_tokens import image_tokens

    config = {**MISTRAL_SMALL, "spatial_merge_size": 2}
    counts = [image_tokens(config, 4032, 3024, budget) for budget in (100_000, 400_000, 1_600_000, None)]
    assert counts == sorted(counts) and len(set(counts)) == 4
    assert counts[-1] == 42 * (55 + 1)  # 1540 x 1155 pixels: 55 blocks across, 42 rows, each row with its break


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from finetune.testing import vision_model

    return vision_model("mistral3", tmp_path_factory.mktemp("mistral3") / "model")


def _pixtral_processor_ids(model: Path, text: str, images: list[Path]) -> list[int]:
    """What transformers' PixtralProcessor makes of a rendered chat (its replace_image_token rule on the image
    processor's image_sizes, tokenized after): each [IMG] becomes rows of [IMG] x blocks + [IMG_BREAK], the
    last break [IMG_END]. The processor class itself imports torchvision, so its rule is written out here."""
    from PIL import Image
    from transformers import AutoConfig, AutoTokenizer, PixtralImageProcessorPil

    config = AutoConfig.from_pretrained(model)
    unit = config.vision_config.patch_size * config.spatial_merge_size
    sizes = PixtralImageProcessorPil.from_pretrained(model)([Image.open(p) for p in images], patch_size=unit,
                                                            return_tensors="np")["image_sizes"]
    pieces = text.split("[IMG]")
    assert len(pieces) == len(images) + 1
    out = pieces[0]
    for (height, width), after in zip(sizes, pieces[1:], strict=True):
        rows = ("[IMG]" * (int(width) // unit) + "[IMG_BREAK]") * (int(height) // unit)
        out += rows.removesuffix("[IMG_BREAK]") + "[IMG_END]" + after
    return AutoTokenizer.from_pretrained(model)(out, add_special_tokens=False)["input_ids"]


def test_input_ids_equal_what_the_pixtral_processor_writes_and_no_image_token_trains(tmp_path, model):
    """Two images of different shapes (one larger than the processor's 112-pixel edge) in one record: the data
    build's input_ids are the processor's; [IMG], [IMG_BREAK] and [IMG_END] never carry a label, the answer does;
    the collated batch has the pixels and image_sizes the model's forward takes. Generation's prompt (the same
    chat without the answer) is expanded the same way."""
    from PIL import Image
    from transformers import AutoConfig, AutoTokenizer

    from finetune.data import build_datasets
    from finetune.data.chat import IGNORE_INDEX
    from finetune.model.chat import prompt_inputs
    from finetune.model.vision import vision_data
    from finetune.recipe.schema import DataConfig

    images = [tmp_path / "wide.png", tmp_path / "tall.png"]
    Image.new("RGB", (84, 56), (200, 30, 30)).save(images[0])
    Image.new("RGB", (90, 200), (30, 30, 200)).save(images[1])  # 200 pixels tall: resized to 50 x 111
    user = [{"type": "image", "path": str(images[0])}, {"type": "text", "text": "and"},
            {"type": "image", "path": str(images[1])}, {"type": "text", "text": "What colours?"}]
    record = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "red, blue"}]}
    (tmp_path / "data.json").write_text(json.dumps([record]))
    tokenizer, config = AutoTokenizer.from_pretrained(model), AutoConfig.from_pretrained(model)
    vision = vision_data(config, model, tokenizer)
    bundle = build_datasets(DataConfig(path=str(tmp_path / "data.json"), max_seq_len=256, validation_split=0.0),
                            tokenizer, 0, "sft", None, vision)
    example = bundle.train[0]
    text = tokenizer.apply_chat_template(record["messages"], tokenize=False)
    assert example["input_ids"] == _pixtral_processor_ids(model, text, images)
    image_ids = {tokenizer.convert_tokens_to_ids(t) for t in ("[IMG]", "[IMG_BREAK]", "[IMG_END]")}
    marked = [label for tok, label in zip(example["input_ids"], example["labels"], strict=True) if tok in image_ids]
    assert len(marked) == 2 * 4 + 4 * 3 and set(marked) == {IGNORE_INDEX}  # 2 rows of 3 blocks; 4 rows of 2
    assert tokenizer.decode([t for t, label in zip(example["input_ids"], example["labels"], strict=True)
                             if label != IGNORE_INDEX]).startswith("red, blue")
    batch = bundle.collator([example])
    assert batch["image_sizes"].tolist() == [[56, 84], [112, 56]] and tuple(batch["pixel_values"].shape) == (2, 3, 112, 84)
    assert int((batch["input_ids"] == config.image_token_index).sum()) == 2 * 3 + 4 * 2

    prompt = tokenizer.apply_chat_template(record["messages"][:1], tokenize=False, add_generation_prompt=True)
    inputs = prompt_inputs(tokenizer, record["messages"][:1], None, vision)
    assert inputs["input_ids"][0].tolist() == _pixtral_processor_ids(model, prompt, images)


def test_data_max_pixels_narrows_the_images_as_the_plan_counts(tmp_path, model):
    """data.max_pixels gives the processor a shorter longest edge (whole 28-pixel blocks): the run's image
    tokens are the counter's for the image's size."""
    from PIL import Image
    from transformers import AutoConfig, AutoTokenizer

    from finetune.data.image_tokens import image_tokens
    from finetune.model.vision import vision_data
    from finetune.plan.vision import processor_config

    Image.new("RGB", (112, 70), (200, 30, 30)).save(tmp_path / "photo.png")
    config, tokenizer = AutoConfig.from_pretrained(model), AutoTokenizer.from_pretrained(model)
    counted = {**processor_config(str(model)), "spatial_merge_size": config.spatial_merge_size}
    seen = []
    for pixels in (None, 60 * 60, 28 * 28):
        tokens = vision_data(config, model, tokenizer, pixels).image_tokens([str(tmp_path / "photo.png")])
        assert tokens == [image_tokens(counted, 112, 70, pixels)], pixels
        seen += tokens
    assert seen == [3 * 5, 2 * 3, 1 * 2]  # 112 x 70: 4 x 3 blocks; a 56-pixel edge: 2 x 2; one block


def test_dpo_on_images_plans_within_5_percent(tmp_path, model):
    """DPO: the chosen and the rejected answer each see the prompt's picture; the plan of the pair step within 5%
    of the measured peak."""
    from finetune.cli import main
    from finetune.rundir import read_jsonl
    from tests.test_vision_train import preference_data, recipe

    path = recipe(tmp_path, model, preference_data(tmp_path), training={"method": "dpo"}, memory={"chunked_loss": False})
    assert main(["run", str(path)]) == 0
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len([r for r in rows if "rewards/margins" in r]) == 3
    seen = run_plan(tmp_path / "run")
    measured = max(r["peak_memory_bytes"] for r in rows if "peak_memory_bytes" in r)
    assert seen is not None and abs(seen["peak_bytes"] / measured - 1) <= 0.05, (seen["peak_bytes"], measured)


def test_generate_answers_about_an_image(tmp_path, model, capsys):
    """`finetune generate RUN --image`: the trained run reads the picture (greedy: the CLI's answer is the API's),
    and two pictures give the model different logits."""
    import torch
    from PIL import Image

    from finetune import api
    from finetune.cli import main
    from finetune.model.chat import prompt_inputs, user_turn
    from finetune.model.trained import load_trained, vision_of
    from tests.test_vision_train import recipe, shapes_data

    assert main(["run", str(recipe(tmp_path, model, shapes_data(tmp_path, n=4), training={"max_steps": 1}))]) == 0
    capsys.readouterr()
    red, blue = tmp_path / "red.png", tmp_path / "blue.png"
    Image.new("RGB", (84, 56), (220, 30, 30)).save(red)
    Image.new("RGB", (84, 56), (30, 30, 220)).save(blue)
    run = tmp_path / "run"
    assert main(["generate", str(run), "--prompt", "What colour?", "--image", str(red), "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip() == api.generate(run, "What colour?", image=red, max_new_tokens=3)
    trained, tokenizer = load_trained(run)
    vision = vision_of(run, trained, tokenizer)
    first, second = (prompt_inputs(tokenizer, [user_turn("What colour?", p)], None, vision) for p in (red, blue))
    assert torch.equal(first["input_ids"], second["input_ids"]) and first["image_sizes"].tolist() == [[56, 84]]
    with torch.no_grad():
        assert not torch.allclose(trained(**first).logits, trained(**second).logits)


@pytest.mark.parametrize("vision", ["lora", "full"])
def test_qlora_with_adapter_vision_trains_the_pixtral_tower_and_plans_within_5_percent(tmp_path, model, vision):
    """QLoRA (the language model in 4 bits, the Pixtral tower and projector not) with adapter.vision lora: LoRA
    weights inside the vision tower are saved; full: the tower's own weights, changed by training. The plan,
    which traces the same adapter, within 5% of the measured peak."""
    from safetensors.torch import load_file

    from finetune.cli import main
    from finetune.rundir import read_jsonl
    from tests.test_vision_train import recipe, shapes_data

    path = recipe(tmp_path, model, shapes_data(tmp_path), quantization={"bits": 4}, adapter={"vision": vision},
                  training={"learning_rate": 1e-2})
    assert main(["run", str(path)]) == 0
    saved = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    in_vision = [k for k in saved if ".vision_tower." in k or ".multi_modal_projector." in k]
    if vision == "lora":
        assert in_vision and all("lora_" in k for k in in_vision)
    else:
        key = next(k for k in in_vision if k.endswith("patch_conv.weight"))
        before = next(v for k, v in load_file(model / "model.safetensors").items() if k.endswith("patch_conv.weight"))
        assert not saved[key].equal(before)
    seen = run_plan(tmp_path / "run")
    measured = max(r["peak_memory_bytes"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")
                   if "peak_memory_bytes" in r)
    assert seen is not None and abs(seen["peak_bytes"] / measured - 1) <= 0.05, (seen["peak_bytes"], measured)
