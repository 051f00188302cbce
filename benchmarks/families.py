"""Every dense model family x every method: a tiny model of the family's own config class (finetune.testing)
trains 3 steps through `finetune run` with QLoRA, LoRA, DoRA and full fine-tuning; the plan's peak against the
measured one (the CPU tensor tracker), the first and last loss, the time of each run.

The test suite (tests/test_families.py) trains each family with one method, the methods taking turns; this is
the whole matrix, too slow for CI on two cores.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/families.py > benchmarks/results/families.txt
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

from finetune.cli import main
from finetune.rundir import read_jsonl
from finetune.testing import make_tiny_model_dir
from tests.test_families import DENSE, METHODS, _recipe


def run_one(folder: Path, model: Path, method: str) -> str:
    folder.mkdir(parents=True)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(["run", str(_recipe(folder, model, **METHODS[method]))])
    seconds = time.perf_counter() - start
    rows = read_jsonl(folder / "run" / "metrics.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    measured = max(r["peak_memory_bytes"] for r in rows if "peak_memory_bytes" in r)
    planned = json.loads((folder / "run" / "plan.json").read_text())["peak_bytes"]
    return (f"{folder.parent.name:14s} {method:6s} exit {code}  steps {len(losses)}  loss {losses[0]:.3f} -> "
            f"{losses[-1]:.3f}  plan {planned:>9d}  measured {measured:>9d}  {planned / measured - 1:+6.2%}  "
            f"{seconds:5.1f} s")


def main_matrix() -> None:
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in DENSE:
            model = make_tiny_model_dir(Path(tmp) / model_type / "model", arch=model_type)
            for method in METHODS:
                line = run_one(Path(tmp) / model_type / method, model, method)
                errors.append(abs(float(line.split("%")[0].split()[-1])))
                print(line, flush=True)
    print(f"{len(errors)} runs; plan vs measured peak: worst {max(errors):.2f}%, "
          f"median {sorted(errors)[len(errors) // 2]:.2f}%")


if __name__ == "__main__":
    sys.exit(main_matrix())
