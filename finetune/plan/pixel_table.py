"""The image budget `data.max_pixels: auto` chooses on common GPUs, per vision-language model: the table in
docs/vision.md, made by the planner itself (tests/test_vision_budgets.py checks the page holds its output).

Each model is planned with the ready QLoRA recipe RECIPE (the language model in 4 bits, LoRA r=16, the vision
tower frozen in 16 bits, max_seq_len 16384, micro-batch, checkpointing, chunked loss and tiled MLP on auto), its
model.path the checkpoint's config and its data.path records of one 12-megapixel photo (`write_photo_data`), at
8, 16 and 24 GiB: the largest pixel budget whose peak fits (and whose image tokens fit max_seq_len), its image
tokens and peak. What fits at 8 GiB leans on host RAM (activations offloaded there), so the table is planned for
a stated machine (MACHINE: its available RAM, its free disk and that disk's speed), not the one it is made on,
whose free RAM moves with its load (made on a CPU machine, as the test does: a GPU machine prices its own PCIe
link). The same plan from the command line (on a machine with that much RAM free):

    finetune plan recipes/qlora-qwen2.5-vl-3b-8gb.yaml --set model.path=CONFIG --set data.path=PHOTOS \
        --gpu-memory 8GiB,16GiB,24GiB

(`python -m finetune.plan.pixel_table DIR` writes PHOTOS, DIR/photos.json; `python -m finetune.plan.pixel_table
--docs` rewrites the table in docs/vision.md.)
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from finetune.plan.search import Plan, predict
from finetune.recipe.load import load_recipe
from finetune.recipe.schema import Recipe
from finetune.testing import stated_machine
from finetune.units import format_bytes

GPU_SIZES = (8, 16, 24)  # GiB
PHOTO = (4032, 3024)  # the records' image: a 12-megapixel phone photo
ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "qlora-qwen2.5-vl-3b-8gb.yaml"
# the table's machine (finetune.testing.stated_machine): 32 GiB of RAM available, 200 GiB free on a disk of the
# cost model's typical speed
MACHINE = {"host_ram": 32 * 2**30, "disk_free": 200 * 2**30, "typical_disk": True}
# the published config.json of one checkpoint per vision-language family (two sizes of SmolVLM), in tests/fixtures
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
MODELS = {"Qwen2.5-VL-3B-Instruct": "qwen2.5-vl-3b.json", "Qwen3-VL-8B-Instruct": "qwen3-vl-8b.json",
          "gemma-3-4b-it": "gemma-3-4b-it.json", "SmolVLM-256M-Instruct": "smolvlm-256m.json",
          "SmolVLM-Instruct (2.2B)": "smolvlm-2.2b.json",
          "Mistral-Small-3.1-24B-Instruct": "mistral-small-3.1-24b.json",
          "Llama-3.2-11B-Vision-Instruct": "llama-3.2-11b-vision.json"}
DOCS = ROOT / "docs" / "vision.md"
BEGIN, END = "<!-- pixel budgets: generated", "<!-- end of the generated table -->"


def budget_recipe(model_path: str, data_path: Path, gib: int, out: Path) -> Recipe:
    """RECIPE for `model_path` on the data `data_path`, for a `gib` GiB GPU."""
    return load_recipe(RECIPE, [f"model.path={model_path}", f"data.path={data_path}",
                                f"memory.gpu_memory={gib}GiB", f"output.dir={out}"])


def write_photo_data(folder: Path) -> Path:
    """The table's data in `folder`: photos.json, one record of one PHOTO-sized picture (photo.png)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", PHOTO, (90, 120, 200)).save(folder / "photo.png")
    data = folder / "photos.json"
    data.write_text(json.dumps([{"messages": [{"role": "user", "content": "<image>Describe the photo."},
                                              {"role": "assistant", "content": "A blue field."}],
                                 "images": ["photo.png"]}]))
    return data


def budget_plans(models: dict[str, str] | None = None, gpus: tuple[int, ...] = GPU_SIZES) -> dict[str, list[Plan]]:
    """Each model's plan (name -> config path; MODELS by default) at each GPU size, on records of one PHOTO-sized
    image, on the MACHINE (the same table wherever and however busy it is made)."""
    models = {name: str(CONFIGS / file) for name, file in MODELS.items()} if models is None else models
    with tempfile.TemporaryDirectory() as tmp, stated_machine(**MACHINE):
        data = write_photo_data(Path(tmp))
        return {name: [predict(budget_recipe(path, data, gib, Path(tmp) / "run"), device="cuda", suggest=False)
                       for gib in gpus]
                for name, path in models.items()}


def pixel_budget_markdown(plans: dict[str, list[Plan]], gpus: tuple[int, ...] = GPU_SIZES) -> str:
    """The docs table of `budget_plans`: per model and GPU size, the chosen data.max_pixels (its image tokens,
    the peak), or that even the smallest budget does not fit."""
    head = "| model | " + " | ".join(f"{g} GiB" for g in gpus) + " |"
    rows = [head, "|" + "---|" * (len(gpus) + 1)]
    for name, per_gpu in plans.items():
        cells = [f"{p.settings['max_pixels']:,} px ({_tokens(p.vision['image_tokens'])}, {format_bytes(p.peak_bytes)})"
                 if p.fits else f"does not fit (smallest: {format_bytes(p.peak_bytes)})" for p in per_gpu]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _tokens(n: int) -> str:
    return f"{n:,} token" if n == 1 else f"{n:,} tokens"


def docs_table(text: str) -> str:
    """The generated table in a page's text (between its BEGIN line and END)."""
    return text.split(BEGIN, 1)[1].split("\n", 1)[1].split(END, 1)[0]


def write_docs(plans: dict[str, list[Plan]], page: Path = DOCS) -> None:
    """Put `plans`' table in the page, in place of the one there."""
    text = page.read_text()
    page.write_text(text.replace(docs_table(text), pixel_budget_markdown(plans), 1))


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--docs"]:
        write_docs(budget_plans())
        print(f"wrote the table in {DOCS}")
    else:
        print(f"wrote {write_photo_data(Path(sys.argv[1]))}")
