"""Mixture-of-experts on CPU: a small Qwen3-MoE with its experts in bf16, in 4 bits, offloaded to RAM and to
disk, side by side; and the planned peak of Qwen3-30B-A3B QLoRA at 12/16/24 GB with and without expert offload
(to RAM, or to disk where RAM is short).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/moe.py      # about a minute on the shared 2-core machine

(a) One model (Qwen3MoeConfig: hidden 128, 4 layers, 16 experts of width 128, top-2, bf16, random weights),
    LoRA r 8 on attention, micro-batch 2 x 256 tokens, AdamW, the same batch for STEPS steps in each mode:
    - bf16: the fused experts as loaded (16-bit parameters);
    - 4-bit: quantization.bits 4 (finetune.model.expert_store: NF4, one matrix per expert, dequantized one
      routed expert at a time; the attention Linear layers are bitsandbytes' Linear4bit as in any QLoRA run,
      so its losses differ from bf16's by the quantization of every weight);
    - 4-bit offloaded: memory.offload_experts: cpu (finetune.memory.expert_offload). On a CPU the host is
      the device, so the copies are made and nothing is saved: this row shows the path's cost and equal
      losses, the memory it saves is a GPU's (part b). The tracker counts the model's tensors and what a step
      allocates: the host copies are outside the model, so its peak there drops by the experts less the
      two layers fetched; in RAM they are still there;
    - 4-bit on disk: memory.offload_experts: disk. The experts are written once to files under the offload
      folder and read back a layer ahead on a reader thread: RAM holds two layers' experts, so this saving
      is real on a CPU too (the files' bytes are listed while the run holds them, and after it ends);
    - dequantized reference: the 4-bit (QLoRA) model with its experts put back as 16-bit parameters holding
      their dequantized values, whose losses the 4-bit run must match (to bf16 rounding).
    Peak from the CPU tensor tracker (finetune.memory.tracker), step time the median of the steps after the first.
(b) `finetune.plan.predict` for Qwen3-30B-A3B (tests/fixtures/configs), QLoRA r 16 all-linear (attention),
    2048 tokens, CUDA bf16, memory.offload_experts none vs auto, at 12, 16 and 24 GiB, and auto with
    memory.offload_cpu_limit 4GiB (host RAM short of the ~15 GiB of 4-bit experts: the disk, priced at this
    machine's measured disk bandwidth).

Writes benchmarks/results/moe.txt.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.memory.tracker import measure_step  # noqa: E402
from finetune.memory.weight_store import weight_store_of  # noqa: E402
from finetune.model.moe import STORE, expert_matrix, moe_blocks  # noqa: E402
from finetune.plan import predict  # noqa: E402
from finetune.recipe import load_recipe, validate_recipe  # noqa: E402
from finetune.step.training_step import training_step  # noqa: E402
from finetune.testing import make_tiny_model_dir  # noqa: E402
from finetune.train.measure import step_setup  # noqa: E402
from finetune.units import format_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STEPS = 4
SEQ, MICRO = 256, 2
SHAPE = {"hidden_size": 128, "num_hidden_layers": 4, "num_experts": 16, "moe_intermediate_size": 128}


def recipe_for(model_dir: Path, out: Path, bits: int | None, offload: str):
    return validate_recipe({
        "model": {"path": str(model_dir), "dtype": "bf16"}, "quantization": {"bits": bits},
        "adapter": {"type": "lora", "r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"path": str(ROOT / "recipes" / "data" / "quickstart.jsonl"), "max_seq_len": SEQ},
        "training": {"micro_batch_size": MICRO, "gradient_accumulation_steps": 1, "max_steps": STEPS},
        "memory": {"activation_checkpointing": False, "chunked_loss": False, "tiled_mlp": False,
                   "offload_experts": offload},
        "output": {"dir": str(out)}})


def train(model, optimizer, batch) -> tuple[list[float], float, int]:
    losses, times = [], []

    def run(tracker):
        for _ in range(STEPS):
            start = time.perf_counter()
            losses.append(float(training_step(model, [batch], optimizer, tracker=tracker)[0]))
            times.append(time.perf_counter() - start)

    peak = measure_step(run, model=model, optimizer=optimizer, vocab_size=model.config.vocab_size)["peak_bytes"]
    return losses, statistics.median(times[1:]), peak


def part_a(folder: Path) -> list[str]:
    model_dir = make_tiny_model_dir(folder / "model", "qwen3_moe", **SHAPE)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (MICRO, SEQ), generator=gen)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    rows, runs = [], {}
    on_disk = []
    for name, bits, offload in (("bf16", None, "none"), ("4-bit", 4, "none"), ("4-bit offloaded", 4, "cpu"),
                                ("4-bit on disk", 4, "disk")):
        torch.manual_seed(0)
        _, model, optimizer, _ = step_setup(recipe_for(model_dir, folder / name, bits, offload))
        runs[name] = train(model, optimizer, batch)
        if offload == "disk":
            files = sorted((folder / name / "offload").iterdir())
            on_disk.append(f"4-bit on disk: {len(files)} files, {format_bytes(sum(f.stat().st_size for f in files))} "
                           f"in the offload folder while training (the experts as stored: "
                           f"{format_bytes(weight_store_of(model).host_bytes)})")
            weight_store_of(model).close()
            on_disk.append(f"after close: {len(list((folder / name / 'offload').iterdir()))} files")
        if name == "4-bit":
            quantized = {b.name: {w: torch.stack([expert_matrix(b.experts, w, e, torch.bfloat16)
                                                   for e in range(b.num_experts)]) for w in b.weights}
                         for b in moe_blocks(model)}
    torch.manual_seed(0)
    _, model, optimizer, _ = step_setup(recipe_for(model_dir, folder / "ref", 4, "none"))
    for block in moe_blocks(model):  # the same QLoRA model, its experts as 16-bit parameters again
        delattr(block.experts, STORE)
        for w, value in quantized[block.name].items():
            block.experts.register_parameter(w, torch.nn.Parameter(value, requires_grad=False))
    runs["dequantized reference"] = train(model, optimizer, batch)
    base_time = runs["bf16"][1]
    rows.append(f"{'experts':<24}{'peak':>12}{'step s':>9}{'vs bf16':>9}  losses ({STEPS} steps)")
    for name, (losses, step, peak) in runs.items():
        rows.append(f"{name:<24}{format_bytes(peak):>12}{step:>9.3f}{step / base_time:>8.2f}x  "
                    + " ".join(f"{x:.4f}" for x in losses))
    four, ref, off = runs["4-bit"][0], runs["dequantized reference"][0], runs["4-bit offloaded"][0]
    gap = max(abs(a - b) for a, b in zip(four, ref, strict=True))
    rows.append(f"4-bit vs dequantized reference: max |loss difference| {gap:.2e}")
    rows.append(f"4-bit offloaded vs 4-bit: losses equal: {off == four}")
    rows.append(f"4-bit on disk vs 4-bit: losses equal: {runs['4-bit on disk'][0] == four}")
    return rows + on_disk


def part_b() -> list[str]:
    config = ROOT / "tests" / "fixtures" / "configs" / "qwen3-30b-a3b.json"
    rows = [f"{'budget':<8}{'offload_experts':<26}{'fits':<6}{'peak':>12}{'weights':>12}{'tokens/s':>10}  settings"]
    for budget in ("12GiB", "16GiB", "24GiB"):
        for offload, limit in (("none", None), ("auto", None), ("auto", "4GiB")):
            recipe = load_recipe(ROOT / "recipes" / "qlora-8b-24gb.yaml", [
                f"model.path={config}", "data.max_seq_len=2048", f"memory.gpu_memory={budget}",
                f"memory.offload_experts={offload}", f"memory.offload_cpu_limit={limit or 'null'}",
                f"memory.offload_dir={tempfile.gettempdir()}"])
            label = offload + (f", RAM limit {limit}" if limit else "")
            start = time.perf_counter()
            plan = predict(recipe, device="cuda")
            s = plan.settings
            rows.append(f"{budget:<8}{label:<26}{'yes' if plan.fits else 'no':<6}{format_bytes(plan.peak_bytes):>12}"
                        f"{format_bytes(plan.breakdown['weights']):>12}{plan.tokens_per_s:>10.0f}  mb={s['micro_batch_size']} "
                        f"ckpt={s['activation_checkpointing']} chunked={s['chunked_loss']} "
                        f"experts offloaded={s['offload_experts']} ({time.perf_counter() - start:.1f} s to plan)")
    return rows


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        a = part_a(Path(tmp))
    b = part_b()
    text = "\n".join([
        "benchmarks/moe.py: mixture-of-experts on CPU (1 thread, shared machine: times are ratios within one run)",
        "", "(a) small Qwen3-MoE (hidden 128, 4 layers, 16 experts, top-2), bf16, LoRA r 8, 2 x 256 tokens", *a,
        "", "(b) Qwen3-30B-A3B QLoRA, 2048 tokens, planned for CUDA (bf16)", *b, ""])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
