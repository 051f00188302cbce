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

import torch

from finetune.model.moe import STORE, moe_blocks
from finetune.recipe.schema import QuantizationConfig

BLOCKSIZE = 64  # bitsandbytes' 4-bit block, as Linear4bit uses


class QuantizedExperts(torch.nn.Module):
    """The fused expert weights of one experts module, one 4-bit quantized matrix per expert (buffers, so
    they move with the model)."""

    def __init__(self, experts: torch.nn.Module, names: tuple[str, ...], quant: QuantizationConfig):
        super().__init__()
        import bitsandbytes.functional as bnbf

        self.names = names
        self.quant_type = quant.quant_type
        self.shapes: dict[str, torch.Size] = {}
        self.dtype = getattr(experts, names[0]).dtype
        for name in names:
            weight = getattr(experts, name)
            states, packed = [], []
            for matrix in weight.detach():
                q, state = bnbf.quantize_4bit(matrix.contiguous(), blocksize=BLOCKSIZE,
                                              compress_statistics=quant.double_quant, quant_type=quant.quant_type)
                packed.append(q.reshape(-1))
                states.append(state)
            self.shapes[name] = weight.shape[1:]
            self.register_buffer(f"{name}_packed", torch.stack(packed))
            self.register_buffer(f"{name}_absmax", torch.stack([s.absmax for s in states]))
            self.register_buffer(f"{name}_code", states[0].code)
            if quant.double_quant:
                self.register_buffer(f"{name}_offset", torch.stack([s.offset for s in states]))
                self.register_buffer(f"{name}_absmax2", torch.stack([s.state2.absmax for s in states]))
                self.register_buffer(f"{name}_code2", states[0].state2.code)
                self.nested_blocksize = states[0].state2.blocksize
            delattr(experts, name)  # the 16-bit parameter goes; the store answers for it

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
    expert weights quantized. Other bit widths leave the experts as loaded."""
    if quant.bits != 4:
        return 0
    count = 0
    for block in moe_blocks(model):
        if getattr(block.experts, STORE, None) is None:
            setattr(block.experts, STORE, QuantizedExperts(block.experts, block.weights, quant))
            count += len(block.weights)
    return count
