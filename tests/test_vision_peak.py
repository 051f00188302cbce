"""A vision-language model's plan at pictures larger than the tiny tests' 84 x 56, against the peak the CPU tracker
measures over every step: a collated micro-batch's pixel values, far larger than a tiny model's activations, once
outlived their step (the next step's were collated beside them: 14-19% over the plan from step 2 on) and, under
gradient accumulation, wait beside the running micro-batch unpriced (48% over); and the tracker's `peaks` mode
tells a step of heavier images from a lighter one of the same token shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from finetune.cli import main
from finetune.rundir import read_jsonl
from finetune.testing import vision_model
from tests.run_support import run_plan
from tests.test_vision_train import recipe, shapes_data


def _larger_pictures(model: Path, side: int) -> Path:
    """The tiny model's processor allowed pictures of `side` x `side` pixels (its own limit is 112 pixels a side)."""
    file = model / "preprocessor_config.json"
    config = json.loads(file.read_text())
    if "max_pixels" in config:  # Qwen-VL: an area
        config["max_pixels"] = config["size"]["longest_edge"] = side * side
    else:  # Idefics3: the long side, cut in tiles of the tower's size
        config["size"]["longest_edge"] = side
    file.write_text(json.dumps(config))
    return model


def _planned_and_measured(tmp_path: Path, arch: str, side: int, accumulation: int = 1) -> tuple[int, int]:
    """A 3-step `finetune run` of a tiny `arch` on `side` x `side` pictures, every step measured: (planned,
    measured) peak."""
    model = _larger_pictures(vision_model(arch, tmp_path / "model"), side)
    path = recipe(tmp_path, model, shapes_data(tmp_path, n=6, size=(side, side)),
                  training={"gradient_accumulation_steps": accumulation})
    values = yaml.safe_load(path.read_text())
    values["data"]["max_seq_len"] = 320  # a 448 x 448 picture is 256 Qwen-VL tokens
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    assert main(["run", str(path)]) == 0
    measured = max(r["peak_memory_bytes"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")
                   if "peak_memory_bytes" in r)
    return run_plan(tmp_path / "run")["peak_bytes"], measured


@pytest.mark.parametrize(("arch", "side", "accumulation"),
                         [("qwen2_5_vl", 224, 1), ("qwen2_5_vl", 448, 1), ("qwen2_5_vl", 224, 2), ("idefics3", 224, 2)])
def test_larger_pictures_are_planned_within_5_percent(tmp_path, monkeypatch, arch, side, accumulation):
    monkeypatch.setenv("FINETUNE_MEMORY_TRACKER", "every_step")
    planned, measured = _planned_and_measured(tmp_path, arch, side, accumulation)
    assert abs(planned / measured - 1) <= 0.05, (planned, measured)


def _batch(rows: int, length: int, pictures: int) -> dict:
    return {"input_ids": torch.zeros(rows, length, dtype=torch.long),
            "attention_mask": torch.ones(rows, length, dtype=torch.long),
            "pixel_values": torch.zeros(pictures * 64, 1176)}


def test_a_step_of_more_pictures_is_tracked_after_one_of_the_same_token_shape():
    """Steps of 2 rows of 40 tokens: one picture (an image row beside a text row), then two (two image rows),
    then one again; the step of two pictures can set a new peak, so it is tracked, the last not. Two micro-batches
    a step: a step with a micro-batch of more pictures, or more pictures in all, is tracked."""
    from finetune.memory.tracker import MemoryTracker
    from finetune.train.peak_memory import FIRST_STEPS, PeakMemory

    policy = PeakMemory(mode="peaks")
    policy.tracker = MemoryTracker()
    pictures = [1] * FIRST_STEPS + [1, 2, 1, 2]
    for step, n in enumerate(pictures):
        policy.step_begins([_batch(2, 40, n)], step)
    assert policy.tracked_steps == [*range(FIRST_STEPS), FIRST_STEPS + 1]
    more = len(pictures)
    for step, (first, second) in enumerate([(1, 1), (1, 0), (2, 1), (1, 2)], more):  # accumulation: another shape
        policy.step_begins([_batch(2, 40, first), _batch(2, 40, second)], step)
    assert policy.tracked_steps[-2:] == [more, more + 2]  # (1, 0) and (1, 2) are bounded by a tracked step
