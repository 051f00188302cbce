"""Expert offload (`memory.offload_experts`): a MoE model's frozen expert weights live off the device, in host
RAM (`cpu`, pinned on CUDA) or in files under memory.offload_dir (`disk`), and each MoE block's experts come to
the device when the block runs, the next block's fetched while this one computes.

Why: a mixture-of-experts model's experts are most of its weights (Qwen3-30B-A3B: 57 of 61 GB in bf16, ~15 GB
in 4 bits), each token uses top_k of them, and they are frozen (LoRA sits on attention and shared layers).
Keeping them off the device leaves it two MoE blocks' experts (the one computing and the one arriving)
instead of all of them, for one copy of each block in forward and one in backward (a checkpointed layer's
recompute fetches again). The weights are the store's (`finetune.model.expert_store`: 4-bit or 16-bit), so
the losses are those of the resident run, bit for bit.

The disk tier is for experts larger than host RAM: each block's tensors are written once, before training,
as files of the activation offload's disk tier (`finetune.memory.offload_disk`: same folder, same writer and
reader); a reader thread reads the next block into a fresh (pinned) buffer while this block computes, copies
it to the device on a side stream, and the files go when training ends (or the process exits). On a CPU run
the read buffers are the device copies, so the disk tier saves RAM there too; the cpu tier saves nothing on a
CPU (the path runs, the planner does not offer it).

Direction: a block fetched after a later one means backward has begun, so the prefetch goes down the layers;
at either end the block before the last one stays, as the next pass starts with it: two blocks are always on
the device (what the planner prices).
"""

from __future__ import annotations

import os
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from finetune.errors import RecipeError
from finetune.memory.offload_disk import (
    OffloadDirError,
    check_offload_dir,
    missing_folders,
    read_tensor_file,
    remove_empty,
    write_tensor_file,
)
from finetune.model.expert_store import store_of
from finetune.model.moe import STORE, moe_blocks, stored_experts
from finetune.units import format_bytes

FILE_PREFIX = "ft-experts-"
DISK_HINT = ("Set memory.offload_dir to a folder on a disk with room for the experts (ideally an NVMe SSD), or use "
             "memory.offload_experts: cpu (host RAM) or none.")


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


class ExpertFiles:
    """Each MoE block's expert tensors (or, with `prefix` FILE_PREFIX of finetune.memory.weight_store, each
    decoder layer's frozen weights) as one file per tensor under the offload folder: written before training,
    read while training, removed by `remove` (or when the process exits, whatever ends it but a kill)."""

    def __init__(self, directory: Path, prefix: str = FILE_PREFIX):
        self.directory = directory
        self.prefix = f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}-"
        self.paths: dict[tuple[int, str], Path] = {}
        made = missing_folders(directory)  # removed with the files, once empty
        directory.mkdir(parents=True, exist_ok=True)
        self._finalizer = weakref.finalize(self, _unlink, self.paths, made)

    def write(self, position: int, name: str, tensor: torch.Tensor) -> None:
        """Block `position`'s tensor `name` (on the host) to its file."""
        path = self.directory / f"{self.prefix}{position}-{name}.bin"
        self.paths[(position, name)] = path
        if tensor.storage_offset() or not tensor.is_contiguous():
            tensor = tensor.clone()
        write_tensor_file(path, tensor)

    def read(self, position: int, name: str, into: torch.Tensor) -> None:
        read_tensor_file(self.paths[(position, name)], into)

    def remove(self) -> None:
        """Delete every file (once)."""
        self._finalizer()


def tier_files(key: str, tier: str, what: str, in_ram: int, host_ram: int | None, directory: str | Path | None,
               needed: int, prefix: str = FILE_PREFIX, hint: str = DISK_HINT) -> ExpertFiles | None:
    """What every frozen-weight offload (experts, decoder layers) checks before it moves anything: the host RAM
    the tier takes (`in_ram`) against what is free, and for the disk tier its files under `directory`."""
    if host_ram is not None and in_ram > host_ram:
        raise RecipeError(f"{key}: {tier}: the {what} take {format_bytes(in_ram)} of host RAM, "
                          f"{format_bytes(host_ram)} available (free RAM or memory.offload_cpu_limit)",
                          hint=f"set {key}: disk (or auto), quantization.bits: 4, or free RAM")
    if tier != "disk":
        return None
    if directory is None:
        raise ValueError(f"{key}: disk needs an offload_dir")
    return ExpertFiles(check_offload_dir(directory, needed, f"of {what}", hint), prefix)


def host_room(limit: int | None) -> int:
    """Bytes a frozen-weight offload may keep in host RAM: what is free now, capped by memory.offload_cpu_limit."""
    import psutil

    ram = psutil.virtual_memory().available
    return min(ram, limit) if limit else ram


def _unlink(paths: dict[tuple[int, str], Path], made: list[Path]) -> None:
    for path in paths.values():
        path.unlink(missing_ok=True)
    remove_empty(made)


class ExpertOffload:
    """Every MoE block's expert weights off the device (host tensors, or `files` with meta tensors naming their
    shapes in `host`) and the device copies of at most two blocks."""

    def __init__(self, host: list[dict[str, torch.Tensor]], device: torch.device, files: ExpertFiles | None = None):
        self.device = device
        self.host = host
        self.files = files
        self.resident: dict[int, dict[str, torch.Tensor] | Future] = {}
        self.events: dict[int, torch.cuda.Event] = {}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="ft-experts-read") if files is not None else None
        self.last = -1

    def _to_device(self, host: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
        """Copies of `host` on the device (on the side stream on CUDA, with the event that ends them)."""
        if self.stream is None:
            return {k: v.clone() for k, v in host.items()}, None
        with torch.cuda.stream(self.stream):
            copies = {k: v.to(self.device, non_blocking=True) for k, v in host.items()}
            event = torch.cuda.Event()
            event.record(self.stream)
        return copies, event

    def _read(self, position: int, buffers: dict[str, torch.Tensor]):
        """On the reader thread: block `position`'s files into `buffers`, then to the device."""
        for name, buffer in buffers.items():
            self.files.read(position, name, buffer)
        return (buffers, None) if self.stream is None else self._to_device(buffers)

    def _copy(self, position: int) -> None:
        """Start bringing block `position` to the device."""
        if position in self.resident or not 0 <= position < len(self.host):
            return
        if self.files is None:
            self.resident[position], event = self._to_device(self.host[position])
        else:
            # allocated on this thread, so a CPU run's tensor tracker counts them; read on the reader thread
            pinned = self.stream is not None
            buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pinned) for k, v in self.host[position].items()}
            self.resident[position], event = self.reader.submit(self._read, position, buffers), None
        if event is not None:
            self.events[position] = event

    def fetch(self, position: int) -> dict[str, torch.Tensor]:
        """Block `position`'s weights on the device; starts the next block's copy (the one below in backward; at
        the last block of a pass the one before it, where the next pass begins, so it stays)."""
        if position != self.last:
            step = -1 if position < self.last else 1
            self.last = position
            ahead = position + step if 0 <= position + step < len(self.host) else position - step
            self._copy(position)
            for other in [p for p in self.resident if p not in (position, ahead)]:
                if isinstance(dropped := self.resident.pop(other), Future):
                    dropped.cancel()
                self.events.pop(other, None)
            self._copy(ahead)
        entry = self.resident[position]
        if isinstance(entry, Future):
            try:
                self.resident[position], event = entry.result()
            except OSError as exc:  # e.g. the files were deleted or the disk failed under the run
                raise OffloadDirError(f"memory.offload_experts: reading the experts from {self.files.directory} "
                                      f"failed: {exc}", hint=DISK_HINT) from exc
            if event is not None:
                self.events[position] = event
        event = self.events.pop(position, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            for tensor in self.resident[position].values():
                tensor.record_stream(torch.cuda.current_stream(self.device))
        return self.resident[position]

    @property
    def host_bytes(self) -> int:
        """Bytes held off the device (in host RAM, or in the files)."""
        return sum(t.numel() * t.element_size() for host in self.host for t in host.values())

    def close(self) -> None:
        """End of training: stop the reader and delete the files (idempotent). The device copies are dropped."""
        if self.reader is not None:
            self.reader.shutdown(wait=True, cancel_futures=True)
        self.resident.clear()
        self.events.clear()
        if self.files is not None:
            self.files.remove()


def expert_offload_of(model: torch.nn.Module) -> ExpertOffload | None:
    """The expert offload `offload_experts` set up on `model` (to close it where its caller did not keep it)."""
    blocks = moe_blocks(model)
    store = stored_experts(blocks[0].experts) if blocks else None
    return store.offload if isinstance(store, OffloadedExperts) else None


def expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of every MoE block's frozen expert weights as stored (4-bit or 16-bit)."""
    total = 0
    for block in moe_blocks(model):
        store = getattr(block.experts, STORE, None)
        tensors = store.buffers() if store is not None else (getattr(block.experts, w) for w in block.weights)
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def offload_experts(model: torch.nn.Module, tier: str, host_ram: int | None,
                    directory: Path | None = None) -> ExpertOffload | None:
    """memory.offload_experts: move every MoE block's expert weights off the device, to tier `cpu` (host RAM,
    pinned on CUDA) or `disk` (files in `directory`, read a layer ahead into pinned buffers), and read them
    through an `ExpertOffload` (whose `close` ends it). `host_ram`: the bytes they may take in RAM (free RAM, or
    memory.offload_cpu_limit); more is a RecipeError, and a `directory` that cannot take them an
    OffloadDirError, before anything moves."""
    if tier == "none":
        return None
    blocks = moe_blocks(model)
    if not blocks:
        return None
    needed = expert_bytes(model)
    device = next(iter(blocks[0].experts.parameters()), next(model.parameters())).device
    cuda = device.type == "cuda"
    in_ram = needed if tier == "cpu" else 2 * max(expert_bytes(block.block) for block in blocks) if cuda else 0
    files = tier_files("memory.offload_experts", tier, "expert weights", in_ram, host_ram, directory, needed)
    host = []
    try:
        for position, block in enumerate(blocks):
            store = store_of(block.experts, block.weights)
            for name, tensor in list(store.named_buffers(recurse=False)):
                on_host = tensor.detach().to("cpu")
                if files is None:
                    setattr(store, name, on_host.pin_memory() if cuda else on_host)
                else:  # one block at a time: its RAM (or device memory) is freed before the next is written
                    files.write(position, name, on_host)
                    setattr(store, name, torch.empty_like(on_host, device="meta"))
                del on_host, tensor
            host.append(dict(store.named_buffers()))
    except OSError as exc:  # the disk filled up or failed while writing
        files.remove()
        raise OffloadDirError(f"memory.offload_experts: writing the experts to {files.directory} failed: {exc}",
                              hint=DISK_HINT) from exc
    offload = ExpertOffload(host, device, files)
    for position, block in enumerate(blocks):
        store = store_of(block.experts, block.weights)
        # no longer a submodule: the store's buffers stay on the host when the model moves
        delattr(block.experts, STORE)
        setattr(block.experts, STORE, OffloadedExperts(store, offload, position))
    return offload
