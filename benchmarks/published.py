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
llama3_2/3B_{lora,qlora}_single_device). torchtune trains LoRA weights in bf16 (adapter.dtype: bf16) and runs the
optimizer in backward (optimizer.layerwise).

torchtune's chunked loss is not ours. Its CEWithChunkedOutputLoss (torchtune/modules/loss/ce_chunked_output_loss.py)
takes the model's logits as a list: TransformerDecoder.chunked_output (torchtune/modules/transformer.py) returns
`[self.output(chunk) for chunk in last_hidden_state.tensor_split(self.num_output_chunks, dim=1)]`, every
chunk's bf16 logits at once (the full tokens x vocab), and each compiled chunk's cross-entropy keeps its chunk
for backward, so `del logits` in the recipe's _loss_step frees nothing; the loss's backward runs every chunk's
cross-entropy before the head's matmuls (higher autograd sequence numbers), each one allocating its chunk's
gradient before its input is freed: one chunk more. memory.chunked_loss never holds more than one chunk, and no
recipe key asks for torchtune's loss, so the `+tt loss` column takes the plan's own windows
(memory_model.Prediction.windows) and replaces, in the window that ends the forward and the one that starts the
backward, our chunked loss's part by torchtune's (`torchtune_loss_peak`). Every row with torchtune's chunked
loss is compiled (its compute_cross_entropy fuses the fp32 upcast: no fp32 copy is held). The rows without it
(baseline, compile) use the non-chunked loss and are priced as planned.

The 3B 8-bit row stays low (0.88): the README does not name its optimizer. Paged (bnb PagedAdamW8bit, the
config's default) cannot be it: its state is outside the allocator's peak (the 8B full row, paged, matches
without it) and would put the row near 9.5 GiB. Planned as bitsandbytes' plain AdamW8bit (ours), the state is
6.08 GiB and its in-place blockwise update allocates nothing of note; the 2 GiB left would fit torchao's
AdamW8bit (the class torchtune's memory_optimizations page names), whose compiled per-weight step may keep fp32
copies of the moments of the tied embedding (394 M elements, 1.47 GiB each) while it updates it in backward,
which nothing here measures.

    PYTHONPATH=$PWD python benchmarks/published.py > benchmarks/results/published.txt
"""

from __future__ import annotations

import statistics
from pathlib import Path

from finetune.plan import predict
from finetune.plan.memory_model import (
    ALLOCATOR_OVERHEAD,
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    Prediction,
    chunked_head_gradient_bytes,
    predict_memory,
)
from finetune.plan.search import model_spec
from finetune.plan.trace import planned_config
from finetune.recipe.schema import Recipe
from finetune.recipe.settings import Settings

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
        "model": {"path": str(HERE / f"{model}.json"), "dtype": "bf16", "attn_implementation": "flex_attention"},
        "data": {"path": "unused.jsonl", "max_seq_len": seq, "packing": True},
        "quantization": {"bits": bits}, "adapter": adapter, "memory": {**memory, "gpu_memory_margin": 0},
        "training": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "compile": compile_},
        "optimizer": optimizer})


def allocated(peak: int) -> float:
    """The plan's peak as the allocator counts it: without the CUDA context and the allocator's rounding
    (memory_model's fixed costs; the cuBLAS workspace is allocated through the allocator and stays)."""
    return (peak - CUDA_CONTEXT_BYTES - CUBLAS_WORKSPACE_BYTES) / (1 + ALLOCATOR_OVERHEAD) + CUBLAS_WORKSPACE_BYTES


def torchtune_loss_peak(prediction: Prediction, logits: int, head_gradient: int) -> float:
    """The allocated peak with torchtune's CEWithChunkedOutputLoss in place of ours (module docstring).

    `logits`: bf16 logits of every token; `head_gradient`: the trained LM head's gradient (0 with LoRA), which
    our chunked loss's window already holds once (memory_model.chunked_head_gradient_bytes). torchtune holds
    the logits at the end of the forward; in the backward, with 8 chunks (its default num_output_chunks), one
    chunk's gradient more while the cross-entropies run, then, as the head's matmuls take one gradient chunk
    each, all of them with the head's first partial gradient, or 7/8 of them with the summed buffer and the
    second partial."""
    held = {"forward": logits, "bwd_head": max(logits * 9 / 8, logits + head_gradient,
                                               logits * 7 / 8 + 2 * head_gradient) - head_gradient}
    return max(allocated(sum(parts.values())) - (parts["logits_and_loss"] - held[name] if name in held else 0)
               for name, parts in prediction.windows.items())


def _summary(name: str, ratios: list[float]) -> str:
    within = sum(abs(r - 1) <= 0.10 for r in ratios)
    return (f"# {name}: {within} of {len(ratios)} rows within 10%; median ratio {statistics.median(ratios):.2f}, "
            f"range {min(ratios):.2f}-{max(ratios):.2f}")


def main() -> None:
    print("# PYTHONPATH=$PWD python benchmarks/published.py > benchmarks/results/published.txt  (planner on the "
          "meta device, device=cuda, bf16, flex attention, micro-batch 2; +tt loss: torchtune's chunked loss in place of ours)")
    print(f"{'row':42} {'torchtune':>9} {'planned':>8} {'ratio':>6} {'+tt loss':>8} {'ratio':>6} {'managed':>8}"
          "  peak parts (GiB)")
    planned, adjusted = [], []
    for label, theirs, model, seq, adapter, bits, memory, optimizer, compile_ in ROWS:
        row = recipe(model, seq, adapter, bits, memory, optimizer, compile_)
        plan = predict(row, gpu_memory="80GiB", device="cuda")
        ours = allocated(plan.peak_bytes) / GIB
        config = planned_config(row.model.path)
        spec, settings = model_spec(row, config, "cuda"), Settings(**plan.settings)
        prediction = predict_memory(spec, settings)
        assert prediction.peak_bytes == plan.peak_bytes, label
        tt = ours
        if memory["chunked_loss"]:
            assert compile_, f"{label}: an uncompiled CEWithChunkedOutputLoss holds fp32 log-probabilities too"
            tokens = row.training.micro_batch_size * seq
            logits = tokens * config.get_text_config().vocab_size * 2
            tt = torchtune_loss_peak(prediction, logits, chunked_head_gradient_bytes(spec, settings, tokens)) / GIB
        planned.append(ours / theirs)
        adjusted.append(tt / theirs)
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in plan.breakdown.items() if v and k != "other")
        print(f"{label:42} {theirs:>9.1f} {ours:>8.2f} {ours / theirs:>6.2f} {tt:>8.2f} {tt / theirs:>6.2f} "
              f"{plan.managed_bytes / GIB:>8.2f}  {parts}")
    print(_summary("planned", planned))
    print(_summary("+tt loss", adjusted))


if __name__ == "__main__":
    main()
