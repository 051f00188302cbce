"""The GRPO quickstart's result: `finetune run recipes/grpo-quickstart.yaml` as a user runs it, then what it
learned: the held-out reward of greedy answers to the 50 unseen questions before and after training (each reward
apart), the sampled answers' mean reward over the first and last steps, the wall and CPU time (issue 28).

    OMP_NUM_THREADS=2 python benchmarks/grpo_quickstart.py [--out benchmarks/results/grpo_quickstart.txt]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "grpo_quickstart.txt"
RECIPE = ROOT / "recipes" / "grpo-quickstart.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--steps", type=int, help="training.max_steps instead of the recipe's (a quick look)")
    args = parser.parse_args(argv)
    from finetune import api
    from finetune.rundir import RunDir

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"output.dir={tmp}/run"] + ([f"training.max_steps={args.steps}"] if args.steps else [])
        recipe = api.load_recipe(RECIPE, overrides)
        wall, cpu = time.time(), time.process_time()
        result = api.run(recipe)
        wall, cpu = time.time() - wall, time.process_time() - cpu
        rows = [r for r in RunDir(result.run_dir).read_metrics() if "reward" in r and "loss" in r]
        samples = RunDir(result.run_dir).read_completions()
    before, after = result.eval_before or {}, result.eval_after or {}
    k = min(5, len(rows) // 2) or 1
    lines = [f"# {' '.join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])}",
             f"# {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
             f"{platform.machine()}; {RECIPE.relative_to(ROOT)}, {result.steps} steps",
             f"# wall {wall / 60:.1f} min, CPU {cpu / 60:.1f} min (model load, both evaluations and training)", "",
             "held-out reward of greedy answers (50 questions)   before   after"]
    for key in [k for k in after if k.startswith("eval_") and k != "eval_runtime"]:
        lines.append(f"  {key[len('eval_'):]:<47} {before.get(key, float('nan')):>7.3f} {after[key]:>7.3f}")
    mean = lambda part: sum(r["reward"] for r in part) / len(part)  # noqa: E731
    lines += ["", f"sampled answers' mean reward: steps 1-{k} {mean(rows[:k]):.3f}, "
              f"steps {len(rows) - k + 1}-{len(rows)} {mean(rows[-k:]):.3f}",
              "per step: " + " ".join(f"{r['reward']:.2f}" for r in rows),
              "completion tokens per step: " + " ".join(f"{r['completion_length']:.0f}" for r in rows), "",
              "last step's sampled answers:"]
    last = [s for s in samples if s["step"] == samples[-1]["step"]] if samples else []
    question = lambda s: (re.search(r"What is [^?]*\?", s["prompt"]) or re.search(".*", s["where"])).group(0)  # noqa: E731
    lines += [f"  {s['where']} {question(s)} {s['completion']!r} -> {s['reward']:.2f}" for s in last]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
