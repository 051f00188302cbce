"""The planner's price of GRPO's generation against measured generation on this CPU, one run.

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 nice -n 10 python benchmarks/grpo_speed_model.py

On the GRPO quickstart (recipes/grpo-quickstart.yaml: SmolLM2-135M-Instruct, LoRA r16 all-linear, 8
completions of 32 tokens per step): the plan's rollout seconds (finetune.plan.cost_model.rollout_seconds,
priced with this CPU's measured matmul throughput and memory bandwidth) for 8 and for 32 completions at once,
next to the measured time of the same generation (the recipe's model with its adapter, greedy, every
completion forced to its full length, prompts of data.max_seq_len - max_completion_length tokens, as the
planner prices them). Wall and CPU seconds (the step's CPU time over the threads: what it takes with the
cores to itself). The last column is the per-layer overhead the measurement implies
(cost_model.LAYER_OVERHEAD_S: the CPU's set from this benchmark; the GPU's to be set from the GPU kit's rows).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.memory.bandwidth import cpu_compute  # noqa: E402
from finetune.plan import predict  # noqa: E402
from finetune.plan.cost_model import Weights, rollout_of, rollout_seconds  # noqa: E402
from finetune.plan.search import model_spec  # noqa: E402
from finetune.plan.shapes import load_model_config  # noqa: E402
from finetune.plan.trace import model_facts  # noqa: E402
from finetune.recipe.load import load_recipe  # noqa: E402
from finetune.recipe.settings import Settings, read_settings  # noqa: E402
from finetune.train.measure import step_setup  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "grpo-quickstart.yaml"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sequences", type=int, nargs="*", default=[8, 32])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    probe = cpu_compute(refresh=True)
    recipe, model, _, vocab = step_setup(load_recipe(args.recipe))
    plan = predict(recipe, device="cpu")
    config = load_model_config(recipe.model.path)
    spec = model_spec(recipe, config, "cpu")
    settings = Settings(**read_settings(recipe))
    shapes = model_facts(config, recipe.model.attn_implementation)[0]
    figures = plan.device_figures
    weights = Weights(shapes.total, shapes.num_layers * shapes.layer_linear if settings.bits else 0,
                      settings.bits or 0, spec.dtype.itemsize, spec.num_layers, spec.hidden_size)
    base = rollout_of(spec, settings)
    prompt, completion = base.prompt_tokens, base.completion_tokens
    model.eval()
    gen = torch.Generator().manual_seed(0)

    def generate(rows: int) -> tuple[float, float]:
        ids = torch.randint(10, vocab - 10, (rows, prompt), generator=gen)
        start, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=completion,
                                 min_new_tokens=completion, do_sample=False)
        assert out.shape[1] == prompt + completion
        return time.perf_counter() - start, (time.process_time() - cpu) / args.threads

    print(f"# {Path(args.recipe).name}: {spec.num_layers} layers, prompts {prompt} + completions {completion} "
          f"tokens; torch threads {args.threads}; median of {args.repeats} after one warm-up")
    print(f"# probe: {', '.join(f'{k} {v / 1e9:.1f}G' for k, v in probe.items())} -> peak "
          f"{figures['flops'] / 1e9:.1f} GFLOP/s, mem_bw {figures['mem_bw'] / 1e9:.1f} GB/s, "
          f"layer overhead {figures['layer_s'] * 1e3:.2f} ms (cost_model.LAYER_OVERHEAD_S)\n")
    print(f"{'completions':>11} {'predicted s':>12} {'measured s':>11} {'pred/meas':>10} {'CPU s':>7} "
          f"{'pred/CPU':>9} {'implied layer ms':>17}")
    for rows in args.sequences:
        rollout = replace(base, sequences=rows, scoring_passes=0, iterations=1)
        predicted = rollout_seconds(rollout, weights, figures, settings.micro_batch_size)
        bare = rollout_seconds(rollout, weights, {**figures, "layer_s": 0.0}, settings.micro_batch_size)
        generate(rows)
        wall, cpu = (statistics.median(t) for t in zip(*(generate(rows) for _ in range(args.repeats)), strict=True))
        implied = (cpu - bare) / (spec.num_layers * (completion + 1))
        print(f"{rows:>11} {predicted:>12.2f} {wall:>11.2f} {predicted / wall:>10.2f} {cpu:>7.2f} "
              f"{predicted / cpu:>9.2f} {implied * 1e3:>17.3f}")


if __name__ == "__main__":
    main()
