"""Weight streaming (memory.offload_weights): Llama-3.1-70B QLoRA planned at 8/12/16/24 GiB with its frozen
weights streamed, against the same model resident on an 80 GiB card; this machine's measured disk read
bandwidth (what prices the disk tier); and, on this CPU, a tiny model's step resident vs streamed.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/stream_weights.py      # about a minute on the shared machine

(a) `finetune.plan.predict` for tests/fixtures/configs/llama-3.1-70b.json with recipes/qlora-8b-24gb.yaml
    (QLoRA r 16 all-linear, 4-bit, the recipe's max_seq_len), CUDA, memory.offload_weights auto at each
    budget; the resident row (offload_weights none, 80 GiB) is the tokens/s streaming is measured against.
    The tier the search takes depends on this machine's free host RAM (the cpu tier holds every layer there)
    and its measured disk bandwidth (the disk tier); the plan's note says what bounds the step.
(b) `finetune.memory.bandwidth.disk_bandwidth` of the offload folder's filesystem (measured once, cached).
(c) A tiny Llama (4 layers, hidden 64) QLoRA, 2 steps of micro-batch 2 x 16 tokens, checkpointing on,
    resident / cpu / disk: the losses (equal) and seconds per step (on a CPU the cpu tier saves nothing; the
    path's cost shows, and the disk tier frees the RAM of all but two layers).
(d) The weight-streaming recipes (recipes/qlora-llama-3.3-70b-*, qlora-qwen3-32b-12gb, qlora-qwen3-235b-a22b-24gb)
    planned on the machine each names (finetune.testing.stated_machine), the SSD at the typical figure: docs/memory.md
    quotes these lines.

Writes benchmarks/results/stream_weights.txt.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.memory.bandwidth import disk_bandwidth  # noqa: E402
from finetune.memory.weight_store import offload_weights  # noqa: E402
from finetune.model.adapter import apply_adapter  # noqa: E402
from finetune.model.load import load_model  # noqa: E402
from finetune.plan import predict  # noqa: E402
from finetune.recipe import load_recipe  # noqa: E402
from finetune.recipe.schema import AdapterConfig, ModelConfig, QuantizationConfig  # noqa: E402
from finetune.step.training_step import enable_checkpointing  # noqa: E402
from finetune.testing import make_tiny_model_dir  # noqa: E402
from finetune.units import format_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RECIPE = ROOT / "recipes" / "qlora-8b-24gb.yaml"
MODEL = ROOT / "tests" / "fixtures" / "configs" / "llama-3.1-70b.json"
BUDGETS = ("8GiB", "12GiB", "16GiB", "24GiB")


def plans(offload_dir: Path) -> list[str]:
    base = [f"model.path={MODEL}", f"memory.offload_dir={offload_dir}"]
    resident = predict(load_recipe(RECIPE, [*base, "memory.offload_weights=none", "memory.gpu_memory=80GiB"]),
                       device="cuda")
    lines = [f"(a) Llama-3.1-70B QLoRA, {RECIPE.name}: resident on 80 GiB: peak {format_bytes(resident.peak_bytes)}, "
             f"{resident.tokens_per_s:,.0f} tokens/s (mb={resident.settings['micro_batch_size']})",
             f"{'budget':>7} {'fits':>5} {'stream':>7} {'mb':>3} {'peak':>11} {'tokens/s':>9} {'vs resident':>12}"]
    notes = []
    for budget in BUDGETS:
        plan = predict(load_recipe(RECIPE, [*base, f"memory.gpu_memory={budget}"]), device="cuda")
        s = plan.settings
        lines.append(f"{budget:>7} {'yes' if plan.fits else 'no':>5} {s['offload_weights']:>7} "
                     f"{s['micro_batch_size']:>3} {format_bytes(plan.peak_bytes):>11} {plan.tokens_per_s:>9,.0f} "
                     f"{plan.tokens_per_s / resident.tokens_per_s:>11.2f}x")
        notes += [f"  {budget}: {note}" for note in plan.notes if "offload_weights" in note]
    return lines + notes


def tiny_steps(folder: Path) -> list[str]:
    path = make_tiny_model_dir(folder / "model", num_hidden_layers=4)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    lines = ["(c) tiny Llama QLoRA on this CPU, checkpointing on, 2 steps:"]
    for tier in ("none", "cpu", "disk"):
        torch.manual_seed(0)
        model, _, _ = load_model(ModelConfig(path=str(path)), QuantizationConfig(bits=4))
        model = apply_adapter(model, AdapterConfig(r=8, dropout=0.0), checkpointing=True)
        enable_checkpointing(model, True, 1)
        model.train()
        store = offload_weights(model, tier, 1, None, folder / "weights") if tier != "none" else None
        losses, seconds = [], []
        for _ in range(2):
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            seconds.append(time.perf_counter() - start)
            losses.append(loss.item())
        held = f", {format_bytes(store.host_bytes)} streamed, {store.materialised_peak} layers at most" if store else ""
        lines.append(f"  {tier:>5}: losses {losses}, {min(seconds) * 1e3:.1f} ms/step{held}")
        if store is not None:
            store.close()
    return lines


# The streaming recipes, the config fixture with their shapes, and the machine each names (RAM, free SSD).
RECIPES = (("qlora-llama-3.3-70b-24gb", "llama-3.1-70b", 64, None), ("qlora-llama-3.3-70b-16gb", "llama-3.1-70b", 64, None),
           ("qlora-qwen3-32b-12gb", "qwen3-32b", 32, None), ("qlora-qwen3-235b-a22b-24gb", "qwen3-235b-a22b", 32, 200))


def recipe_plans() -> list[str]:
    """(d) Each streaming recipe planned as `finetune plan` plans it, on the machine it names, with the SSD priced
    at the cost model's typical figure (this machine's disk is not the recipe's NVMe)."""
    from finetune.testing import stated_machine

    lines = ["(d) the streaming recipes on the machines they name (GPU as titled; RAM and free SSD as stated; "
             "the SSD priced at the typical 3 GB/s, PCIe at 20 GB/s):"]
    for name, config, ram, disk in RECIPES:
        overrides = [f"model.path={ROOT / 'tests' / 'fixtures' / 'configs' / config}.json"]
        with stated_machine(ram * 10**9, disk * 10**9 if disk else None, typical_disk=True):
            plan = predict(load_recipe(ROOT / "recipes" / f"{name}.yaml", overrides), device="cuda")
        s = plan.settings
        lines.append(f"  {name} ({ram} GB RAM{f', {disk} GB free SSD' if disk else ''}): "
                     f"{'fits' if plan.fits else 'does not fit'}, peak {format_bytes(plan.peak_bytes)} of "
                     f"{format_bytes(plan.budget_bytes)}, mb={s['micro_batch_size']} ga={s['gradient_accumulation_steps']} "
                     f"ckpt={s['activation_checkpointing']} offload={s['offload']} stream={s['offload_weights']}, "
                     f"{plan.tokens_per_s:,.0f} tokens/s")
        lines += [f"    {note}" for note in plan.notes if "offload_weights" in note]
    return lines


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="stream-weights-") as scratch:
        folder = Path(scratch)
        disk = disk_bandwidth(folder)
        lines = plans(folder)
        lines.append("(b) disk bandwidth of the offload folder's filesystem here: "
                     + (", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in disk.items()) if disk else "not measurable"))
        lines += tiny_steps(folder)
        lines += recipe_plans()
    text = "\n".join(lines) + "\n"
    print(text, end="")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "stream_weights.txt").write_text(text)


if __name__ == "__main__":
    main()
