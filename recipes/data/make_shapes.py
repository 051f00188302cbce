"""Write the CPU vision demo's data and model: recipes/data/shapes/ and recipes/models/tiny-qwen2.5-vl/.

The data is the synthetic coloured-shape task (finetune.testing.shape_task): 64 training and 32 held-out
56x56 pictures of one red, green, blue or yellow circle, square or triangle, each with the question "What colour
is the shape?" and the colour as its answer, in LLaMA-Factory's format (`<image>` marker, `images` relative to
the file). The model is a tiny random Qwen2.5-VL (finetune.testing.vision_model: the real config class, shrunk;
about a million weights), which answers at chance, or worse, before training. recipes/vision-demo-cpu.yaml
trains it; benchmarks/vision_demo.py measures the held-out answers before and after. Deterministic data:
running it again writes the same bytes (tests/test_vision_use.py checks the committed files are current).

    python recipes/data/make_shapes.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

from finetune.testing import shape_task, vision_model

DATA = Path(__file__).with_name("shapes")
MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen2.5-vl"
TRAIN, HELD_OUT, SEED = 64, 32, 0


def write_data(folder: Path = DATA) -> tuple[Path, Path]:
    """The task's files in `folder` (replaced whole)."""
    shutil.rmtree(folder, ignore_errors=True)
    return shape_task(folder, train=TRAIN, held_out=HELD_OUT, seed=SEED)


if __name__ == "__main__":
    train, held_out = write_data()
    shutil.rmtree(MODEL, ignore_errors=True)
    vision_model("qwen2_5_vl", MODEL)
    print(f"wrote {train}, {held_out} and the model {MODEL}")
