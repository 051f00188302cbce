"""The planner against peak memory that others measured on real GPUs: torchtune's README tables.

Each row is torchtune's configuration written as a recipe (same model, quantization, adapter and its dtype,
micro-batch, length, checkpointing, loss chunking, offload, optimizer and where its state lives, compile),
planned on the meta device from config.json alone (benchmarks/published/). torchtune reports the allocator's
peak ("peak memory active"), so the comparison takes the plan's peak without the CUDA context and the
allocator's rounding (`allocated` below); a paged optimizer's state (CUDA managed memory) is in neither.

Source: https://github.com/pytorch/torchtune README, "Memory and training speed" (Llama 3.1 8B: batch 2, no
gradient accumulation, packed to 2048 tokens, torch.compile on; configs llama3_1/8B_{lora,qlora,full}_single_device)
and "Optimization flags" (Llama 3.2 3B, full_finetune_single_device, batch 2, max length 4096, bf16, A100, each
technique added to the row above; LoRA and QLoRA rows without optimizer-in-backward or 8-bit AdamW; configs
llama3_2/3B_{lora,qlora}_single_device). torchtune trains LoRA weights in bf16 (adapter.dtype: bf16), runs the
optimizer in backward (optimizer.layerwise) and keeps full-vocabulary bf16 logits in its chunked loss, which ours
never makes (memory.chunked_loss): the rows whose peak is in the backward are predicted low by about that much.

    python benchmarks/published.py > benchmarks/results/published.txt
"""

from __future__ import annotations

import statistics
from pathlib import Path

from finetune.plan import predict
from finetune.plan.memory_model import ALLOCATOR_OVERHEAD, CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES
from finetune.recipe.schema import Recipe

HERE = Path(__file__).resolve().parent / "published"
GIB = 2**30
ATTN_MLP = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_8B = {"type": "lora", "r": 8, "alpha": 16, "dropout": 0.0, "dtype": "bf16", "target_modules": ATTN_MLP}
QLORA_8B = {**LORA_8B, "target_modules": ["k_proj", *ATTN_MLP]}
LORA_3B = {**LORA_8B, "r": 64, "alpha": 128}
FULL = {"type": "full"}


def _mem(ckpt: bool, chunked: bool, offload: str = "none", recompute_norms: bool = True) -> dict:
    return {"activation_checkpointing": ckpt, "chunked_loss": chunked, "offload": offload, "tiled_mlp": False,
            "recompute_norms": recompute_norms}


def _opt(name: str, in_backward: bool = False) -> dict:
    return {"name": name, "layerwise": in_backward}


# (label, torchtune's GiB, model, seq, adapter, bits, memory, optimizer, compile)
ROWS = [
    ("8B LoRA, RTX 4090", 16.2, "llama-3.1-8b", 2048, LORA_8B, None, _mem(True, True), _opt("adamw"), True),
    ("8B QLoRA, RTX 4090", 7.4, "llama-3.1-8b", 2048, QLORA_8B, 4, _mem(True, True), _opt("adamw"), True),
    ("8B full, paged 8-bit AdamW in bwd, 4090", 18.9, "llama-3.1-8b", 2048, FULL, None, _mem(True, True),
     _opt("paged_adamw_8bit", True), True),
    # torchtune's RMSNorm keeps fp32 copies unless compiled: the uncompiled row recomputes nothing
    ("3B packed baseline, A100", 60.0, "llama-3.2-3b", 4096, FULL, None, _mem(False, False, recompute_norms=False),
     _opt("adamw"), False),
    ("3B + compile", 51.0, "llama-3.2-3b", 4096, FULL, None, _mem(False, False), _opt("adamw"), True),
    ("3B + chunked cross-entropy", 42.9, "llama-3.2-3b", 4096, FULL, None, _mem(False, True), _opt("adamw"), True),
    ("3B + activation checkpointing", 24.9, "llama-3.2-3b", 4096, FULL, None, _mem(True, True), _opt("adamw"), True),
    ("3B + optimizer in backward", 23.1, "llama-3.2-3b", 4096, FULL, None, _mem(True, True), _opt("adamw", True),
     True),
    ("3B + cpu activation offload", 21.8, "llama-3.2-3b", 4096, FULL, None, _mem(True, True, "cpu"),
     _opt("adamw", True), True),
    ("3B + 8-bit AdamW", 17.6, "llama-3.2-3b", 4096, FULL, None, _mem(True, True, "cpu"), _opt("adamw_8bit", True),
     True),
    ("3B LoRA r64 (no 8-bit, no in-bwd)", 8.5, "llama-3.2-3b", 4096, LORA_3B, None, _mem(True, True, "cpu"),
     _opt("adamw"), True),
    ("3B QLoRA r64", 4.6, "llama-3.2-3b", 4096, LORA_3B, 4, _mem(True, True, "cpu"), _opt("adamw"), True),
]


def recipe(model: str, seq: int, adapter: dict, bits: int | None, memory: dict, optimizer: dict,
           compile_: bool) -> Recipe:
    return Recipe.model_validate({
        "model": {"path": str(HERE / f"{model}.json"), "dtype": "bf16", "attn_implementation": "sdpa"},
        "data": {"path": "unused.jsonl", "max_seq_len": seq, "packing": True},
        "quantization": {"bits": bits}, "adapter": adapter, "memory": {**memory, "gpu_memory_margin": 0},
        "training": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "compile": compile_},
        "optimizer": optimizer})


def allocated(peak: int) -> float:
    """The plan's peak as the allocator counts it: without the CUDA context and the allocator's rounding
    (memory_model's fixed costs; the cuBLAS workspace is allocated through the allocator and stays)."""
    return (peak - CUDA_CONTEXT_BYTES - CUBLAS_WORKSPACE_BYTES) / (1 + ALLOCATOR_OVERHEAD) + CUBLAS_WORKSPACE_BYTES


def main() -> None:
    print("# python benchmarks/published.py  (planner on the meta device, device=cuda, bf16, sdpa, micro-batch 2)")
    print(f"{'row':42} {'torchtune':>9} {'planned':>8} {'ratio':>6} {'managed':>8}  peak parts (GiB)")
    ratios = []
    for label, theirs, model, seq, adapter, bits, memory, optimizer, compile_ in ROWS:
        plan = predict(recipe(model, seq, adapter, bits, memory, optimizer, compile_), gpu_memory="80GiB",
                       device="cuda")
        ours = allocated(plan.peak_bytes) / GIB
        ratios.append(ours / theirs)
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in plan.breakdown.items() if v and k != "other")
        print(f"{label:42} {theirs:>9.1f} {ours:>8.2f} {ours / theirs:>6.2f} {plan.managed_bytes / GIB:>8.2f}  {parts}")
    within = sum(abs(r - 1) <= 0.10 for r in ratios)
    print(f"# {within} of {len(ratios)} rows within 10%; median ratio {statistics.median(ratios):.2f}, "
          f"range {min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
