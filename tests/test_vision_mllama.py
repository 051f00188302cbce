"""Llama 3.2 Vision (mllama) on a tiny random model of its own config class: one `<|image|>` token per image in the
text, the image's tiles read by cross-attention layers through a per-row cross_attention_mask. It trains through
`finetune run` (images and text-only records in one batch), DPO shares the prompt's images, generate answers
about a picture, resume is exact; the vision tower stays frozen and unquantized, the cross-attention layers get
LoRA and checkpointing like the self-attention ones. (The plan within 5% of the measured peak:
tests/test_vision_train.py's per-family test.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from finetune import api
from finetune.cli import main
from finetune.rundir import read_jsonl
from finetune.testing import vision_model
from tests.run_support import run_plan
from tests.test_vision_train import _measured, assert_resume_exact, preference_data, recipe, shapes_data

QUESTION = "What colour is the picture?"


@pytest.fixture(scope="module")
def mllama(tmp_path_factory) -> Path:
    return vision_model("mllama", tmp_path_factory.mktemp("mllama") / "model")


def mixed_data(folder: Path, n: int = 8) -> Path:
    """`n` picture records (shapes_data's) and as many text-only ones, alternating: every batch of two mixes a
    row with an image and a row without."""
    pictures = json.loads(shapes_data(folder, n).read_text())
    texts = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                           {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(n)]
    path = folder / "mixed.json"
    path.write_text(json.dumps([r for pair in zip(pictures, texts, strict=True) for r in pair]))
    return path


def _build(model: Path, data: Path, method: str = "sft", max_pixels: int | None = None):
    from transformers import AutoConfig, AutoTokenizer

    from finetune.data import build_datasets
    from finetune.model.vision import vision_data
    from finetune.recipe.schema import DataConfig

    tokenizer = AutoTokenizer.from_pretrained(model)
    vision = vision_data(AutoConfig.from_pretrained(model), model, tokenizer, max_pixels)
    return build_datasets(DataConfig(path=str(data), max_seq_len=64), tokenizer, 0, method, None, vision), vision


def _run_losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def test_a_row_without_an_image_shares_a_batch_with_a_row_that_has_one(tmp_path, mllama):
    """One <|image|> token per image, no loss on it; the image row carries its tiles as the Pillow processor makes
    them and reads them from its token on (cross_attention_mask), so another picture changes its logits; the
    text-only row gets an empty image and a mask that reads nothing, so its logits do not depend on the other
    row's picture; a batch of text alone has no image inputs (the model skips its cross-attention layers).
    (transformers adds the cross-attention output to tokens before an image token too, where Meta's reference
    code masks it: huggingface/transformers#39379.)"""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, MllamaImageProcessorPil

    bundle, vision = _build(mllama, mixed_data(tmp_path, 2))
    (picture, green), text = ([e for e in bundle.train if e.get("images")],
                              next(e for e in bundle.train if not e.get("images")))
    batch = bundle.collator([picture, text])
    ids = batch["input_ids"]
    image_at = (ids[0] == vision.image_token_id).nonzero().flatten().tolist()
    assert len(image_at) == 1 and not (ids[1] == vision.image_token_id).any()
    assert int(batch["labels"][0, image_at[0]]) == -100
    real = MllamaImageProcessorPil.from_pretrained(mllama)(images=[[Image.open(picture["images"][0])]],
                                                           return_tensors="pt")
    assert batch["pixel_values"].shape == (2, 1, 2, 3, 56, 56)  # rows, images, the tower's 2 tiles, pixels
    assert torch.equal(batch["pixel_values"][0], real["pixel_values"][0])
    assert torch.equal(batch["aspect_ratio_ids"][0], real["aspect_ratio_ids"][0])
    assert not batch["pixel_values"][1].any() and int(batch["aspect_ratio_ids"][1, 0]) == 0  # padding: no image
    tiles = int(real["num_tiles"][0][0])
    reads = batch["cross_attention_mask"][0, :, 0]  # [tokens, tiles]: which tokens read the image's tiles
    assert not reads[:image_at[0]].any() and reads[image_at[0]:, :tiles].all() and not reads[:, tiles:].any()
    assert not batch["cross_attention_mask"][1].any()
    assert set(bundle.collator([text])) == {"input_ids", "labels", "attention_mask"}
    other = bundle.collator([green, text])  # the other picture in the first row
    model = AutoModelForImageTextToText.from_pretrained(mllama).eval()
    with torch.no_grad():
        first, second = model(**batch).logits, model(**other).logits
    answer = int((batch["labels"][0] != -100).nonzero()[0])  # the prompt before it: the same tokens in both rows
    assert torch.equal(ids[0, :answer], other["input_ids"][0, :answer])
    assert not torch.allclose(first[0, image_at[0]:answer], second[0, image_at[0]:answer])  # the picture is read
    n = int(batch["attention_mask"][1].sum())  # the text row's own tokens
    assert torch.allclose(first[1, :n], second[1, :n], atol=1e-5)


def test_max_pixels_narrows_the_tiles_and_the_model_still_gets_its_own(tmp_path, mllama):
    """data.max_pixels of one tile's pixels: the processor tiles a wide picture once instead of twice; the batch
    still holds the tower's two tiles per image (the second empty) and numbers the arrangement as the model's
    own list does, so the same vision tower reads it."""
    from transformers.models.mllama.image_processing_pil_mllama import get_all_supported_aspect_ratios

    data = shapes_data(tmp_path, 1, size=(112, 56))
    batches = [_build(mllama, data, max_pixels=pixels)[0] for pixels in (None, 56 * 56)]
    full, narrow = (b.collator([b.train[0]]) for b in batches)
    assert full["pixel_values"].shape == narrow["pixel_values"].shape == (1, 1, 2, 3, 56, 56)
    arrangements = get_all_supported_aspect_ratios(2)
    assert arrangements[int(full["aspect_ratio_ids"][0, 0]) - 1] == (1, 2)  # one row of two tiles
    assert arrangements[int(narrow["aspect_ratio_ids"][0, 0]) - 1] == (1, 1)
    assert narrow["aspect_ratio_mask"][0, 0].tolist() == [1, 0] and not narrow["pixel_values"][0, 0, 1].any()
    assert narrow["cross_attention_mask"][0, :, 0, 1].sum() == 0 and full["cross_attention_mask"][0, -1, 0].tolist() == [1, 1]


@pytest.mark.parametrize("vision", ["frozen", "lora", "full"])
def test_the_cross_attention_layers_get_lora_and_checkpointing_and_the_tower_stays_16_bit(mllama, vision):
    """QLoRA: every decoder layer, the cross-attention one too, is found by the layer discovery and
    checkpointed, its projections in 4 bits with LoRA beside them; the vision tower and projector are never
    quantized, frozen unless adapter.vision says lora or full."""
    import bitsandbytes as bnb

    from finetune.model.adapter import apply_adapter
    from finetune.model.family import decoder_layers, vision_parts
    from finetune.model.load import load_model
    from finetune.recipe.schema import AdapterConfig, ModelConfig, QuantizationConfig
    from finetune.step.training_step import enable_checkpointing

    model, _, _ = load_model(ModelConfig(path=str(mllama)), QuantizationConfig(bits=4))
    model = apply_adapter(model, AdapterConfig(r=4, vision=vision), checkpointing=True)
    enable_checkpointing(model, True, 1)
    layers = decoder_layers(model)
    assert [type(layer).__name__ for layer in layers] == [
        "MllamaSelfAttentionDecoderLayer", "MllamaCrossAttentionDecoderLayer", "MllamaSelfAttentionDecoderLayer"]
    assert all(layer.gradient_checkpointing for layer in layers)
    cross = layers[1].cross_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert isinstance(getattr(cross, name).base_layer, bnb.nn.Linear4bit) and "default" in getattr(cross, name).lora_A
    parts = vision_parts(model)
    assert {n.rsplit(".", 1)[-1] for n in parts} == {"vision_model", "multi_modal_projector"}
    for part in parts.values():
        assert not any(isinstance(m, bnb.nn.Linear4bit) for m in part.modules())
        trained = [n for n, p in part.named_parameters() if p.requires_grad]
        if vision == "frozen":
            assert trained == []
        else:  # lora: LoRA beside the tower's Linear layers; full: its own weights (peft's modules_to_save)
            assert trained and all(("lora_" in n) == (vision == "lora") for n in trained)


def test_mllama_trains_on_mixed_batches_and_the_loss_falls(tmp_path, mllama):
    path = recipe(tmp_path, mllama, mixed_data(tmp_path, 4),
                  training={"max_steps": 12, "learning_rate": 1e-2, "micro_batch_size": 8})
    assert main(["run", str(path)]) == 0
    stats = json.loads((tmp_path / "run" / "data_stats.json").read_text())
    assert stats["train_examples"] == 8 and stats["images"] == 4
    losses = _run_losses(tmp_path / "run")
    assert losses[-1] < 0.5 * losses[0], losses
    seen = run_plan(tmp_path / "run")
    assert seen is not None and abs(seen["peak_bytes"] / _measured(tmp_path / "run") - 1) <= 0.05


def test_dpo_on_images_shares_the_prompts_pictures_and_plans_within_5_percent(tmp_path, mllama):
    bundle, vision = _build(mllama, preference_data(tmp_path, 2), "dpo")
    batch = bundle.collator([bundle.train[0], bundle.train[1]])  # chosen, chosen, rejected, rejected
    assert batch["pixel_values"].shape[0] == 4
    assert torch.equal(batch["pixel_values"][0], batch["pixel_values"][2])
    assert not torch.equal(batch["pixel_values"][0], batch["pixel_values"][1])
    assert [int((row == vision.image_token_id).sum()) for row in batch["input_ids"]] == [1, 1, 1, 1]
    path = recipe(tmp_path, mllama, preference_data(tmp_path), training={"method": "dpo"},
                  memory={"chunked_loss": False})
    assert main(["run", str(path)]) == 0
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 3 and all("rewards/margins" in r for r in rows)
    seen = run_plan(tmp_path / "run")
    assert seen is not None and abs(seen["peak_bytes"] / _measured(tmp_path / "run") - 1) <= 0.05


def test_resume_is_exact_generate_answers_about_an_image_and_export(tmp_path, mllama, capsys):
    """2 steps + --resume to 4 equal 4 straight; `finetune generate RUN --image`: several new tokens, each step
    reading the picture (the model extends the cross_attention_mask per step), the API's answer; GGUF export
    refused in one line, merged safetensors answer as the run does."""
    from transformers import AutoModelForImageTextToText

    from finetune.model.chat import prompt_inputs, user_turn
    from finetune.model.trained import load_trained, vision_of

    assert_resume_exact(tmp_path, mllama)
    capsys.readouterr()
    image = tmp_path / "images" / "0.png"
    run_dir = tmp_path / "straight"
    assert main(["generate", str(run_dir), "--prompt", QUESTION, "--image", str(image), "--max-new-tokens", "5"]) == 0
    answer = capsys.readouterr().out.strip()
    assert answer == api.generate(run_dir, QUESTION, image=image, max_new_tokens=5).strip()
    model, tokenizer = load_trained(run_dir, quantize=False)
    vision = vision_of(run_dir, model, tokenizer)
    assert len(answer) > 3 and answer == _greedy_without_cache(run_dir, image, 5), answer
    assert main(["export", str(run_dir), "--out", str(tmp_path / "gguf"), "--format", "gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert "llama.cpp has no Llama 3.2 Vision support" in err and "Traceback" not in err
    assert main(["export", str(run_dir), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged").eval()
    assert (tmp_path / "merged" / "preprocessor_config.json").is_file()
    inputs = dict(prompt_inputs(tokenizer, [user_turn(QUESTION, image)], None, vision))
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, model(**inputs).logits, rtol=1e-4, atol=1e-4)


def _greedy_without_cache(run_dir: Path, image: Path, steps: int) -> str:
    """The greedy answer from whole forwards over the growing sequence, each new token reading the picture as
    the last prompt token does: what generate's cached steps (which extend cross_attention_mask) must give."""
    from finetune.model.chat import prompt_inputs, user_turn
    from finetune.model.trained import load_trained, vision_of

    model, tokenizer = load_trained(run_dir)
    inputs = dict(prompt_inputs(tokenizer, [user_turn(QUESTION, image)], None, vision_of(run_dir, model, tokenizer)))
    new: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(**inputs).logits[0, -1].argmax())
            new.append(token)
            if token == tokenizer.eos_token_id:
                break
            inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([[token]])], 1)
            inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
            mask = inputs["cross_attention_mask"]
            inputs["cross_attention_mask"] = torch.cat([mask, mask[:, -1:]], 1)
    return tokenizer.decode(new, skip_special_tokens=True).strip()


def test_the_full_size_model_plans_its_tower_over_every_tile(tmp_path):
    """Llama-3.2-11B-Vision from its published config.json: the vision tower and projector priced in 16 bits,
    one image token per picture, and the frozen tower's 4 tiles cost the same at every pixel budget (the tower
    always reads all 4 tile slots), so `data.max_pixels: auto` keeps the model's whole 4 tiles; text alone
    skips the cross-attention layers, a picture makes them read its 4 x 1,601 vision tokens."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from tests.test_vision_model import ROOT, _pictures, _plan_recipe

    config = ROOT / "tests" / "fixtures" / "configs" / "llama-3.2-11b-vision.json"

    def plan(name: str, pixels: int | str, pictures: bool = True):
        folder = tmp_path / name
        folder.mkdir()
        data = _pictures(folder, [(1500, 1100)]) if pictures else ROOT / "recipes" / "data" / "quickstart.jsonl"
        path = _plan_recipe(folder, data, max_pixels=pixels, max_seq_len=1024)
        values = yaml.safe_load(path.read_text())
        values["model"]["path"] = str(config)
        path.write_text(yaml.safe_dump(values))
        return api.plan(api.load_recipe(path))

    chosen, one_tile, text = plan("auto", "auto"), plan("one-tile", 560 * 560), plan("text", "auto", False)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(config))
    tower = sum(p.numel() for part in (model.model.vision_model, model.model.multi_modal_projector)
                for p in part.parameters())
    assert chosen.vision == {"vision_weights": 2 * tower, "images": 1, "image_tokens": 1,
                             "sequence": chosen.vision["sequence"]}
    assert chosen.settings["max_pixels"] == 4 * 560 * 560 and chosen.fits
    assert one_tile.peak_bytes == chosen.peak_bytes
    assert text.vision["images"] == 0 and text.breakdown["activations"] < chosen.breakdown["activations"]


def test_the_planner_prices_the_cross_attention_layers_by_their_share():
    """The planner traces cut copies (a first layer and copies of one kind above it) and weighs them by each
    kind's share: Llama-3.2-11B-Vision's 8 cross-attention layers among the 39 above its first."""
    from transformers import AutoConfig

    from finetune.model.family import CROSS, attention_kinds
    from finetune.plan.shapes import kind_variants, with_layers

    config = AutoConfig.from_pretrained(Path(__file__).parent / "fixtures" / "configs" / "llama-3.2-11b-vision.json")
    assert attention_kinds(config).count(CROSS) == 8
    variants = {len(c.text_config.cross_attention_layers) > 0: (c, w) for c, w in kind_variants(config, lambda: config)}
    assert variants[True][1] == pytest.approx(8 / 39) and variants[False][1] == pytest.approx(31 / 39)
    assert with_layers(variants[True][0], 3).text_config.cross_attention_layers == [1, 2]
    assert with_layers(variants[False][0], 3).text_config.cross_attention_layers == []


def test_two_images_in_a_record_each_read_until_the_next_and_the_plan_holds(tmp_path, mllama):
    """A wide and a tall picture in one turn: each keeps its own tile arrangement (1 x 2, 2 x 1), the tokens
    from the first image's token to the second's read the first image only, the rest the second (as
    MllamaProcessor's mask); trained through `finetune run` with the plan within 5% of the measured peak."""
    from PIL import Image
    from transformers.models.mllama.image_processing_pil_mllama import get_all_supported_aspect_ratios

    (tmp_path / "images").mkdir()
    rows = []
    for i in range(6):
        Image.new("RGB", (112, 56), (200, 20 * i, 30)).save(tmp_path / "images" / f"{i}-wide.png")
        Image.new("RGB", (56, 112), (20, 20 * i, 200)).save(tmp_path / "images" / f"{i}-tall.png")
        rows.append({"messages": [{"role": "user", "content": "<image>Compare it with <image>."},
                                  {"role": "assistant", "content": "Red, then blue."}],
                     "images": [f"images/{i}-wide.png", f"images/{i}-tall.png"]})
    data = tmp_path / "two.json"
    data.write_text(json.dumps(rows))
    bundle, vision = _build(mllama, data)
    batch = bundle.collator([bundle.train[0]])
    first, second = (batch["input_ids"][0] == vision.image_token_id).nonzero().flatten().tolist()
    arrangements = get_all_supported_aspect_ratios(2)
    assert [arrangements[int(i) - 1] for i in batch["aspect_ratio_ids"][0]] == [(1, 2), (2, 1)]
    reads = batch["cross_attention_mask"][0]  # [tokens, images, tiles]
    assert not reads[:first].any()
    assert reads[first:second, 0].all() and not reads[first:second, 1].any()
    assert reads[second:, 1].all() and not reads[second:, 0].any()
    assert main(["run", str(recipe(tmp_path, mllama, data))]) == 0
    seen = run_plan(tmp_path / "run")
    assert seen is not None and abs(seen["peak_bytes"] / _measured(tmp_path / "run") - 1) <= 0.05


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "no-checkpointing"])
def test_a_deeper_model_plans_its_cross_attention_layers_from_cut_copies(tmp_path, checkpointing):
    """Six text layers, two of them cross-attention: the plan extrapolates from 2- and 3-layer copies of each
    kind weighted by its share, within 5% of the measured peak."""
    model = vision_model("mllama", tmp_path / "model", num_hidden_layers=6, cross_attention_layers=[2, 5])
    path = recipe(tmp_path, model, shapes_data(tmp_path), memory={"activation_checkpointing": checkpointing})
    assert main(["run", str(path)]) == 0
    seen = run_plan(tmp_path / "run")
    assert seen is not None and abs(seen["peak_bytes"] / _measured(tmp_path / "run") - 1) <= 0.05


def text_data(folder: Path, n: int = 8) -> Path:
    """`n` chat records without an image."""
    path = folder / "text.json"
    path.write_text(json.dumps([{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                              {"role": "assistant", "content": f"It is {2 * i}."}]}
                                for i in range(n)]))
    return path


@pytest.mark.parametrize("data", ["text", "images"])
def test_full_fine_tuning_prices_state_for_what_the_data_runs(tmp_path, mllama, data):
    """Full fine-tuning with the tower and projector trained too: on text without images transformers skips the
    cross-attention layers and nothing runs the tower or the projector, so they get no gradient and AdamW no state;
    with images everything trains. The plan prices the optimizer state of exactly what the traced backward gives
    a gradient (equal to the measured state at the peak), and the peak within 5% either way."""
    records = text_data(tmp_path) if data == "text" else shapes_data(tmp_path, 8)
    path = recipe(tmp_path, mllama, records, adapter={"type": "full", "vision": "full"})
    assert main(["run", str(path)]) == 0
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "peak_memory_bytes" in r]
    peak = max(rows, key=lambda r: r["peak_memory_bytes"])
    seen = run_plan(tmp_path / "run")
    assert seen is not None and abs(seen["peak_bytes"] / peak["peak_memory_bytes"] - 1) <= 0.05, (seen, peak)
    state = peak["peak_memory_breakdown"]["optimizer_state"]
    assert seen["breakdown"]["optimizer_state"] == state
    # AdamW's two fp32 moments (and a step) per trained weight that got a gradient: with images every one
    trained = peak["peak_memory_breakdown"]["trainable_weights"]
    assert (state > 2 * trained) == (data == "images"), (state, trained)
