"""Images longer than data.max_seq_len: an image's tokens are never cut (that breaks the model's count of image
features), so a record whose images do not fit is a bad record naming the record, its image tokens at the pixel
budget, max_seq_len and the fix: found by the preflight from the image headers, or by the data build where the
text before an image pushes it past; skipped and counted under on_bad_record: skip, one line and exit 3 under
error. The planner never traces such a record, and `data.max_pixels: auto` prefers budgets at which every
record's images fit. A tiny random Qwen2.5-VL (its processor keeps at most 112 x 112 pixels: a 448 x 448 picture
is 16 image tokens, a 56 x 56 one 4)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import yaml

from finetune.cli import main
from finetune.testing import vision_model


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return vision_model("qwen2_5_vl", tmp_path_factory.mktemp("vlm") / "model")


def write_data(folder: Path, big_prompt: str = "<image>What colour?", answer: str = "green") -> Path:
    """Three small-picture records and, as record 1, one big picture."""
    from PIL import Image

    Image.new("RGB", (448, 448), (200, 0, 0)).save(folder / "big.png")
    Image.new("RGB", (56, 56), (0, 200, 0)).save(folder / "small.png")
    small = {"messages": [{"role": "user", "content": "<image>What colour?"},
                          {"role": "assistant", "content": answer}], "images": ["small.png"]}
    big = {"messages": [{"role": "user", "content": big_prompt}, {"role": "assistant", "content": "red"}],
           "images": ["big.png"]}
    path = folder / "data.json"
    path.write_text(json.dumps([small, big, small, small]))
    return path


def write_recipe(folder: Path, model: Path, data: Path, **data_keys) -> Path:
    values = {"model": {"path": str(model)}, "quantization": {"bits": None},
              "adapter": {"type": "lora", "r": 4, "alpha": 8},
              "data": {"path": str(data), "validation_split": 0.0, **data_keys},
              "training": {"max_steps": 1, "micro_batch_size": 1, "learning_rate": 1e-3},
              "memory": {"gpu_memory_margin": 0}, "output": {"dir": str(folder / "run")}}
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_the_preflight_refuses_a_record_whose_image_tokens_exceed_max_seq_len(tmp_path, vlm, capsys):
    recipe = write_recipe(tmp_path, vlm, write_data(tmp_path), max_seq_len=12, max_pixels=12544)
    assert main(["validate", str(recipe)]) == 3
    err = capsys.readouterr().err
    assert "data.json record 1: its images need 16 image tokens at data.max_pixels=12544, more than " \
           "data.max_seq_len=12" in err and "raise data.max_seq_len, or lower data.max_pixels" in err
    assert "Traceback" not in err and "record 0" not in err
    # auto: refused only where even the smallest budget does not fit: nine pictures of at least one token each
    nine = tmp_path / "nine.json"
    nine.write_text(json.dumps([{"messages": [{"role": "user", "content": "<image>" * 9 + "Colours?"},
                                              {"role": "assistant", "content": "red"}],
                                 "images": ["big.png"] * 9}]))
    assert main(["validate", str(write_recipe(tmp_path, vlm, nine, max_seq_len=8, max_pixels="auto"))]) == 3
    err = capsys.readouterr().err
    assert "nine.json record 0: its images need 9 image tokens at the smallest pixel budget data.max_pixels: " \
           "auto tries, more than data.max_seq_len=8" in err and ": raise data.max_seq_len" in err
    assert main(["validate", str(write_recipe(tmp_path, vlm, nine, max_seq_len=16, max_pixels="auto"))]) == 0
    recipe = write_recipe(tmp_path, vlm, write_data(tmp_path), max_seq_len=12, max_pixels=12544,
                          on_bad_record="skip")
    assert main(["validate", str(recipe)]) == 0
    assert "1 malformed to skip" in capsys.readouterr().out


def test_the_planner_never_traces_a_record_too_long_and_auto_shrinks_the_budget_to_fit(tmp_path, vlm):
    from finetune import api
    from finetune.api import load_recipe

    data = write_data(tmp_path)
    fixed = api.plan(load_recipe(write_recipe(tmp_path, vlm, data, max_seq_len=12, max_pixels=12544,
                                              on_bad_record="skip")), device="cpu")
    assert fixed.vision["image_tokens"] == 4  # the big picture's 16 do not fit: a small one is traced
    auto = api.plan(load_recipe(write_recipe(tmp_path, vlm, data, max_seq_len=12, max_pixels="auto")),
                    device="cpu")
    pixels = auto.settings["max_pixels"]
    assert pixels < 12544 and 4 <= auto.vision["image_tokens"] <= 10  # a budget whose big picture fits
    # the image budget sets the traced sequence (image tokens and a bound on the records' text), not max_seq_len
    plans = [api.plan(load_recipe(write_recipe(tmp_path, vlm, data, max_seq_len=n, max_pixels=12544)), device="cpu")
             for n in (1024, 2048)]
    assert 16 < plans[0].vision["sequence"] == plans[1].vision["sequence"] < 1024
    assert plans[0].peak_bytes == plans[1].peak_bytes


def test_the_plan_view_says_the_image_tokens_of_the_longest_record(tmp_path, vlm, capsys):
    recipe = write_recipe(tmp_path, vlm, write_data(tmp_path), max_seq_len=64, max_pixels=12544)
    assert main(["plan", str(recipe), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "images: the longest image record: 16 image tokens (1 image(s)) at max_pixels=12,544, traced in a " in out
    from finetune import api
    from ui.views import images_markdown

    plan = api.plan(api.load_recipe(recipe), device="cpu").to_dict()
    assert (f"the longest image record's 1 image(s) are 16 image tokens at `max_pixels=12,544`, traced in a "
            f"{plan['vision']['sequence']:,}-token sequence") in images_markdown(plan)


def test_the_build_skips_or_refuses_a_record_whose_text_pushes_its_image_past_max_seq_len(tmp_path, vlm, capsys):
    # the big picture's 16 tokens alone fit 30, but the text before it pushes their end past 30
    data = write_data(tmp_path, big_prompt="Look closely at the picture below, then answer.<image>What colour?")
    recipe = write_recipe(tmp_path, vlm, data, max_seq_len=30, max_pixels=12544)
    assert main(["run", str(recipe)]) == 3
    err = capsys.readouterr().err
    assert "data.json record 1: its images need 16 image tokens at data.max_pixels=12544 (" in err
    assert "more than data.max_seq_len=30" in err and "Traceback" not in err
    recipe = write_recipe(tmp_path, vlm, data, max_seq_len=30, max_pixels=12544, on_bad_record="skip")
    assert main(["run", str(recipe)]) == 0
    stats = json.loads((tmp_path / "run" / "data_stats.json").read_text())
    assert stats["train_examples"] == 3 and stats["bad_records_skipped"] == 1
    assert stats["bad_records_at"] == [f"{data} record 1"]


def test_truncation_cuts_an_image_records_answer_never_its_image(tmp_path, vlm):
    from transformers import AutoConfig

    from finetune.api import load_recipe
    from finetune.data.build import build_datasets
    from finetune.model.load import load_tokenizer
    from finetune.model.vision import vision_data

    data = write_data(tmp_path, answer="green " * 40)
    recipe = load_recipe(write_recipe(tmp_path, vlm, data, max_seq_len=40, max_pixels=12544, overlong="truncate"))
    tokenizer = load_tokenizer(vlm, recipe.model)
    vision = vision_data(AutoConfig.from_pretrained(vlm), vlm, tokenizer, 12544)
    bundle = build_datasets(recipe.data, tokenizer, 0, vision=vision)
    assert bundle.stats["truncated"] == 3 and bundle.stats["train_examples"] == 4
    for ids, labels in zip(bundle.train["input_ids"], bundle.train["labels"], strict=True):
        assert len(ids) <= 40 and sum(label != -100 for label in labels) > 0
        assert ids.count(vision.image_token_id) in (4, 16)  # every image whole


def test_the_gpu_size_sweep_plans_contexts_of_max_seq_len_whatever_the_images(tmp_path, vlm):
    """`finetune plan --gpu-memory A,B` and the UI's chart ask how long a context fits: sequences of that many
    tokens, not the data's short image records."""
    from finetune import api

    recipe = api.load_recipe(write_recipe(tmp_path, vlm, write_data(tmp_path), max_seq_len=64, max_pixels=12544))
    need = api.plan_gpu_sizes(recipe, (0.001, 1.0))["context_need_bytes"]
    lengths = sorted(need)
    assert len(lengths) >= 2 and all(need[a] < need[b] for a, b in itertools.pairwise(lengths))


def test_the_end_of_a_run_says_the_plan_was_made_at_the_image_record_it_trains(tmp_path, vlm, capsys):
    """One step of one record: the plan is priced at that record's row (its image and text tokens), no longer
    than the longest record's the search bounds it by."""
    recipe = write_recipe(tmp_path, vlm, write_data(tmp_path), max_seq_len=2048, max_pixels=12544)
    assert main(["run", str(recipe)]) == 0
    line = next(li for li in capsys.readouterr().err.splitlines() if li.startswith("memory: planned"))
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["data"]["rows"] == 1 and plan["data"]["sequence"] <= plan["vision"]["sequence"]
    assert f"for the run's largest micro-batch (1 x {plan['data']['sequence']:,} tokens, no padding; " \
           "data.max_seq_len 2,048)" in line
