"""The shared sample datasets, side by side in one run: the plan vs the measured peak at the run's real batches,
the real-token share of the micro-batches, and CPU tokens/s of the default recipe before (data.batching: random,
the old default) and after (auto), beside TRL's SFTTrainer (padding-free) on the same examples and model.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/real_data.py [--records 32] [--max-seq-len 512]
        [--micro-batch 4] [--accumulation 2] [--datasets alpaca_en_demo,c4_demo] [--no-trl] [--repeats 1]
        [--out benchmarks/results/real_data.txt]

Each dataset trains one epoch of its first --records records (data.max_samples: sampled with the seed) through
`finetune.api.run`, as `finetune run` does, twice: data.batching random, then auto. Everything else is the
recipe's defaults (LoRA r 16 on every linear layer, AdamW, the planner's memory settings) but the model, a small
random one (benchmarks/batching.py's Llama; mllm_demo: finetune.testing's tiny Qwen2.5-VL), quantization.bits
null (a million weights) and the batch shape (--micro-batch x --accumulation, so that batching has rows to
group). dpo_en_demo trains with training.method dpo.

- planned / measured: the run's plan.json peak (made for the largest micro-batch the run forms: its rows, row
  length and padding, finetune.plan.batches) and the peak the run's tracker measured (metrics.jsonl), as the
  end of `finetune run` prints them (api.run_memory).
- largest: the largest micro-batch of the epoch (padded tokens) over the search's bound (micro-batch rows x the
  longest example): below 100% the run's batches never reach the bound, and its plan is priced below it.
- real: real tokens / padded tokens of one epoch's micro-batches under the run's batching
  (finetune.data.batching.epoch_shape over the data's lengths, finetune.data.build.data_shape; image records
  count their text tokens).
- tokens/CPU-s: the run's real training tokens / the CPU seconds its training took (results.json's
  train_cpu_s; TRL: time.process_time around trainer.train()), so other jobs on a shared machine slow the wall
  clock but hardly this. dpo_en_demo's before and after are the same settings where auto keeps random: their
  ratio is the measurement's noise.
- TRL: SFTTrainer with padding_free=True (one row of the batch's examples, sequence boundaries in position_ids)
  on the same tokenized examples (finetune's build, the same labels as completion_mask), the same model, LoRA,
  batch shape, learning rate and activation checkpointing as the finetune run's plan chose; not run for DPO
  (SFTTrainer) nor the vision records (TRL refuses padding-free vision batches).

Each variant runs --repeats times, interleaved (before, after, TRL, TRL, after, before, ...); the best time
counts. On a shared CPU read the speeds as ratios, not to the percent.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.batching import batch_shapes, tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "datasets"
RESULTS = ROOT / "benchmarks" / "results" / "real_data.txt"
DATASETS = {  # name: (file, training.method, vision-language)
    "alpaca_en_demo": ("alpaca_en_demo.json", "sft", False),
    "identity": ("identity.json", "sft", False),
    "glaive_toolcall_en_demo": ("glaive_toolcall_en_demo.json", "sft", False),
    "c4_demo": ("c4_demo.jsonl", "sft", False),
    "mllm_demo": ("mllm_demo.json", "sft", True),
    "dpo_en_demo": ("dpo_en_demo.json", "dpo", False),
}
TOLERANCE = 0.05  # planned vs measured peak


@dataclass(frozen=True)
class Shape:
    """The benchmark's batch and data size."""

    records: int
    max_seq_len: int
    micro_batch: int
    accumulation: int


@dataclass(frozen=True)
class Measured:
    """One finetune run: its batching (as resolved), plan, measured peak, speed and real-token share."""

    batching: str
    planned: int
    measured: int | None
    tokens: int
    seconds: float
    real_share: float
    largest: float  # the largest micro-batch's padded tokens / the planned micro-batch's (rows x longest)

    @property
    def speed(self) -> float:
        return self.tokens / self.seconds

    @property
    def off(self) -> float | None:
        """measured / planned - 1."""
        return None if self.measured is None else self.measured / self.planned - 1


def recipe_for(data_file: Path, method: str, model: Path, shape: Shape, batching: str, out: Path):
    """The default recipe on `data_file` with the benchmark's model, batch shape and batching."""
    from finetune import api

    return api.validate({
        "model": {"path": str(model)}, "quantization": {"bits": None},
        "data": {"path": str(data_file), "max_samples": shape.records, "max_seq_len": shape.max_seq_len,
                 "batching": batching},
        "training": {"method": method, "micro_batch_size": shape.micro_batch,
                     "gradient_accumulation_steps": shape.accumulation, "seed": 0},
        "output": {"dir": str(out), "save_steps": 10**6}})


def finetune_run(recipe, shape: Shape, takes_images: bool) -> Measured:
    """`recipe` run as `finetune run` runs it; what its run directory says."""
    from finetune import api
    from finetune.data.build import data_shape
    from finetune.model.load import local_tokenizer

    api.run(recipe, overwrite=True)
    files = api.view_of(recipe.output.dir)
    memory = api.run_memory(files)
    results = json.loads((Path(recipe.output.dir) / "results.json").read_text())
    settings = files.plan["settings"]
    tokenizer, _ = local_tokenizer(recipe.model)
    lengths = list(data_shape(recipe.data, tokenizer, recipe.training.seed, recipe.training.method,
                              takes_images).lengths)
    kind = settings["batching"]
    mb, acc = settings["micro_batch_size"], settings["gradient_accumulation_steps"]
    epoch = batch_shapes(lengths, mb, acc)[kind]
    largest = epoch.largest_tokens / (mb * min(max(lengths), shape.max_seq_len))
    return Measured(kind, memory["planned_peak_bytes"], memory["measured_peak_bytes"], results["data"]["train_tokens"],
                    results["train_cpu_s"], epoch.real_share, largest)


def trl_run(recipe, shape: Shape, checkpointing: bool, folder: Path) -> tuple[int, float]:
    """TRL's SFTTrainer, padding-free, on the examples finetune trains `recipe` on: (real tokens, seconds)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from finetune.data import build_datasets

    tokenizer = AutoTokenizer.from_pretrained(recipe.model.path)
    train = build_datasets(recipe.data, tokenizer, seed=recipe.training.seed).train
    rows = {"input_ids": list(train["input_ids"]),
            "completion_mask": [[int(t != -100) for t in labels] for labels in train["labels"]]}
    dataset = Dataset.from_dict(rows)
    a, t = recipe.adapter, recipe.training
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(recipe.model.path, dtype=torch.float32)
    config = SFTConfig(
        output_dir=str(folder), per_device_train_batch_size=shape.micro_batch,
        gradient_accumulation_steps=shape.accumulation, num_train_epochs=1, learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler, warmup_steps=t.warmup_ratio,  # below 1: a ratio max_grad_norm=t.max_grad_norm, seed=0,
        use_cpu=True, report_to=[], save_strategy="no", logging_steps=10**6, disable_tqdm=True,
        activation_checkpointing=checkpointing, padding_free=True, completion_only_loss=True,
        max_length=None, dataloader_num_workers=0)  # the examples are already fitted
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=a.dropout,
                                                target_modules="all-linear", task_type="CAUSAL_LM"))
    start = time.process_time()
    trainer.train()
    return sum(len(ids) for ids in rows["input_ids"]), time.process_time() - start


def plan_checkpointing(recipe) -> bool:
    """Whether the plan checkpoints activations for `recipe` (what TRL is given, to train alike)."""
    from finetune import api

    return bool(api.plan(recipe).settings["activation_checkpointing"])


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the shared datasets' folder")
    parser.add_argument("--records", type=int, default=32)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated, of: " + ", ".join(DATASETS))
    parser.add_argument("--no-trl", action="store_true", help="leave TRL's SFTTrainer out")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each variant, interleaved; the best counts")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    names = args.datasets.split(",")
    unknown = [n for n in names if n not in DATASETS]
    if unknown:
        parser.error(f"unknown dataset(s) {', '.join(unknown)}: one of {', '.join(DATASETS)}")
    if not args.data.is_dir():
        sys.exit(f"{args.data} not found (the shared datasets sit beside the repository: ../shared/datasets)")
    import torch

    from finetune.testing import vision_model

    shape = Shape(args.records, args.max_seq_len, args.micro_batch, args.accumulation)
    lines = [f"# OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} nice -n 10 python benchmarks/real_data.py "
             + shlex.join(argv if argv is not None else sys.argv[1:]),
             f"# {platform.machine()}, {os.cpu_count()} CPUs (shared), torch {torch.__version__}, "
             f"{torch.get_num_threads()} thread(s); best of {args.repeats} interleaved run(s): read speeds as ratios",
             f"# each dataset: its first {shape.records} records (data.max_samples), one epoch, data.max_seq_len "
             f"{shape.max_seq_len}, micro-batch {shape.micro_batch} x accumulation {shape.accumulation}, LoRA r 16, "
             "AdamW; before = data.batching random (the old default), after = auto",
             ""]
    table: list[str] = []
    misses: list[str] = []
    with tempfile.TemporaryDirectory(prefix="real-data-") as tmp:
        folder = Path(tmp)
        text_model = tiny_model(folder / "model")
        vlm = None
        for name in names:
            file, method, vision = DATASETS[name]
            if vision and vlm is None:
                vlm = vision_model("qwen2_5_vl", folder / "vlm")
            model = vlm if vision else text_model
            runs: dict[str, Measured] = {}
            trl: tuple[int, float] | None = None
            for repeat in range(args.repeats):  # interleaved, the order reversed each time; the best time counts
                variants = [("before", "random"), ("after", "auto"), ("TRL", None)]
                for when, batching in variants if repeat % 2 == 0 else variants[::-1]:
                    if batching is not None:
                        recipe = recipe_for(args.data / file, method, model, shape, batching, folder / f"{name}-{when}")
                        new = finetune_run(recipe, shape, vision)
                        runs[when] = new if when not in runs or new.seconds < runs[when].seconds else runs[when]
                    elif not args.no_trl and method == "sft" and not vision:
                        recipe = recipe_for(args.data / file, method, model, shape, "random", folder / f"{name}-trl")
                        checkpointing = plan_checkpointing(recipe)
                        new_trl = trl_run(recipe, shape, checkpointing, folder / f"{name}-trl")
                        trl = new_trl if trl is None or new_trl[1] < trl[1] else trl
            runs = {"before": runs["before"], "after": runs["after"]}
            table += row(name, method, runs, trl)
            misses += [f"{name} {when} ({r.batching}): measured {r.off:+.1%} of planned"
                       for when, r in runs.items() if r.off is not None and abs(r.off) > TOLERANCE]
            print("\n".join(lines + HEADER + table), flush=True)
    summary = [""] + ([f"outside {TOLERANCE:.0%}: " + "; ".join(misses)] if misses
                      else [f"every planned peak within {TOLERANCE:.0%} of the measured one"])
    text = "\n".join(lines + HEADER + table + summary) + "\n"
    print(text)
    args.out.write_text(text)
    return 0


HEADER = [f"{'dataset':24s} {'run':6s} {'batching':14s} {'planned MiB':>11s} {'measured':>9s} {'off':>6s} "
          f"{'largest':>7s} {'real':>6s} {'tok/CPU-s':>10s} {'x before':>8s}"]


def row(name: str, method: str, runs: dict[str, Measured], trl: tuple[int, float] | None) -> list[str]:
    """The dataset's lines: before, after, and TRL's speed."""
    base = runs["before"].speed
    out = []
    for when, r in runs.items():
        off = "-" if r.off is None else f"{r.off:+.1%}"
        label = name + (" (dpo)" if method == "dpo" else "") if when == "before" else ""
        out.append(f"{label:24s} {when:6s} {r.batching:14s} {mib(r.planned):>11s} {mib(r.measured):>9s} {off:>6s} "
                   f"{r.largest:7.0%} {r.real_share:6.1%} {r.speed:10.0f} {r.speed / base:7.2f}x")
    if trl is not None:
        speed = trl[0] / trl[1]
        out.append(f"{'':24s} {'TRL':6s} {'padding_free':14s} {'-':>11s} {'-':>9s} {'-':>6s} {'-':>7s} "
                   f"{'100.0%':>6s} {speed:10.0f} {speed / base:7.2f}x   (after / TRL {runs['after'].speed / speed:.2f}x)")
    return out


if __name__ == "__main__":
    sys.exit(main())
