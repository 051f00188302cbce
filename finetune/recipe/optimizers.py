"""The optimizer registry: one spec per recipe `optimizer.name`, the one list everything else reads.

The schema takes its name list, its descriptions and its cross-field checks from here; `finetune.optim`
builds each optimizer and predicts its state from the spec; the planner reads step temporaries and the
`auto` preference. This module imports neither torch nor finetune.optim (the schema, at the bottom of the
import graph, imports it): factories and state rules are named as "module:function" and imported only when
an optimizer is built or sized.

How to add an optimizer: append one `OptimizerSpec` to `SPECS` below. Its `factory` names a function
(opt, learning_rate) -> (param_groups, seed_offset=0) -> torch optimizer (see finetune/optim/factories.py;
finetune/optim/muon.py is a complete example with its own parameter split and state rule); `state` names a
function (shape, itemsize, opt, own) -> (bytes, uses bitsandbytes maps) that says what the optimizer keeps
for one parameter after its first step (tests/test_optim.py compares it byte for byte with a real step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ADAPTER_TYPES = ("lora", "dora", "full")
LOW_RANK_KEYS = ("rank", "update_proj_gap", "scale", "proj_type", "target_modules")


@dataclass(frozen=True)
class LowRankPreset:
    """APOLLO/GaLore projection defaults (finetune/optim/presets.py says why these values)."""

    method: str  # "apollo" (random projection, scaled gradient) or "galore" (SVD projection)
    rank: Callable[[int], int]  # rank from the projected weights' width (their largest short side)
    scale: float
    scale_type: str | None  # APOLLO only: "channel" or "tensor"
    update_proj_gap: int = 200
    proj_type: str = "std"


@dataclass(frozen=True)
class OptimizerSpec:
    """Everything the tool knows about one optimizer name."""

    name: str
    family: str  # the update and state layout: adamw, adamw_8bit, low_rank, low_rank_8bit, adafactor, sgd, muon
    summary: str  # a few words for the optimizer.name description (docs/recipe.md)
    factory: str  # "module:function" (opt, learning_rate) -> (groups, seed_offset=0) -> torch.optim.Optimizer
    state: str  # "module:function" (shape, itemsize, opt, own) -> (state bytes, uses bitsandbytes' maps)
    step_temporaries: float  # bytes one update allocates, in multiples of the largest trained parameter
    keys: tuple[str, ...] = ()  # optimizer.* keys that apply only to the optimizers naming them here
    low_rank: LowRankPreset | None = None  # projects the weights in `optimizer.target_modules`
    own_params: str | None = None  # "module:function" (name, shape) -> bool: weights given the optimizer's own
    #                                update (a group with "method": name); the rest get AdamW-style groups
    cuda_only: str | None = None  # why it cannot run on the CPU, and what to use there instead
    auto_preference: float | None = None  # `optimizer.name: auto` may pick it; factor on tokens/s (quality)
    adapters: tuple[str, ...] = ADAPTER_TYPES  # adapter.type values it can train
    layerwise: bool = True  # works with optimizer.layerwise (one inner optimizer per weight)
    sharded_states: bool = False  # its update is elementwise, so it works on FSDP / ZeRO shards of each weight
    # How the tuned learning rate follows the batch (finetune/recipe/batch_rules.py): "sqrt" for Adam-style
    # updates (normalised by a second moment), "linear" for SGD; uses_beta2: optimizer.betas[1] is its
    # second-moment decay, kept at a fixed half-life in tokens when the batch changes.
    lr_batch_scaling: str = "sqrt"
    uses_beta2: bool = True
    # Where its state lives on a GPU: "device" (torch's allocator), or "managed": CUDA managed (unified) memory,
    # which the driver pages out to host RAM under pressure and which torch's allocator neither counts nor
    # limits; the planner reports it apart from the device peak and checks it against free host RAM.
    state_memory: str = "device"


_ADAMW_STATE = "finetune.optim.state_size:adamw_state"
_BNB_STATE = "finetune.optim.state_size:bnb_state"
_LOW_RANK_STATE = "finetune.optim.state_size:low_rank_state"
_LOW_RANK_FACTORY = "finetune.optim.factories:low_rank"
_APOLLO_KEYS = (*LOW_RANK_KEYS, "scale_type")

SPECS: tuple[OptimizerSpec, ...] = (
    OptimizerSpec("adamw", "adamw", "torch AdamW", "finetune.optim.factories:adamw", _ADAMW_STATE, 2,
                  auto_preference=1.0, sharded_states=True),
    OptimizerSpec("adamw_8bit", "adamw_8bit", "bitsandbytes 8-bit AdamW", "finetune.optim.factories:adamw_8bit",
                  _BNB_STATE, 1, auto_preference=0.99),
    OptimizerSpec("paged_adamw_8bit", "adamw_8bit", "bitsandbytes 8-bit AdamW, paged state",
                  "finetune.optim.factories:paged_adamw_8bit", _BNB_STATE, 1, state_memory="managed"),
    OptimizerSpec("apollo", "low_rank", "APOLLO, rank width/8", _LOW_RANK_FACTORY, _LOW_RANK_STATE, 3,
                  keys=_APOLLO_KEYS, low_rank=LowRankPreset("apollo", lambda width: max(1, width // 8), 1.0, "channel")),
    OptimizerSpec("apollo_mini", "low_rank", "APOLLO-Mini, rank 1", _LOW_RANK_FACTORY, _LOW_RANK_STATE, 3,
                  keys=_APOLLO_KEYS, low_rank=LowRankPreset("apollo", lambda width: 1, 128.0, "tensor"),
                  auto_preference=0.95),
    OptimizerSpec("galore", "low_rank", "GaLore, rank width/4", _LOW_RANK_FACTORY, _LOW_RANK_STATE, 3,
                  keys=LOW_RANK_KEYS, low_rank=LowRankPreset("galore", lambda width: max(1, width // 4), 0.25, None)),
    OptimizerSpec("galore_8bit", "low_rank_8bit", "GaLore with 8-bit state, GPU only",
                  "finetune.optim.factories:galore_8bit", _BNB_STATE, 3, keys=LOW_RANK_KEYS,
                  low_rank=LowRankPreset("galore", lambda width: max(1, width // 4), 0.25, None),
                  cuda_only="galore-torch's 8-bit step calls torch.cuda.synchronize(), which fails on CPU; use "
                            "galore (32-bit state) on CPU, or run on a GPU"),
    OptimizerSpec("adafactor", "adafactor", "torch Adafactor", "finetune.optim.factories:adafactor",
                  "finetune.optim.state_size:adafactor_state", 3, uses_beta2=False),
    OptimizerSpec("sgd", "sgd", "torch SGD", "finetune.optim.factories:sgd", "finetune.optim.state_size:sgd_state", 1,
                  keys=("momentum",), sharded_states=True, lr_batch_scaling="linear", uses_beta2=False),
    OptimizerSpec("muon", "muon", "torch Muon on 2-D hidden weights, AdamW on the rest",
                  "finetune.optim.muon:factory", "finetune.optim.muon:state", 3,
                  own_params="finetune.optim.muon:is_hidden_matrix"),
)

_BY_NAME = {s.name: s for s in SPECS}


def optimizer_names() -> tuple[str, ...]:
    """Every registered optimizer name, in registry order (without `auto`)."""
    return tuple(_BY_NAME)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The spec of a registered optimizer; `auto` and unknown names are a ValueError listing the valid ones."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; valid names: {', '.join(_BY_NAME)}") from None


def auto_preferences() -> dict[str, float]:
    """Optimizers `optimizer.name: auto` may pick, in registry order, with their preference factor."""
    return {s.name: s.auto_preference for s in SPECS if s.auto_preference is not None}


def names_with_key(key: str) -> tuple[str, ...]:
    """The optimizers an optimizer-specific key (rank, momentum, ...) applies to."""
    return tuple(s.name for s in SPECS if key in s.keys)


def specific_keys() -> tuple[str, ...]:
    """Every optimizer-specific key, in first-use order."""
    return tuple(dict.fromkeys(k for s in SPECS for k in s.keys))
