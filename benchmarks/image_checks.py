"""The data preflight's image check (headers and the file's last bytes) against decoding every image.

    nice -n 10 python benchmarks/image_checks.py            # ~1 min on the shared 2-core machine

Writes N photo-sized JPEGs (1920 x 1080, noise so they do not compress away) and a LLaMA-Factory data file
naming them, then times, side by side in one process: `check_records` (what `validate`, `plan` and `run` do
before a model loads: every record normalised and every image checked from its header) and decoding each
image to RGB with Pillow (what a check that reads the pixels would cost). The ratio is the claim; the
absolute times depend on the machine and its load. Result: benchmarks/results/image_checks.txt.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from PIL import Image  # noqa: E402

from finetune.data.build import check_records  # noqa: E402
from finetune.recipe.schema import DataConfig  # noqa: E402

N = 200
SIZE = (1920, 1080)
RESULT = Path(__file__).parent / "results" / "image_checks.txt"


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="image-checks-"))
    try:
        report(folder)
    finally:
        shutil.rmtree(folder)


def report(folder: Path) -> None:
    noise = Image.frombytes("RGB", SIZE, os.urandom(SIZE[0] * SIZE[1] * 3))
    for i in range(N):
        noise.save(folder / f"{i}.jpg", quality=90)
    records = [{"messages": [{"role": "user", "content": "<image>What is it?"},
                             {"role": "assistant", "content": "Noise."}], "images": [f"{i}.jpg"]} for i in range(N)]
    data = folder / "data.json"
    data.write_text(json.dumps(records))

    start = time.perf_counter()
    out = check_records(DataConfig(path=str(data)), model_takes_images=True)
    checked = time.perf_counter() - start
    assert out["images"] == N and out["bad_records"] == 0, out

    start = time.perf_counter()
    for i in range(N):
        with Image.open(folder / f"{i}.jpg") as image:
            image.convert("RGB")
    decoded = time.perf_counter() - start

    size = sum(p.stat().st_size for p in folder.glob("*.jpg")) / N / 1e6
    lines = [f"{N} JPEGs of {SIZE[0]}x{SIZE[1]} ({size:.1f} MB each), one process, OMP_NUM_THREADS=1",
             f"check_records (headers + last bytes): {checked:.3f} s ({checked / N * 1e3:.2f} ms per image)",
             f"decoding every image to RGB:          {decoded:.3f} s ({decoded / N * 1e3:.2f} ms per image)",
             f"decoding / checking: {decoded / checked:.1f}x"]
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text("\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
