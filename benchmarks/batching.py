"""data.batching side by side: real-token share and CPU tokens/s of random, length-grouped and token-budget
micro-batches on alpaca_en_demo, in one run.

    nice -n 10 python benchmarks/batching.py [--records 96] [--micro-batch 8] [--accumulation 4] [--threads 1]

The share is over the whole file (999 records, every epoch's micro-batches as the run forms them,
finetune.data.batching.epoch_shape); the speed is training through the project's loop (simple_loop: the
padded collator, the loss normalised by the step's labelled tokens) over one epoch of the first --records
records, a small Llama with random weights (finetune.testing's tiny model widened to 128, 4 layers, its
trained byte-level BPE tokenizer), full fine-tuning, AdamW. Each variant runs --repeats times, interleaved
(random, grouped, budget, budget, grouped, random, ...), each from the same weights; the best time counts.
Tokens/s counts real (non-padding) tokens: the work the data asks for.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.data import build_datasets  # noqa: E402
from finetune.data.batching import Batching, EpochShape, epoch_shape  # noqa: E402
from finetune.data.packing import make_collator  # noqa: E402
from finetune.recipe import validate_recipe  # noqa: E402
from finetune.recipe.resolved import resolve  # noqa: E402
from finetune.recipe.schema import BATCHINGS, DataConfig  # noqa: E402
from finetune.testing import make_tiny_model_dir  # noqa: E402
from finetune.train.setup import simple_loop  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "alpaca_en_demo.json"
SHAPE = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 4}


def tiny_model(folder: Path) -> Path:
    """The benchmarks' small Llama with random weights (finetune.testing's tiny model widened to SHAPE, its
    trained byte-level BPE tokenizer), written to `folder`."""
    return make_tiny_model_dir(folder, **SHAPE)


def batch_shapes(lengths: list[int], micro_batch: int, accumulation: int) -> dict[str, EpochShape]:
    """Every batching's micro-batches of one epoch over examples of `lengths` (token_budget at the run's
    budget: micro_batch x the longest example)."""
    budget = micro_batch * max(lengths)
    return {k: epoch_shape(lengths, Batching(k, micro_batch, accumulation, token_budget=budget)) for k in BATCHINGS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--records", type=int, default=96)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.data.is_file():
        sys.exit(f"{args.data} not found (the shared datasets sit beside the repository: ../shared/datasets)")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(tempfile.mkdtemp(prefix="batching-bench-"))
    model_dir = tiny_model(folder / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train = build_datasets(DataConfig(path=str(args.data), max_seq_len=4096), tokenizer, seed=0).train
    lengths = [len(ids) for ids in train["input_ids"]]
    mb, acc = args.micro_batch, args.accumulation
    print(f"{args.data.name}: {len(lengths)} examples, median {statistics.median(lengths):.0f} tokens, longest "
          f"{max(lengths)} (tiny byte-level BPE tokenizer); micro-batch {mb} x accumulation {acc}; "
          f"{args.threads} CPU thread(s)")
    print("\nreal-token share of every micro-batch of one epoch over the whole file:")
    for k, s in batch_shapes(lengths, mb, acc).items():
        print(f"  {k:15s} real {100 * s.real_share:5.1f}%  padded tokens {s.padded_tokens:8d}  "
              f"forward/backwards {s.passes:4d}  largest micro-batch {s.largest_rows} rows / {s.largest_tokens} tokens")

    subset = [train[i] for i in range(min(args.records, len(train)))]
    real = sum(len(r["input_ids"]) for r in subset)
    steps = -(-len(subset) // (mb * acc))
    collator = make_collator(tokenizer, packed=False)
    seconds: dict[str, list[float]] = {k: [] for k in BATCHINGS}
    order = list(BATCHINGS)
    for repeat in range(args.repeats):
        for kind in order if repeat % 2 == 0 else order[::-1]:
            config = resolve(validate_recipe({
                "model": {"path": str(model_dir)}, "data": {"path": str(args.data), "batching": kind},
                "adapter": {"type": "full"}, "quantization": {"bits": None},
                "training": {"micro_batch_size": mb, "gradient_accumulation_steps": acc, "noise_scale": False,
                             "learning_rate": 1e-4, "seed": 0},
                "memory": {"activation_checkpointing": False, "chunked_loss": False, "tiled_mlp": False}}))
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            loop = simple_loop(config, model, subset, collator, steps)
            start = time.perf_counter()
            loop.fit()
            seconds[kind].append(time.perf_counter() - start)
            print(f"  ({kind}: {seconds[kind][-1]:.2f} s)", flush=True)
    base = min(seconds["random"])
    print(f"\ntraining one epoch of the first {len(subset)} records ({real} real tokens, {steps} steps), "
          f"best of {args.repeats}:")
    for kind, times in seconds.items():
        best = min(times)
        print(f"  {kind:15s} {best:7.2f} s  {real / best:8.0f} real tokens/s  {base / best:5.2f}x random's speed")


if __name__ == "__main__":
    main()
