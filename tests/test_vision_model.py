"""Vision-language families: the whole checkpoint loads (vision tower and projector in 16 bits, the language
model quantized), `adapter.vision` says what of the vision part trains, records' images become the image
processor's tokens with no loss on them, a full-size Qwen2.5-VL plans with the images of its data, and a
vision-language architecture no family describes is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from finetune.cli import main
from finetune.data.chat import IGNORE_INDEX
from finetune.recipe.schema import AdapterConfig, DataConfig, ModelConfig, QuantizationConfig
from finetune.testing import VISION_ARCHITECTURES, vision_model, vision_tokenizer

ROOT = Path(__file__).resolve().parents[1]
QWEN_VL_3B = ROOT / "tests" / "fixtures" / "configs" / "qwen2.5-vl-3b.json"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return vision_model("qwen2_5_vl", tmp_path_factory.mktemp("vlm") / "model")


def _pictures(folder: Path, sizes: list[tuple[int, int]], per_record: int = 1) -> Path:
    from PIL import Image

    rows = []
    for i, size in enumerate(sizes):
        names = []
        for j in range(per_record):
            Image.new("RGB", size, (40 * i % 255, 90, 160)).save(folder / f"{i}-{j}.png")
            names.append(f"{i}-{j}.png")
        rows.append({"messages": [{"role": "user", "content": "<image>" * per_record + "Describe it."},
                                  {"role": "assistant", "content": "A plain colour."}], "images": names})
    path = folder / "pictures.json"
    path.write_text(json.dumps(rows))
    return path


def _loaded(vlm: Path, bits: int | None, vision: str):
    from finetune.model.adapter import apply_adapter
    from finetune.model.load import load_model

    model, _, _ = load_model(ModelConfig(path=str(vlm)), QuantizationConfig(bits=bits))
    return apply_adapter(model, AdapterConfig(r=4, vision=vision), checkpointing=False)


@pytest.mark.parametrize("vision", ["frozen", "lora", "full"])
def test_the_language_model_is_quantized_and_adapter_vision_says_what_trains(vlm, vision):
    import bitsandbytes as bnb

    model = _loaded(vlm, 4, vision)
    quantized = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert quantized and all(".language_model." in n for n in quantized)  # the vision tower stays 16-bit
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    in_vision = [n for n in trained if ".visual." in n]
    assert any(".language_model." in n and "lora_" in n for n in trained)
    if vision == "frozen":
        assert in_vision == []
    elif vision == "lora":
        assert in_vision and all("lora_" in n for n in in_vision)
    else:  # the vision tower's own weights (peft's modules_to_save: trained and saved with the adapter)
        assert any(n.endswith("patch_embed.proj.weight") for n in in_vision)
        assert not any("lora_" in n for n in in_vision)


def test_full_fine_tuning_keeps_a_frozen_vision_tower(vlm):
    from finetune.model.adapter import apply_adapter
    from finetune.model.load import load_model

    model, _, _ = load_model(ModelConfig(path=str(vlm)), QuantizationConfig(bits=None))
    model = apply_adapter(model, AdapterConfig(type="full"), checkpointing=False)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".visual." in n for n in frozen)
    assert frozen == {n for n, _ in model.named_parameters() if ".visual." in n}


def _trained_on_a_picture(tmp_path: Path, arch: str, vision: str = "frozen"):
    """A tiny model of `arch` with LoRA (adapter.vision `vision`) and checkpointing as a run builds it, in train
    mode, and a batch of two records with an 84 x 56 picture each."""
    from transformers import AutoConfig, AutoTokenizer

    from finetune.data import build_datasets
    from finetune.model.adapter import apply_adapter
    from finetune.model.load import load_model
    from finetune.model.vision import vision_data
    from finetune.step.training_step import enable_checkpointing

    folder = vision_model(arch, tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    images = vision_data(AutoConfig.from_pretrained(folder), folder, tokenizer)
    bundle = build_datasets(DataConfig(path=str(_pictures(tmp_path, [(84, 56), (56, 84)])), max_seq_len=128),
                            tokenizer, 0, "sft", None, images)
    model, _, _ = load_model(ModelConfig(path=str(folder)), QuantizationConfig(bits=None))
    model = apply_adapter(model, AdapterConfig(r=4, vision=vision, dropout=0.0), checkpointing=True)
    enable_checkpointing(model, True, 1)
    model.train()
    return model, bundle.collator([bundle.train[0], bundle.train[1]])


@pytest.mark.parametrize("vision", ["frozen", "lora", "full"])
@pytest.mark.parametrize("arch", list(VISION_ARCHITECTURES))
def test_a_frozen_vision_tower_keeps_nothing_for_backward_and_a_trained_one_gets_gradients(tmp_path, arch, vision):
    """transformers' activation_checkpointing_enable makes every sub-model's input embedding output require
    grad, the vision tower's patch embedding too, which would keep a frozen tower's activations (gigabytes at
    full size) for a backward that reaches no trained weight: frozen, the tower saves nothing and the language
    model does; lora or full, the tower keeps its graph and its trained weights get gradients."""
    from finetune.model.family import vision_parts
    from finetune.model.vision import in_vision

    model, batch = _trained_on_a_picture(tmp_path, arch, vision)
    where, saved = ["text"], {"vision": 0, "text": 0}
    parts = vision_parts(model).values()
    for part in parts:
        part.register_forward_pre_hook(lambda *_: where.__setitem__(0, "vision"))
        part.register_forward_hook(lambda *_: where.__setitem__(0, "text"))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.requires_grad:  # an activation of a recorded graph, kept for backward
            saved[where[0]] += tensor.numel()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch).loss.backward()
    assert saved["text"] > 0, saved
    language = [p for n, p in model.named_parameters() if "lora_" in n and not in_vision(n)]
    assert language and all(p.grad is not None for p in language)  # mllama: its cross-attention's LoRA too
    trained = [(n, p) for part in parts for n, p in part.named_parameters() if p.requires_grad]
    if vision == "frozen":
        assert saved["vision"] == 0 and trained == [], saved
    else:
        assert saved["vision"] > 0 and trained, saved
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for _, p in trained)


@pytest.mark.parametrize("arch", list(VISION_ARCHITECTURES))
def test_the_chunked_loss_sees_the_images(tmp_path, arch):
    """memory.chunked_loss runs the whole model (vision tower, projector, language model) and only then the head
    in chunks: the loss and every gradient equal the model's own loss's, images included (a vision-language
    model's decoder alone is its language model, which would ignore the pixels)."""
    from finetune.step.training_step import compute_loss

    model, batch = _trained_on_a_picture(tmp_path, arch)
    results = []
    for chunked in (False, True):
        loss = compute_loss(model, batch, chunked_loss=chunked)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        results.append((loss.detach(), grads))
    (plain, plain_grads), (chunked, chunked_grads) = results
    torch.testing.assert_close(chunked, plain, rtol=1e-4, atol=1e-5)
    assert chunked_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-3, atol=1e-6, msg=name)


def test_each_image_becomes_its_processor_tokens_without_loss(tmp_path, vlm):
    """Two images of different sizes in one record: each image token repeated grid_t*grid_h*grid_w/4 times
    (the processor's image_grid_thw, merged 2x2), no label on them, and the collated batch carries the pixel
    values of exactly those patches."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2VLImageProcessorPil

    from finetune.data import build_datasets
    from finetune.model.vision import vision_data

    data = _pictures(tmp_path, [(84, 56)], per_record=1)
    rows = json.loads(data.read_text())
    from PIL import Image

    Image.new("RGB", (56, 112), (0, 0, 0)).save(tmp_path / "tall.png")
    rows[0]["messages"][0]["content"] = "<image>Compare with <image>."
    rows[0]["images"] = ["0-0.png", "tall.png"]
    data.write_text(json.dumps(rows))
    tokenizer = AutoTokenizer.from_pretrained(vlm)
    vision = vision_data(AutoConfig.from_pretrained(vlm), vlm, tokenizer)
    bundle = build_datasets(DataConfig(path=str(data), max_seq_len=128), tokenizer, 0, "sft", None, vision)
    row = bundle.train[0]
    grids = Qwen2VLImageProcessorPil.from_pretrained(vlm)(
        images=[Image.open(tmp_path / "0-0.png"), Image.open(tmp_path / "tall.png")], return_tensors="pt")["image_grid_thw"]
    expected = sum(int(g.prod()) // 4 for g in grids)
    image = vision.image_token_id
    assert sum(t == image for t in row["input_ids"]) == expected
    assert all(label == IGNORE_INDEX for t, label in zip(row["input_ids"], row["labels"], strict=True) if t == image)
    batch = bundle.collator([row])
    assert torch.equal(batch["image_grid_thw"], grids)
    assert batch["pixel_values"].shape[0] == int(grids.prod(-1).sum())
    assert torch.equal(batch["mm_token_type_ids"].bool(), batch["input_ids"] == image)


def test_more_image_markers_than_images_is_a_bad_record(tmp_path, vlm):
    from transformers import AutoConfig, AutoTokenizer

    from finetune.data import build_datasets
    from finetune.errors import DataError
    from finetune.model.vision import vision_data

    data = _pictures(tmp_path, [(84, 56), (84, 56)])
    rows = json.loads(data.read_text())
    rows[1]["messages"][0]["content"] = "<image><image>Two?"
    data.write_text(json.dumps(rows))
    tokenizer = AutoTokenizer.from_pretrained(vlm)
    vision = vision_data(AutoConfig.from_pretrained(vlm), vlm, tokenizer)
    with pytest.raises(DataError) as exc:
        build_datasets(DataConfig(path=str(data), max_seq_len=128), tokenizer, 0, "sft", None, vision)
    assert "record 1" in str(exc.value.problems) and "'images' lists 1" in str(exc.value.problems)  # vl-data's reader


def _plan_recipe(tmp_path: Path, data: Path, **data_keys) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": str(QWEN_VL_3B)}, "quantization": {"bits": 4}, "adapter": {"type": "lora", "r": 16},
        "data": {"path": str(data), "max_seq_len": 4096, **data_keys}, "training": {"micro_batch_size": 1},
        "memory": {"chunked_loss": True, "tiled_mlp": False, "gpu_memory": "24GiB", "activation_checkpointing": True},
        "output": {"dir": str(tmp_path / "run")}}))
    return path


def test_a_full_size_qwen2_5_vl_plans_with_its_datas_images(tmp_path):
    """Qwen2.5-VL-3B from its published config.json: the vision tower's weights are priced in 16 bits, and the
    plan grows with the pixels of the data's largest record (the vision tower traced with them)."""
    from finetune import api

    small, large = tmp_path / "small", tmp_path / "large"
    small.mkdir()
    large.mkdir()
    plans = {}
    for folder, size in ((small, (448, 448)), (large, (1344, 1008))):
        recipe = api.load_recipe(_plan_recipe(folder, _pictures(folder, [size, (64, 64)])))
        plans[size] = api.plan(recipe)
    plain = api.plan(api.load_recipe(_plan_recipe(tmp_path, ROOT / "recipes" / "data" / "quickstart.jsonl")))
    small_plan, large_plan = plans[(448, 448)], plans[(1344, 1008)]
    assert small_plan.breakdown["activations"] < large_plan.breakdown["activations"]
    # the image records' sequence is their image tokens and text, not max_seq_len (text data: max_seq_len)
    assert small_plan.vision["sequence"] < large_plan.vision["sequence"] < plain.vision["sequence"] == 4096
    assert small_plan.peak_bytes < plain.peak_bytes
    # the 32-block vision tower and merger: about 670M parameters, in bf16 (never quantized), within the weights
    assert plain.vision["vision_weights"] == pytest.approx(2 * 670e6, rel=0.02)
    assert plain.breakdown["weights"] > plain.vision["vision_weights"]
    # 448 x 448 pixels: 32 x 32 patches of 14, merged 2 x 2: 256 tokens (the other image, 64 x 64, is smaller)
    assert small_plan.vision["images"] == 1 and small_plan.vision["image_tokens"] == 256
    assert plain.vision["images"] == 0


def test_max_pixels_auto_is_the_largest_image_budget_whose_plan_fits(tmp_path):
    """data.max_pixels: auto tries the budgets largest first, none above the model's own limit (its
    preprocessor_config.json), and takes the first whose plan fits: between the peaks of two budgets, the
    smaller one."""
    from finetune import api
    from finetune.plan.search import pixel_budgets
    from finetune.plan.trace import planned_config

    model = vision_model("qwen2_5_vl", tmp_path / "model")
    processor = json.loads((model / "preprocessor_config.json").read_text())
    processor["max_pixels"] = processor["size"]["longest_edge"] = 1024 * 28 * 28
    (model / "preprocessor_config.json").write_text(json.dumps(processor))
    data = _pictures(tmp_path, [(1000, 1000)])

    def recipe(pixels, gpu_memory="24GiB"):
        path = _plan_recipe(tmp_path, data, max_pixels=pixels, max_seq_len=1100)
        values = yaml.safe_load(path.read_text())
        values["model"]["path"] = str(model)
        values["memory"]["gpu_memory"] = gpu_memory
        values["memory"]["gpu_memory_margin"] = 0
        path.write_text(yaml.safe_dump(values))
        return api.load_recipe(path)

    budgets = pixel_budgets(recipe("auto"), planned_config(str(model)))
    assert budgets == [1024 * 784, 512 * 784, 256 * 784]
    peaks = [api.plan(recipe(b)).peak_bytes for b in budgets]
    assert peaks[0] > peaks[1] > peaks[2]  # fewer pixels: fewer image tokens through the vision tower
    assert api.plan(recipe("auto")).settings["max_pixels"] == budgets[0]
    tight = api.plan(recipe("auto", gpu_memory=str((peaks[0] + peaks[1]) // 2)))
    assert tight.fits and tight.settings["max_pixels"] == budgets[1], peaks


@pytest.mark.parametrize("name", ["smolvlm-256m", "smolvlm-2.2b"])
def test_a_full_size_smolvlm_plans_its_tiles_and_vision_tower(tmp_path, name):
    """SmolVLM from its published config.json (Idefics3's layout): the plan traces the vision tower over every
    tile of the data's longest image record (in image tokens) plus the whole image (the real image processor's tile count, each tile the
    tower's patches pixel-shuffled into the text), and prices the SigLIP tower and connector in 16 bits."""
    from PIL import Image
    from transformers import AutoConfig, AutoModelForImageTextToText, Idefics3ImageProcessorPil
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    from finetune import api

    config_file = ROOT / "tests" / "fixtures" / "configs" / f"{name}.json"
    published = json.loads(config_file.read_text())
    data = _pictures(tmp_path, [(1344, 1008), (64, 64)])
    path = _plan_recipe(tmp_path, data)
    values = yaml.safe_load(path.read_text())
    values["model"]["path"] = str(config_file)
    path.write_text(yaml.safe_dump(values))
    plan = api.plan(api.load_recipe(path))
    vision = published["vision_config"]
    side = vision["image_size"]
    processor = Idefics3ImageProcessorPil(size={"longest_edge": 4 * side}, max_image_size={"longest_edge": side})
    # the record with the most image tokens is traced: Idefics3 resizes the longest edge up to its size, so the
    # 64 x 64 picture is more tiles than the 1344 x 1008 one
    outs = [processor(images=[Image.open(tmp_path / f"{i}-0.png")], return_tensors="pt", return_row_col_info=True)
            for i in range(2)]
    per_tile = (side // vision["patch_size"]) ** 2 // published["scale_factor"] ** 2

    def tokens(out: dict) -> int:  # the processor's text for the image's tiles, tokenized
        text = get_image_prompt_string(out["rows"][0][0], out["cols"][0][0], per_tile, "<fake_token_around_image>",
                                       "<image>", "<global-img>")
        return len(vision_tokenizer("idefics3")(text).input_ids)
    out = max(outs, key=tokens)
    assert plan.vision["images"] == 1 and plan.vision["image_tokens"] == tokens(out)
    assert out["pixel_values"].shape[1] == out["rows"][0][0] * out["cols"][0][0] + 1  # traced: the tiles, the whole
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(config_file))
    tower = sum(p.numel() for part in (model.model.vision_model, model.model.connector) for p in part.parameters())
    assert plan.vision["vision_weights"] == 2 * tower
    assert plan.fits and plan.breakdown["activations"] > 0


@pytest.mark.parametrize("model_type, arch, vision, text, why", [
    ("llava", "LlavaForConditionalGeneration", "clip_vision_model", "llama", "no family describes"),
])
def test_a_vision_language_architecture_no_family_trains_is_one_line(tmp_path, capsys, model_type, arch, vision, text,
                                                                     why):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": model_type, "architectures": [arch],
                                  "vision_config": {"model_type": vision}, "text_config": {"model_type": text}}))
    recipe = _plan_recipe(tmp_path, ROOT / "recipes" / "data" / "quickstart.jsonl")
    recipe.write_text(recipe.read_text().replace(str(QWEN_VL_3B), str(tmp_path)))
    assert main(["plan", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert arch in err and "vision-language" in err and why in err and "qwen2_5_vl" in err and "idefics3" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2  # the line and its hint


def test_smolvlm_images_become_their_tiles_tokens_within_the_pixel_budget(tmp_path):
    """Idefics3 / SmolVLM: an image is its tiles plus the whole image, each tile the tower's patches
    pixel-shuffled (4 image tokens per 56-pixel tile here) after its markers; data.max_pixels narrows the long side
    to whole tiles, so a one-tile budget leaves the whole image alone, as the real image processor resizes it."""
    from PIL import Image
    from transformers import AutoConfig, AutoTokenizer, Idefics3ImageProcessorPil

    from finetune.model.vision import vision_data

    model = vision_model("idefics3", tmp_path / "model")
    Image.new("RGB", (84, 56), (200, 30, 30)).save(tmp_path / "wide.png")
    config, tokenizer = AutoConfig.from_pretrained(model), AutoTokenizer.from_pretrained(model)
    counts = []
    for pixels, edge in ((None, 112), (56 * 56, 56)):
        vision = vision_data(config, model, tokenizer, pixels)
        real = Idefics3ImageProcessorPil.from_pretrained(model, size={"longest_edge": edge})
        tiles = real(images=[Image.open(tmp_path / "wide.png")], return_tensors="pt")["pixel_values"].shape[1]
        counts.append(vision.image_tokens([str(tmp_path / "wide.png")]))
        assert vision.image_ids([str(tmp_path / "wide.png")])[0].count(vision.image_token_id) == tiles * 4, pixels
    # 2 x 2 tiles (each <fake_token_around_image><row_R_col_C> and 4 image tokens, a newline per row) and the whole
    # image ("\n\n<fake_token_around_image><global-img>", 4, <fake_token_around_image>); then the whole image alone
    assert counts == [[2 * (2 * 6 + 1) + 7], [7]]
