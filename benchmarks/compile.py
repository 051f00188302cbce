"""training.compile on the CPU: the same LoRA training with and without the per-layer torch.compile, side by side.

    OMP_NUM_THREADS=1 python benchmarks/compile.py      # about 10 minutes on the shared 2-core machine

For each model (a tiny dense Llama and a tiny Qwen3-MoE, random weights, fp32), LoRA r 8 on every linear layer
of the decoder, micro-batch 2 x SEQ tokens, AdamW, the same batch for STEPS steps: once eager, once with every
decoder layer compiled by finetune's `compile_layers` (inductor's CPU backend, one graph shared by the layers);
the two runs' steps interleaved, so the shared machine's load falls on both alike.
Printed per model: median tokens/s of the steps after the first, the ratio, the largest loss difference over
the steps (the two must train alike), the compile time (the compiled run's first step less its median step)
and the break-even step count (compile time / seconds saved per step: the run length from which compile pays,
what `training.compile: auto` compares the run's steps with), and the graph breaks torch reported.
A second dense row runs with activation checkpointing (transformers' non-reentrant checkpoint around each
layer), where dynamo meets a side effect it will not replay in recompute (transformers' checkpointed layer sets a
context variable): the graph break is counted and that layer runs uncompiled.

Writes benchmarks/results/compile-cpu.txt.
"""

from __future__ import annotations

import copy
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# A cold compile, as a run's first on a machine: inductor's on-disk caches (kernels, FX graphs) start empty
# (a warm cache from an earlier run of the same model cut the dense model's compile from minutes to ~18 s).
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="finetune-compile-bench-")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.compat import graph_breaks  # noqa: E402
from finetune.memory.layer_recompute import compile_layers  # noqa: E402
from finetune.step.training_step import enable_checkpointing, training_step  # noqa: E402
from finetune.testing import tiny_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STEPS = 6
SEQ, MICRO = 256, 2
MODELS = {
    "dense llama (h 256, 4 layers)": ("llama", {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}),
    "moe qwen3_moe (h 128, 4 layers, 8 experts)": ("qwen3_moe", {"hidden_size": 128, "num_hidden_layers": 4}),
}


def lora_copy(base: torch.nn.Module, compiled: bool, checkpointing: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A LoRA copy of `base` (the same adapter initialisation each time), compiled or not, with its optimizer."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                           lora_dropout=0.0))
    enable_checkpointing(model, checkpointing, 1)
    compile_layers(model, compiled)
    model.train()
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def row(name: str, arch: str, shape: dict, checkpointing: bool) -> list[str]:
    """Both models' steps interleaved (eager, compiled, eager, ...) so that the shared machine's load falls on
    both alike."""
    torch.manual_seed(0)
    config = tiny_config(arch, **shape)
    base = __import__("transformers").AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (MICRO, SEQ), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    runs = {mode: lora_copy(base, mode == "compiled", checkpointing) for mode in ("eager", "compiled")}
    losses: dict[str, list[float]] = {mode: [] for mode in runs}
    seconds: dict[str, list[float]] = {mode: [] for mode in runs}
    breaks_before = graph_breaks() or 0
    for _ in range(STEPS):
        for mode, (model, optimizer) in runs.items():
            start = time.perf_counter()
            losses[mode].append(float(training_step(model, [batch], optimizer)[0]))
            seconds[mode].append(time.perf_counter() - start)
    breaks = (graph_breaks() or 0) - breaks_before
    eager, comp = statistics.median(seconds["eager"][1:]), statistics.median(seconds["compiled"][1:])
    compile_s = seconds["compiled"][0] - comp
    saved = eager - comp
    break_even = f"{compile_s / saved:,.0f}" if saved > 0 else "never (no step saved)"
    diff = max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"], strict=True))
    tok = MICRO * SEQ
    label = name + (" + checkpointing" if checkpointing else "")
    return [f"{label}:",
            f"  eager     {tok / eager:8.0f} tokens/s   losses {' '.join(f'{x:.4f}' for x in losses['eager'])}",
            f"  compiled  {tok / comp:8.0f} tokens/s   losses {' '.join(f'{x:.4f}' for x in losses['compiled'])}",
            f"  speed ratio compiled/eager {eager / comp:.2f}x   largest loss difference {diff:.2e}",
            f"  compile time {compile_s:.1f} s   break-even after {break_even} steps   graph breaks {breaks}"
            + ("  (each checkpointed layer ran uncompiled: the ratio is the machine's noise)"
               if checkpointing and breaks else "")]


def main() -> None:
    torch.set_num_threads(1)
    lines = [f"torch {torch.__version__}, CPU, 1 thread, fp32, LoRA r 8 all-linear, micro-batch {MICRO} x {SEQ} "
             f"tokens, {STEPS} steps (median of steps 2..{STEPS}), eager and compiled steps interleaved; inductor's "
             "cache cold (compile time as on a first run); machine shared (load varies: ratios, not absolute "
             "figures)", ""]
    runs = [(name, arch, shape, False) for name, (arch, shape) in MODELS.items()]
    runs.insert(1, (*next(iter(MODELS.items()))[:1], *next(iter(MODELS.values())), True))
    for name, arch, shape, checkpointing in runs:
        lines += row(name, arch, shape, checkpointing)
        print("\n".join(lines[-5:]), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compile-cpu.txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'compile-cpu.txt'}")
    shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


if __name__ == "__main__":
    main()
