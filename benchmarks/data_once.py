"""What reading and tokenizing the data a second time cost `finetune run` and `finetune eval`, side by side in one
process: the same steps with the data read once and handed on (finetune.data.build.DataRead, as the commands
now run) and with each step reading it again (as they did before), on a shared sample dataset repeated to a
size where it shows.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/data_once.py [--dataset alpaca_en_demo.json] [--repeat 5]
        [--repeats 3] [--data-dir ../shared/datasets] [--out benchmarks/results/data_once.txt]

The data: the dataset's records --repeat times (one JSON array; alpaca_en_demo: 999 records -> 4,995), 10% held
out (data.validation_split), max_seq_len 1024, tokenized by finetune.testing's tiny model's byte-level BPE
tokenizer (no model hub here; its 482 tokens make a token of every byte or two of text, so more records are cut
to max_seq_len than a real model's tokenizer would cut: the times are this tokenizer's). No model loads and nothing trains: the rows are the data steps of each command before its model loads, and the
run's plan (`predict` of the tiny model on the CPU, its traces cached by a first, unmeasured run) for scale.

- run, once: the preflight's check (`api.preflight`), the plan's read and tokenization of the training part
  (`data_for_run`, with an empty shape cache), the plan (`predict`: the shape from the planner's cache), and the
  build from the plan's read (`build_datasets(read=)`: the held-out part tokenized, the training part taken
  over).
- run, before: the same, but the build reading, rendering and tokenizing everything again.
- eval, once / before: `finetune eval RUN` without --data: the check, the fingerprint of the split, the build,
  from one read and of the held-out part alone (`held_out_only`), or each reading (and the fingerprint and build
  each rendering) it again and the build tokenizing the training part too, which eval does not measure.

Times are CPU seconds of this process (`time.process_time`: the tokenizer's threads included), which other jobs
on a shared machine hardly change. Each variant runs --repeats times, interleaved; the best time counts. The share printed is the second pass's
time over the whole of what the command did before.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "datasets"
RESULTS = ROOT / "benchmarks" / "results" / "data_once.txt"


def timed(step: Callable[[], object]) -> tuple[float, object]:
    """The step's CPU seconds (this process's, its threads' included): steadier than the wall clock on a machine
    shared with other jobs."""
    start = time.process_time()
    out = step()
    return time.process_time() - start, out


def run_steps(recipe, tokenizer, once: bool) -> dict[str, float]:
    """`finetune run`'s data steps before training, with the plan's read handed to the build (`once`) or not."""
    from finetune import api
    from finetune.data.build import build_datasets
    from finetune.plan import DEFAULT_PLANNER, predict
    from finetune.plan.search import data_for_run
    from finetune.units import cache_dir

    DEFAULT_PLANNER.data.clear()  # the data's shape not measured before (the traces are: --repeats > 1)
    shutil.rmtree(cache_dir() / "data_shapes", ignore_errors=True)
    t: dict[str, float] = {}
    t["preflight"], _ = timed(lambda: api.preflight(recipe))
    t["plan's read"], planned = timed(lambda: data_for_run(recipe))
    t["plan"], _ = timed(lambda: predict(recipe, device="cpu"))
    read = planned.read if once else None
    t["build"], _ = timed(lambda: build_datasets(recipe.data, tokenizer, recipe.training.seed, read=read))
    return t


def eval_steps(recipe, tokenizer, once: bool) -> dict[str, float]:
    """`finetune eval RUN`'s data steps: check, fingerprint, build, from one read and of the held-out part alone
    (`once`), or each reading and the build of both parts."""
    from finetune.data.build import build_datasets, built_fingerprint, check_records, data_read

    cfg, seed = recipe.data.model_copy(update={"packing": False}), recipe.training.seed
    t: dict[str, float] = {}
    t["read"], read = timed(lambda: data_read(cfg) if once else None)
    t["check"], _ = timed(lambda: check_records(cfg, read=read))
    t["fingerprint"], _ = timed(lambda: built_fingerprint(cfg, tokenizer, seed, read=read))
    t["build"], _ = timed(lambda: build_datasets(cfg, tokenizer, seed, read=read, held_out_only=once))
    return t


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: min(r[k] for r in runs) for k in runs[0]}


def line(name: str, t: dict[str, float]) -> str:
    steps = ", ".join(f"{k} {v:.2f}" for k, v in t.items())
    return f"  {name:<12} {sum(t.values()):7.2f} s  ({steps})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="alpaca_en_demo.json")
    parser.add_argument("--data-dir", type=Path, default=DATA, help="the shared datasets' folder")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from finetune.recipe.load import validate_recipe
    from finetune.testing import make_tiny_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ["FINETUNE_CACHE"] = str(folder / "cache")
        records = json.loads((args.data_dir / args.dataset).read_text())
        data = folder / "data.json"
        data.write_text(json.dumps(records * args.repeat))
        model = make_tiny_model_dir(folder / "model")
        tokenizer = AutoTokenizer.from_pretrained(model)
        recipe = validate_recipe({
            "model": {"path": str(model)}, "quantization": {"bits": None},
            "data": {"path": str(data), "max_seq_len": 1024, "validation_split": 0.1},
            "training": {"micro_batch_size": 2, "max_steps": 10}, "output": {"dir": str(folder / "run")}})
        runs: dict[str, list[dict[str, float]]] = {"run once": [], "run before": [], "eval once": [],
                                                   "eval before": []}
        run_steps(recipe, tokenizer, True)  # the model's traces on disk: the plan's time is a warm plan's
        for i in range(args.repeats):
            order = [True, False] if i % 2 == 0 else [False, True]
            for once in order:
                runs["run once" if once else "run before"].append(run_steps(recipe, tokenizer, once))
            for once in order:
                runs["eval once" if once else "eval before"].append(eval_steps(recipe, tokenizer, once))
    t = {name: best(r) for name, r in runs.items()}
    run_saved = t["run before"]["build"] - t["run once"]["build"]
    eval_saved = sum(t["eval before"].values()) - sum(t["eval once"].values())
    out = [
        f"# benchmarks/data_once.py --dataset {args.dataset} --repeat {args.repeat} --repeats {args.repeats}",
        f"# {platform.machine()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        f"python {platform.python_version()}",
        f"data: {len(records) * args.repeat:,} records ({args.dataset} x {args.repeat}), 10% held out, "
        "max_seq_len 1024, the tiny model's tokenizer; best of each, CPU seconds",
        "finetune run, its steps before the model loads:",
        line("before", t["run before"]), line("once", t["run once"]),
        f"  the second read and tokenization: {run_saved:.2f} s, {run_saved / sum(t['run before'].values()):.0%} "
        "of those steps before",
        "finetune eval RUN (no --data), its data steps:",
        line("before", t["eval before"]), line("once", t["eval once"]),
        f"  the second and third reads, second rendering and the training part's tokens: {eval_saved:.2f} s, "
        f"{eval_saved / sum(t['eval before'].values()):.0%} of those steps before",
    ]
    text = "\n".join(out)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
