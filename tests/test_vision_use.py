"""Using vision-language runs: the synthetic coloured-shape task, `finetune generate --image` (and its
refusals, one line and exit 2, before any model loads), export with the processor files, eval on image records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.cli import main
from finetune.recipe import validate_recipe
from finetune.testing import SHAPE_COLOURS, SHAPE_QUESTION, VISION_ARCHITECTURES, shape_task
from finetune.train.run import run
from tests.run_support import sums_data, tiny_lora_recipe


def test_the_shape_task_is_balanced_split_and_deterministic(tmp_path):
    from PIL import Image

    train, held_out = shape_task(tmp_path / "a", train=16, held_out=8, size=40, seed=3)
    shape_task(tmp_path / "b", train=16, held_out=8, size=40, seed=3)
    records = {p.name: json.loads(p.read_text()) for p in (train, held_out)}
    assert [len(records["train.json"]), len(records["held_out.json"])] == [16, 8]
    for part in records.values():
        for record in part:
            user, answer = record["messages"]
            assert user["content"] == f"<image>{SHAPE_QUESTION}" and len(record["images"]) == 1
            with Image.open(train.parent / record["images"][0]) as image:
                assert image.size == (40, 40)
                pixels = {c for _, c in image.getcolors()} - {(255, 255, 255)}
            assert pixels == {SHAPE_COLOURS[answer["content"]]}  # the answer is the shape's colour, and only it
    seen = [r["images"][0] for part in records.values() for r in part]
    assert len(set(seen)) == 24  # no image in both splits
    answers = [r["messages"][1]["content"] for r in records["train.json"]]
    assert {answers.count(c) for c in SHAPE_COLOURS} == {4}  # every colour equally common
    for name in ("train.json", "held_out.json", "images/0005.png"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert shape_task(tmp_path / "c", train=16, held_out=8, size=40, seed=4)[0].read_bytes() != train.read_bytes()


@pytest.fixture(scope="module")
def text_run(tmp_path_factory, tiny_model_dir) -> Path:
    folder = tmp_path_factory.mktemp("text-run")
    run(validate_recipe(tiny_lora_recipe(tiny_model_dir, sums_data(folder / "sums.jsonl", 8), folder / "run",
                                         {"training": {"max_steps": 1, "micro_batch_size": 2}})))
    return folder / "run"


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.startswith("error:"), err
    return err


def test_an_image_for_a_text_only_run_is_refused_in_one_line(text_run, tmp_path, capsys):
    image = tmp_path / "red.png"
    from finetune.testing import shape_image

    shape_image("red", "circle", (4, 4, 30, 30)).save(image)
    assert main(["generate", str(text_run), "--prompt", SHAPE_QUESTION, "--image", str(image)]) == 2
    err = _one_line_error(capsys)
    assert "text-only model" in err and str(text_run) in err and "leave out --image" in err
    assert main(["generate", str(text_run), "--prompt", "hi", "--image", str(image), "--compare"]) == 2
    assert "reads no images" in _one_line_error(capsys)


def test_a_missing_or_unreadable_image_is_named_in_one_line(text_run, tmp_path, capsys):
    assert main(["generate", str(text_run), "--prompt", "hi", "--image", str(tmp_path / "gone.png")]) == 2
    assert f"--image {tmp_path / 'gone.png'}: no such file" in _one_line_error(capsys)
    (tmp_path / "notes.png").write_text("not an image")
    assert main(["generate", str(text_run), "--prompt", "hi", "--image", str(tmp_path / "notes.png")]) == 2
    assert "not an image Pillow can read" in _one_line_error(capsys)


def test_data_preview_thumbnails_are_small_copies_and_never_of_files_outside(tmp_path):
    from finetune.testing import shape_image
    from ui.tabs.data import THUMBNAIL, gallery_update, thumbnails

    inside, outside = tmp_path / "data", tmp_path / "elsewhere"
    inside.mkdir(), outside.mkdir()
    shape_image("green", "square", (10, 10, 300, 300), size=400).save(inside / "big.png")
    shape_image("red", "circle", (2, 2, 20, 20), size=24).save(outside / "secret.png")
    (inside / "broken.png").write_bytes((inside / "big.png").read_bytes()[:200])
    shown = thumbnails({"images": [str(inside / "big.png"), str(outside / "secret.png"),
                                   str(inside / "broken.png")]}, [inside])
    (big, big_caption), (hidden, hidden_caption), (_, broken_caption) = shown
    assert max(big.size) == THUMBNAIL and big_caption == "image 1: big.png (400x400)"
    assert big.getpixel((THUMBNAIL // 2, THUMBNAIL // 2)) == SHAPE_COLOURS["green"]
    assert "outside the allowed folders" in hidden_caption and SHAPE_COLOURS["red"] not in \
        {c for _, c in hidden.getcolors()}
    assert broken_caption.startswith("image 3: unreadable")
    assert gallery_update({"tokens": []}, [inside])["visible"] is False  # a text example: no image strip


def test_the_data_preview_of_a_vision_model_lists_each_examples_images(vision_run):
    from finetune import api
    from ui.tabs.data import thumbnails

    run_dir, shapes = vision_run
    examples, problems = api.preview_data(api.load_recipe(run_dir / "recipe.yaml"), n=2)
    records = json.loads((shapes / "train.json").read_text())
    assert not problems and [e["images"] for e in examples] == [[str((shapes / r["images"][0]).resolve())]
                                                                 for r in records[:2]]
    assert records[0]["messages"][1]["content"] in "".join(text for text, loss in examples[0]["tokens"] if loss)
    (picture, caption), = thumbnails(examples[0], [shapes])
    assert caption == f"image 1: {Path(records[0]['images'][0]).name} (56x56)" and picture.size == (56, 56)


def _shape_run(folder: Path, arch: str, steps: int, seq_len: int = 64) -> tuple[Path, Path]:
    """A LoRA run of `arch`'s tiny random model on the shape task (`steps` steps of two pictures), and the task's
    folder."""
    from finetune.testing import vision_model

    model = vision_model(arch, folder / "model")
    train, _ = shape_task(folder / "shapes", train=8, held_out=4)
    run(validate_recipe(tiny_lora_recipe(model, train, folder / "run", {
        "training": {"max_steps": steps, "micro_batch_size": 2}, "data": {"max_seq_len": seq_len}})))
    return folder / "run", folder / "shapes"


@pytest.fixture(scope="module")
def vision_run(tmp_path_factory) -> tuple[Path, Path]:
    """A LoRA run of a tiny random Qwen2.5-VL on the shape task, and the task's folder."""
    return _shape_run(tmp_path_factory.mktemp("vision-run"), "qwen2_5_vl", 2)


def test_generate_compares_with_the_base(vision_run, capsys):
    from finetune import api

    run_dir, shapes = vision_run
    image = shapes / "images" / "0000.png"
    answer = api.generate(run_dir, SHAPE_QUESTION, image=image, max_new_tokens=4)
    assert main(["generate", str(run_dir), "--prompt", SHAPE_QUESTION, "--image", str(image), "--compare",
                 "--max-new-tokens", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"image:      {image}" and lines[3] == f"fine-tuned: {answer}".rstrip()
    base = api.generate(run_dir, SHAPE_QUESTION, image=image, max_new_tokens=4, use_adapter=False)
    assert lines[2] == f"base model: {base}".rstrip()


@pytest.fixture(scope="module", params=list(VISION_ARCHITECTURES))
def family_run(request, tmp_path_factory) -> tuple[Path, Path]:
    """A one-step LoRA run of each vision family's tiny model on the shape task (room for SmolVLM's tiles and
    their markers), and the task's folder."""
    return _shape_run(tmp_path_factory.mktemp(f"run-{request.param}"), request.param, 1, seq_len=96)


def test_each_vision_family_generates_with_an_image(family_run, capsys):
    """`finetune generate RUN --image PATH --prompt ...` answers (greedy: what the API answers) for every family."""
    from finetune import api

    run_dir, shapes = family_run
    image = shapes / "images" / "0000.png"
    assert main(["generate", str(run_dir), "--prompt", SHAPE_QUESTION, "--image", str(image),
                 "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out.strip()
    assert out and out == api.generate(run_dir, SHAPE_QUESTION, image=image, max_new_tokens=4)


def test_the_image_changes_what_the_model_reads(family_run):
    """Every family: the image's features reach the model: two images of the same size and question give the
    same input_ids, a token for each of the image's features, and different logits."""
    import torch

    from finetune.model.chat import prompt_inputs, user_turn
    from finetune.model.trained import load_trained, vision_of

    run_dir, shapes = family_run
    model, tokenizer = load_trained(run_dir)
    vision = vision_of(run_dir, model, tokenizer)
    first, second = (prompt_inputs(tokenizer, [user_turn(SHAPE_QUESTION, shapes / "images" / name)], None, vision)
                     for name in ("0000.png", "0001.png"))
    assert torch.equal(first["input_ids"], second["input_ids"]) and "pixel_values" in first
    assert int((first["input_ids"] == vision.image_token_id).sum()) > 0
    with torch.no_grad():
        assert not torch.allclose(model(**first).logits, model(**second).logits)


def test_export_writes_the_processor_files_and_gguf_with_its_projector(vision_run, tmp_path, capsys):
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from finetune.model.chat import prompt_inputs, user_turn
    from finetune.model.trained import load_trained, vision_of

    run_dir, shapes = vision_run
    assert main(["export", str(run_dir), "--out", str(tmp_path / "merged")]) == 0
    out = tmp_path / "merged"
    for name in ("preprocessor_config.json", "chat_template.json", "tokenizer.json", "config.json"):
        assert (out / name).is_file(), name
    merged = AutoModelForImageTextToText.from_pretrained(out).eval()
    model, tokenizer = load_trained(run_dir, quantize=False)
    inputs = prompt_inputs(AutoTokenizer.from_pretrained(out), [user_turn(SHAPE_QUESTION, shapes / "images" /
                                                                          "0002.png")], None,
                           vision_of(run_dir, model, tokenizer))
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, model(**inputs).logits, rtol=1e-4, atol=1e-4)
    # GGUF: the language model and llama.cpp's projector file (checked tensor by tensor in test_gguf_vision.py)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "gguf"), "--format", "gguf"]) == 0
    assert sorted(p.name for p in (tmp_path / "gguf").glob("*.gguf")) == [f"mmproj-{run_dir.name}.f16.gguf",
                                                                         f"{run_dir.name}.f16.gguf"]


def test_eval_measures_a_vision_run_on_held_out_image_records(family_run, capsys):
    from finetune.evaluate.match import score

    run_dir, shapes = family_run
    assert main(["eval", str(run_dir), "--data", str(shapes / "held_out.json"), "--compare",
                 "--max-new-tokens", "3"]) == 0
    report = json.loads((run_dir / "evaluation.json").read_text())
    assert report["examples_kept"] == report["with_expected_answer"] == 4
    held_out = json.loads((shapes / "held_out.json").read_text())
    for row, record in zip(report["answers"], held_out, strict=True):
        assert row["prompt"] == SHAPE_QUESTION and row["expected"] == record["messages"][1]["content"]
        assert row["images"] == [str((shapes / record["images"][0]).resolve())]
    base, tuned = report["models"]
    assert [base["label"], tuned["label"]] == ["base model", run_dir.name]
    assert base["loss"] != tuned["loss"] and tuned["loss_tokens"] == base["loss_tokens"] > 0
    for model in (base, tuned):  # the rates are the answers' scores
        found = sum(score(row["answers"][model["label"]], row["expected"])["contains"] for row in report["answers"])
        assert model["contains"] == {"matched": found, "of": 4}


def test_the_vision_demo_data_is_what_its_script_writes(tmp_path):
    import importlib.util

    data = Path(__file__).resolve().parents[1] / "recipes" / "data"
    spec = importlib.util.spec_from_file_location("make_shapes", data / "make_shapes.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.write_data(tmp_path / "shapes")
    committed = sorted(p.relative_to(data / "shapes") for p in (data / "shapes").rglob("*") if p.is_file())
    assert committed == sorted(p.relative_to(tmp_path / "shapes") for p in (tmp_path / "shapes").rglob("*")
                               if p.is_file())
    assert len(committed) == 2 + 96
    for name in committed:
        assert (data / "shapes" / name).read_bytes() == (tmp_path / "shapes" / name).read_bytes(), name


def test_the_real_llamafactory_sample_trains_a_tiny_vlm_end_to_end(shared_datasets, tmp_path, capsys):
    """../shared/datasets/mllm_demo.json (LLaMA-Factory's multimodal sample: 6 conversations, `<image>` markers,
    JPEGs beside it) through `finetune run`, then `finetune generate` about one of its pictures."""
    import yaml

    from finetune.rundir import read_jsonl
    from finetune.testing import vision_model

    data = shared_datasets / "mllm_demo.json"
    model = vision_model("qwen2_5_vl", tmp_path / "model")
    recipe = tiny_lora_recipe(model, data, tmp_path / "run", {"data": {"max_seq_len": 512}},
                              {"training": {"max_steps": 2, "micro_batch_size": 2, "logging_steps": 1}})
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["run", str(tmp_path / "recipe.yaml")]) == 0
    stats = json.loads((tmp_path / "run" / "data_stats.json").read_text())
    records = json.loads(data.read_text())
    assert stats["records"] == len(records) and stats["bad_records_skipped"] == 0
    assert stats["images"] == sum(len(r["images"]) for r in records) and stats["image_records"] == len(records)
    losses = [r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses)
    capsys.readouterr()
    picture = shared_datasets / records[0]["images"][0]
    assert main(["generate", str(tmp_path / "run"), "--image", str(picture), "--prompt", "Who are they?",
                 "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.strip()


def test_the_plan_view_shows_the_vision_tower_and_the_image_tokens(tmp_path):
    """The Memory tab's reading of a vision-language plan: the vision tower as its own bar component (the same
    total), the images' tokens and the chosen pixel budget in the text; a text plan as before."""
    from finetune import api
    from finetune.testing import vision_model
    from ui import views

    model = vision_model("qwen2_5_vl", tmp_path / "model")
    train, _ = shape_task(tmp_path / "shapes", train=4, held_out=1)
    recipe = validate_recipe(tiny_lora_recipe(model, train, tmp_path / "run", {"data": {"max_pixels": "auto"}}))
    plan = json.loads(api.plan(recipe, gpu_memory="2GiB", device="cuda").to_json())
    vision = plan["vision"]
    assert vision["images"] == 1 and vision["image_tokens"] == 4 and 0 < vision["vision_weights"]
    (label, bar), *_ = views.plan_bars(plan)
    assert bar[views.VISION_TOWER] == vision["vision_weights"]
    assert bar["weights"] == plan["breakdown"]["weights"] - vision["vision_weights"]
    assert sum(bar.values()) == sum(plan["breakdown"].values())
    text = views.plan_markdown(plan)
    assert f"1 image(s) are 4 image tokens at `max_pixels={plan['settings']['max_pixels']:,}`" in text
    text_plan = {k: v for k, v in plan.items() if k != "vision"}
    assert "Images" not in views.plan_markdown(text_plan)
    assert views.VISION_TOWER not in views.plan_bars(text_plan)[0][1]
