"""Vision-language data: the image formats users bring normalised to text/image parts with absolute local paths,
every bad image a bad record (named, skipped and counted, or refused) found from headers before a model loads,
and the image-token counter equal to the real transformers image processors."""

from __future__ import annotations

import functools
import json
import struct
import zlib
from pathlib import Path

import pytest
import yaml
from run_support import tiny_lora_recipe

from finetune.cli import main
from finetune.data import build_datasets, preview
from finetune.data.build import check_records, record_image_sizes
from finetune.data.formats import Chat, Preference, RecordError, detect_format, images_of, normalize
from finetune.data.images import image_sizes, open_image
from finetune.errors import DataError
from finetune.recipe.schema import DataConfig
from finetune.units import cache_dir

QUESTION = {"role": "user", "content": "<image>What colour is it?"}
ANSWER = {"role": "assistant", "content": "Red."}


def picture(path: Path, size: tuple[int, int] = (40, 30), colour: str = "red") -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def noisy(path: Path, size: tuple[int, int] = (64, 64)) -> Path:
    """An image whose bytes do not compress away (so half the file is half the picture)."""
    from PIL import Image

    image = Image.frombytes("RGB", size, bytes((i * 7919) % 251 for i in range(size[0] * size[1] * 3)))
    image.save(path)
    return path


def png_header(path: Path, width: int, height: int) -> Path:
    """A PNG that declares `width` x `height` pixels (header and end only): what Pillow's lazy open reads."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
                     + chunk(b"IEND", b""))
    return path


def record(images: list, *turns: dict) -> dict:
    return {"messages": list(turns or (QUESTION, ANSWER)), "images": images}


def write(path: Path, records: list) -> Path:
    path.write_text(json.dumps(records))
    return path


# ChatML that renders content parts as vision-language templates do (an image part: its placeholder).
PARTS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
                  "{% else %}{% for p in m.content %}{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}"
                  "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% endif %}")


@pytest.fixture(scope="module")
def vlm_data(tmp_path_factory):
    """A tiny Qwen2.5-VL's tokenizer and image processor (finetune.data.vision.VisionData): what the data build
    needs to tokenize image records."""
    from transformers import AutoConfig, AutoTokenizer

    from finetune.model.vision import vision_data
    from finetune.testing import vision_model

    folder = vision_model("qwen2_5_vl", tmp_path_factory.mktemp("vlm") / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenizer, vision_data(AutoConfig.from_pretrained(folder), folder, tokenizer)


def cfg(path: Path, **kwargs) -> DataConfig:
    return DataConfig(path=str(path), **kwargs)


# ---- formats ----------------------------------------------------------------------------------------------

def test_llama_factory_markers_take_the_images_in_order_with_paths_from_the_data_files_folder(tmp_path):
    rec = record(["a.jpg", "sub/b.png"], {"role": "user", "content": "<image>Who?"},
                 {"role": "assistant", "content": "Kane."}, {"role": "user", "content": "And here<image>, now?"},
                 {"role": "assistant", "content": "Dancing."})
    chat = normalize(rec, detect_format([rec]), folder=tmp_path / "data")
    assert chat.messages == [
        {"role": "user", "content": [{"type": "image", "path": str(tmp_path / "data" / "a.jpg")},
                                     {"type": "text", "text": "Who?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Kane."}]},
        {"role": "user", "content": [{"type": "text", "text": "And here"},
                                     {"type": "image", "path": str(tmp_path / "data" / "sub" / "b.png")},
                                     {"type": "text", "text": ", now?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Dancing."}]},
    ]
    assert images_of(chat) == [str(tmp_path / "data" / "a.jpg"), str(tmp_path / "data" / "sub" / "b.png")]


def test_sharegpt_conversations_with_images_and_the_preference_variant(tmp_path):
    rec = {"conversations": [{"from": "human", "value": "<image>Colour?"}, {"from": "gpt", "value": "Red."}],
           "images": ["/abs/x.jpg"]}
    chat = normalize(rec, detect_format([rec]), folder=tmp_path)
    assert chat.messages[0]["content"][0] == {"type": "image", "path": "/abs/x.jpg"}
    pair = {"conversations": [{"from": "human", "value": "<image>Colour?"}], "chosen": {"from": "gpt", "value": "Red."},
            "rejected": {"from": "gpt", "value": "Blue."}, "images": ["x.jpg"]}
    assert detect_format([pair]) == "sharegpt_preference"
    example = normalize(pair, "sharegpt_preference", folder=tmp_path)
    assert isinstance(example, Preference) and images_of(example) == [str(tmp_path / "x.jpg")]
    assert example.chosen == [{"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]
    assert [chat.messages[0]["content"][0]["path"] for chat, _ in example.chats()] == [str(tmp_path / "x.jpg")] * 2


@pytest.mark.parametrize("part, expected", [
    ({"type": "image", "path": "p.png"}, "p.png"),
    ({"type": "image", "image": "/abs/i.png"}, "/abs/i.png"),
    ({"type": "image", "url": "file:///abs/with%20space.png"}, "/abs/with space.png"),
    ({"type": "image_url", "image_url": {"url": "u.png"}}, "u.png"),
])
def test_content_parts_name_their_image_in_each_style(tmp_path, part, expected):
    rec = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}, ANSWER]}
    chat = normalize(rec, detect_format([rec]), folder=tmp_path)
    assert chat.messages[0]["content"] == [{"type": "image", "path": str(tmp_path / expected)},
                                           {"type": "text", "text": "What is it?"}]
    assert chat.messages[1]["content"] == [{"type": "text", "text": "Red."}]  # every turn of an image record: parts


def test_trl_style_parts_without_a_source_take_the_records_images(tmp_path):
    rec = {"images": ["one.png"], "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q"}]}],
           "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "A"}]}],
           "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "B"}]}]}
    example = normalize(rec, detect_format([rec]), folder=tmp_path)
    assert images_of(example) == [str(tmp_path / "one.png")]


def test_text_only_records_are_unchanged_and_text_parts_become_their_text(tmp_path):
    plain = {"messages": [{"role": "user", "content": "Is <image> a tag?"}, ANSWER]}  # no images: plain text
    assert normalize(plain, "messages") == Chat([dict(m) for m in plain["messages"]])
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                                       {"type": "text", "text": "there"}]}, ANSWER]}
    assert normalize(parts, "messages").messages[0]["content"] == "Hello there"
    assert images_of(normalize(plain, "messages")) == [] and images_of("raw text") == []
    text = [{"role": "user", "content": "Hi"}, ANSWER]
    assert normalize({"messages": text, "images": []}, "messages") == Chat(text)  # LLaMA-Factory's text records
    with pytest.raises(RecordError, match="have 1 <image> marker"):
        normalize({"messages": [{"role": "user", "content": "<image>What?"}, ANSWER], "images": []}, "messages")


def test_a_file_mixing_image_and_text_records_is_counted_per_kind(tmp_path):
    picture(tmp_path / "red.png")
    data = write(tmp_path / "d.json", [record(["red.png"]), {"messages": [{"role": "user", "content": "Hi"}, ANSWER]},
                                       record(["red.png", "red.png"], {"role": "user", "content": "<image><image>Same?"},
                                              {"role": "assistant", "content": "Yes."})])
    assert check_records(cfg(data), model_takes_images=True) == {
        "format": "messages", "records": 3, "bad_records": 0, "images": 3, "image_records": 2}
    text_only = write(tmp_path / "t.json", [{"messages": [{"role": "user", "content": "Hi"}, ANSWER]}])
    assert check_records(cfg(text_only), model_takes_images=True) == {"format": "messages", "records": 1, "bad_records": 0}


def test_a_mix_counts_images_per_file(tmp_path):
    picture(tmp_path / "red.png")
    images = write(tmp_path / "i.json", [record(["red.png"])] * 2)
    text = write(tmp_path / "t.json", [{"messages": [{"role": "user", "content": "Hi"}, ANSWER]}])
    out = check_records(DataConfig(path=[str(images), str(text)]), model_takes_images=True)
    assert (out["images"], out["image_records"]) == (2, 2)
    assert [(f.get("images"), f.get("image_records")) for f in out["files"]] == [(2, 2), (0, 0)]


def _png_bytes(size: tuple[int, int]) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, "green").save(out, "PNG")
    return out.getvalue()


def test_images_held_in_the_data_are_stored_once_in_the_cache(tmp_path):
    import base64

    import datasets

    png = _png_bytes((12, 7))
    parts = [{"type": "image", "image": None, "text": None}, {"type": "text", "image": None, "text": "Colour?"}]
    rows = {"messages": [[{"role": "user", "content": parts},
                          {"role": "assistant", "content": [{"type": "text", "image": None, "text": "Green."}]}]],
            "images": [[{"bytes": png, "path": None}]]}
    features = datasets.Features({
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.List(
            {"type": datasets.Value("string"), "image": datasets.Value("string"), "text": datasets.Value("string")})}),
        "images": datasets.List(datasets.Image())})
    table = datasets.Dataset.from_dict(rows, features=features)  # TRL's vision datasets, as the Hub holds them
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    inline = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
        {"type": "text", "text": "Colour?"}]}, ANSWER]}
    write(tmp_path / "inline.json", [inline])
    for path in ("d.parquet", "saved", "inline.json"):
        assert record_image_sizes(cfg(tmp_path / path)) == [[(12, 7)]], path
    example = normalize(inline, "messages")
    stored, = images_of(example)
    assert Path(stored).read_bytes() == png and Path(stored).is_relative_to(cache_dir())


def test_the_planner_gets_each_good_records_image_sizes_from_headers(tmp_path, tiny_tokenizer, vlm_data):
    picture(tmp_path / "a.png", (40, 30))
    picture(tmp_path / "b.png", (17, 90))
    data = write(tmp_path / "d.json", [record(["a.png"]), {"messages": [{"role": "user", "content": "Hi"}, ANSWER]},
                                       record(["gone.png"]),
                                       record(["b.png", "a.png"], {"role": "user", "content": "<image><image>Same?"},
                                              {"role": "assistant", "content": "No."})])
    assert record_image_sizes(cfg(data, on_bad_record="skip")) == [[(40, 30)], [], [(17, 90), (40, 30)]]
    shown = preview(cfg(data, chat_template=PARTS_TEMPLATE), tiny_tokenizer, n=2, model_takes_images=True)
    assert [item.get("images") for item in shown] == [[str(tmp_path / "a.png")], None]
    tokenizer, vision = vlm_data
    bundle = build_datasets(cfg(data, on_bad_record="skip"), tokenizer, 0, vision=vision)
    assert {k: bundle.stats[k] for k in ("images", "image_records", "bad_records_skipped", "train_examples")} == {
        "images": 3, "image_records": 2, "bad_records_skipped": 1, "train_examples": 3}
    assert "(3 images in 2 records)" in bundle.summary()
    for ids, labels in zip(bundle.train["input_ids"], bundle.train["labels"], strict=True):
        trained = tiny_tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != -100])
        assert "<image>" not in trained and trained.strip().startswith(("Red.", "No."))


def test_the_real_llama_factory_sample(shared_datasets):
    path = shared_datasets / "mllm_demo.json"
    raw = json.loads(path.read_text())
    out = check_records(cfg(path), model_takes_images=True)
    assert out == {"format": "messages", "records": len(raw), "bad_records": 0,
                   "images": sum(len(r["images"]) for r in raw), "image_records": len(raw)}
    first = normalize(raw[0], "messages", folder=shared_datasets)
    assert images_of(first) == [str(shared_datasets / p) for p in raw[0]["images"]]
    sizes = image_sizes(first)
    assert sizes == [open_image(p).size for p in images_of(first)] and all(w > 0 and h > 0 for w, h in sizes)


# ---- bad images -------------------------------------------------------------------------------------------

def _file(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return path.name


def _cut(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


BAD = {  # name -> (make the record's images in tmp_path, what the message says)
    "missing": (lambda d: ["gone.jpg"], "gone.jpg does not exist"),
    "empty": (lambda d: [_file(d / "empty.png", b"")], "is empty (0 bytes)"),
    "not an image": (lambda d: [_file(d / "text.jpg", b"hello")], "is not an image Pillow can read"),
    "cut jpeg": (lambda d: [_cut(noisy(d / "cut.jpg")).name], "is cut short (a JPEG file"),
    "cut png": (lambda d: [_cut(noisy(d / "cut.png")).name], "is cut short (a PNG file"),
    "over the bomb limit": (lambda d: [png_header(d / "big.png", 10_000, 9_000).name],
                            "over Pillow's decompression-bomb limit of 89,478,485 pixels (PIL.Image.MAX_IMAGE_PIXELS): "
                            "10000x9000 = 90,000,000 pixels"),
    "twice the bomb limit": (lambda d: [png_header(d / "huge.png", 20_000, 20_000).name],
                             "over Pillow's decompression-bomb limit"),
    "no pixels": (lambda d: [png_header(d / "none.png", 0, 10).name], "is not an image Pillow can read"),
    "a URL": (lambda d: ["https://example.com/cat.jpg"], "is a URL; images must be local files"),
    "inline data that is not base64": (lambda d: ["data:text/plain,hello"], "without readable base64 image bytes"),
    "inline bytes that are not an image": (lambda d: ["data:image/png;base64,AAAA"], "is not an image Pillow can read"),
    "more markers": (lambda d: [picture(d / "ok.png").name], "have 2 <image> marker(s) or image parts without a path "
                                                            "but 'images' lists 1"),
    "fewer markers": (lambda d: [picture(d / "ok.png").name] * 3, "have 2 <image> marker(s) or image parts without "
                                                                  "a path but 'images' lists 3"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_image_is_a_bad_record_named_with_file_record_and_image(tmp_path, case):
    make, says = BAD[case]
    picture(tmp_path / "good.png")
    two = {"role": "user", "content": "<image>and<image>?"}
    bad = record(make(tmp_path), *((two, ANSWER) if "markers" in case else ()))
    data = write(tmp_path / "d.json", [record(["good.png"]), bad, record(["good.png"])])
    with pytest.raises(DataError) as refused:
        check_records(cfg(data), model_takes_images=True)
    problem, = refused.value.problems
    assert problem.startswith(f"{data} record 1: ") and says in problem, problem
    skipped = check_records(cfg(data, on_bad_record="skip"), model_takes_images=True)
    assert (skipped["bad_records"], skipped["images"], skipped["image_records"]) == (1, 2, 2)


def test_an_image_for_a_text_only_model_is_a_bad_record(tmp_path):
    picture(tmp_path / "good.png")
    data = write(tmp_path / "d.json", [record(["good.png"]), {"messages": [{"role": "user", "content": "Hi"}, ANSWER]}])
    with pytest.raises(DataError) as refused:
        check_records(cfg(data))
    assert refused.value.problems == [f"{data} record 0: has 1 image(s) but the model reads only text: train a "
                                      "vision-language model on it, or leave the image records out"]
    assert check_records(cfg(data, on_bad_record="skip"))["bad_records"] == 1


def test_a_text_model_builds_the_text_records_and_skips_the_image_ones(tmp_path, tiny_tokenizer):
    picture(tmp_path / "good.png")
    text = {"messages": [{"role": "user", "content": "Hi"}, ANSWER]}
    data = write(tmp_path / "d.json", [record(["good.png"]), text])
    mixed = build_datasets(cfg(data, on_bad_record="skip"), tiny_tokenizer, 0)
    alone = build_datasets(cfg(write(tmp_path / "t.json", [text])), tiny_tokenizer, 0)
    assert mixed.train["input_ids"] == alone.train["input_ids"] and mixed.stats["bad_records_skipped"] == 1
    assert "images" not in mixed.stats and "images" not in alone.stats  # text-only data: the stats it always had


def test_bytes_that_fail_past_a_good_header_are_named_by_the_check_and_by_open_image(tmp_path):
    path = noisy(tmp_path / "n.png")
    data = bytearray(path.read_bytes())
    start = data.index(b"IDAT") + 8
    data[start:start + 40] = bytes(40)  # the compressed pixels broken, the header and the end intact
    path.write_bytes(bytes(data))
    with pytest.raises(RecordError, match=rf"image {path} cannot be decoded"):  # the check decodes it once
        image_sizes(Chat([{"role": "user", "content": [{"type": "image", "path": str(path)}]}]))
    with pytest.raises(RecordError, match=rf"image {path} cannot be decoded"):
        open_image(str(path))


def _recipe(tmp_path: Path, model: Path, data: Path, **data_keys) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tiny_lora_recipe(model, data, tmp_path / "run", {"data": data_keys})))
    return path


def test_validate_refuses_image_records_for_a_text_model_and_counts_them_under_skip(tmp_path, tiny_model_dir, capsys):
    picture(tmp_path / "good.png")
    data = write(tmp_path / "d.json", [{"messages": [{"role": "user", "content": "Hi"}, ANSWER]}, record(["good.png"]),
                                       record(["gone.png"])])
    assert main(["validate", str(_recipe(tmp_path, tiny_model_dir, data))]) == DataError.exit_code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{data} record 1: has 1 image(s) but the model reads only text" in err.replace("\n", "")
    assert main(["validate", str(_recipe(tmp_path, tiny_model_dir, data, on_bad_record="skip"))]) == 0
    assert "3 messages records, 2 malformed to skip" in capsys.readouterr().out.replace("\n", "")


# ---- image tokens -----------------------------------------------------------------------------------------

# preprocessor_config.json as the Hub ships them (the keys that decide sizes), with the real Pillow processor.
PROCESSORS = {
    "Qwen2.5-VL": ("qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil",
                   {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 12845056,
                    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}),
    "Qwen3-VL": ("qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil",
                 {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16, "temporal_patch_size": 2,
                  "merge_size": 2, "size": {"longest_edge": 16777216, "shortest_edge": 65536}}),
    "Gemma 3": ("gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil",
                {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 896, "width": 896}}),
    "Gemma 3 pan and scan": ("gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil",
                             {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 896, "width": 896},
                              "do_pan_and_scan": True, "pan_and_scan_min_crop_size": 256,
                              "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2}),
    "Idefics3": ("idefics3.image_processing_pil_idefics3.Idefics3ImageProcessorPil",
                 {"image_processor_type": "Idefics3ImageProcessor", "size": {"longest_edge": 1456},
                  "max_image_size": {"longest_edge": 364}, "do_image_splitting": True}),
    "SmolVLM": ("smolvlm.image_processing_pil_smolvlm.SmolVLMImageProcessorPil",
                {"image_processor_type": "SmolVLMImageProcessor", "size": {"longest_edge": 2048},
                 "max_image_size": {"longest_edge": 512}}),
    "Llama 3.2 Vision": ("mllama.image_processing_pil_mllama.MllamaImageProcessorPil",
                         {"image_processor_type": "MllamaImageProcessor", "size": {"height": 560, "width": 560},
                          "max_image_tiles": 4}),
}
SIZES = [(40, 30), (640, 480), (1000, 200), (300, 1200), (1500, 1100)]


def _processor(name: str, max_pixels: int | None, folder: Path):
    """The real Pillow processor read from a model folder's preprocessor_config.json, with data.max_pixels's
    overrides, as a run loads it."""
    import importlib

    from finetune.data.image_tokens import pixel_overrides

    where, config = PROCESSORS[name]
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    module, cls = where.rsplit(".", 1)
    processor = getattr(importlib.import_module(f"transformers.models.{module}"), cls)
    return processor.from_pretrained(folder, **pixel_overrides(config, max_pixels)), config


@functools.cache
def _smolvlm_tokenizer():
    """A tokenizer that splits as SmolVLM's published one: its image markers special, "\n\n" one token."""
    from finetune.testing import vision_tokenizer

    return vision_tokenizer("smolvlm")


def _real(name: str, processor, image) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(image tokens, one image's pixel_values shape, grid) from the processor's own output."""
    import numpy as np

    tiled = name in ("Idefics3", "SmolVLM")
    out = processor(image, return_tensors="np", **({"return_row_col_info": True} if tiled else {}))
    shape = tuple(np.asarray(out["pixel_values"]).shape)
    if "image_grid_thw" in out:
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        return grid[0] * grid[1] * grid[2] // processor.merge_size ** 2, shape, grid
    if "num_crops" in out:
        return 256 * (1 + int(out["num_crops"][0])), shape, (shape[0],)
    if tiled:  # the tokens of the text the processor writes for the image's tiles
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        text = get_image_prompt_string(rows, cols, 64 if name == "SmolVLM" else 169, "<fake_token_around_image>",
                                       "<image>", "<global-img>")
        return len(_smolvlm_tokenizer()(text)["input_ids"]), shape[1:], (rows, cols)
    from transformers.models.mllama.image_processing_pil_mllama import get_all_supported_aspect_ratios

    arrangement = get_all_supported_aspect_ratios(processor.max_image_tiles)[int(out["aspect_ratio_ids"][0][0]) - 1]
    assert int(out["num_tiles"][0][0]) == arrangement[0] * arrangement[1]
    return 1, shape[2:], tuple(arrangement)


@pytest.mark.parametrize("max_pixels", [None, 200_000])
@pytest.mark.parametrize("name", list(PROCESSORS))
def test_image_tokens_equal_the_real_image_processors_output(tmp_path, name, max_pixels):
    from PIL import Image

    from finetune.data.image_tokens import image_inputs, image_tokens

    processor, config = _processor(name, max_pixels, tmp_path)
    for width, height in SIZES:
        expected = _real(name, processor, Image.new("RGB", (width, height), "red"))
        counted = image_inputs(config, width, height, max_pixels)
        assert (counted.tokens, counted.pixel_values, counted.grid) == expected, (name, width, height)
        assert image_tokens(config, width, height, max_pixels) == expected[0]


def test_max_pixels_narrows_the_processors_limit_and_never_widens_it():
    from finetune.data.image_tokens import image_tokens, pixel_overrides

    qwen = PROCESSORS["Qwen2.5-VL"][1]
    assert pixel_overrides(qwen, 10**12) == {"min_pixels": 3136, "max_pixels": 12845056}
    counts = [image_tokens(qwen, 4000, 3000, budget) for budget in (100_000, 400_000, 1_600_000, None)]
    assert counts == sorted(counts) and len(set(counts)) == 4
    assert pixel_overrides(PROCESSORS["Llama 3.2 Vision"][1], 10**12) == {"max_image_tiles": 4}
    assert pixel_overrides(PROCESSORS["Gemma 3"][1], 1000) == {}


def test_an_unknown_image_processor_is_named():
    from finetune.data.image_tokens import image_tokens
    from finetune.recipe.families import UnsupportedModel

    with pytest.raises(UnsupportedModel, match="image processor 'SiglipImageProcessor' is not one whose image tokens"):
        image_tokens({"image_processor_type": "SiglipImageProcessor"}, 10, 10, None)


def test_the_image_checks_and_counters_import_neither_torch_nor_transformers():
    import subprocess
    import sys

    code = ("import sys, finetune.data.image_tokens, finetune.data.images; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def test_resume_names_an_image_replaced_under_the_same_name(tmp_path, vlm_data):
    from finetune.data.fingerprint import data_changes

    picture(tmp_path / "a.png", colour="red")
    data = write(tmp_path / "d.json", [record(["a.png"])])

    def fingerprint() -> dict:
        tokenizer, vision = vlm_data
        return build_datasets(cfg(data), tokenizer, 0, vision=vision).fingerprint

    before = fingerprint()
    assert data_changes(before, fingerprint()) == []
    picture(tmp_path / "a.png", colour="blue")
    assert data_changes(before, fingerprint()) == ["images changed"]
    text = build_datasets(cfg(write(tmp_path / "t.json", [{"messages": [{"role": "user", "content": "Hi"}, ANSWER]}])),
                          vlm_data[0], 0).fingerprint
    assert "images_sha256" not in text  # text data: the fingerprint it always had


_CHECK_IN_A_NEW_PROCESS = """
import sys
from PIL import ImageFile
decoded = []
load = ImageFile.ImageFile.load
ImageFile.ImageFile.load = lambda self: decoded.append(1) or load(self)  # counts full decodes in this process
from finetune.data.images import image_size
print(image_size(sys.argv[1]), len(decoded))
"""


def _check_in_a_new_process(path: Path, cache: Path) -> str:
    import os
    import subprocess
    import sys

    env = {**os.environ, "FINETUNE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _CHECK_IN_A_NEW_PROCESS, str(path)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_later_process_reuses_the_image_check_and_checks_a_changed_file_again(tmp_path):
    path = noisy(tmp_path / "n.png")
    cache = tmp_path / "cache"
    assert _check_in_a_new_process(path, cache) == "(64, 64) 1"  # decoded once: validate's process
    assert _check_in_a_new_process(path, cache) == "(64, 64) 0"  # the run's process reuses the answer
    noisy(tmp_path / "n.png", (32, 48))  # a new version of the file
    assert _check_in_a_new_process(path, cache) == "(32, 48) 1"
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a cache that cannot be made: every process checks for itself, as before
    assert [_check_in_a_new_process(path, blocked) for _ in range(2)] == ["(32, 48) 1"] * 2
