"""Count a training step's memory on the `meta` device: exact tensor sizes, no memory, no weights.

Why: activation memory depends on every detail of an architecture's forward (GQA handled by the kernel or by
repeating K/V, rotary tables, dropout masks, soft-capping, fused projections, the attention kernel's saved
log-sum-exp, upcasts in norms and in the loss). Writing that as a formula per family drifts with every
transformers release. Running the training step itself (`finetune.step.training_step.forward_backward`, what `finetune run`
and `finetune measure` run) on meta tensors, under the same tracker, gives the byte count of every saved
tensor in ~0.1 s. We run it on copies with 2-3 repeating blocks of layers at micro-batch 1 and extrapolate
linearly (activations are linear in micro-batch and in the number of layers), see `memory_model.py`; the batch
padded or packed as the run's collator makes it (`finetune.step.preference.batch_layout`), a packed one whole. Results are cached on disk (`trace_cache.py`).

Why one module of ~700 lines: the meta-device machinery (the kernel mode that keeps index tensors on the CPU,
the model cut to repeating blocks, the traced batch, the cached facts) serves the trace alone and shares its
state.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from finetune.compat import (
    TorchDispatchMode,
    engine_backward,
    flash_attention_cpu,
    meta_on_device,
    op_schema,
    set_attn_implementation,
    storage_id,
    tree_leaves,
    tree_map,
)
from finetune.errors import FinetuneError
from finetune.memory.layer_recompute import apply_layer_recompute
from finetune.memory.tracker import MemoryTracker
from finetune.model.adapter import apply_adapter
from finetune.model.building import BUILDING
from finetune.model.family import decoder_layers, in_decoder_layers
from finetune.model.moe import EXPERT_COUNT_FIELDS, expert_weight_names, is_experts, use_finetune_experts
from finetune.model.source import config_location
from finetune.plan import trace_cache
from finetune.plan.planner import DEFAULT, Planner
from finetune.plan.shapes import ModelShapes, load_model_config, model_shapes, with_layers
from finetune.plan.vision import Grid, trace_batch
from finetune.recipe.schema import AdapterConfig, GRPOConfig
from finetune.rl.step import (
    completion_logps,
    grpo_forward_backward,
    of_trace_objective,
    synthetic_micro_batch,
)
from finetune.step.preference import PreferenceLoss, batch_reference_logps, synthetic_batch
from finetune.step.training_step import enable_checkpointing, forward_backward


class _MetaKernels(TorchFunctionMode):
    """On meta, torch picks the math SDPA (which stores s x s probabilities); use the fused kernel's shapes.

    The fused CPU kernel saves what CUDA's flash/efficient kernels save (q, k, v, output, log-sum-exp). Also
    answer transformers' packed-sequence check (find_packed_sequence_indices asks whether every row is one
    sequence: it is, for a batch without position_ids), the one place the step reads a meta tensor's value. A
    padded or packed batch's attention_mask and position_ids stay on the CPU (`synthetic_batch`): their values
    are read for real, and the masks built from them join the meta tensors.
    A function mode is thread-local and sees only the tracing thread's calls: nothing process-wide is patched,
    so concurrent plans (UI handlers) and a training running in the same process are unaffected.
    A vision-language trace keeps the index tensors whose values its forward reads on the CPU
    (`finetune.plan.vision.trace_batch`): where one meets a meta tensor, it joins it on meta.
    """

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and _cpu_mask(args[0]) and _meta_target(args[1:], kwargs):
            # a mask from the token ids (or a padded batch's attention_mask) keeps its values, so what it selects
            # has a shape; in the dtype asked for (a MoE router's loss weighs tokens by the mask as floats)
            return args[0].to(_dtype_of(args[1:], kwargs) or torch.bool)
        if func is torch.as_tensor and _cpu_index(args[0]) and _meta_target(args[1:], kwargs):
            return args[0]  # an index tensor (Mistral 3's image_sizes) keeps its values: they split the features
        if func is torch.Tensor.to and args[0].is_meta:  # moved to the token ids' device (SmolVLM): stays on meta
            args, kwargs = tree_map(_cpu_as_meta, (args, kwargs))
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and args[0].is_meta:
            args = (args[0], _mask_indices(args[1]), *args[2:])
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.is_meta for t in tensors) and any(not t.is_meta and t.dim() for t in tensors):
            with self.tracker.as_stand_in():  # the host tensors are counted where computed
                args, kwargs = tree_map(_to_meta, (args, kwargs))
        if func is torch.nn.functional.scaled_dot_product_attention and args[0].is_meta:
            return _meta_sdpa(*args, **kwargs)
        if func is torch.Tensor.__bool__ and args[0].is_meta:
            return True
        return func(*args, **kwargs)


def _to_meta(x: Any) -> Any:
    return x.to("meta") if isinstance(x, torch.Tensor) and not x.is_meta else x


def _cpu_as_meta(x: Any) -> Any:
    return "meta" if (x == "cpu" if isinstance(x, str) else isinstance(x, torch.device) and x.type == "cpu") else x


def _cpu_mask(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not x.is_meta and x.dtype == torch.bool


def _dtype_of(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype a Tensor.to call asks for, if any."""
    return next((a for a in (*args, kwargs.get("dtype")) if isinstance(a, torch.dtype)), None)


def _cpu_index(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not x.is_meta and not x.is_floating_point()


def _meta_target(args: tuple, kwargs: dict) -> bool:
    return any(a == "meta" or (isinstance(a, torch.device) and a.type == "meta")
               for a in (*args, kwargs.get("device")))


def _mask_indices(key: Any) -> Any:
    """An index whose boolean masks hold values (on the CPU) as the positions they select, whose count is
    known: a meta tensor indexed by them gets its real shape (Qwen3-VL adds image features at the image
    tokens' positions)."""
    parts = key if isinstance(key, tuple) else (key,)
    if not any(_cpu_mask(p) for p in parts):
        return key
    out = tuple(i for p in parts for i in (p.nonzero(as_tuple=True) if _cpu_mask(p) else (p,)))
    return out if isinstance(key, tuple) or len(out) > 1 else out[0]


class _Uncacheable(Exception):
    pass


_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _signature(x: Any) -> Any:
    """What a meta kernel's result can depend on: a tensor's metadata, a scalar's type and value."""
    if isinstance(x, torch.Tensor):
        if not x.is_meta or x.layout != torch.strided:
            raise _Uncacheable
        return (x.shape, x.stride(), x.dtype, x.storage_offset())
    if isinstance(x, (list, tuple)):
        return (type(x), *map(_signature, x))
    if isinstance(x, _SCALARS):
        return (type(x), x)  # 1, 1.0 and True hash alike but promote differently
    raise _Uncacheable


def _functional(func: Any, facts: dict[Any, bool]) -> bool:
    known = facts.get(func)
    if known is None:
        schema = op_schema(func)
        known = facts[func] = schema is not None and not schema.is_mutable and all(
            a.alias_info is None for a in (*schema.arguments, *schema.returns))
    return known


def _describe(out: Any, args: Any, kwargs: dict) -> Any:
    """The outputs' metadata (storage size, sharing between outputs), or None where an output is not a fresh
    meta tensor (it aliases an input, or is not a tensor)."""
    inputs = {storage_id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    storages: list[int] = []
    single = isinstance(out, torch.Tensor)
    specs = []
    for t in (out,) if single else out if isinstance(out, (tuple, list)) else [object()]:
        if t is None:
            specs.append(None)
            continue
        if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor or not t.is_meta:
            return None
        storage = t.untyped_storage()
        if storage_id(storage) in inputs:
            return None
        if storage_id(storage) not in storages:
            storages.append(storage_id(storage))
        specs.append((tuple(t.shape), t.stride(), t.dtype, t.storage_offset(), storage.nbytes(),
                      storages.index(storage_id(storage))))
    return single, type(out), specs


def _rebuild(memo: Any) -> Any:
    single, kind, specs = memo
    storages: dict[int, torch.UntypedStorage] = {}
    out = []
    for spec in specs:
        if spec is None:
            out.append(None)
            continue
        shape, stride, dtype, offset, nbytes, index = spec
        storage = storages.get(index)
        if storage is None:
            storage = storages[index] = torch.UntypedStorage(nbytes, device="meta")
        out.append(torch.empty(0, dtype=dtype, device="meta").set_(storage, offset, shape, stride))
    return out[0] if single else kind(out)


class _MetaMemo(TorchDispatchMode):
    """Memoise meta kernels: an op that neither mutates nor aliases its arguments gives, on `meta`, outputs
    whose shapes, strides, dtypes and storage sizes depend only on its inputs' metadata and its other
    arguments. Most of a trace's time is torch's Python meta kernels, and the same ops recur with the same
    shapes in every layer, every recomputation and every traced family: compute each once per process.
    Sits below the tracker (entered first), which counts the rebuilt outputs as fresh allocations like the
    kernel's own (tests/test_plan_speedups.py compares traces with and without it). The memo is the
    planner's (`Planner.meta_kernels`)."""

    def __init__(self, planner: Planner):
        super().__init__()
        self.planner = planner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = None
        memo_of = self.planner.meta_kernels
        if _functional(func, self.planner.functional):
            try:
                key = (func, torch.get_default_dtype(), _signature(args),
                       _signature(tuple(kwargs.items())) if kwargs else ())
            except _Uncacheable:
                key = None
        if key is not None:
            memo = memo_of.get(key, memo_of)
            if memo is not memo_of and memo is not None:
                return _rebuild(memo)
        out = func(*args, **kwargs)
        if key is not None and key not in memo_of:
            if len(memo_of) > Planner.MEMO_LIMIT:
                memo_of.clear()
            memo_of[key] = _describe(out, args, kwargs)
        return out


def _backward(loss: torch.Tensor) -> None:
    """loss.backward() without entering torch's function dispatch: a mode is off inside its own handler, and
    the checkpointed layers' forward that backward recomputes must see it."""
    engine_backward(loss)


def _meta_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The fused kernel as scaled_dot_product_attention calls it: a boolean mask (sliding-window layers,
    packed or padded batches) first becomes an additive mask of q's dtype, a new tensor per call that the kernel
    keeps for backward (one [batch, 1, s, s] tensor per sliding-window layer: Gemma, Ministral)."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~attn_mask, float("-inf"))
    if v.shape[-1] != q.shape[-1]:  # MLA (DeepSeek): values narrower than queries; the fused kernel wants one
        # width, so V is padded to it (as transformers does for flash attention) and the output cut back
        pad = torch.nn.functional.pad(v, (0, q.shape[-1] - v.shape[-1]))
        return flash_attention_cpu(q, k, pad, dropout_p, is_causal, attn_mask, scale)[..., :v.shape[-1]]
    return flash_attention_cpu(q, k, v, dropout_p, is_causal, attn_mask, scale)


# flex attention and flash-attention are CUDA kernels (and flex attention compiles itself): the meta model runs this
# stand-in instead, registered in transformers' public attention and mask registries under its own name.
_FUSED = "finetune_meta_fused"


def _meta_fused_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Any, scaling: float | None = None, s_aux: torch.Tensor | None = None,
                          **_: Any) -> tuple[torch.Tensor, None]:
    """What flex attention (and flash-attention) keep: q, k, v, the output and its log-sum-exp, grouped-query
    attention in the kernel, no s x s tensor and no dense mask (flex attention's block mask holds a few integers
    per 128 x 128 tile, built by transformers from the same mask function). Attention sinks renormalise the output
    through the log-sum-exp (transformers' flex_attention_forward): one more output-sized tensor. A query head
    count that is no power of two makes transformers copy K and V per query head first (its flex attention's
    tensor-parallel guard), as here: Llama-3.2-3B's 24 heads."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads & (heads - 1) and kv_heads != heads:
        def repeat(x: torch.Tensor) -> torch.Tensor:
            b, _, length, dim = x.shape
            return x[:, :, None].expand(b, kv_heads, heads // kv_heads, length, dim).reshape(b, heads, length, dim)
        key, value = repeat(key), repeat(value)
    out = flash_attention_cpu(query, key, value, 0.0, False, None, scaling)
    if s_aux is not None:
        b, heads, length, _ = out.shape
        lse = out.new_empty(b, heads, length, 1)
        sinks = s_aux.view(1, -1, 1, 1).expand(b, heads, length, 1)
        combined = torch.logsumexp(torch.cat([lse, sinks.to(lse.dtype)], dim=-1), dim=-1, keepdim=True)
        out = out * torch.exp(lse - combined)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*_: Any, **__: Any) -> None:
    return None


def _traced_attention(attn: str) -> str:
    """The implementation the meta model runs for the one a run trains with: the CUDA kernels' stand-in, or the
    implementation itself (sdpa through `_meta_sdpa`, chunked and eager as they are)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from finetune.model.attention import register

    register()
    if attn not in ("flex_attention", "flash_attention_2"):
        return attn
    AttentionInterface.register(_FUSED, _meta_fused_attention)
    AttentionMaskInterface.register(_FUSED, _no_mask)
    return _FUSED


class _Int8LikeLinear(torch.autograd.Function):
    """What bitsandbytes' 8-bit matmul holds: the input kept for backward (even for a frozen weight) and a
    dequantized copy of the weight while it multiplies, in forward and again in backward."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.x = x
        ctx.save_for_backward(weight)
        return torch.nn.functional.linear(x, weight.clone())

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ weight.clone(), None


def _int8_forward(module: torch.nn.Linear):
    def forward(x):
        out = _Int8LikeLinear.apply(x, module.weight)
        return out if module.bias is None else out + module.bias
    return forward


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of the traced model: how the memory model prices it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    out_features: int
    bytes_per_elem: int
    trainable: bool
    quantizable: bool  # a decoder-layer Linear weight that bitsandbytes would quantize


@dataclass(frozen=True)
class Trace:
    """Window peaks (total, breakdown) of one traced step, and the trainable parameters its backward gave no
    gradient: parts of the model the traced inputs do not run (Llama 3.2 Vision skips its cross-attention
    layers on text without images), which get neither a gradient nor optimizer state in the run either."""

    windows: dict[str, tuple[int, dict[str, int]]]
    untrained: tuple[str, ...] = ()


def _quantizable(name: str, module: torch.nn.Module, in_layers: set[int]) -> bool:
    """Decoder-layer Linear layers that bitsandbytes replaces (not adapters, not the LM head); `in_layers`:
    finetune.model.family.in_decoder_layers of the model."""
    return (isinstance(module, torch.nn.Linear) and id(module) in in_layers and "lora_" not in name
            and not module.weight.requires_grad)


def _param_infos(model: torch.nn.Module) -> tuple[ParamInfo, ...]:
    infos = []
    seen: set[int] = set()
    in_layers = in_decoder_layers(model)
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            # fused 3-D expert weights are stored in 4 bits by finetune.model.expert_store (bits: 4)
            quantizable = (pname == "weight" and _quantizable(name, module, in_layers)) or \
                (p.dim() == 3 and not p.requires_grad and pname in expert_weight_names(module))
            out = p.shape[0] if p.dim() == 2 else p.numel()
            infos.append(ParamInfo(f"{name}.{pname}".lstrip("."), tuple(p.shape), p.dtype, p.numel(), out,
                                   p.element_size(), p.requires_grad, quantizable))
    return tuple(infos)


def _layer_windows(model: torch.nn.Module, tracker: MemoryTracker) -> list:
    """Split the backward window at decoder-layer boundaries: bwd_head (LM head and loss), bwd_top (last
    layer), bwd_mid, bwd_bottom (first layer and embeddings). The peak moves from the top to the bottom as
    activations are freed and gradients appear; each end extrapolates linearly with the layer count."""
    layers = decoder_layers(model)
    names = ["bwd_bottom", *["bwd_mid"] * (len(layers) - 2), "bwd_top"] if len(layers) > 1 else ["bwd_top"]

    def hook_for(name: str):
        def forward_hook(_module, _args, output):
            out = output[0] if isinstance(output, tuple) else output
            if torch.is_grad_enabled() and out.requires_grad and tracker._window == "forward":
                out.register_hook(lambda grad: tracker.switch_window(name))
        return forward_hook

    return [layer.register_forward_hook(hook_for(name)) for layer, name in zip(layers, names, strict=True)]


def _meta_model(config_json: str, model_type: str, adapter_json: str, dtype: str, attn: str, layers: int,
                checkpointing: bool, recompute_norms: bool = False, mlp_tokens: int = 0) -> torch.nn.Module:
    from transformers import AutoConfig

    from finetune.model.load import auto_model

    config = AutoConfig.for_model(model_type, **json.loads(config_json))
    config = with_layers(config, layers)
    set_attn_implementation(config, _traced_attention(attn))
    adapter = AdapterConfig.model_validate_json(adapter_json)
    with torch.device("meta"):
        with BUILDING:
            model = auto_model(config).from_config(config, dtype=getattr(torch, dtype))
        use_finetune_experts(model)
        model = apply_adapter(model, adapter, checkpointing=checkpointing)
        apply_layer_recompute(model, recompute_norms, mlp_tokens)
    if adapter.target_experts:
        _expert_weights_report_cpu(model)
    return model


def _expert_weights_report_cpu(model: torch.nn.Module) -> None:
    """LoRA on fused expert weights (peft's `target_parameters`) switches torch.autocast off on the weight's
    device type while it folds the low-rank update into the weight, and autocast has no `meta` device: the
    frozen expert weights report `cpu` (`compat.meta_on_device`: still meta, no bytes), so the trace runs
    peft's fold (the whole updated expert stack of a layer, kept for backward) as the run does."""
    for module in model.modules():
        if is_experts(module):
            for name, weight in list(module.named_parameters(recurse=False)):
                if weight.dim() == 3 and weight.is_meta:
                    setattr(module, name, torch.nn.Parameter(meta_on_device(weight.detach(), "cpu"),
                                                             requires_grad=False))


def _direct_trace(key: tuple[str, str, str, str], attn: str, micro_batch: int, seq_len: int, layers: int,
                  checkpoint_every: int, int8: bool, recompute_norms: bool, mlp_tokens: int,
                  objective: str = "sft", chunked_loss: bool = False, images: tuple[Grid, ...] = (),
                  planner: Planner = DEFAULT, layout: str = "full") -> Trace:
    """Run the training step's forward_backward on a meta model under the tracker (its model and meta-kernel
    memo from `planner`; `images`: each example's image grids, for a vision-language model; `layout`: the
    batch's, `finetune.step.preference.batch_layout`)."""
    built = (key, attn, layers, checkpoint_every, recompute_norms, mlp_tokens)
    model = _take_model(planner, built)
    config = model.config
    preference = PreferenceLoss.of_objective(objective)
    batch = synthetic_batch(preference, micro_batch, seq_len, config.get_text_config().vocab_size, "meta",
                            layout=layout)
    in_layers = in_decoder_layers(model) if int8 else set()
    int8_layers = [module for name, module in model.named_modules() if int8 and _quantizable(name, module, in_layers)]
    for module in int8_layers:
        module.forward = _int8_forward(module)
    tracker = MemoryTracker(vocab_size=config.get_text_config().vocab_size, device="meta",
                            host_values=bool(images) or layout != "full")
    tracker.register_model(model)
    handles = _layer_windows(model, tracker)
    grpo = of_trace_objective(objective)
    try:
        with _MetaKernels(tracker), _MetaMemo(planner), tracker:
            if images:  # every row (a pair's chosen and rejected rows alike) shows the example's images; made under
                # the tracker, as the run's collator makes its batch in the step: the pixels count while it lasts
                batch.update(trace_batch(config, len(batch["input_ids"]), seq_len, images))
            if grpo is not None:
                _grpo_step(model, tracker, micro_batch, seq_len, *grpo)
            elif preference is not None and preference.reference_precomputed:
                with tracker.window("reference_pass"):  # the pass before training: no gradients exist yet
                    batch_reference_logps(model, batch, chunked_loss, current=preference.reference_current)
            if grpo is None:
                forward_backward(model, batch, backward=_backward, tracker=tracker, backward_window="bwd_head",
                                 preference=preference, chunked_loss=chunked_loss)
    finally:
        tracker.remove_hooks()
        for handle in handles:
            handle.remove()
    for module in int8_layers:
        del module.forward  # the class's forward again
    untrained = tuple(name for name, p in model.named_parameters() if p.requires_grad and p.grad is None)
    _return_model(planner, built, model)
    return Trace(windows=dict(tracker.windows), untrained=untrained)


def _grpo_step(model: torch.nn.Module, tracker: MemoryTracker, rows: int, seq_len: int, completion: int,
               logps_pass: bool) -> None:
    """GRPO's training phase (finetune.rl.step): with `logps_pass`, the no-grad log-prob forward over `rows`
    completions (old policy / reference) in its own window, then the policy's forward and backward."""
    micro = synthetic_micro_batch(rows, seq_len - completion, completion, "meta")
    if logps_pass:
        with tracker.window("logps_pass"), torch.no_grad():
            completion_logps(model, micro.input_ids, micro.attention_mask, micro.prompt_length)
    grpo_forward_backward(model, micro, GRPOConfig(max_completion_length=completion, loss_type="grpo"),
                          backward=_backward, tracker=tracker, backward_window="bwd_head")


# Meta models built for tracing are kept in the planner (`Planner.models`), by everything that shapes them
# (model key, attention, layers, checkpointing, recomputed norms, tiled MLP): building one (transformers +
# peft on `meta`) costs about as much as tracing it, and the int8 and plain families trace the same model. A
# model is taken out while one thread traces it.
def _take_model(planner: Planner, built: tuple) -> torch.nn.Module:
    with planner.models_lock:
        free = planner.models.get(built)
        if free:
            return free.pop()
    return _build_model(built)


def _build_model(built: tuple) -> torch.nn.Module:
    key, attn, layers, checkpoint_every, recompute_norms, mlp_tokens = built
    model = _meta_model(*key, attn, layers, checkpoint_every > 0, recompute_norms, mlp_tokens)
    enable_checkpointing(model, checkpoint_every > 0, max(checkpoint_every, 1))
    model.train()
    return model


def _return_model(planner: Planner, built: tuple, model: torch.nn.Module) -> None:
    """Back to the pool as built: no gradients (a trace leaves them on the trained parameters)."""
    for p in model.parameters():
        p.grad = None
    with planner.models_lock:
        planner.models.setdefault(built, []).append(model)
        while len(planner.models) > Planner.MODELS_KEPT:
            del planner.models[next(iter(planner.models))]


def _encode_trace(trace: Trace) -> Any:
    return {"windows": {name: [total, parts] for name, (total, parts) in trace.windows.items()},
            "untrained": list(trace.untrained)}


def _decode_trace(value: Any) -> Trace:
    return Trace(windows={name: (int(total), {k: int(v) for k, v in parts.items()})
                          for name, (total, parts) in value["windows"].items()},
                 untrained=tuple(value["untrained"]))


def _encode_params(params: tuple[ParamInfo, ...]) -> Any:
    return [[p.name, list(p.shape), str(p.dtype).removeprefix("torch."), p.numel, p.out_features,
             p.bytes_per_elem, p.trainable, p.quantizable] for p in params]


def _decode_params(value: Any) -> tuple[ParamInfo, ...]:
    return tuple(ParamInfo(name, tuple(shape), getattr(torch, dtype), numel, out, size, trainable, quantizable)
                 for name, shape, dtype, numel, out, size, trainable, quantizable in value)


def _params_cached(key: tuple[str, str, str, str], layers: int, planner: Planner) -> tuple[ParamInfo, ...]:
    """The planner's memory, then the disk cache, then a meta model."""
    return planner.params.get_or_compute((key, layers), lambda: trace_cache.cached(
        "params", [*key, layers],
        lambda: _param_infos(_meta_model(*key, "eager", layers, False)), _encode_params, _decode_params))


def _trace_cached(key: tuple[str, str, str, str], device: str, args: tuple, objective: str,
                  chunked_loss: bool, planner: Planner, images: tuple[Grid, ...] = (), layout: str = "full") -> Trace:
    """The planner's memory, then the disk cache, then a trace."""
    if objective != "sft" or images:  # text sft traces keep their disk cache key
        args = (*args, objective, chunked_loss, *((images,) if images else ()))
    tagged = (*args, layout) if layout != "full" else args  # full-row traces keep their disk cache key
    return planner.traces.get_or_compute((key, device, tagged), lambda: trace_cache.cached(
        "trace", [*key, device, *tagged], lambda: _direct_trace(key, *args, planner=planner, layout=layout),
        _encode_trace, _decode_trace))


def _config_key(config: Any, planner: Planner) -> tuple[str, str]:
    """The config as JSON (without fields that do not change the model), computed once per config object (and
    remembered by `planner`)."""
    if isinstance(config, CachedConfig):
        return config._key
    keys = planner.config_keys
    with planner.config_keys_lock:
        hit = keys.get(id(config))
        if hit is not None and hit[0]() is config:
            return hit[1]
    data = config.to_dict()
    model_type = data.pop("model_type")
    for key in ("transformers_version", "architectures", "_name_or_path"):
        data.pop(key, None)
    value = (json.dumps(data, sort_keys=True, default=str), model_type)
    ident = id(config)
    with planner.config_keys_lock:
        keys[ident] = (weakref.ref(config, lambda _r: keys.pop(ident, None)), value)
    return value


class CachedConfig:
    """A model config as the planner reads it, from the disk cache: its key (`_config_key`) and the text
    model's dimensions, without importing transformers' config classes (that import alone takes about half a
    second, most of a warm plan). Any other attribute loads the real config once and reads it there."""

    def __init__(self, key: tuple[str, str], text: dict[str, Any], load: Any, real: Any = None):
        self._key, self._text, self._load, self._real = key, text, load, real

    def real(self) -> Any:
        """The transformers config (loaded on first use; `real_config` for any config)."""
        if self._real is None:
            self._real = self._load()
        return self._real

    def get_text_config(self, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return self.real().get_text_config(*args, **kwargs)
        return _TextFacts(self)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_load" not in self.__dict__:  # copy/pickle probes, half-built objects
            raise AttributeError(name)
        return getattr(self.real(), name)


def model_type_of(config: Any) -> str:
    """The model_type of a planned config (a CachedConfig's without loading the transformers config)."""
    return config._key[1] if isinstance(config, CachedConfig) else config.model_type


def real_config(config: Any) -> Any:
    """The transformers config behind a CachedConfig, or the config itself."""
    return config.real() if isinstance(config, CachedConfig) else config


class _TextFacts:
    """The text config's dimensions the planner reads; anything else from the real text config."""

    def __init__(self, owner: CachedConfig):
        self.__dict__.update(owner._text)
        self._owner = owner

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_owner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._owner.real().get_text_config(), name)


# The dimensions above, and the mixture-of-experts facts `finetune.model.moe.moe_config` reads (None: absent).
TEXT_FACTS = ("num_hidden_layers", "hidden_size", "vocab_size", "max_position_embeddings", "layer_types",
              *EXPERT_COUNT_FIELDS, "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits",
              "cross_attention_layers")


def _source_fingerprint(path: str, trust_remote_code: bool) -> list | None:
    """What a config read from `path` depends on besides library versions: the config file's bytes (a .gguf:
    its size and mtime); None where that is not known (a hub name, remote code)."""
    if trust_remote_code:
        return None
    try:
        p = config_location(path)
        if p.is_file() and p.suffix == ".gguf":
            stat = p.stat()
            return ["gguf", str(p.resolve()), stat.st_size, stat.st_mtime_ns]
        file = p / "config.json" if p.is_dir() else p
        if file.is_file() and file.suffix == ".json":
            import hashlib

            return ["json", hashlib.sha256(file.read_bytes()).hexdigest()]
    except (OSError, FinetuneError):
        return None
    return None


def planned_config(path: str, trust_remote_code: bool = False, planner: Planner = DEFAULT) -> Any:
    """The config of model.path for planning: a `CachedConfig` where its facts are in the disk cache (or were
    just computed), else the transformers config (shapes.load_model_config)."""
    def load() -> Any:
        return load_model_config(path, trust_remote_code)

    fingerprint = _source_fingerprint(path, trust_remote_code)
    if fingerprint is None:
        return load()
    loaded: list[Any] = []

    def compute() -> tuple[tuple[str, str], dict[str, Any]]:
        config = load()
        loaded.append(config)
        text = config.get_text_config()
        return _config_key(config, planner), {name: getattr(text, name, None) for name in TEXT_FACTS}

    key, text = trace_cache.cached("config", fingerprint, compute, lambda v: [list(v[0]), v[1]],
                                   lambda v: ((str(v[0][0]), str(v[0][1])), dict(v[1])))
    return CachedConfig(key, text, load, loaded[0] if loaded else None)


def _real_config(config: Any) -> Any:
    return config.real() if isinstance(config, CachedConfig) else config


def model_key(config: Any, adapter: AdapterConfig, dtype: torch.dtype, planner: Planner = DEFAULT
              ) -> tuple[str, str, str, str]:
    """What identifies a traced model: config, adapter and dtype, as hashable strings."""
    # Not init_from: where the start weights come from changes neither shapes nor the trace (the meta model
    # never loads them); the frozen reference adapter it adds is priced in memory_model.
    return (*_config_key(config, planner), adapter.model_dump_json(exclude={"init_from"}), str(dtype).removeprefix("torch."))

def model_facts(config: Any, attn_choice: str, planner: Planner = DEFAULT, device: str = "cuda",
                packing: bool = False) -> tuple[ModelShapes, str]:
    """The model's shapes and the attention kernel `auto` resolves to for training on `device` with or without
    packed documents (finetune.model.attention.choose), from the disk cache when known: both need the
    architecture's modeling code, whose import alone takes longer than a warm plan."""
    from dataclasses import asdict

    from finetune.model.load import attn_implementation

    def compute() -> tuple[ModelShapes, str]:
        real = _real_config(config)
        return model_shapes(real), attn_implementation(attn_choice, real, device, packing)[0]

    def decode(value: Any) -> tuple[ModelShapes, str]:
        return ModelShapes(**value[0]), str(value[1])

    return trace_cache.cached("model", [*_config_key(config, planner), attn_choice, device, packing], compute,
                              lambda v: [asdict(v[0]), v[1]], decode)


def trace_step(config: Any, adapter: AdapterConfig, dtype: torch.dtype, attn: str, device: str, micro_batch: int,
               seq_len: int, layers: int, checkpoint_every: int, int8: bool = False, recompute_norms: bool = False,
               mlp_tokens: int = 0, objective: str = "sft", chunked_loss: bool = False,
               images: tuple[Grid, ...] = (), planner: Planner = DEFAULT, layout: str = "full") -> Trace:
    """Trace one forward+backward of `config` cut to `layers` layers (checkpoint_every 0 = no checkpointing).

    int8: frozen decoder Linear layers behave like bitsandbytes LLM.int8 layers (see `_Int8LikeLinear`).
    recompute_norms, mlp_tokens: `finetune.memory.layer_recompute` as the run applies it (0 = no tiled MLP).
    objective: sft, or a preference loss's `objective` (micro_batch then counts examples: pairs for dpo/orpo);
    a preference step is traced with its real chunked log-probabilities (chunked_loss), an sft step always
    with full logits (the memory model scales them for chunked loss). A precomputed reference
    (`...:precompute_reference`) traces the step without a reference forward and, in window `reference_pass`,
    the pass over the data that precedes training. images: a vision-language model's image grids per example
    (`finetune.plan.vision`), traced through its vision tower. `planner`: whose caches remember the trace.
    layout: the micro-batch as the run's collator lays it out (`finetune.step.preference.batch_layout`):
    `padded` rows end in padding with their attention mask, `packed` ones are joined into one sequence of
    micro_batch x seq_len tokens with restarting position_ids; either makes the step build a 4-D mask (and
    SDPA copy K and V per head for grouped-query attention): the trace runs that code, priced by the tracker.
    """
    return _trace_cached(model_key(config, adapter, dtype, planner), device,
                         (attn, micro_batch, seq_len, layers, checkpoint_every, int8, recompute_norms, mlp_tokens),
                         objective, chunked_loss and objective != "sft", planner, images, layout)


def param_table_of(key: tuple[str, str, str, str], layers: int, planner: Planner = DEFAULT
                   ) -> tuple[ParamInfo, ...]:
    """The parameters of the model `key` (see model_key) cut to `layers` layers, adapter applied (no forward:
    milliseconds, then from `planner`'s or the disk cache)."""
    return _params_cached(key, layers, planner)
