"""Fused expert weights stored in 4 bits: what `quantization.bits: 4` does to a mixture-of-experts model.

Why: transformers' bitsandbytes integration quantizes nn.Linear layers; transformers 5 keeps a MoE block's
experts as 3-D parameters, which it leaves in 16 bits (Qwen3-30B-A3B: ~57 GB of its ~61 GB). Here each
expert's matrix is quantized on its own with bitsandbytes' functional NF4/FP4 (`quantize_4bit`, the same
blocks of 64, double-quantized scales, as a Linear4bit) into buffers of a `QuantizedExperts` module held by
the experts module as `finetune_store`; the 3-D parameter is dropped. `finetune.model.moe.expert_matrix`
dequantizes one expert of the batch's routing at a time, in forward and again in backward (never kept). The
router stays in full precision (it is not an expert weight).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from finetune.model.moe import STORE, moe_blocks
from finetune.recipe.schema import QuantizationConfig

BLOCKSIZE = 64  # bitsandbytes' 4-bit block, as Linear4bit uses


class QuantizedExperts(torch.nn.Module):
    """The fused expert weights of one experts module, one 4-bit quantized matrix per expert (buffers, so
    they move with the model). Filled one fused weight at a time (`add`): at load, as each arrives."""

    def __init__(self, quant: QuantizationConfig):
        super().__init__()
        self.names: tuple[str, ...] = ()
        self.quant_type = quant.quant_type
        self.double_quant = quant.double_quant
        self.shapes: dict[str, torch.Size] = {}
        self.dtype: torch.dtype | None = None

    def add(self, name: str, weight: torch.Tensor) -> None:
        """Store the fused weight `name` ([experts, ...]) in 4 bits, on its device, one expert's matrix at a
        time; the caller drops the 16-bit tensor."""
        import bitsandbytes.functional as bnbf

        states, packed = [], []
        for matrix in weight.detach():
            q, state = bnbf.quantize_4bit(matrix.contiguous(), blocksize=BLOCKSIZE,
                                          compress_statistics=self.double_quant, quant_type=self.quant_type)
            packed.append(q.reshape(-1))
            states.append(state)
        self.dtype = weight.dtype
        self.shapes[name] = weight.shape[1:]
        self.names = (*self.names, name)
        self.register_buffer(f"{name}_packed", torch.stack(packed))
        self.register_buffer(f"{name}_absmax", torch.stack([s.absmax for s in states]))
        self.register_buffer(f"{name}_code", states[0].code)
        if self.double_quant:
            self.register_buffer(f"{name}_offset", torch.stack([s.offset for s in states]))
            self.register_buffer(f"{name}_absmax2", torch.stack([s.state2.absmax for s in states]))
            self.register_buffer(f"{name}_code2", states[0].state2.code)
            self.nested_blocksize = states[0].state2.blocksize

    def shape_of(self, name: str) -> torch.Size:
        """One expert's matrix of `name`."""
        return self.shapes[name]

    def matrix(self, name: str, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `index`'s matrix of `name`, dequantized into `dtype`."""
        return self.matrix_from(dict(self.named_buffers()), name, index, dtype)

    def matrix_from(self, tensors: dict[str, torch.Tensor], name: str, index: int, dtype: torch.dtype) -> torch.Tensor:
        """`matrix` read from `tensors` (this store's buffers by name, or copies of them on another device)."""
        import bitsandbytes.functional as bnbf

        packed = tensors[f"{name}_packed"]
        state2 = None
        offset = None
        if f"{name}_absmax2" in tensors:
            state2 = bnbf.QuantState(absmax=tensors[f"{name}_absmax2"][index], code=tensors[f"{name}_code2"],
                                     blocksize=self.nested_blocksize, dtype=torch.float32)
            offset = tensors[f"{name}_offset"][index]
        state = bnbf.QuantState(absmax=tensors[f"{name}_absmax"][index], shape=self.shapes[name],
                                code=tensors[f"{name}_code"], blocksize=BLOCKSIZE, quant_type=self.quant_type,
                                dtype=self.dtype, offset=offset, state2=state2)
        return bnbf.dequantize_4bit(packed[index].unsqueeze(1), state).to(dtype)


class DenseExperts(torch.nn.Module):
    """The fused expert weights of one experts module as frozen 16-bit buffers (what an offload moves when
    they are not stored in 4 bits)."""

    def __init__(self, experts: torch.nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.names = names
        for name in names:
            self.register_buffer(name, getattr(experts, name).detach())
            delattr(experts, name)

    def shape_of(self, name: str) -> torch.Size:
        return getattr(self, name).shape[1:]

    def matrix(self, name: str, index: int, dtype: torch.dtype) -> torch.Tensor:
        return getattr(self, name)[index].to(dtype)

    def matrix_from(self, tensors: dict[str, torch.Tensor], name: str, index: int, dtype: torch.dtype) -> torch.Tensor:
        return tensors[name][index].to(dtype)


def store_of(experts: torch.nn.Module, names: tuple[str, ...]) -> torch.nn.Module:
    """The experts module's store, made (16-bit buffers) where its weights are still parameters."""
    store = getattr(experts, STORE, None)
    if store is None:
        store = DenseExperts(experts, names)
        setattr(experts, STORE, store)
    return store


def quantize_experts(model: torch.nn.Module, quant: QuantizationConfig) -> int:
    """Store every MoE block's fused expert weights in 4 bits (quantization.bits: 4); returns the number of
    expert weights quantized here. Weights `quantize_on_arrival` already stored at load leave their meta
    placeholders, which go. Other bit widths leave the experts as loaded."""
    if quant.bits != 4:
        return 0
    count = 0
    for block in moe_blocks(model):
        store = getattr(block.experts, STORE, None)
        if store is None:
            store = QuantizedExperts(quant)
            setattr(block.experts, STORE, store)
        if not isinstance(store, QuantizedExperts):
            continue  # offloaded: already stored apart
        for name, weight in list(block.experts.named_parameters(recurse=False)):
            if weight.dim() != 3:
                continue
            if name not in store.names:
                store.add(name, weight)
                count += 1
            delattr(block.experts, name)  # the 16-bit parameter (or the placeholder) goes; the store answers
    return count


def _is_expert_weight(module: torch.nn.Module, param: torch.Tensor | None) -> bool:
    """A fused 3-D expert weight with values, arriving on an experts module (see `moe.is_experts`)."""
    return (param is not None and not param.is_meta and param.dim() == 3
            and isinstance(getattr(module, "num_experts", None), int))


@contextmanager
def quantize_on_arrival(quant: QuantizationConfig) -> Iterator[None]:
    """While a model loads in this thread, store each fused expert weight in 4 bits the moment it is set on
    its experts module, leaving a `meta` placeholder of its shape (no bytes) that `quantize_experts` removes.
    (memory.offload_experts and offload_weights move each 4-bit store off the device as it is made:
    finetune.memory.weight_store.stream_on_arrival.)

    Why: transformers sets a converted weight with `setattr`; bitsandbytes quantizes Linear layers as they
    arrive but leaves 3-D experts in 16 bits, so they would all be on the device at once before being stored
    (Qwen3-30B-A3B: ~57 GB). Here at most one fused weight is unquantized at a time (transformers loads one
    weight after another while it quantizes on the fly). The seam is torch's public parameter-registration
    hook, limited to this thread and to experts modules; nothing of transformers is patched."""
    if quant.bits != 4:
        yield
        return
    thread = threading.get_ident()

    def arrived(module: torch.nn.Module, name: str, param: torch.Tensor | None) -> torch.nn.Parameter | None:
        if threading.get_ident() != thread or not _is_expert_weight(module, param):
            return None
        store = getattr(module, STORE, None)
        if store is None:
            store = QuantizedExperts(quant)
            setattr(module, STORE, store)
        store.add(name, param)
        placeholder = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                         requires_grad=False)
        placeholder.__dict__.update(param.__dict__)  # transformers' marks (_is_hf_initialized: not re-initialized)
        return placeholder

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(arrived)
    try:
        yield
    finally:
        handle.remove()
