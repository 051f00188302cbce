"""The first lease's plan: the decisive rows first, so a 30-minute lease (start-up included) answers the
questions that matter even if nothing else runs. In this order:

1. the environment check (versions, the GPU, a bitsandbytes 4-bit product on the device, allocator APIs);
2. planner vs CUDA: the Llama-3.1-8B QLoRA rows, the offload tiers (cpu, disk) right after the first row, then
   GRPO (generation and training planned together; tokens/s of both);
3. tokens/s of `finetune run` vs HF Trainer + PEFT and TRL at 2k, micro-batch 1;
4. max context at 8 GiB.

`python -m benchmarks.gpu.suite OUT --first-lease` runs what is not measured yet, in this order, until its
time limit; the same command with the merged results.json goes on (docs/gpu.md gives the calls).
"""

from __future__ import annotations

import platform
import shutil
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.gpu import configs

if TYPE_CHECKING:
    from benchmarks.gpu.suite import Suite

STAGE_A = ["Llama-3.1-8B QLoRA 2k", "Llama-3.1-8B QLoRA 8k offload cpu", "Llama-3.1-8B QLoRA 8k offload disk",
           "Llama-3.1-8B QLoRA 8k", "Llama-3.1-8B QLoRA 2k mb4", "Llama-3.1-8B QLoRA 2k mb2 acc4",
           "Llama-3.1-8B QLoRA 8k chunked loss", "Llama-3.1-8B QLoRA 8k tiled MLP",
           "Llama-3.1-8B QLoRA 1k mb8", "Llama-3.1-8B QLoRA 32k chunked+tiled", configs.GRPO_ROW]
STAGE_C = ["Llama-3.1-8B QLoRA 2k mb1"]


def run_first_lease(suite: Suite, budgets: list[int]) -> None:
    """The decisive rows in order; on CPU (the dry run) the stage-a rows the toy configuration list has."""
    suite.stage_env()
    if suite.cpu:
        cpu_names = {c["name"] for c in configs.stage_a_cpu()}
        suite.stage_a([n for n in STAGE_A if n in cpu_names])
    else:
        suite.stage_a(STAGE_A)
    suite.stage_c(STAGE_C)
    suite.stage_b(budgets, subset=True)


def environment_row(versions: dict[str, str]) -> dict[str, Any]:
    """What the machine has, and whether what the suite relies on works there; status ok or error."""
    checks: dict[str, str] = {}
    cuda = torch.cuda.is_available()
    row: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "versions": versions,
                           "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    if cuda:
        row["total_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    checks["disk /tmp free GiB"] = f"{shutil.disk_usage('/tmp').free / 2**30:.0f}"
    for name, check in (("bitsandbytes 4-bit", _bnb_4bit), ("per-process memory fraction", _fraction),
                        ("pinned host cache", _host_cache)):
        try:
            checks[name] = check(cuda)
        except Exception as exc:  # noqa: BLE001 - each check reports its own failure
            checks[name] = f"error: {type(exc).__name__}: {exc}"[:300]
    row["checks"] = checks
    failed = [k for k, v in checks.items() if v.startswith("error")]
    row["status"] = f"error: {', '.join(failed)}" if failed else "ok"
    row["error_kind"] = "error" if failed else None
    return row


def _bnb_4bit(cuda: bool) -> str:
    """A 4-bit quantized linear layer's forward and backward on the device (the QLoRA path)."""
    import bitsandbytes as bnb

    device = "cuda" if cuda else "cpu"
    layer = bnb.nn.Linear4bit(256, 256, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4").to(device)
    x = torch.randn(4, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().square().sum().backward()
    if x.grad is None or not torch.isfinite(x.grad).all():
        raise RuntimeError("no finite input gradient through the 4-bit layer")
    return f"ok on {device}"


def _fraction(cuda: bool) -> str:
    """torch.cuda.get_per_process_memory_fraction: finetune's OOM recovery reads the stage-b cap with it."""
    if not cuda:
        return "no CUDA"
    return f"ok ({torch.cuda.get_per_process_memory_fraction():.2f})"


def _host_cache(cuda: bool) -> str:
    """The pinned host cache can be emptied between probes (suite._release)."""
    if not cuda:
        return "no CUDA"
    from benchmarks.gpu.suite import empty_host_cache

    pinned = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    del pinned
    empty_host_cache()
    return "ok"
