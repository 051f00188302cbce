"""What the data preflight's image check costs: headers and end markers only, against the check as it is (each
image also decoded once, in full, so a broken stream behind a good header is a bad record before training).

    nice -n 10 python benchmarks/image_checks.py            # ~3 min on the shared 2-core machine

Writes 1,000 noise PNGs of 512 x 512 and 100 noise JPEGs of 1920 x 1080 (noise, so they do not compress away)
and a LLaMA-Factory data file for each set, then times in one process, side by side: `check_records` (what
`validate`, `plan` and `run` do before a model loads) with the decode switched off (the header check alone),
the check as shipped (first call: every image decoded), a second call of it (the answers this process keeps),
and a call as a later process makes it (`validate` then `run`: the answers read from the check cache on disk,
by path, size and modification time). Ratios are the claim; absolute times depend on the machine and its load. Result: benchmarks/results/image_checks.txt.
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

import finetune.data.images as images  # noqa: E402
from finetune.data.build import check_records  # noqa: E402
from finetune.recipe.schema import DataConfig  # noqa: E402

SETS = [(1000, (512, 512), "png"), (100, (1920, 1080), "jpg")]
RESULT = Path(__file__).parent / "results" / "image_checks.txt"


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="image-checks-"))
    try:
        lines = [line for n, size, kind in SETS for line in measure(folder / kind, n, size, kind)]
    finally:
        shutil.rmtree(folder)
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text("\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + "\n")


def _timed(data: Path, n: int) -> float:
    start = time.perf_counter()
    out = check_records(DataConfig(path=str(data)), model_takes_images=True)
    assert out["images"] == n and out["bad_records"] == 0, out
    return time.perf_counter() - start


def measure(folder: Path, n: int, size: tuple[int, int], kind: str) -> list[str]:
    folder.mkdir(parents=True)
    for i in range(n):  # each image its own noise: no two files alike
        Image.frombytes("RGB", size, os.urandom(size[0] * size[1] * 3)).save(folder / f"{i}.{kind}")
    records = [{"messages": [{"role": "user", "content": "<image>What is it?"},
                             {"role": "assistant", "content": "Noise."}], "images": [f"{i}.{kind}"]} for i in range(n)]
    data = folder / "data.json"
    data.write_text(json.dumps(records))

    decode = images._decode
    images._decode = lambda path: None  # the header check alone, as the preflight was before it decoded
    (folder / "no-cache").write_text("")  # a cache folder that is a file: no check cache, as before it was kept
    _fresh_process(folder / "no-cache")
    header = _timed(data, n)
    images._decode = decode
    _fresh_process(folder / "cache")
    first = _timed(data, n)
    again = _timed(data, n)
    _fresh_process(folder / "cache")  # the same cache folder: what a later command finds there
    later = _timed(data, n)

    mb = sum(p.stat().st_size for p in folder.glob(f"*.{kind}")) / n / 1e6
    per = 1e3 / n
    return [f"{n} {kind.upper()}s of {size[0]}x{size[1]} ({mb:.2f} MB each), one process, OMP_NUM_THREADS=1",
            f"  header check only:            {header:7.3f} s ({header * per:6.2f} ms per image)",
            f"  check with one full decode:   {first:7.3f} s ({first * per:6.2f} ms per image)",
            f"  the same again (cached):      {again:7.3f} s ({again * per:6.2f} ms per image)",
            f"  a later process (disk cache): {later:7.3f} s ({later * per:6.2f} ms per image)",
            f"  decode / header only: {first / header:.1f}x; cached / header only: {again / header:.2f}x; "
            f"later process / header only: {later / header:.2f}x"]


def _fresh_process(cache: Path) -> None:
    """The check as a new process starts it: nothing in memory, the check cache under `cache`."""
    os.environ["FINETUNE_CACHE"] = str(cache)
    images._checked.cache_clear()
    images.CHECKS = images.CheckCache()


if __name__ == "__main__":
    main()
