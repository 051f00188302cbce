"""`finetune eval --compare` on the quickstart's 8 held-out records, CPU time side by side in one process: the
old default answer length (a fixed 64 new tokens) against the new one (twice the longest expected answer's
tokens + 16), both ending an answer at the chat template's end of turn. The base model of the quickstart
never ends its turn on these prompts (it repeats a sentence), so its answers run to the limit either way.

The run evaluated is `recipes/quickstart.yaml` trained here first (`--steps`: fewer than the recipe's 60 on a
loaded machine; then the run, too, answers more like its base model and runs to the limit). Each setting is
evaluated after a warm-up evaluation, so both read a loaded, converted model.

    OMP_NUM_THREADS=1 python benchmarks/eval_length.py [--steps 60] [--out benchmarks/results/eval_length.txt]
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
RESULTS = ROOT / "benchmarks" / "results" / "eval_length.txt"
RECIPE = ROOT / "recipes" / "quickstart.yaml"
HELD_OUT = ROOT / "recipes" / "data" / "quickstart_heldout.jsonl"
OLD_DEFAULT = 64  # finetune eval's --max-new-tokens default before it was derived from the expected answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--steps", type=int, help="training.max_steps instead of the recipe's 60")
    args = parser.parse_args(argv)
    from finetune import api
    from finetune.cli_tables import capped_line
    from finetune.evaluate.report import table

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"output.dir={tmp}/run"] + ([f"training.max_steps={args.steps}"] if args.steps else [])
        recipe = api.load_recipe(RECIPE, overrides)
        trained = time.process_time()
        run = api.run(recipe)
        trained = time.process_time() - trained
        api.evaluate(run.run_dir, HELD_OUT, max_new_tokens=1)  # warm-up: imports, the converted model's files
        measured = {}
        for name, limit in (("old default (64 new tokens)", OLD_DEFAULT), ("new default (from the answers)", None)):
            cpu, wall = time.process_time(), time.time()
            report = api.evaluate(run.run_dir, HELD_OUT, compare=[], max_new_tokens=limit)
            measured[name] = (time.process_time() - cpu, time.time() - wall, report)
    old, new = (measured[name][0] for name in measured)
    lines = [f"# {' '.join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])}",
             f"# {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
             f"{platform.machine()}; {RECIPE.relative_to(ROOT)} trained {run.steps} steps "
             f"(CPU {trained:.0f} s), then finetune eval --compare on {HELD_OUT.relative_to(ROOT)}", ""]
    for name, (cpu, wall, report) in measured.items():
        headers, rows = table(report)
        lines += [f"{name}: max_new_tokens {report['max_new_tokens']}, CPU {cpu:.1f} s, wall {wall:.1f} s",
                  "  " + "  ".join(f"{h:>10}" for h in headers),
                  *("  " + "  ".join(f"{c:>10}" for c in row) for row in rows),
                  f"  {capped_line(report) or 'no answer cut at the limit'}", ""]
    lines.append(f"CPU time, new / old default: {new / old:.2f} ({old / new:.1f}x less)")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
