"""Expert offload (`memory.offload_experts`): a MoE model's frozen expert weights live in host RAM (pinned on
CUDA), and each MoE block's experts come to the device when the block runs, the next block's fetched while
this one computes.

Why: a mixture-of-experts model's experts are most of its weights (Qwen3-30B-A3B: 57 of 61 GB in bf16, ~15 GB
in 4 bits), each token uses top_k of them, and they are frozen (LoRA sits on attention and shared layers).
Keeping them on the host leaves the device two MoE blocks' experts (the one computing and the one arriving)
instead of all of them, for one host-to-device copy of each block in forward and one in backward (a
checkpointed layer's recompute fetches again). The weights are the store's (`finetune.model.expert_store`:
4-bit or 16-bit), so the losses are those of the resident run, bit for bit.

Direction: a block fetched after a later one means backward has begun, so the prefetch goes down the layers.
On a CPU run the host is the device: the copies are made (the path is the same) and nothing is saved; the
planner offers this setting on GPUs only.
"""

from __future__ import annotations

import torch

from finetune.errors import RecipeError
from finetune.model.expert_store import store_of
from finetune.model.moe import STORE, moe_blocks
from finetune.units import format_bytes


class OffloadedExperts:
    """Stands in for one experts module's store: the weights stay on the host, `matrix` reads the device copy
    the offload keeps for this block."""

    def __init__(self, store: torch.nn.Module, offload: ExpertOffload, position: int):
        self.store, self.offload, self.position = store, offload, position
        self.names = store.names

    def shape_of(self, name: str) -> torch.Size:
        return self.store.shape_of(name)

    def matrix(self, name: str, index: int, dtype: torch.dtype) -> torch.Tensor:
        return self.store.matrix_from(self.offload.fetch(self.position), name, index, dtype)


class ExpertOffload:
    """The host copies of every MoE block's expert weights and the device copies of at most two blocks."""

    def __init__(self, stores: list[torch.nn.Module], device: torch.device):
        self.device = device
        self.host = [dict(store.named_buffers()) for store in stores]
        self.resident: dict[int, dict[str, torch.Tensor]] = {}
        self.events: dict[int, torch.cuda.Event] = {}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.last = -1

    def _copy(self, position: int) -> None:
        """Start the copy of block `position` to the device (on the side stream on CUDA)."""
        if position in self.resident or not 0 <= position < len(self.host):
            return
        if self.stream is None:
            self.resident[position] = {k: v.clone() for k, v in self.host[position].items()}
            return
        with torch.cuda.stream(self.stream):
            self.resident[position] = {k: v.to(self.device, non_blocking=True) for k, v in self.host[position].items()}
            event = torch.cuda.Event()
            event.record(self.stream)
        self.events[position] = event

    def fetch(self, position: int) -> dict[str, torch.Tensor]:
        """Block `position`'s weights on the device; starts the next block's copy (the one below in backward)."""
        if position != self.last:
            step = -1 if position < self.last else 1
            self.last = position
            self._copy(position)
            for other in [p for p in self.resident if p not in (position, position + step)]:
                del self.resident[other]
                self.events.pop(other, None)
            self._copy(position + step)
        event = self.events.pop(position, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            for tensor in self.resident[position].values():
                tensor.record_stream(torch.cuda.current_stream(self.device))
        return self.resident[position]

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for host in self.host for t in host.values())


def expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of every MoE block's frozen expert weights as stored (4-bit or 16-bit)."""
    total = 0
    for block in moe_blocks(model):
        store = getattr(block.experts, STORE, None)
        tensors = store.buffers() if store is not None else (getattr(block.experts, w) for w in block.weights)
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def offload_experts(model: torch.nn.Module, enabled: bool, host_ram: int | None) -> ExpertOffload | None:
    """memory.offload_experts: move every MoE block's expert weights to the host (pinned on CUDA) and read
    them through an `ExpertOffload`. `host_ram`: the bytes they may take there (free RAM, or
    memory.offload_cpu_limit); more is a RecipeError, before anything moves."""
    if not enabled:
        return None
    blocks = moe_blocks(model)
    if not blocks:
        return None
    needed = expert_bytes(model)
    if host_ram is not None and needed > host_ram:
        raise RecipeError(f"memory.offload_experts: the expert weights take {format_bytes(needed)} of host RAM, "
                          f"{format_bytes(host_ram)} available (free RAM or memory.offload_cpu_limit)",
                          hint="set memory.offload_experts: false (or auto), quantization.bits: 4, or free RAM")
    device = next(iter(blocks[0].experts.parameters()), next(model.parameters())).device
    cuda = device.type == "cuda"
    stores = []
    for block in blocks:
        store = store_of(block.experts, block.weights)
        for name, tensor in list(store.named_buffers(recurse=False)):
            host = tensor.to("cpu")
            setattr(store, name, host.pin_memory() if cuda else host)
        stores.append(store)
    offload = ExpertOffload(stores, device)
    for position, block in enumerate(blocks):
        # no longer a submodule: the store's buffers stay on the host when the model moves
        delattr(block.experts, STORE)
        setattr(block.experts, STORE, OffloadedExperts(stores[position], offload, position))
    return offload
