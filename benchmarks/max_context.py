"""Longest trainable sequence for Llama-3.1-8B QLoRA (r=16, all-linear, dropout 0 as in Unsloth's setup,
micro-batch 1) at 8, 16 and 24 GiB.

Predicted by the planner (no GPU needed): for each budget, binary search over max_seq_len for the longest
sequence with a plan that fits, (a) checkpointing with peft's defaults (fp32 adapter compute, plain norms and
MLP, no offload, full logits), (b) letting the planner choose offload, chunked loss and the tiled MLP, with
LoRA matmuls in bf16 and recomputed norms (our defaults), next to Unsloth's published figures (Unsloth,
Llama 3.1 8B QLoRA: 2,972 / 40,724 / 78,475). cpu offload is limited by this machine's free RAM, disk
offload by the free space where the run directory would be: both are printed.

    python benchmarks/max_context.py > benchmarks/results/max_context.txt
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from finetune.plan import predict
from finetune.plan.shapes import load_model_config
from finetune.recipe.schema import Recipe

CONFIG = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "configs" / "llama-3.1-8b.json"
UNSLOTH = {8: 2972, 16: 40724, 24: 78475}


def recipe(seq: int, planner_memory: bool) -> Recipe:
    if planner_memory:
        memory = {"offload": "auto", "chunked_loss": "auto", "tiled_mlp": "auto"}
    else:
        memory = {"offload": "none", "chunked_loss": False, "tiled_mlp": False, "recompute_norms": False}
    return Recipe.model_validate({
        "model": {"path": str(CONFIG)}, "data": {"path": "unused", "max_seq_len": seq},
        "quantization": {"bits": 4},
        "adapter": {"type": "lora", "r": 16, "dropout": 0.0, "fp32_compute": not planner_memory},
        "training": {"micro_batch_size": 1}, "memory": {"activation_checkpointing": True, **memory},
        "optimizer": {"name": "adamw"}})


def longest(gib: int, planner_memory: bool, config):
    lo, hi, best = 0, 1 << 18, None
    while hi - lo > 256:
        mid = (lo + hi) // 2 // 256 * 256
        plan = predict(recipe(mid, planner_memory), model_config=config, gpu_memory=f"{gib}GiB", device="cuda",
                       suggest=False)  # a search over lengths: no "what would fit" per failed length
        if plan.fits:
            lo, best = mid, plan
        else:
            hi = mid
    return lo, best


def main() -> None:
    config = load_model_config(str(CONFIG))
    import psutil

    from finetune.plan.search import free_disk_bytes

    print("# python benchmarks/max_context.py  (planner prediction, device=cuda, bf16, sdpa, NF4 + double quant,")
    print("#  LoRA r=16 all-linear, micro-batch 1, memory.gpu_memory_margin 512 MiB, CUDA fixed costs included)")
    print(f"#  this machine: {psutil.virtual_memory().available / 2**30:.0f} GiB RAM available (cpu offload), "
          f"{free_disk_bytes(Path('runs')) / 2**30:.0f} GiB free disk (disk offload)")
    print(f"{'budget':>7} {'unsloth':>9} {'peft+ckpt':>10} {'planner':>9} {'vs unsloth':>10}  chosen")
    for gib, theirs in UNSLOTH.items():
        start = time.perf_counter()
        plain, _ = longest(gib, False, config)
        ours, plan = longest(gib, True, config)
        chosen = (f"offload={plan.settings['offload']} chunked_loss={plan.settings['chunked_loss']} "
                  f"tiled_mlp={plan.settings['tiled_mlp']}") if plan else "-"
        print(f"{gib:>5}GB {theirs:>9,} {plain:>10,} {ours:>9,} {ours / theirs:>9.2f}x  {chosen}"
              f"  ({time.perf_counter() - start:.0f} s)")
        if plan:
            parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in plan.breakdown.items() if v)
            print(f"{'':>8}peak at {ours:,} tokens (GiB): {parts}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
