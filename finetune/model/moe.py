"""Mixture-of-experts blocks: found generically, computed through transformers' experts registry.

Why generic: transformers 5 stores a MoE block's experts as one module of fused 3-D parameters
(`Qwen3MoeExperts.gate_up_proj` [E, 2I, H], `GptOssExperts.down_proj` [E, I, H] transposed, with biases), next
to a router (a module with an [E, H] weight) and, in DeepSeek / GLM / Qwen2-MoE, shared experts (dense MLPs
every token goes through). `experts_of(block)` reads that layout from the module tree, so Qwen3-MoE, Mixtral,
OLMoE, gpt-oss, DeepSeek-V2/V3 and GLM-4-MoE need no entry of their own; a model-family description can hold
the `MoEBlock` it returns.

More in docs/moe.md, "Computing the experts (finetune/model/moe.py)".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from finetune.compat import expert_gate
from finetune.errors import RecipeError

IMPLEMENTATION = "finetune"  # our name in transformers' ExpertsInterface
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")  # the config names families use
SHARED_NAMES = ("shared_experts", "shared_expert", "shared_mlp")
STORE = "finetune_store"  # the experts module's attribute holding its weights when stored apart (4-bit, offloaded)


@dataclass(frozen=True)
class MoEConfig:
    """A config's mixture-of-experts facts (torch-free reading of the text config)."""

    num_experts: int
    top_k: int
    aux_loss_coef: float | None  # router_aux_loss_coef where the model adds a load-balancing loss


def moe_config(config: Any) -> MoEConfig | None:
    """The MoE facts of a transformers config, or None for a dense model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = next((int(n) for f in EXPERT_COUNT_FIELDS if isinstance(n := getattr(text, f, None), int) and n > 0),
                   0)
    top_k = getattr(text, "num_experts_per_tok", None)
    if not experts or not isinstance(top_k, int):
        return None
    # a model adds the loss where its config has output_router_logits (the planner's cached facts hold None
    # for an attribute a config lacks)
    coef = getattr(text, "router_aux_loss_coef", None) if getattr(text, "output_router_logits", None) is not None \
        else None
    return MoEConfig(experts, top_k, float(coef) if coef else None)


@dataclass(frozen=True)
class MoEBlock:
    """One MoE block of a decoder layer, as found in the module tree."""

    name: str  # the block's module path, e.g. model.layers.3.mlp
    block: torch.nn.Module
    experts_name: str  # the experts module's name inside the block ("experts")
    experts: torch.nn.Module
    router: torch.nn.Module | None  # the module holding the [E, H] routing weight
    shared: tuple[str, ...]  # names inside the block of the shared-expert MLPs
    num_experts: int
    weights: tuple[str, ...]  # the fused expert weights, e.g. ("gate_up_proj", "down_proj")


def expert_weight_names(module: torch.nn.Module) -> tuple[str, ...]:
    """The fused expert weights of `module`: its own 3-D parameters, or those a store holds in their place."""
    store = stored_experts(module)
    if store is not None:
        return store.names
    return tuple(n for n, p in module.named_parameters(recurse=False) if p.dim() == 3)


def is_experts(module: torch.nn.Module) -> bool:
    """A fused-experts module: an expert count and 3-D expert weights."""
    return isinstance(getattr(module, "num_experts", None), int) and bool(expert_weight_names(module))


def experts_of(module: torch.nn.Module, name: str = "") -> MoEBlock | None:
    """The MoE block `module` is (a direct child holds fused experts), or None."""
    found = next(((n, child) for n, child in module.named_children() if is_experts(child)), None)
    if found is None:
        return None
    experts_name, experts = found
    num = experts.num_experts
    router = next((child for child in module.children() if child is not experts
                   and isinstance(getattr(child, "weight", None), torch.Tensor) and child.weight.dim() == 2
                   and child.weight.shape[0] == num), None)
    shared = tuple(n for n in SHARED_NAMES if isinstance(getattr(module, n, None), torch.nn.Module))
    return MoEBlock(name, module, experts_name, experts, router, shared, num, expert_weight_names(experts))


def moe_block_of(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The MoE block of one decoder layer (the family table's `experts` hook), None for a dense layer."""
    return next((child for child in layer.children() if experts_of(child) is not None), None)


def moe_blocks(model: torch.nn.Module) -> list[MoEBlock]:
    """Every MoE block of a (peft-wrapped) model, in module order."""
    blocks = []
    for name, module in model.named_modules():
        block = experts_of(module, name)
        if block is not None:
            blocks.append(block)
    return blocks


def stored_experts(experts: torch.nn.Module) -> Any:
    """The store holding `experts`' weights in place of its parameters (4-bit, offloaded), or None."""
    return getattr(experts, STORE, None)


def stored_elements(model: torch.nn.Module) -> int:
    """Weights held by expert stores in place of parameters (4-bit, offloaded), as elements."""
    total = 0
    for block in moe_blocks(model):
        store = stored_experts(block.experts)
        if store is not None:
            total += sum(block.num_experts * math.prod(store.shape_of(name)) for name in store.names)
    return total


# ---------------------------------------------------------------------------------------------------------
# The experts implementation


def expert_matrix(experts: torch.nn.Module, name: str, index: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert `index`'s matrix of the fused weight `name`, as the layout stores it ([out, in], or [in, out]
    when the module is_transposed), in `dtype` on the compute device."""
    store = stored_experts(experts)
    if store is not None:
        return store.matrix(name, index, dtype)
    return getattr(experts, name)[index]


class _StoredLinear(torch.autograd.Function):
    """x @ W for a frozen expert matrix held by a store: W is fetched (dequantized) in forward and again in
    backward, never kept for backward (what bitsandbytes' 4-bit matmul does for a Linear4bit)."""

    @staticmethod
    def forward(ctx, x, experts, name, index, transposed):
        ctx.args = (experts, name, index, transposed)
        w = expert_matrix(experts, name, index, x.dtype)
        return x @ w if transposed else F.linear(x, w)

    @staticmethod
    def backward(ctx, grad):
        experts, name, index, transposed = ctx.args
        w = expert_matrix(experts, name, index, grad.dtype)
        return (grad @ w.T if transposed else grad @ w), None, None, None, None


def _expert_linear(experts: torch.nn.Module, name: str, index: int, x: torch.Tensor) -> torch.Tensor:
    transposed = bool(getattr(experts, "is_transposed", False))
    if stored_experts(experts) is not None:
        out = _StoredLinear.apply(x, experts, name, index, transposed)
    else:
        w = getattr(experts, name)[index]
        out = x @ w.to(x.dtype) if transposed else F.linear(x, w.to(x.dtype))
    bias = getattr(experts, f"{name}_bias", None) if getattr(experts, "has_bias", False) else None
    return out if bias is None else out + bias[index].to(out.dtype)


def _expert(experts: torch.nn.Module, index: int, x: torch.Tensor) -> torch.Tensor:
    """One expert's MLP on its routed rows, in the layout transformers' `use_experts_implementation` declares."""
    if getattr(experts, "has_gate", True):
        hidden = expert_gate(experts, _expert_linear(experts, "gate_up_proj", index, x))
    else:
        hidden = experts.act_fn(_expert_linear(experts, "up_proj", index, x))
    out = _expert_linear(experts, "down_proj", index, hidden)
    if getattr(experts, "has_post_expert_norm", False):
        out = experts.post_expert_norm(out)
    return out


def routed_counts(expert_ids: torch.Tensor, num_experts: int, tokens: int, top_k: int,
                  every_expert: bool = False) -> list[int]:
    """Rows each expert gets (expert_ids sorted): counted (one host sync), or on `meta` the worst case the
    router allows: top_k experts with every token each (a token picks an expert at most once). `every_expert`
    (LoRA folded into the fused weights: each routed expert adds a whole-stack gradient in backward): top_k - 1
    experts with every token and the last token slot spread over all the others, so both worst cases meet."""
    if expert_ids.is_meta:
        if every_expert and num_experts > top_k:
            rest = num_experts - top_k + 1
            spread = [tokens // rest + (i < tokens % rest) for i in range(rest)]
            return [tokens] * (top_k - 1) + spread
        return [tokens] * min(top_k, num_experts) + [0] * max(num_experts - top_k, 0)
    return torch.bincount(expert_ids, minlength=num_experts)[:num_experts].tolist()


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts of one MoE block on (tokens, hidden) inputs: each routed expert on its rows, weighted and
    summed per token (fp32-free: the rows' dtype, as transformers' implementations)."""
    tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = hidden_states[order // top_k]
    counts = routed_counts(flat, self.num_experts, tokens, top_k, torch.nn.utils.parametrize.is_parametrized(self))
    outs, start = [], 0
    for index, count in enumerate(counts):
        if count:
            outs.append(_expert(self, index, rows[start:start + count]))
            start += count
    out = torch.cat(outs) if outs else rows[:0]
    if out.shape[0] < rows.shape[0]:  # ids outside the experts (expert-parallel sentinels) add nothing
        out = torch.cat([out, out.new_zeros(rows.shape[0] - out.shape[0], out.shape[1])])
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return out[inverse].view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def use_finetune_experts(model: torch.nn.Module) -> int:
    """Select our experts implementation on every experts module of `model` (registered once in transformers'
    ExpertsInterface; `set_experts_implementation` is the public switch). Returns the MoE blocks found."""
    blocks = moe_blocks(model)
    if not blocks:
        return 0
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(IMPLEMENTATION)
    if not hasattr(model, "get_experts_implementation") or \
            model.get_experts_implementation().get("") != IMPLEMENTATION:
        raise RecipeError(f"model.path: the experts of {type(model).__name__} ({blocks[0].name}) do not use "
                          "transformers' experts registry", hint="this architecture's MoE blocks are not supported")
    return len(blocks)


# ---------------------------------------------------------------------------------------------------------
# Adapter targets and the load-balancing loss


def adapter_targets(model: torch.nn.Module, target_modules: str | list[str], target_experts: bool,
                    key: str = "adapter.target_experts") -> tuple[str | list[str], list[str]]:
    """(target_modules, target_parameters) for peft on `model`.

    A dense model keeps the recipe's target_modules; `target_experts` there is a RecipeError. On a MoE model
    `all-linear` becomes the Linear layers outside the routers (attention, shared experts, dense layers): peft
    would otherwise turn it into LoRA on every expert and router (its conversion of transformers-4 MoE
    adapters), and a name peft remaps that way (its qwen2_moe / mixtral tables: gate_proj, up_proj, down_proj,
    w1-w3, gate) is left out, so the experts are adapted only when the recipe asks: `target_experts` adds the
    fused expert weights as peft `target_parameters`. The Linear layers left out by such a name (DeepSeek's and
    GLM's shared experts and dense MLPs, named like the experts) are named by their full paths instead, where
    the installed peft keeps those as the modules they are (peft 0.21 converts them too: they stay frozen)."""
    blocks = moe_blocks(model)
    if not blocks:
        if target_experts:
            raise RecipeError(f"{key}: {type(_unwrap(model)).__name__} is not a mixture-of-experts model",
                              hint=f"remove {key} (it applies to mixture-of-experts models only)")
        return target_modules, []
    routers = {id(b.router) for b in blocks if b.router is not None}
    head = _unwrap(model).get_output_embeddings()
    if target_modules == "all-linear":
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear) and m is not head and id(m) not in routers})
    else:
        names = list(target_modules) if isinstance(target_modules, list) else [target_modules]
    remapped = _peft_remapped(model, names)
    kept = [n for n in names if n not in remapped]
    paths = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head
             and id(m) not in routers and n.rsplit(".", 1)[-1] in remapped]
    kept += [p for p in paths if p not in _peft_remapped(model, paths)] if paths else []
    parameters = sorted({f"{b.experts_name}.{w}" for b in blocks for w in b.weights}) if target_experts else []
    return kept, parameters


PEFT_MOE_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "gate")  # peft's conversion tables


def _peft_remapped(model: torch.nn.Module, names: list[str]) -> set[str]:
    """The module names (or paths) peft's transformers-4 MoE conversion would turn into expert/router
    parameters: those it takes out of target_modules, and any whose leaf is in its tables when it adds a
    parameter target (a version that keeps a name as a module but adapts the experts for it too)."""
    from peft import LoraConfig

    from finetune.compat import peft_moe_conversion

    probe = LoraConfig(target_modules=list(names))
    tabled = {n for n in names if n.rsplit(".", 1)[-1] in PEFT_MOE_NAMES}
    try:
        peft_moe_conversion()(probe, _unwrap(model), None)
    except ValueError:  # a fused pair named only in part: every name of the pair would be remapped
        return tabled
    return (set(names) - set(probe.target_modules or [])) | (tabled if probe.target_parameters else set())


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside accelerate's DDP wrapper and peft's."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def aux_loss_coef(model: torch.nn.Module) -> float | None:
    """The router's load-balancing loss coefficient the model adds to its loss, or None (dense models, and
    MoE families that balance without one: DeepSeek-V3 and GLM-4-MoE route with a learned bias)."""
    facts = moe_config(_unwrap(model).config)
    return facts.aux_loss_coef if facts is not None else None


def router_aux_loss(model: torch.nn.Module, router_logits: tuple[torch.Tensor, ...],
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The load-balancing loss of `router_logits` exactly as the model's own forward adds it: its family's
    `load_balancing_loss_func` (a public function of each MoE modeling module), so the chunked loss, which
    runs the decoder without the model's head, adds what the model would."""
    import sys

    base = _unwrap(model)
    facts = moe_config(base.config)
    func = sys.modules[type(base).__module__].load_balancing_loss_func
    return func(router_logits, facts.num_experts, facts.top_k, attention_mask)
