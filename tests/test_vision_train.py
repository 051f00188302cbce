"""Vision-language models train on records with images through `finetune run`: a tiny random Qwen2.5-VL (its own
config class, shrunk) on Pillow-generated pictures in LLaMA-Factory's format; the plan, which traces the whole
model with the image tokens of the records, within 5% of the measured peak; QLoRA with the language model in
4 bits; resume exact; an image record for a text-only model refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from finetune.cli import main
from finetune.rundir import read_jsonl
from finetune.testing import VISION_ARCHITECTURES, make_tiny_model_dir, vision_model
from tests.run_support import run_plan

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}


def shapes_data(folder: Path, n: int = 12, size: tuple[int, int] = (84, 56)) -> Path:
    """`n` LLaMA-Factory records, each a picture of one colour and the question what colour it is; the images
    in a folder beside the data file, named relative to it."""
    from PIL import Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        name = list(COLOURS)[i % len(COLOURS)]
        Image.new("RGB", size, COLOURS[name]).save(folder / "images" / f"{i}.png")
        rows.append({"messages": [{"role": "user", "content": "<image>What colour is the picture?"},
                                  {"role": "assistant", "content": f"It is {name}."}],
                     "images": [f"images/{i}.png"]})
    path = folder / "shapes.json"
    path.write_text(json.dumps(rows))
    return path


def recipe(folder: Path, model: Path, data: Path, name: str = "run", **sections: dict) -> Path:
    values = {
        "model": {"path": str(model)}, "quantization": {"bits": None},
        "adapter": {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 64, "validation_split": 0.0},
        "training": {"max_steps": 3, "micro_batch_size": 2, "learning_rate": 1e-3, "warmup_ratio": 0.0,
                     "logging_steps": 1},
        "memory": {"activation_checkpointing": True, "gpu_memory_margin": 0},
        "output": {"dir": str(folder / name), "save_steps": 100},
    }
    for section, changes in sections.items():
        values[section] = {**values.get(section, {}), **changes}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


def roomy(path: Path) -> Path:
    """The recipe at `path` with data.max_seq_len 96: room for every family's picture (SmolVLM: an 84 x 56
    picture's 2 x 2 tiles and their markers, 33 tokens) and the text."""
    values = yaml.safe_load(path.read_text())
    values["data"]["max_seq_len"] = 96
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return vision_model("qwen2_5_vl", tmp_path_factory.mktemp("vlm") / "model")


def _measured(run: Path) -> int:
    return max(r["peak_memory_bytes"] for r in read_jsonl(run / "metrics.jsonl") if "peak_memory_bytes" in r)


@pytest.mark.parametrize("bits", [None, 4], ids=["lora", "qlora"])
def test_trains_on_images_with_the_plan_within_5_percent(tmp_path, vlm, bits):
    """3 steps through `finetune run`; the plan at the longest example (image tokens included) within 5% of the
    measured peak; the language model's Linear layers in 4 bits for QLoRA, the vision tower's in 16."""
    data = shapes_data(tmp_path)
    assert main(["run", str(recipe(tmp_path, vlm, data, quantization={"bits": bits}))]) == 0
    stats = json.loads((tmp_path / "run" / "data_stats.json").read_text())
    assert stats["train_examples"] == 12 and stats["bad_records_skipped"] == 0
    seen = run_plan(tmp_path / "run")
    assert seen is not None and seen["longest"] > 30  # 6 image tokens per 84 x 56 picture, and the text
    measured = _measured(tmp_path / "run")
    assert abs(seen["peak_bytes"] / measured - 1) <= 0.05, (seen["peak_bytes"], measured)
    assert [r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]


def _trains_with_the_plan_within_5_percent(tmp_path: Path, arch: str, **memory) -> dict:
    """`finetune run` of a tiny `arch` on the pictures with the memory section's `memory` keys; the plan at the
    longest example within 5% of the measured peak. Returns the run's plan.json."""
    model = vision_model(arch, tmp_path / "model")
    assert main(["run", str(roomy(recipe(tmp_path, model, shapes_data(tmp_path), memory=memory)))]) == 0
    seen = run_plan(tmp_path / "run")
    assert seen is not None
    measured = _measured(tmp_path / "run")
    assert abs(seen["peak_bytes"] / measured - 1) <= 0.05, (seen["peak_bytes"], measured)
    return json.loads((tmp_path / "run" / "plan.json").read_text())


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    """`arch` -> a folder with its tiny model, shapes_data's 6 pictures and `straight_run`'s run: trained once per
    family (and worker), read by the per-family plan test and by the resume test, neither of which changes it."""
    folders: dict[str, Path] = {}

    def straight(arch: str) -> Path:
        if arch not in folders:
            folder = tmp_path_factory.mktemp(f"straight-{arch}")
            straight_run(folder, vision_model(arch, folder / "model"))
            folders[arch] = folder
        return folders[arch]
    return straight


@pytest.mark.parametrize("arch", [a for a in VISION_ARCHITECTURES if a != "qwen2_5_vl"])
def test_each_vision_family_trains_on_images_with_the_plan_within_5_percent(straight_runs, arch):
    """The run resume is compared with (the recipe's defaults, a constant schedule): the plan at the longest
    example within 5% of the measured peak."""
    run = straight_runs(arch) / "straight"
    seen = run_plan(run)
    assert seen is not None
    measured = _measured(run)
    assert abs(seen["peak_bytes"] / measured - 1) <= 0.05, (seen["peak_bytes"], measured)


@pytest.mark.parametrize("arch", list(VISION_ARCHITECTURES))
def test_the_chunked_loss_plans_each_vision_family_within_5_percent(tmp_path, arch):
    """memory.chunked_loss sends only labelled positions through the head: a row's image tokens never (they
    carry no label), so the plan prices the logits of the rest of the sequence, not of all of it."""
    assert _trains_with_the_plan_within_5_percent(tmp_path, arch, chunked_loss=True)["settings"]["chunked_loss"]


@pytest.mark.parametrize("tokens", [1024, 16], ids=["one-chunk", "tiled"])
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "mllama"])
def test_the_tiled_mlp_and_recomputed_norms_plan_a_vision_model_within_5_percent(tmp_path, arch, tokens):
    """memory.tiled_mlp: true and memory.recompute_norms on the language model's layers: the image records'
    sequence the plan traces (shorter than max_seq_len) may be one MLP chunk, which runs the plain MLP (a fixed
    true still plans, where it once found no configuration at all), or several, each tiled; within 5% of the
    measured peak either way."""
    plan = _trains_with_the_plan_within_5_percent(tmp_path, arch, tiled_mlp=True, tiled_mlp_tokens=tokens,
                                                  recompute_norms=True)
    assert plan["settings"]["tiled_mlp"] is True


def text_among(path: Path, n: int, images_per_record: int = 1) -> Path:
    """`n` short text records, then the picture records of `path` with `images_per_record` pictures each (its
    first, repeated)."""
    pictures = json.loads(path.read_text())
    for row in pictures:
        row["images"] = [row["images"][0]] * images_per_record
        row["messages"][0]["content"] = "<image>" * images_per_record + "What colour is the picture?"
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(n)]
    path.write_text(json.dumps(rows + pictures))
    return path


@pytest.mark.parametrize(("records", "images"), [(1, 1), (1, 2), (3, 2)],
                         ids=["one-image", "one-record-of-two-images", "three-records-of-two-images"])
def test_text_rows_beside_an_image_row_are_planned_as_text(tmp_path, vlm, records, images, monkeypatch):
    """Data mostly text, `records` of its 12 records with `images` pictures each: a micro-batch of an image row
    and a text row runs the vision tower on the image row's pictures alone, and the plan prices it so (it once
    traced every row with the images: 6.5% over for one image record); within 5% of the measured peak, 6
    steps: every micro-batch of the epoch, each measured (the tracker's step signature does not tell image rows
    from text rows as long, so it could pass over the step of two image rows)."""
    monkeypatch.setenv("FINETUNE_MEMORY_TRACKER", "every_step")
    data = text_among(shapes_data(tmp_path, n=records), 12 - records, images)
    assert main(["run", str(roomy(recipe(tmp_path, vlm, data, training={"max_steps": 6})))]) == 0
    stats = json.loads((tmp_path / "run" / "data_stats.json").read_text())
    assert stats["image_records"] == records and stats["images"] == records * images
    seen = run_plan(tmp_path / "run")
    assert seen is not None and seen["data"]["rows"] == 2
    measured = _measured(tmp_path / "run")
    assert abs(seen["peak_bytes"] / measured - 1) <= 0.05, (seen["peak_bytes"], measured)


def test_the_loss_on_the_answers_falls(tmp_path, vlm):
    data = shapes_data(tmp_path, n=6)
    path = recipe(tmp_path, vlm, data, training={"max_steps": 12, "learning_rate": 1e-2, "micro_batch_size": 6})
    assert main(["run", str(path)]) == 0
    losses = [r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("arch", [a for a in VISION_ARCHITECTURES if a != "mllama"])
def test_resume_is_exact(tmp_path, straight_runs, arch):
    """Each vision family: 2 steps, then --resume to 4 (constant schedule; mid-epoch, then into the next),
    equal to 4 straight steps: the images' order and inputs are a function of the seed and the step. (mllama:
    tests/test_vision_mllama.py's resume test, on the same model, which then generates from the run.)"""
    folder = straight_runs(arch)
    assert_resume_exact(tmp_path, folder / "model", folder)


def straight_run(folder: Path, model: Path) -> Path:
    """shapes_data's 6 pictures in `folder` and a 4-step run on them there (`straight`, constant schedule: a
    resumed run's longer max_steps keeps its learning rate); returns the run."""
    data = shapes_data(folder, n=6)
    path = recipe(folder, model, data, "straight", training={"max_steps": 4, "lr_scheduler": "constant"})
    assert main(["run", str(roomy(path))]) == 0
    return folder / "straight"


def assert_resume_exact(tmp_path: Path, model: Path, straight: Path | None = None) -> None:
    """Runs `resumed` (2 steps, then --resume to 4) in `tmp_path` on the pictures of `straight` (a folder
    `straight_run` trained in; by default it trains in `tmp_path`); the resumed steps' losses equal the straight
    run's."""
    if straight is None:
        straight_run(tmp_path, model)
        straight = tmp_path
    data = straight / "shapes.json"
    first = roomy(recipe(tmp_path, model, data, "resumed", training={"max_steps": 2, "lr_scheduler": "constant"},
                         output={"save_steps": 2}))
    assert main(["run", str(first)]) == 0
    again = yaml.safe_load(first.read_text())
    again["training"]["max_steps"] = 4
    first.write_text(yaml.safe_dump(again))
    assert main(["run", str(first), "--resume"]) == 0
    reference = {r["step"]: r["loss"] for r in read_jsonl(straight / "straight" / "metrics.jsonl") if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "resumed" / "metrics.jsonl") if "loss" in r}
    assert sorted(resumed) == sorted(reference) == list(range(1, 5))
    for step in range(3, 5):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5), step


def test_an_image_record_for_a_text_only_model_is_one_line(tmp_path, capsys):
    text_model = make_tiny_model_dir(tmp_path / "text")
    data = shapes_data(tmp_path, n=3)
    assert main(["run", str(recipe(tmp_path, text_model, data))]) == 3  # a malformed record (DataError)
    err = capsys.readouterr().err
    assert "but the model reads only text" in err and "Traceback" not in err  # a bad record (data.on_bad_record)
    assert "shapes.json" in err


def preference_data(folder: Path, n: int = 8) -> Path:
    """LLaMA-Factory preference records: a picture, the question, the right colour chosen, another rejected."""
    from PIL import Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    names = list(COLOURS)
    rows = []
    for i in range(n):
        name, other = names[i % 3], names[(i + 1) % 3]
        Image.new("RGB", (84, 56), COLOURS[name]).save(folder / "images" / f"{i}.png")
        rows.append({"conversations": [{"from": "human", "value": "<image>What colour is the picture?"}],
                     "chosen": {"from": "gpt", "value": f"It is {name}."},
                     "rejected": {"from": "gpt", "value": f"It is {other}."}, "images": [f"images/{i}.png"]})
    path = folder / "pairs.json"
    path.write_text(json.dumps(rows))
    return path


def test_dpo_on_images_shares_the_prompts_pictures_and_plans_within_5_percent(tmp_path, vlm):
    """DPO through the same loop: the chosen and the rejected answer each see the prompt's picture (the batch
    carries its pixels once per row), the plan of the pair step within 5% of the measured peak."""
    data = preference_data(tmp_path)
    path = recipe(tmp_path, vlm, data, training={"method": "dpo"}, memory={"chunked_loss": False})
    assert main(["run", str(path)]) == 0
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 3 and all("rewards/margins" in r for r in rows)
    seen = run_plan(tmp_path / "run")
    assert seen is not None
    measured = _measured(tmp_path / "run")
    assert abs(seen["peak_bytes"] / measured - 1) <= 0.05, (seen["peak_bytes"], measured)


def test_a_pair_batch_shows_each_row_the_prompts_images(tmp_path, vlm):
    from transformers import AutoConfig, AutoTokenizer

    from finetune.data import build_datasets
    from finetune.model.vision import vision_data
    from finetune.recipe.schema import DataConfig

    tokenizer = AutoTokenizer.from_pretrained(vlm)
    vision = vision_data(AutoConfig.from_pretrained(vlm), vlm, tokenizer)
    bundle = build_datasets(DataConfig(path=str(preference_data(tmp_path, 3)), max_seq_len=64), tokenizer, 0, "dpo",
                            None, vision)
    batch = bundle.collator([bundle.train[0], bundle.train[1]])
    assert batch["input_ids"].shape[0] == 4 and batch["image_grid_thw"].shape[0] == 4
    tokens = (batch["input_ids"] == vision.image_token_id).sum(-1)
    assert tokens.tolist() == [int(g.prod()) // 4 for g in batch["image_grid_thw"]]


@pytest.mark.parametrize("vision", ["lora", "full"])
def test_adapter_vision_trains_the_vision_tower_and_saves_it_with_the_adapter(tmp_path, vlm, vision):
    """adapter.vision lora: LoRA weights inside the vision tower are saved; full: its own weights are, changed
    by training; the plan (which traces the same adapter) within 5% of the measured peak."""
    from safetensors.torch import load_file

    data = shapes_data(tmp_path)
    path = recipe(tmp_path, vlm, data, adapter={"vision": vision}, training={"learning_rate": 1e-2})
    assert main(["run", str(path)]) == 0
    saved = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    in_vision = [k for k in saved if ".visual." in k]
    if vision == "lora":
        assert in_vision and all("lora_" in k for k in in_vision)
    else:
        key = next(k for k in in_vision if k.endswith("patch_embed.proj.weight"))
        base = load_file(vlm / "model.safetensors")
        before = next(v for k, v in base.items() if k.endswith("visual.patch_embed.proj.weight"))
        assert not saved[key].equal(before)
    seen = run_plan(tmp_path / "run")
    assert seen is not None
    assert abs(seen["peak_bytes"] / _measured(tmp_path / "run") - 1) <= 0.05
