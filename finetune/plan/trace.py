"""Count a training step's memory on the `meta` device: exact tensor sizes, no memory, no weights.

Why: activation memory depends on every detail of an architecture's forward (GQA handled by the kernel or by
repeating K/V, rotary tables, dropout masks, soft-capping, fused projections, the attention kernel's saved
log-sum-exp, upcasts in norms and in the loss). Writing that as a formula per family drifts with every
transformers release. Running the training step itself (`finetune.memory.step.forward_backward`, what `finetune run`
and `finetune measure` run) on meta tensors, under the same tracker, gives the byte count of every saved
tensor in ~0.1 s. We run it on copies with 2-3 repeating blocks of layers at micro-batch 1 and extrapolate
linearly (activations are linear in micro-batch and in the number of layers), see `memory_model.py`. Results are cached on disk (`trace_cache.py`).
"""

from __future__ import annotations

import functools
import json
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from finetune.memory.layer_recompute import apply_layer_recompute
from finetune.memory.preference import PreferenceLoss, synthetic_batch
from finetune.memory.step import enable_checkpointing, forward_backward
from finetune.memory.tracker import MemoryTracker
from finetune.model.adapter import apply_adapter
from finetune.plan import trace_cache
from finetune.plan.shapes import ModelShapes, model_shapes, with_layers
from finetune.recipe.schema import AdapterConfig


class _MetaKernels(TorchFunctionMode):
    """On meta, torch picks the math SDPA (which stores s x s probabilities); use the fused kernel's shapes.

    The fused CPU kernel saves what CUDA's flash/efficient kernels save (q, k, v, output, log-sum-exp). Also
    answer transformers' packed-sequence check (find_packed_sequence_indices asks whether every row is one
    sequence: it is, for the traced batch), the one place the step reads a tensor's value.
    A function mode is thread-local and sees only the tracing thread's calls: nothing process-wide is patched,
    so concurrent plans (UI handlers) and a training running in the same process are unaffected.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and args[0].is_meta:
            return _meta_sdpa(*args, **kwargs)
        if func is torch.Tensor.__bool__ and args[0].is_meta:
            return True
        return func(*args, **kwargs)


def _backward(loss: torch.Tensor) -> None:
    """loss.backward() without entering torch's function dispatch: a mode is off inside its own handler, and
    the checkpointed layers' forward that backward recomputes must see it."""
    from torch.autograd.graph import _engine_run_backward

    _engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True,
                         accumulate_grad=True)


def _meta_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


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
    """Window peaks (total, breakdown) of one traced step."""

    windows: dict[str, tuple[int, dict[str, int]]]


def _quantizable(name: str, module: torch.nn.Module) -> bool:
    """Decoder-layer Linear layers that bitsandbytes replaces (not adapters, not the LM head)."""
    return (isinstance(module, torch.nn.Linear) and ".layers." in f".{name}." and "lora_" not in name
            and not module.weight.requires_grad)


def _param_infos(model: torch.nn.Module) -> tuple[ParamInfo, ...]:
    infos = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            quantizable = pname == "weight" and _quantizable(name, module)
            out = p.shape[0] if p.dim() == 2 else p.numel()
            infos.append(ParamInfo(f"{name}.{pname}".lstrip("."), tuple(p.shape), p.dtype, p.numel(), out,
                                   p.element_size(), p.requires_grad, quantizable))
    return tuple(infos)


def _layer_windows(model: torch.nn.Module, tracker: MemoryTracker) -> list:
    """Split the backward window at decoder-layer boundaries: bwd_head (LM head and loss), bwd_top (last
    layer), bwd_mid, bwd_bottom (first layer and embeddings). The peak moves from the top to the bottom as
    activations are freed and gradients appear; each end extrapolates linearly with the layer count."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
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
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **json.loads(config_json))
    config = with_layers(config, layers)
    config._attn_implementation = attn
    adapter = AdapterConfig.model_validate_json(adapter_json)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        model = apply_adapter(model, adapter, checkpointing=checkpointing)
        apply_layer_recompute(model, recompute_norms, mlp_tokens)
        return model


def _direct_trace(key: tuple[str, str, str, str], attn: str, micro_batch: int, seq_len: int, layers: int,
                  checkpoint_every: int, int8: bool, recompute_norms: bool, mlp_tokens: int,
                  objective: str = "sft", chunked_loss: bool = False) -> Trace:
    """Run the training step's forward_backward on a meta model under the tracker."""
    model = _meta_model(*key, attn, layers, checkpoint_every > 0, recompute_norms, mlp_tokens)
    config = model.config
    preference = PreferenceLoss.of_objective(objective)
    batch = synthetic_batch(preference, micro_batch, seq_len, config.get_text_config().vocab_size, "meta")
    if int8:
        for name, module in model.named_modules():
            if _quantizable(name, module):
                module.forward = _int8_forward(module)
    enable_checkpointing(model, checkpoint_every > 0, max(checkpoint_every, 1))
    model.train()
    tracker = MemoryTracker(vocab_size=config.get_text_config().vocab_size, device="meta")
    tracker.register_model(model)
    handles = _layer_windows(model, tracker)
    try:
        with _MetaKernels(), tracker:
            forward_backward(model, batch, backward=_backward, tracker=tracker, backward_window="bwd_head",
                             preference=preference, chunked_loss=chunked_loss)
    finally:
        tracker.remove_hooks()
        for handle in handles:
            handle.remove()
    return Trace(windows=dict(tracker.windows))


def _encode_trace(trace: Trace) -> Any:
    return {name: [total, parts] for name, (total, parts) in trace.windows.items()}


def _decode_trace(value: Any) -> Trace:
    return Trace(windows={name: (int(total), {k: int(v) for k, v in parts.items()})
                          for name, (total, parts) in value.items()})


def _encode_params(params: tuple[ParamInfo, ...]) -> Any:
    return [[p.name, list(p.shape), str(p.dtype).removeprefix("torch."), p.numel, p.out_features,
             p.bytes_per_elem, p.trainable, p.quantizable] for p in params]


def _decode_params(value: Any) -> tuple[ParamInfo, ...]:
    return tuple(ParamInfo(name, tuple(shape), getattr(torch, dtype), numel, out, size, trainable, quantizable)
                 for name, shape, dtype, numel, out, size, trainable, quantizable in value)


@functools.lru_cache(maxsize=512)
def _params_cached(config_json: str, model_type: str, adapter_json: str, dtype: str, layers: int):
    key = (config_json, model_type, adapter_json, dtype)
    return trace_cache.cached(
        "params", [*key, layers],
        lambda: _param_infos(_meta_model(*key, "eager", layers, False)), _encode_params, _decode_params)


@functools.lru_cache(maxsize=512)
def _trace_cached(config_json: str, model_type: str, adapter_json: str, dtype: str, attn: str, device: str,
                  micro_batch: int, seq_len: int, layers: int, checkpoint_every: int, int8: bool, recompute_norms: bool,
                  mlp_tokens: int, objective: str, chunked_loss: bool) -> Trace:
    key = (config_json, model_type, adapter_json, dtype)
    args = (attn, micro_batch, seq_len, layers, checkpoint_every, int8, recompute_norms, mlp_tokens)
    if objective != "sft":  # sft traces keep their cache key
        args = (*args, objective, chunked_loss)
    return trace_cache.cached("trace", [*key, device, *args], lambda: _direct_trace(key, *args), _encode_trace,
                              _decode_trace)


_KEYS: dict[int, tuple[weakref.ref, tuple[str, str]]] = {}
_KEYS_LOCK = threading.Lock()


def _config_key(config: Any) -> tuple[str, str]:
    """The config as JSON (without fields that do not change the model), computed once per config object."""
    with _KEYS_LOCK:
        hit = _KEYS.get(id(config))
        if hit is not None and hit[0]() is config:
            return hit[1]
    data = config.to_dict()
    model_type = data.pop("model_type")
    for key in ("transformers_version", "architectures", "_name_or_path"):
        data.pop(key, None)
    value = (json.dumps(data, sort_keys=True, default=str), model_type)
    ident = id(config)
    with _KEYS_LOCK:
        _KEYS[ident] = (weakref.ref(config, lambda _r: _KEYS.pop(ident, None)), value)
    return value


def model_key(config: Any, adapter: AdapterConfig, dtype: torch.dtype) -> tuple[str, str, str, str]:
    """What identifies a traced model: config, adapter and dtype, as hashable strings."""
    return (*_config_key(config), adapter.model_dump_json(), str(dtype).removeprefix("torch."))

def model_facts(config: Any, attn_choice: str) -> tuple[ModelShapes, str]:
    """The model's shapes and the attention kernel `auto` resolves to, from the disk cache when known: both
    need the architecture's modeling code, whose import alone takes longer than a warm plan."""
    from dataclasses import asdict

    from finetune.model.load import attn_implementation

    def compute() -> tuple[ModelShapes, str]:
        return model_shapes(config), attn_implementation(attn_choice, config)

    def decode(value: Any) -> tuple[ModelShapes, str]:
        return ModelShapes(**value[0]), str(value[1])

    return trace_cache.cached("model", [*_config_key(config), attn_choice], compute,
                              lambda v: [asdict(v[0]), v[1]], decode)


def trace_step(config: Any, adapter: AdapterConfig, dtype: torch.dtype, attn: str, device: str, micro_batch: int,
               seq_len: int, layers: int, checkpoint_every: int, int8: bool = False, recompute_norms: bool = False,
               mlp_tokens: int = 0, objective: str = "sft", chunked_loss: bool = False) -> Trace:
    """Trace one forward+backward of `config` cut to `layers` layers (checkpoint_every 0 = no checkpointing).

    int8: frozen decoder Linear layers behave like bitsandbytes LLM.int8 layers (see `_Int8LikeLinear`).
    recompute_norms, mlp_tokens: `finetune.memory.layer_recompute` as the run applies it (0 = no tiled MLP).
    objective: sft, or a preference loss's `objective` (micro_batch then counts examples: pairs for dpo/orpo);
    a preference step is traced with its real chunked log-probabilities (chunked_loss), an sft step always
    with full logits (the memory model scales them for chunked loss).
    """
    return _trace_cached(*model_key(config, adapter, dtype), attn, device, micro_batch, seq_len, layers,
                         checkpoint_every, int8, recompute_norms, mlp_tokens, objective,
                         chunked_loss and objective != "sft")


def param_table_of(key: tuple[str, str, str, str], layers: int) -> tuple[ParamInfo, ...]:
    """The parameters of the model `key` (see model_key) cut to `layers` layers, adapter applied (no forward:
    milliseconds, then from the cache)."""
    return _params_cached(*key, layers)
