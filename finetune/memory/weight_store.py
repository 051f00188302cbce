"""The weight store: frozen weights off the device, in host RAM (`cpu`, pinned on CUDA) or in files under
memory.offload_dir (`disk`), each decoder layer's brought to the device when the layer runs and the next `ahead`
layers' fetched meanwhile (at most `ahead + 1` materialised). One mechanism for `memory.offload_weights` (every
frozen weight of each layer) and `memory.offload_experts` (the experts only): `Streamed`.

Why: a 70B model's 4-bit weights (~37 GB) exceed a 24 GB card, and each is read once per pass, so the link can
carry a layer while the previous one computes. How (storages emptied and refilled in place, module and gradient
hooks, loading as weights arrive): docs/memory.md, "The weight store in the code".
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.console import console
from finetune.errors import RecipeError
from finetune.memory.offload_disk import (
    EXPERTS_PREFIX,
    WEIGHTS_PREFIX,
    OffloadDirError,
    OffloadFolder,
    check_offload_dir,
    read_tensor_file,
    write_tensor_file,
)
from finetune.model.expert_store import store_of
from finetune.model.family import decoder_layers
from finetune.model.moe import STORE, moe_blocks
from finetune.units import format_bytes

STORE_ATTRIBUTE = "finetune_weight_store"  # the first decoder layer's reference to its model's store


@dataclass(frozen=True)
class Streamed:
    """What a recipe key streams through the store, and the words its messages use."""

    key: str  # the recipe key
    what: str  # what it moves, in messages
    prefix: str  # its files' names under memory.offload_dir
    hint: str  # the fix where its disk tier lacks a folder with room
    experts_only: bool  # a MoE layer's expert weights only, else every frozen weight of each layer


WEIGHTS = Streamed("memory.offload_weights", "frozen weights", WEIGHTS_PREFIX,
                   "Set memory.offload_dir to a folder on a disk with room for the model's weights (ideally an NVMe "
                   "SSD), or use memory.offload_weights: cpu (host RAM) or none.", False)
EXPERTS = Streamed("memory.offload_experts", "expert weights", EXPERTS_PREFIX,
                   "Set memory.offload_dir to a folder on a disk with room for the experts (ideally an NVMe SSD), "
                   "or use memory.offload_experts: cpu (host RAM) or none.", True)


class StoreFiles:
    """The store's tensors as one file per tensor under the offload folder: written before training (or as the
    model loads), read while training, removed by `remove` (or when the process exits, whatever ends it but a
    kill: the next run writing there removes them, `reclaim_left_behind`), with the folders the store made."""

    def __init__(self, directory: Path, prefix: str):
        folder = OffloadFolder(directory, prefix)
        self.directory, self.prefix = folder.directory, folder.prefix
        self.paths: dict[tuple[int, str], Path] = {}
        folder.make()
        self._finalizer = weakref.finalize(self, _unlink, self.paths, folder)

    def write(self, position: int, name: str, tensor: torch.Tensor) -> None:
        """Layer `position`'s tensor `name` (on the host) to its file."""
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


def _unlink(paths: dict[tuple[int, str], Path], folder: OffloadFolder) -> None:
    for path in paths.values():
        path.unlink(missing_ok=True)
    folder.close()


def host_room(limit: int | None) -> int:
    """Bytes the store may keep in host RAM: what is free now, capped by memory.offload_cpu_limit."""
    import psutil

    ram = psutil.virtual_memory().available
    return min(ram, limit) if limit else ram


def tier_files(kind: Streamed, tier: str, in_ram: int, host_ram: int | None, directory: str | Path | None,
               needed: int) -> StoreFiles | None:
    """What the store checks before it moves anything: the host RAM the tier takes (`in_ram`) against what is
    free, and for the disk tier its files under `directory` (room for `needed` bytes)."""
    if host_ram is not None and in_ram > host_ram:
        raise RecipeError(f"{kind.key}: {tier}: the {kind.what} take {format_bytes(in_ram)} of host RAM, "
                          f"{format_bytes(host_ram)} available (free RAM or memory.offload_cpu_limit)",
                          hint=f"set {kind.key}: disk (or auto), quantization.bits: 4, or free RAM")
    if tier != "disk":
        return None
    if directory is None:
        raise ValueError(f"{kind.key}: disk needs an offload_dir")
    return StoreFiles(check_offload_dir(directory, needed, f"of {kind.what}", kind.hint), kind.prefix)


def frozen_storages(layer: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors whose storages hold `layer`'s frozen weights: parameters without requires_grad, their
    bitsandbytes quant state's absmax (and the nested state's), and buffers (a 4-bit expert store's), by
    name. A quant state's code and offset (a kilobyte) stay: bitsandbytes reads them when the model's state
    dict is taken (peft's adapter save), outside any layer's forward."""
    found = [named for name, param in layer.named_parameters() if not param.requires_grad
             for named in _with_quant_state(name, param)]
    return found + [(name, b) for name, b in layer.named_buffers() if b is not None]


def _with_quant_state(name: str, param: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """`param` and its bitsandbytes quant state's absmax (and the nested state's), by name."""
    found = [(name, param)]
    state = getattr(param, "quant_state", None)
    while state is not None:
        found.append((f"{name}.absmax", state.absmax))
        name, state = f"{name}.nested", getattr(state, "state2", None)
    return found


class WeightStore:
    """The frozen weights of each decoder layer (position), resident on the device only while the layer or
    the next `ahead` ones run; off it in host tensors (`files` None) or in files."""

    def __init__(self, count: int, device: torch.device, ahead: int, files: StoreFiles | None,
                 kind: Streamed = WEIGHTS):
        self.device, self.ahead, self.files, self.kind = device, ahead, files, kind
        self.storages: list[list[torch.UntypedStorage]] = [[] for _ in range(count)]
        self.names: list[list[str]] = [[] for _ in range(count)]
        self.sizes: list[list[int]] = [[] for _ in range(count)]
        self.host: list[list[torch.Tensor]] = [[] for _ in range(count)]
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="ft-weights-read") if files is not None else None
        self.resident: dict[int, Future | torch.cuda.Event | None] = {}
        self.last = -1
        self.materialised_peak = 0  # the most layers materialised at once
        self.hooks: list = []  # the layers' module hooks

    def take(self, position: int, name: str, tensor: torch.Tensor) -> None:
        """Move `tensor`'s bytes (a frozen weight of layer `position`) off the device, to host RAM or its file,
        and free its storage: at load as each weight arrives, or for a model loaded whole, layer by layer."""
        if not tensor.untyped_storage().resizable():  # e.g. mapped from a safetensors file: a copy of its own
            tensor.data = tensor.detach().clone()
        storage = tensor.untyped_storage()
        flat = _bytes_of(storage)
        if self.files is None:
            copy = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=self.stream is not None)
            copy.copy_(flat)
            self.host[position].append(copy)
        else:
            self.files.write(position, name, flat.to("cpu", copy=True))  # (numpy would pin its storage)
        self.storages[position].append(storage)
        self.names[position].append(name)
        self.sizes[position].append(storage.nbytes())
        _free(storage)

    @property
    def host_bytes(self) -> int:
        """Bytes held off the device (in host RAM, or in the files)."""
        return sum(sum(sizes) for sizes in self.sizes)

    def _materialise(self, position: int) -> None:
        """Layer `position`'s bytes into its storages (resized by the caller); on the reader thread for files."""
        for i, storage in enumerate(self.storages[position]):
            target = _bytes_of(storage)
            if self.files is None:
                target.copy_(self.host[position][i], non_blocking=self.stream is not None)
                continue
            # read through a buffer (pinned on CUDA): a storage numpy has seen can no longer be resized
            buffer = torch.empty(target.shape, dtype=torch.uint8, pin_memory=self.stream is not None)
            self.files.read(position, self.names[position][i], buffer)
            target.copy_(buffer, non_blocking=self.stream is not None)

    def _start(self, position: int) -> None:
        """Begin bringing layer `position` to the device (nothing if it is there, beyond the ends, or one that
        stays on the device: memory.offload_weights_resident)."""
        if position in self.resident or not 0 <= position < len(self.storages) or not self.storages[position]:
            return
        context = torch.cuda.stream(self.stream) if self.stream is not None else _nothing()
        with context:  # allocated on the copy stream (CUDA), on this thread (a CPU run's tracker counts them)
            for storage, size in zip(self.storages[position], self.sizes[position], strict=True):
                storage.resize_(size)
        self.materialised_peak = max(self.materialised_peak, len(self.resident) + 1)
        if self.reader is not None:
            self.resident[position] = self.reader.submit(self._copy_on_stream, position)
        else:
            self.resident[position] = self._copy_on_stream(position)

    def _copy_on_stream(self, position: int) -> torch.cuda.Event | None:
        if self.stream is None:
            self._materialise(position)
            return None
        with torch.cuda.stream(self.stream):
            self._materialise(position)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def _release(self, position: int) -> None:
        entry = self.resident.pop(position)
        if isinstance(entry, Future):
            entry.result()  # a read in flight writes into these storages: let it end first
        for storage in self.storages[position]:
            if self.stream is not None:
                _bytes_of(storage).record_stream(torch.cuda.current_stream(self.device))
            _free(storage)

    def fetch(self, position: int) -> None:
        """Layer `position`'s weights on the device before it runs; start the next `ahead` layers' in the pass
        direction (turning back at either end), release the rest."""
        if self.reader is None and self.files is not None:
            raise RecipeError(f"{self.kind.key}: the weight files were removed when training ended",
                              hint="load the model again to use it after a run that streamed its weights from disk")
        if position != self.last:
            step = -1 if position < self.last else 1
            self.last = position
            count = len(self.storages)
            ahead = [p for p in (position + step * k for k in range(1, self.ahead + 1)) if 0 <= p < count]
            behind = [p for p in (position - step * k for k in range(1, count)) if 0 <= p < count]
            wanted = [position, *ahead, *behind[:self.ahead - len(ahead)]]
            for other in [p for p in self.resident if p not in wanted]:
                self._release(other)
            for p in wanted:
                self._start(p)
        entry = self.resident.get(position)
        if isinstance(entry, Future):
            try:
                entry = self.resident[position] = entry.result()
            except OSError as exc:  # the files were deleted or the disk failed under the run
                raise OffloadDirError(f"{self.kind.key}: reading the {self.kind.what} from {self.files.directory} "
                                      f"failed: {exc}", hint=self.kind.hint) from exc
        if isinstance(entry, torch.cuda.Event):
            torch.cuda.current_stream(self.device).wait_event(entry)
            self.resident[position] = None

    def close(self) -> None:
        """End of training: remove the hooks, stop the reader, delete the files (idempotent). With the cpu tier
        the weights come back to the device (those of a model that does not fit stay in RAM, streamed)."""
        if self.reader is not None:
            self.reader.shutdown(wait=True, cancel_futures=True)
            self.reader = None
        if self.files is not None:
            for position in list(self.resident):
                self._release(position)
            self.files.remove()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _free(storage: torch.UntypedStorage) -> None:
    """Free `storage`'s bytes, and show it freed to a tensor tracker (`finetune.memory.tracker`, which sees
    storages through the operators that return tensors over them)."""
    storage.resize_(0)
    _bytes_of(storage)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of `storage`'s bytes (its own version counter: autograd sees no write)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


def _hooks(store: WeightStore, layer: torch.nn.Module, position: int) -> list:
    """Fetch layer `position` before its forward (and a checkpointed layer's recompute), and before its
    backward through a gradient hook on its output."""

    def before(module: torch.nn.Module, args: tuple) -> None:
        store.fetch(position)

    def after(module: torch.nn.Module, args: tuple, output: object) -> None:
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: store.fetch(position))

    return [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]


def _unique(tensors: list[tuple[str, torch.Tensor]]) -> dict[int, tuple[str, torch.Tensor]]:
    """`tensors` by storage (the first name of each), leaving out empty ones."""
    out: dict[int, tuple[str, torch.Tensor]] = {}
    for name, t in tensors:
        if t.untyped_storage().nbytes() and t.device.type != "meta":
            out.setdefault(t.untyped_storage().data_ptr(), (name, t))
    return out


def offload_weights(model: torch.nn.Module, tier: str, ahead: int, host_ram: int | None,
                    directory: Path | None = None, kind: Streamed = WEIGHTS, resident: int = 0) -> WeightStore | None:
    """memory.offload_weights (or, `kind` EXPERTS, memory.offload_experts): stream each decoder layer's frozen
    weights (its experts) from tier `cpu` (host RAM, pinned on CUDA) or `disk` (files in `directory`), `ahead`
    layers read ahead, the first `resident` layers left on the device (memory.offload_weights_resident).
    `host_ram`: the bytes they may take in RAM (free RAM, or memory.offload_cpu_limit); more is a RecipeError, a
    `directory` without room an OffloadDirError, before anything moves. A storage shared by
    several layers (tied weights) stays put. A model loaded through `stream_on_arrival` has its store already
    (checked and filled as it loaded): what did not arrive through it (a buffer made at build) joins it here."""
    if tier == "none" or (kind.experts_only and not moe_blocks(model)):
        return None
    layers = decoder_layers(model)
    found = [_unique(_streamed(layer, kind)) for layer in layers]
    counts = Counter(ptr for tensors in found for ptr in tensors)
    kept = [[named for ptr, named in tensors.items() if counts[ptr] == 1] if position >= resident else []
            for position, tensors in enumerate(found)]
    store = weight_store_of(model)
    if store is None:
        sizes = [sum(t.untyped_storage().nbytes() for _, t in tensors) for tensors in kept]
        device = next(model.parameters()).device
        in_ram = sum(sizes) if tier == "cpu" else (ahead + 1) * max(sizes, default=0) if device.type == "cuda" else 0
        files = tier_files(kind, tier, in_ram, host_ram, directory, sum(sizes))
        store = WeightStore(len(layers), device, ahead, files, kind)
    elif store.hooks:
        return store  # streaming already
    with _writing(store.files, kind):
        for position, tensors in enumerate(kept):
            for name, tensor in tensors:  # one layer at a time: its device memory goes before the next is copied
                store.take(position, name, tensor)
    for position, layer in enumerate(layers):
        store.hooks += _hooks(store, layer, position)
    setattr(layers[0], STORE_ATTRIBUTE, store)  # a plain attribute: weight_store_of finds it
    return store


def _streamed(layer: torch.nn.Module, kind: Streamed) -> list[tuple[str, torch.Tensor]]:
    """What `kind` streams of `layer`: its frozen weights, or its MoE block's expert store (made, 16-bit
    buffers, where the experts are still parameters)."""
    if not kind.experts_only:
        return frozen_storages(layer)
    names = {id(m): n for n, m in layer.named_modules()}
    return [(f"{names[id(block.experts)]}.{STORE}.{name}", tensor) for block in moe_blocks(layer)
            for name, tensor in store_of(block.experts, block.weights).named_buffers()]


@contextmanager
def _writing(files: StoreFiles | None, kind: Streamed) -> Iterator[None]:
    """A disk that fills up or fails while the weights are written: the files go, one line says so."""
    try:
        yield
    except OSError as exc:
        if files is None:
            raise
        files.remove()
        raise OffloadDirError(f"{kind.key}: writing the {kind.what} to {files.directory} failed: {exc}",
                              hint=kind.hint) from exc


@contextmanager
def stream_on_arrival(tier: str, ahead: int, host_ram: int | None, directory: Path | None,
                      planned: tuple[int, int], kind: Streamed = WEIGHTS, resident: int = 0) -> Iterator[None]:
    """While a model loads in this thread, move each decoder layer's weight off the device the moment it is set
    on its module (a 4-bit one with its quant state, a MoE layer's 4-bit expert store as it is made; with `kind`
    EXPERTS the experts alone), into a `WeightStore` that `offload_weights` completes after the load: the device
    never holds more than the parts that stay (embeddings, norms outside the layers, the LM head) and the weight
    arriving, and host RAM one weight beyond the store. So a model whose weights exceed the card (or RAM, for
    the disk tier) loads.

    `resident`: the first layers, whose weights stay where they load (memory.offload_weights_resident).
    `planned`: (host RAM, disk) bytes the tier takes (finetune.plan.weight_stream.host_bytes), checked against
    `host_ram` and `directory` before anything loads; host RAM is checked again as it fills. The seams are
    torch's public module and parameter registration hooks, limited to this thread: a parameter's module is
    found through the parents the registrations recorded while the model was built; nothing of transformers
    is patched."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    files = tier_files(kind, tier, planned[0], host_ram, directory, planned[1])
    thread = threading.get_ident()
    parents: dict[int, tuple[torch.nn.Module, str]] = {}
    positions: dict[int, int] = {}
    stores: list[WeightStore] = []

    def registered(parent: torch.nn.Module, name: str, child: torch.nn.Module | None) -> None:
        if threading.get_ident() == thread and child is not None:
            parents[id(child)] = (parent, name)

    def layer_of(module: torch.nn.Module) -> tuple[torch.nn.Module, str] | None:
        """The decoder layer holding `module` and the module's path in it, or None (outside the layers)."""
        path = []
        while not isinstance(module, GradientCheckpointingLayer):
            if id(module) not in parents:
                return None
            module, name = parents[id(module)]
            path.append(name)
        return module, ".".join(reversed(path))

    def start(layer: torch.nn.Module, device: torch.device) -> WeightStore:
        root = layer
        while id(root) in parents:
            root = parents[id(root)][0]
        layers = decoder_layers(root)
        positions.update((id(m), p) for p, m in enumerate(layers))
        stores.append(WeightStore(len(layers), device, ahead, files, kind))
        setattr(layers[0], STORE_ATTRIBUTE, stores[0])
        return stores[0]

    def arrived(module: torch.nn.Module, name: str, param: torch.Tensor | None) -> None:
        if threading.get_ident() != thread or param is None or param.is_meta:
            return
        found = layer_of(module)
        if found is None:
            return
        layer, path = found
        store = stores[0] if stores else start(layer, param.device)
        position = positions.get(id(layer))
        if position is None or position < resident:  # a vision tower's layer, or one that stays: not streamed
            return
        prefix = f"{path}." if path else ""
        expert_store = getattr(module, STORE, None)  # a MoE layer's 4-bit expert store, made as they arrive
        tensors = [] if kind.experts_only and not _is_expert_weight(module, param) \
            else _with_quant_state(name, param)
        tensors += [(f"{STORE}.{n}", b) for n, b in (expert_store.named_buffers() if expert_store else ())]
        for key, tensor in tensors:
            if tensor.untyped_storage().nbytes():  # not taken yet (a 4-bit expert store's earlier buffers are)
                store.take(position, prefix + key, tensor)
        if files is None:  # what the plan priced was not less than what arrives: RAM checked as it fills
            tier_files(kind, tier, store.host_bytes, host_ram, None, 0)

    handles = [torch.nn.modules.module.register_module_module_registration_hook(registered),
               torch.nn.modules.module.register_module_parameter_registration_hook(arrived)]
    try:
        with _writing(files, kind):
            yield
        where = "in host RAM" if files is None else f"in files under {files.directory}"
        console.print(f"{kind.key}: {tier}: loaded layer by layer, "
                      f"{format_bytes(sum(s.host_bytes for s in stores))} of {kind.what} {where}", markup=False)
    except BaseException:
        for store in stores:
            store.close()  # its reader; the files go too
        if files is not None:
            files.remove()
        raise
    finally:
        for handle in handles:
            handle.remove()


def _is_expert_weight(module: torch.nn.Module, param: torch.Tensor) -> bool:
    """A fused 3-D expert weight set on an experts module (16-bit: the experts are not stored in 4 bits)."""
    return param.dim() == 3 and isinstance(getattr(module, "num_experts", None), int)


def weight_store_of(model: torch.nn.Module) -> WeightStore | None:
    """The weight store `offload_weights` set up on `model` (to close it where its caller did not keep it)."""
    return getattr(decoder_layers(model)[0], STORE_ATTRIBUTE, None)
