"""The CPU vision demo's result: `finetune run recipes/vision-demo-cpu.yaml` as a user runs it (a tiny random
Qwen2.5-VL, LoRA on its language model and vision tower, 64 pictures of a coloured shape), then `finetune eval`
on the 32 held-out pictures against the base model: the held-out loss and how many answers name the right
colour, before and after training, with each picture's answers; the wall and CPU time.

    OMP_NUM_THREADS=2 python benchmarks/vision_demo.py [--out benchmarks/results/vision_demo.txt]
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "vision_demo.txt"
RECIPE = ROOT / "recipes" / "vision-demo-cpu.yaml"
HELD_OUT = ROOT / "recipes" / "data" / "shapes" / "held_out.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--steps", type=int, help="training.max_steps instead of the recipe's (a quick look)")
    args = parser.parse_args(argv)
    from finetune import api
    from finetune.evaluate.report import table

    os.chdir(ROOT)  # the recipe names its model and data relative to the repository
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"output.dir={tmp}/run"] + ([f"training.max_steps={args.steps}"] if args.steps else [])
        recipe = api.load_recipe(RECIPE, overrides)
        wall, cpu = time.time(), time.process_time()
        result = api.run(recipe)
        trained = time.time() - wall
        report = api.evaluate(result.run_dir, HELD_OUT, compare=[], max_new_tokens=8)
        wall, cpu = time.time() - wall, time.process_time() - cpu
    headers, rows = table(report)
    base, tuned = report["models"]
    lines = [f"# {' '.join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])}",
             f"# {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
             f"{platform.machine()}; {RECIPE.relative_to(ROOT)}, {result.steps} steps, final loss "
             f"{result.final_loss:.4f}",
             f"# wall {wall:.0f} s (training {trained:.0f} s), CPU {cpu:.0f} s (model loads, training, both evaluations)",
             "", f"held-out pictures: {report['with_expected_answer']} ({HELD_OUT.relative_to(ROOT)})",
             f"right colour named (exact answer): before {base['exact']['matched']}/{base['exact']['of']}, "
             f"after {tuned['exact']['matched']}/{tuned['exact']['of']} (chance: 1 in 4 for a model that names a colour)",
             "", "  ".join(f"{h:>12}" for h in headers),
             *("  ".join(f"{c:>12}" for c in row) for row in rows), "", "answers (expected: before -> after):"]
    lines += [f"  {Path(r['images'][0]).name}  {r['expected']:<7} {r['answers'][base['label']]!r} -> "
              f"{r['answers'][tuned['label']]!r}" for r in report["answers"]]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
