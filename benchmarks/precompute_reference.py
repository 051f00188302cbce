"""training.precompute_reference: step time with the reference forward in each step vs precomputed values.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/precompute_reference.py [RECIPE] [--steps 6]

The recipe's model, adapter, quantization and memory settings (default recipes/dpo-quickstart.yaml: 4-bit
SmolLM2-135M-Instruct, LoRA r=16, checkpointing), one micro-batch of full-length pairs (data.max_seq_len),
the real step (finetune.step.training_step.training_step with the optimizer update). The two variants alternate
step by step, so load on the machine hits both alike; times are CPU seconds of this process (one thread),
so other processes on the machine do not count. Also times the pass itself (the reference forward of one
micro-batch), which precompute pays once per example before training.

Writes benchmarks/results/precompute_reference.txt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.recipe.load import load_recipe  # noqa: E402
from finetune.step.preference import PreferenceLoss, batch_reference_logps, synthetic_batch  # noqa: E402
from finetune.step.training_step import training_step  # noqa: E402
from finetune.train.measure import step_setup  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="recipes/dpo-quickstart.yaml")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant (after one warm-up each)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    given = load_recipe(Path(args.recipe))
    # Built for the in-step variant (with adapter.init_from: the frozen copy of the start adapter loaded)
    training = given.training.model_copy(update={"precompute_reference": False})
    recipe, model, optimizer, vocab = step_setup(given.model_copy(update={"training": training}),
                                                 gpu_memory="24GiB", device="cpu")
    mb, seq, chunked = int(recipe.training.micro_batch_size), recipe.data.max_seq_len, recipe.memory.chunked_loss is True
    in_step = PreferenceLoss.of(recipe.training.model_copy(update={"precompute_reference": False}))
    precomputed = PreferenceLoss.of(recipe.training.model_copy(update={"precompute_reference": True}))
    batch = synthetic_batch(in_step, mb, seq, vocab, "cpu", torch.Generator().manual_seed(0))
    with_ref = {**batch, "ref_logps": batch_reference_logps(model, batch, chunked)}

    def timed(fn) -> float:
        start = time.process_time()
        fn()
        return time.process_time() - start

    variants = {"reference forward in each step": (in_step, batch), "precomputed reference": (precomputed, with_ref)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(args.steps + 1):
        for name, (loss, inputs) in variants.items():
            t = timed(lambda loss=loss, inputs=inputs: training_step(
                model, [inputs], optimizer, max_grad_norm=recipe.training.max_grad_norm, chunked_loss=chunked,
                preference=loss))
            if i:  # the first step of each is a warm-up
                times[name].append(t)
    passes = [timed(lambda: batch_reference_logps(model, batch, chunked)) for _ in range(args.steps)]
    slow, fast = (statistics.median(times[name]) for name in variants)
    lines = [f"recipe {args.recipe}: model {recipe.model.path}, quantization.bits {recipe.quantization.bits}, "
             f"adapter {recipe.adapter.type} r={recipe.adapter.r}, method {recipe.training.method}, micro-batch {mb} "
             f"pairs of {seq} tokens, checkpointing {bool(recipe.memory.activation_checkpointing)}, chunked_loss {chunked}; CPU, 1 thread, CPU "
             f"seconds, median of {args.steps} steps (alternating)",
             *(f"  {name}: {statistics.median(ts):.2f} s/step (min {min(ts):.2f}, max {max(ts):.2f})"
               for name, ts in times.items()),
             f"  precomputed / in-step step time: {fast / slow:.2f} (the step is {1 - fast / slow:.0%} shorter)",
             f"  the pass, per micro-batch (once before training): {statistics.median(passes):.2f} s",
             f"  break-even after {statistics.median(passes) / (slow - fast):.2f} epochs (the pass runs each example "
             "once; each epoch saves the step-time difference once per micro-batch)" if slow > fast
             else "  no saving measured"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "precompute_reference.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
