"""Expert offload (`memory.offload_experts`): the weight store (finetune.memory.weight_store) limited to a MoE
model's frozen expert weights. They live off the device, in host RAM (`cpu`, pinned on CUDA) or in files under
memory.offload_dir (`disk`); each layer's experts come to the device when the layer runs, the next layer's
fetched while this one computes, so two layers' experts are on the device at once (what the planner prices).

Why: a mixture-of-experts model's experts are most of its weights (Qwen3-30B-A3B: 57 of 61 GB in bf16, ~15 GB
in 4 bits), each token uses top_k of them, and they are frozen (LoRA sits on attention and shared layers). The
weights are the expert store's (`finetune.model.expert_store`: 4-bit, or 16-bit buffers), their storages
emptied and refilled in place, so the losses are those of the resident run, bit for bit; a checkpointed
layer's recompute and its backward fetch them again. The disk tier is for experts larger than host RAM (and
saves a CPU run's RAM too); the cpu tier saves nothing on a CPU (the path runs, the planner does not offer it).
With the run, the experts go into the store as they load (`stream_on_arrival` with EXPERTS), never all on the
device at once.
"""

from __future__ import annotations

from pathlib import Path

import torch

from finetune.memory.weight_store import EXPERTS, WeightStore, offload_weights
from finetune.model.moe import STORE, moe_blocks


def expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of every MoE block's frozen expert weights as stored (4-bit or 16-bit)."""
    total = 0
    for block in moe_blocks(model):
        store = getattr(block.experts, STORE, None)
        tensors = store.buffers() if store is not None else (getattr(block.experts, w) for w in block.weights)
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def offload_experts(model: torch.nn.Module, tier: str, host_ram: int | None,
                    directory: Path | None = None) -> WeightStore | None:
    """memory.offload_experts: move every MoE block's expert weights off the device, to tier `cpu` (host RAM,
    pinned on CUDA) or `disk` (files in `directory`), one layer read ahead, through the weight store (whose
    `close` ends it). `host_ram`: the bytes they may take in RAM (free RAM, or memory.offload_cpu_limit); more is
    a RecipeError, and a `directory` that cannot take them an OffloadDirError, before anything moves. None for a
    model without MoE blocks."""
    return offload_weights(model, tier, 1, host_ram, directory, EXPERTS)
