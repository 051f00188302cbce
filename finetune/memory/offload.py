"""Activation offload: move the tensors autograd saves in forward to RAM or disk, bring them back in backward.

Built on `torch.autograd.graph.saved_tensors_hooks`; where the tensors go is a spill chain of offload tiers
(`finetune.memory.offload_tier`, built from the table in `finetune.recipe.offload_tiers`).

More in docs/memory.md, "Activation offload (finetune/memory/offload.py)".
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from finetune.compat import attn_implementation, tensor_version
from finetune.memory.bandwidth import offload_bytes_per_step
from finetune.memory.offload_cpu import CudaMover, Mover
from finetune.memory.offload_disk import check_offload_dir
from finetune.memory.offload_tier import StoredTensor, build_chain
from finetune.model.family import decoder_layers, text_config
from finetune.recipe.offload_tiers import chain_names, tier_names, tier_spec
from finetune.recipe.schema import MemoryConfig
from finetune.rundir import RunDir

__all__ = ["ActivationOffload", "activation_offload", "check_offload_dir",
           "offload_dir_for", "preflight_offload", "tier_limits"]


def offload_dir_for(memory_cfg: MemoryConfig, run_dir: str | Path) -> Path:
    """Where the disk tier writes: `memory.offload_dir`, or `<run_dir>/offload` when unset."""
    return Path(memory_cfg.offload_dir).expanduser() if memory_cfg.offload_dir else RunDir(run_dir).offload


def tier_limits(memory_cfg: MemoryConfig) -> dict[str, int]:
    """Bytes each tier may hold, by tier name, from the recipe keys the tier table names (unset: no limit)."""
    keys = {name: tier_spec(name).limit_key for name in tier_names()}
    limits = {name: getattr(memory_cfg, key) for name, key in keys.items() if key is not None}
    return {name: limit for name, limit in limits.items() if limit is not None}


def _flat_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class _Stored:
    """One offloaded copy, shared by every handle saved from it; released when the last handle goes."""

    __slots__ = ("item", "layer", "__weakref__")

    def __init__(self, item: StoredTensor, layer: int):
        self.item = item
        self.layer = layer

    def __del__(self) -> None:
        self.item.release()


class _LastLayer:
    """A tensor of the last decoder layer, kept as is: backward reaching it starts fetching the layers below."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _Handle:
    """What autograd holds instead of a tensor: the stored copy, how to view it, the layer that saved it.

    `view` is None when the copy already has the tensor's layout, else (dtype, shape, stride, offset)
    into the copied storage bytes.
    """

    __slots__ = ("stored", "view", "layer")

    def __init__(self, stored: _Stored, view: tuple | None, layer: int):
        self.stored = stored
        self.view = view
        self.layer = layer

    def unpack(self) -> torch.Tensor:
        data = self.stored.item.get()
        if self.view is None:
            return data
        dtype, shape, stride, offset = self.view
        return torch.empty(0, dtype=dtype, device=data.device).set_(data.untyped_storage(), offset, shape, stride)


class ActivationOffload:
    """Saved-tensor hooks that offload decoder-layer activations to `tier` (see the module docstring).

    `tier` names an entry of the tier table (finetune.recipe.offload_tiers); with a limit in `limits` (bytes
    by tier name) a full tier spills into the next one of its chain (`chain`). `offload_dir`: where tiers
    that write files write them.
    """

    def __init__(self, model: nn.Module, tier: str, min_size: int, offload_dir: Path | None = None,
                 limits: dict[str, int] | None = None, mover: Mover | None = None):
        try:
            spec = tier_spec(tier)
        except KeyError as exc:
            raise ValueError(f"activation offload: {exc.args[0]}") from None
        self.model = model
        self.tier_name = tier
        self.min_size = min_size
        self.prefetch_layers = spec.prefetch_layers
        layers = decoder_layers(model)
        self.num_layers = len(layers)
        if mover is None:
            device = next(model.parameters()).device
            mover = CudaMover(device) if device.type == "cuda" else None
        self.mover = mover
        self.chain = build_chain(tier, mover, offload_dir, limits)
        self._hooks = []
        for index, layer in enumerate(layers):
            self._hooks.append(layer.register_forward_pre_hook(self._enter_layer(index)))
            self._hooks.append(layer.register_forward_hook(self._leave_layer))
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._lock = threading.RLock()
        self._active = False
        self._reset()
        # Totals since creation (all steps): tensors and bytes offloaded, bytes spilled past the first tier.
        self.stats = {"offloaded_tensors": 0, "offloaded_bytes": 0, "spilled_bytes": 0}

    # -- per-step state ------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._layer: int | None = None
        self._param_storages: set[int] = set()
        self._by_layer: dict[int, list[weakref.ref]] = {}
        self._seen: dict[int, tuple[weakref.ref, int, weakref.ref]] = {}
        self._fetching = False
        self._next_fetch: int | None = None

    def _enter_layer(self, index: int):
        def hook(module, args):
            self._layer = index
        return hook

    def _leave_layer(self, module, args, output) -> None:
        self._layer = None

    def __enter__(self) -> ActivationOffload:
        if self._active:
            raise RuntimeError("activation offload: this context is already active (it is not re-entrant)")
        self._reset()
        self._param_storages = {t.untyped_storage().data_ptr()
                                for t in (*self.model.parameters(), *self.model.buffers())}
        self._active = True
        self._saved_hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._saved_hooks.__exit__(*exc)
        self._active = False
        with self._lock:
            stored = [ref() for refs in self._by_layer.values() for ref in refs]
        for item in stored:
            if item is not None:
                item.item.release()
        self.chain.drain()
        self._reset()

    def close(self) -> None:
        """End of training: remove the module hooks and close the tiers (files deleted, threads stopped)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.chain.close()

    # -- pack / unpack -------------------------------------------------------------------------------
    def _offloadable(self, t: torch.Tensor) -> bool:
        layer = self._layer
        if layer is None or layer == self.num_layers - 1:
            return False
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.device.type == "meta":
            return False
        if t.numel() * t.element_size() < self.min_size:
            return False
        if t.is_leaf and t.requires_grad:  # autograd keeps leaves alive anyway (e.g. LoRA's embedding output)
            return False
        return t.untyped_storage().data_ptr() not in self._param_storages

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._offloadable(t):
            # The last layer's tensors stay, but their use in backward starts the read-ahead.
            return _LastLayer(t) if self._layer == self.num_layers - 1 else t
        storage = t.untyped_storage()
        nbytes = t.numel() * t.element_size()
        if storage.nbytes() != nbytes:
            # A view into a larger storage: copy just its elements, densely (strides kept when dense).
            stored = self._store(t, torch.empty_like(t, device="meta"), nbytes)
            return t if stored is None else _Handle(stored, None, self._layer)
        # The tensor spans its whole storage: offload the storage once for all the views saved from it
        # (hidden states reach several ops as different views) and rebuild each view in backward.
        view = (t.dtype, t.shape, t.stride(), t.storage_offset())
        key = storage.data_ptr()
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is storage and seen[1] == tensor_version(t) and seen[2]() is not None:
            stored = seen[2]()
            if self._layer not in self._by_layer or self._by_layer[self._layer][-1]() is not stored:
                # Shared by several layers (rotary cos/sin): fetch it when backward reaches the last of them.
                with self._lock:
                    self._by_layer.setdefault(self._layer, []).append(weakref.ref(stored))
            return _Handle(stored, view, self._layer)
        flat = _flat_bytes(storage, t.device)
        stored = self._store(flat, torch.empty_like(flat, device="meta"), nbytes)
        if stored is None:
            return t
        self._seen[key] = (weakref.ref(storage, lambda _ref, key=key: self._seen.pop(key, None)),
                           tensor_version(t), weakref.ref(stored))
        return _Handle(stored, view, self._layer)

    def _store(self, t: torch.Tensor, layout: torch.Tensor, nbytes: int) -> _Stored | None:
        """Hand `t` to the spill chain; None when every tier is full (then it stays where it is)."""
        with torch.no_grad():
            item = self.chain.store(t, layout, nbytes)
        if item is None:
            return None
        self.stats["spilled_bytes"] = self.chain.spilled_bytes
        stored = _Stored(item, self._layer)
        self.stats["offloaded_tensors"] += 1
        self.stats["offloaded_bytes"] += nbytes
        with self._lock:
            self._by_layer.setdefault(stored.layer, []).append(weakref.ref(stored))
        return stored

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _LastLayer):
            self._prefetch_below(self.num_layers - 1)
            return packed.tensor
        self._prefetch_below(packed.layer)
        return packed.unpack()

    def _prefetch_below(self, layer: int) -> None:
        """Backward has reached `layer`: fetch what the next `prefetch_layers` layers below it offloaded."""
        with self._lock:
            if not self._fetching:
                self._fetching = True
                self._next_fetch = max((i for i in self._by_layer if i <= layer), default=None)
            while self._next_fetch is not None and self._next_fetch >= layer - self.prefetch_layers:
                for ref in reversed(self._by_layer.get(self._next_fetch, [])):
                    stored = ref()
                    if stored is not None:
                        stored.item.fetch()
                self._next_fetch = max((i for i in self._by_layer if i < self._next_fetch), default=None)


def activation_offload(model: nn.Module, memory_cfg: MemoryConfig, run_dir: str | Path,
                       mover: Mover | None = None) -> ActivationOffload | None:
    """The run's offload context per `memory_cfg`, or None when `memory.offload` is none.

    Call `preflight_offload` first so a bad directory fails before step one.
    """
    if memory_cfg.offload == "auto":
        raise ValueError("memory.offload=auto must be resolved by the planner before building the offload")
    if memory_cfg.offload == "none":
        return None
    return ActivationOffload(
        model, memory_cfg.offload, memory_cfg.offload_min_size,
        offload_dir=offload_dir_for(memory_cfg, run_dir), limits=tier_limits(memory_cfg), mover=mover)


def _layer_saved_bytes_estimate(config: Any, micro_batch: int, seq_len: int, dtype_bytes: int) -> int:
    """Bytes one transformer layer saves for backward without checkpointing: sbh(34 + 5as/h) in 16-bit
    (Korthikanti et al. 2022), scaled to the dtype; the s^2 attention term only for eager attention."""
    s, b, h = seq_len, micro_batch, config.hidden_size
    attention = 5 * config.num_attention_heads * s / h if attn_implementation(config) == "eager" else 0
    return int(s * b * h * (34 + attention) * dtype_bytes / 2)


def preflight_offload(model: nn.Module, memory_cfg: MemoryConfig, run_dir: str | Path, micro_batch: int,
                      seq_len: int) -> int:
    """Before training: make sure the disk tier's directory is writable and big enough for one step.

    Call it once the model (with adapters) is built and the recipe resolved (no `auto`), before the loop.
    Returns the predicted bytes a micro-batch writes to disk (0 when the run does not use the disk): exact
    for checkpointed layers, estimated for the others. Raises `OffloadDirError` (a FinetuneError) otherwise.
    """
    if memory_cfg.offload in ("none", "auto"):
        return 0
    limits = tier_limits(memory_cfg)
    chain = chain_names(memory_cfg.offload, limits)
    on_disk = [i for i, name in enumerate(chain) if tier_spec(name).holds_in == "offload_dir"]
    if not on_disk:
        return 0
    layers = decoder_layers(model)
    # From the recipe, not the layers: checkpointing is switched on when the loop is built.
    every = memory_cfg.checkpoint_every_n_layers if memory_cfg.activation_checkpointing is True else None
    config = text_config(model.config)
    dtype_bytes = next(p for p in model.parameters() if p.is_floating_point()).element_size()
    total = offload_bytes_per_step(
        len(layers), config.hidden_size, micro_batch, seq_len, dtype_bytes, memory_cfg.offload_min_size, every,
        layer_saved_bytes=_layer_saved_bytes_estimate(config, micro_batch, seq_len, dtype_bytes),
        frozen_embeddings=not model.get_input_embeddings().weight.requires_grad)
    # The tiers before the first one on disk spill into it once their limits are full.
    total = max(0, total - sum(limits[name] for name in chain[:on_disk[0]]))
    if total:
        check_offload_dir(offload_dir_for(memory_cfg, run_dir), total)
    return total
