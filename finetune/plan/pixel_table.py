"""The image budget `data.max_pixels: auto` chooses on common GPUs, per vision-language model: the table in
docs/vision.md, made by the planner itself (tests/test_vision_budgets.py checks the page holds its output).

Each model is planned for the same QLoRA recipe (the language model in 4 bits, LoRA r=16, the vision tower frozen
in 16 bits, micro-batch 1, activation checkpointing and the chunked loss on, 16384 tokens: the photo whole) on records of one
12-megapixel photo, at 8, 16 and 24 GiB: the largest pixel budget whose peak fits, its image tokens and peak.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from finetune.plan.search import Plan, predict
from finetune.recipe.schema import Recipe
from finetune.units import format_bytes

GPU_SIZES = (8, 16, 24)  # GiB
PHOTO = (4032, 3024)  # the records' image: a 12-megapixel phone photo


def budget_recipe(model_path: str, data_path: Path, gib: int, out: Path) -> Recipe:
    """The QLoRA recipe every model of the table is planned with, for a `gib` GiB GPU."""
    return Recipe.model_validate({
        "model": {"path": model_path}, "quantization": {"bits": 4},
        "adapter": {"type": "lora", "r": 16, "alpha": 32, "vision": "frozen"},
        "data": {"path": str(data_path), "max_seq_len": 16384, "max_pixels": "auto"},
        "training": {"micro_batch_size": 1},
        "memory": {"gpu_memory": f"{gib}GiB", "activation_checkpointing": True, "chunked_loss": True,
                   "tiled_mlp": False},
        "output": {"dir": str(out)}})


def budget_plans(models: dict[str, str], gpus: tuple[int, ...] = GPU_SIZES) -> dict[str, list[Plan]]:
    """Each model's plan (name -> config path) at each GPU size, on records of one PHOTO-sized image."""
    from PIL import Image

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        Image.new("RGB", PHOTO, (90, 120, 200)).save(folder / "photo.png")
        data = folder / "photos.json"
        data.write_text(json.dumps([{"messages": [{"role": "user", "content": "<image>Describe the photo."},
                                                  {"role": "assistant", "content": "A blue field."}],
                                     "images": ["photo.png"]}]))
        return {name: [predict(budget_recipe(path, data, gib, folder / "run"), device="cuda") for gib in gpus]
                for name, path in models.items()}


def pixel_budget_markdown(plans: dict[str, list[Plan]], gpus: tuple[int, ...] = GPU_SIZES) -> str:
    """The docs table of `budget_plans`: per model and GPU size, the chosen data.max_pixels (its image tokens,
    the peak), or that even the smallest budget does not fit."""
    head = "| model | " + " | ".join(f"{g} GiB" for g in gpus) + " |"
    rows = [head, "|" + "---|" * (len(gpus) + 1)]
    for name, per_gpu in plans.items():
        cells = [f"{p.settings['max_pixels']:,} px ({p.vision['image_tokens']:,} tokens, {format_bytes(p.peak_bytes)})"
                 if p.fits else f"does not fit (smallest: {format_bytes(p.peak_bytes)})" for p in per_gpu]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"
