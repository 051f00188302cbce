"""A resolved recipe's memory section applied to a loaded model: the layer recompute (norms, tiled MLP) and the
one frozen-weight offload it names (experts, or every frozen weight streamed). Why a module of its own: it
composes the memory savers of layer_recompute, expert_offload and weight_store, and belongs to none of them;
`finetune run` and `finetune measure` both call it after the adapter is in place."""

from __future__ import annotations

from pathlib import Path

import torch

from finetune.memory.expert_offload import offload_experts
from finetune.memory.layer_recompute import apply_layer_recompute
from finetune.memory.offload import offload_dir_for
from finetune.memory.weight_store import WeightStore, host_room, offload_weights
from finetune.recipe.schema import MemoryConfig


def apply_memory_config(model: torch.nn.Module, memory: MemoryConfig,
                        run_dir: str | Path | None = None) -> WeightStore | None:
    """`apply_layer_recompute`, expert offload and weight streaming as a resolved recipe's memory section says
    (tiled_mlp, offload_experts and offload_weights no longer auto; the schema allows one of the last two).
    `run_dir`: where the disk tier's default folder is (memory.offload_dir unset). Returns the offload, which
    the caller closes when training ends (its files go then)."""
    apply_layer_recompute(model, memory.recompute_norms, memory.tiled_mlp_tokens if memory.tiled_mlp is True else None)
    if memory.offload_experts == "none" and memory.offload_weights == "none":
        return None
    ram = host_room(memory.offload_cpu_limit)
    directory = offload_dir_for(memory, run_dir) if memory.offload_dir or run_dir is not None else None
    if memory.offload_weights != "none":
        return offload_weights(model, memory.offload_weights, memory.offload_weights_ahead, ram, directory,
                               resident=memory.offload_weights_resident)
    return offload_experts(model, memory.offload_experts, ram, directory)
