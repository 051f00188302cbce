"""Peak memory per component for one set of concrete settings.

Why one module of ~650 lines: every component of the peak (weights, optimizer state, activations, offload,
several processes) is priced from the same ModelSpec and Settings and summed in one place, so none is
counted twice or missed.

More in docs/planner.md, "The memory model, component by component (finetune/plan/memory_model.py)".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from finetune.memory.chunked_loss import default_chunk_size
from finetune.optim import gradient_bytes, optimizer_state_bytes
from finetune.plan.generation import generation_memory
from finetune.plan.planner import DEFAULT, Planner
from finetune.plan.shapes import kind_variants
from finetune.plan.trace import ParamInfo, Trace, model_key, param_table_of, real_config, trace_step
from finetune.plan.vision import image_input_bytes
from finetune.recipe.offload_tiers import tier_spec
from finetune.recipe.optimizers import optimizer_spec
from finetune.recipe.schema import AdapterConfig, OptimizerConfig
from finetune.recipe.settings import Settings
from finetune.rl.step import of_trace_objective, prompts_per_step
from finetune.step.liger_losses import FUSED_CHUNK_BYTES, fused_problem
from finetune.step.preference import PreferenceLoss, batch_layout

# CUDA fixed costs. The context is outside torch's allocator, so it is added to the peak; the budget is
# measured as free memory before the process creates its context. Values for CUDA 12 with lazy module
# loading on Ampere/Ada/Hopper; cuBLAS keeps one 32 MiB workspace (Hopper) per stream/handle.
CUDA_CONTEXT_BYTES = 500 * 2**20
CUBLAS_WORKSPACE_BYTES = 32 * 2**20
# The caching allocator rounds blocks (to 512 B, and large ones to 2 MiB segments) and fragments; reserved
# memory runs this fraction above allocated memory in our CUDA runs of LoRA/QLoRA training steps.
ALLOCATOR_OVERHEAD = 0.05
NF4_BLOCK = 64
DOUBLE_QUANT_BLOCK = 256
# A 4-bit weight's quant state besides its absmax, on the device with the model: the NF4 code table (16 fp32),
# and with double quantization the absmax's offset (one fp32) and its 8-bit code table (256 fp32). Weight
# streaming leaves them there (finetune.memory.weight_store.frozen_storages): they are not streamed.
NF4_CODE_BYTES = 16 * 4
NESTED_CODE_BYTES = 4 + 256 * 4


@dataclass
class Prediction:
    peak_bytes: int
    breakdown: dict[str, int]
    offloaded_bytes: int = 0  # activation bytes moved off the device per micro-batch
    communication_bytes: int = 0  # several processes: the strategy's buffers, counted in `other`
    reference_pass_bytes: int = 0  # training.precompute_reference: the peak of the pass before training
    managed_bytes: int = 0  # optimizer state in CUDA managed memory (a paged optimizer): not in the peak
    windows: dict[str, dict[str, int]] = field(default_factory=dict)  # every window's parts; the peak is the
    # largest (what benchmarks/published.py reads to price another library's loss at its own window)
    generation_bytes: int = 0  # training.method grpo: the peak of generating a step's completions
    training_bytes: int = 0  # training.method grpo: the peak of the rest (log-prob pass, forward, backward, update)


def quantized_weight_bytes(numel: int, out_features: int, bits: int | None, double_quant: bool,
                           bytes_per_elem: int) -> int:
    """Bytes of one frozen Linear weight under bitsandbytes quantization (None = unquantized)."""
    if bits == 4:
        blocks = math.ceil(numel / NF4_BLOCK)
        scales = blocks + math.ceil(blocks / DOUBLE_QUANT_BLOCK) * 4 if double_quant else blocks * 4
        return math.ceil(numel / 2) + scales
    if bits == 8:
        return numel + out_features * 4
    return numel * bytes_per_elem


@dataclass(frozen=True)
class ModelSpec:
    """What the memory model needs to know about the model and the run besides `Settings`."""

    config: Any
    adapter: AdapterConfig
    dtype: torch.dtype
    attn: str
    device: str  # cpu | cuda: the device trained on
    seq_len: int
    num_layers: int
    hidden_size: int
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    double_quant: bool = True
    offload_min_size: int = 1 << 20
    offload_cpu_limit: int | None = None  # memory.offload_cpu_limit: host RAM the offload may hold
    recompute_norms: bool = True
    tiled_mlp_tokens: int = 1024
    world_size: int = 1  # processes (GPUs) the run is spread over; the plan is per device
    interconnect_bandwidth: float = 20e9  # bytes/s between GPUs (the speed model's communication time)
    zero_stage: int = 3  # deepspeed only
    deepspeed_offload: str = "none"  # deepspeed only: none | cpu | nvme (optimizer state off the device)
    objective: str = "sft"  # or a preference method (finetune.step.preference.PreferenceLoss.objective)
    rows_per_example: int = 1  # sequences per example: 2 for chosen + rejected pairs
    reference_adapter: bool = False  # adapter.init_from, reference forward in each step: a frozen copy
    reference_pass: bool = True  # precompute_reference: price the pass before training (not in a re-plan)
    num_generations: int = 0  # training.method grpo: completions per prompt (objective `grpo:...`)
    scoring_passes: int = 0  # grpo: no-grad passes over the completions before training (finetune.rl.step)
    iterations: int = 1  # grpo: updates trained on one generation's completions (grpo.num_iterations)
    planner: Planner = field(default=DEFAULT, compare=False, repr=False)  # whose caches the traces go to
    images: tuple[tuple[int, int, int], ...] = ()  # a vision-language model: one example's image grids (plan.vision)
    image_positions: int = 0  # those images' tokens in the sequence: never labelled, never through a chunked loss's head
    # of a micro-batch's examples, how many show the images (the others are text rows: `_text_rows`); None: all
    image_rows: int | None = None
    packing: bool = False  # data.packing: a micro-batch's rows joined into one sequence (step.preference.batch_layout)
    # the priced micro-batch has padding (finetune.plan.batches); False: its rows are one length, so the collator's
    # attention_mask is all ones and transformers builds no mask from it (traced without one)
    padded: bool = True


def _block(settings: Settings) -> int:
    return settings.checkpoint_every_n_layers if settings.activation_checkpointing else 1


def _layer_counts(spec: ModelSpec, settings: Settings) -> tuple[int, int]:
    """Two and three blocks: the first layer (whose input needs no gradient under LoRA) and the last (next to
    the head) are both present and distinct; a model that small is used whole."""
    n = _block(settings)
    return (2 * n, 3 * n) if 3 * n < spec.num_layers else (spec.num_layers, spec.num_layers)


def _variants(spec: ModelSpec, settings: Settings) -> list[tuple[Any, float]]:
    """The configs traced for the model and their weights: the model itself, or where the traced copies are
    extrapolated over middle layers of several kinds, its uniform stand-ins (plan.shapes.kind_variants)."""
    _, lb = _layer_counts(spec, settings)
    if lb >= spec.num_layers:
        return [(spec.config, 1.0)]
    return kind_variants(spec.config, lambda: real_config(spec.config))


def _mix(traces: list[Trace], weights: list[float], checkpointing: bool) -> Trace:
    """The variants' traces as one (plan.shapes.kind_variants): the weighted sum, window by window and
    component by component; with checkpointing the activations are the largest variant's."""
    if len(traces) == 1:
        return traces[0]
    windows = {}
    for name in traces[0].windows:
        parts = {k: sum(w * t.windows[name][1].get(k, 0) for t, w in zip(traces, weights, strict=True))
                 for k in traces[0].windows[name][1]}
        if checkpointing and "activations" in parts:
            parts["activations"] = max(t.windows[name][1].get("activations", 0) for t in traces)
        windows[name] = (round(sum(parts.values())), {k: round(v) for k, v in parts.items()})
    return Trace(windows)


def _layout(spec: ModelSpec, settings: Settings) -> str:
    """The micro-batch's layout as the run's collator makes it (`finetune.step.preference.batch_layout`);
    GRPO's steps build their own batches (`finetune.rl.step`). Flash attention takes padded and packed rows
    through its variable-length kernels (no mask, grouped-query attention in the kernel): full rows, as are rows
    without padding (`ModelSpec.padded`). Under flex attention and `chunked` a packed batch is traced as such,
    without a dense mask (plan.trace)."""
    if spec.num_generations or spec.attn == "flash_attention_2" or not (spec.padded or spec.packing):
        return "full"
    return batch_layout(settings.micro_batch_size * spec.rows_per_example, spec.packing)


def _traces(spec: ModelSpec, settings: Settings, micro_batch: int = 1) -> tuple[Trace, Trace]:
    """The step traced at two depths (`_layer_counts`), `micro_batch` examples a row each; a packed
    micro-batch whole, as the one sequence the collator joins it into (its attention mask grows with the
    square of its length: no trace of one example scales to it)."""
    la, lb = _layer_counts(spec, settings)
    every = settings.checkpoint_every_n_layers if settings.activation_checkpointing else 0
    layer = (settings.bits == 8, spec.recompute_norms, spec.tiled_mlp_tokens if settings.tiled_mlp else 0,
             spec.objective, settings.loss_without_logits)
    variants = _variants(spec, settings)
    weights = [w for _, w in variants]
    layout = _layout(spec, settings)
    if layout == "packed":
        micro_batch = settings.micro_batch_size

    def at(layers: int) -> Trace:
        return _mix([trace_step(config, spec.adapter, spec.dtype, spec.attn, spec.device, micro_batch, spec.seq_len,
                                layers, every, *layer, planner=spec.planner, images=spec.images, layout=layout)
                     for config, _ in variants], weights, every > 0)

    return at(la), at(lb)


def _batch_fixed_activations(spec: ModelSpec, settings: Settings) -> bool:
    """Whether the backward holds weight-sized tensors among its activations that do not grow with the
    micro-batch: gradients on their way to a trained weight as large as a layer's activations (a fully
    trained input embedding's gradient in the bottom layer's window; with tied embeddings the LM head's
    gradient waits in autograd's buffer from the head to the bottom, and the two are summed there). Then a
    second trace at micro-batch 2 separates what scales with the batch from what does not. LoRA on fused
    expert weights (adapter.target_experts) is such a case in forward too: peft folds the update into a copy of
    each layer's expert stack, kept for backward, whose gradient backward makes whole."""
    weight_sized = spec.adapter.type == "full" or bool(spec.adapter.modules_to_save) or spec.adapter.target_experts
    # a packed micro-batch is traced whole: nothing to separate
    return settings.micro_batch_size > 1 and _layout(spec, settings) != "packed" and bool(weight_sized)


def _lerp(a: float, b: float, xa: int, xb: int, x: int) -> float:
    return a if xa == xb else a + (b - a) * (x - xa) / (xb - xa)


def _param_sums(planner: Planner, key: tuple[str, ...], layers: int, bits: int | None, double_quant: bool,
                optimizer: str, optimizer_json: str, accumulation: int, untrained: frozenset[str]
                ) -> tuple[dict[str, float], int, int]:
    """Weights, trained weights, optimizer state and gradients of one cut model, its largest trained
    parameter's bytes and largest quantized weight's elements (remembered by the planner: a plan with every
    key on auto asks for the same few combinations hundreds of times). `untrained`: trainable parameters the
    step gives no gradient (`_untrained`), priced as weights that have neither gradients nor optimizer state."""
    args = (key, layers, bits, double_quant, optimizer, optimizer_json, accumulation, untrained)
    return planner.param_sums.get_or_compute(args, lambda: _sum_params(planner, *args))


def _sum_params(planner: Planner, key: tuple[str, ...], layers: int, bits: int | None, double_quant: bool,
                optimizer: str, optimizer_json: str, accumulation: int, untrained: frozenset[str]
                ) -> tuple[dict[str, float], int, int]:
    params = param_table_of(key, layers, planner)
    frozen = sum(_stored_bytes(p, bits, double_quant) + quant_state_codes(p, bits, double_quant)
                 for p in params if not p.trainable)
    graded = [p for p in params if p.trainable and p.name not in untrained]
    trained = [(p.name, p.shape, p.dtype) for p in graded]
    opt = OptimizerConfig.model_validate_json(optimizer_json).model_copy(update={"name": optimizer})
    sums = {"weights": frozen, "trainable_weights": sum(p.numel * p.bytes_per_elem for p in params if p.trainable),
            "optimizer_state": optimizer_state_bytes(optimizer, trained, opt),
            "grads": gradient_bytes(trained, opt, accumulation)}
    largest_trained = max((p.numel * p.bytes_per_elem for p in graded), default=0)
    largest_quant = max((p.numel // (p.shape[0] if len(p.shape) == 3 else 1) for p in params if p.quantizable),
                        default=0)
    return sums, largest_trained, largest_quant


def quant_state_codes(p: ParamInfo, bits: int | None, double_quant: bool) -> int:
    """Bytes of a bitsandbytes 4-bit Linear weight's quant state codes (NF4_CODE_BYTES, NESTED_CODE_BYTES): on
    the device whether the weight is resident or streamed; 0 for any other parameter (a MoE block's 4-bit
    experts keep their state in the expert store's streamed buffers)."""
    if bits != 4 or not p.quantizable or len(p.shape) != 2:
        return 0
    return NF4_CODE_BYTES + (NESTED_CODE_BYTES if double_quant else 0)


def _stored_bytes(p: ParamInfo, bits: int | None, double_quant: bool) -> float:
    """A frozen parameter's bytes as stored. A quantizable 3-D weight holds a MoE block's experts: in 4 bits one
    expert matrix at a time (finetune.model.expert_store), left in 16 bits by 8-bit quantization."""
    return quantized_weight_bytes(p.numel, p.out_features, bits if p.quantizable and (bits == 4 or len(p.shape) == 2)
                                  else None, double_quant, p.bytes_per_elem)


def _untrained(spec: ModelSpec, config: Any, layers: int, block: int) -> frozenset[str]:
    """The trainable parameters of `config` cut to `layers` layers that the training step's backward gives no
    gradient with the planned data (`Trace.untrained`: Llama 3.2 Vision's cross-attention layers, and a trained
    tower and projector, on text without images, which transformers skips): the run's optimizer makes no state
    for them and no gradient of theirs is ever resident. Which parameters a backward reaches depends on the
    model, the method and the inputs (images or not), not on the memory settings (checkpointing is
    non-reentrant), so it is read from one trace that every configuration of these layer counts shares, the
    first the search makes: micro-batch 1, checkpointing every `block` layers, plain layers. `memory_floor`
    so knows it before the configurations' own traces."""
    return frozenset(trace_step(config, spec.adapter, spec.dtype, spec.attn, spec.device, 1, spec.seq_len, layers,
                                block, recompute_norms=spec.recompute_norms, objective=spec.objective,
                                planner=spec.planner, images=spec.images).untrained)


def _whole_parts(spec: ModelSpec, settings: Settings) -> tuple[dict[str, float], dict[str, float], int, int]:
    """Weights, trained weights, optimizer state and resident gradients of the whole model and of one layer
    (extrapolated from two cut copies), the largest trained parameter's bytes and the largest quantized
    weight's elements."""
    la, lb = _layer_counts(spec, settings)
    opt = spec.optimizer.model_dump_json()
    pa: dict[str, float] = {}
    pb: dict[str, float] = {}
    largest_trained = largest_quant = 0
    for config, weight in _variants(spec, settings):
        key = model_key(config, spec.adapter, spec.dtype, spec.planner)
        (a, _, _), (b, trained, quant) = (
            _param_sums(spec.planner, key, layers, settings.bits, spec.double_quant, settings.optimizer, opt,
                        settings.gradient_accumulation_steps, _untrained(spec, config, layers, _block(settings)))
            for layers in (la, lb))
        for k in a:
            pa[k], pb[k] = pa.get(k, 0.0) + weight * a[k], pb.get(k, 0.0) + weight * b[k]
        largest_trained, largest_quant = max(largest_trained, trained), max(largest_quant, quant)
    whole = {k: _lerp(pa[k], pb[k], la, lb, spec.num_layers) for k in pa}
    per_layer = {k: (pb[k] - pa[k]) / (lb - la) if lb != la else pb[k] / max(lb, 1) for k in pa}
    if spec.reference_adapter:  # frozen weights, as many bytes as the trained adapter (peft keeps both fp32)
        for part in (whole, per_layer):
            part["weights"] += part["trainable_weights"]
    return whole, per_layer, largest_trained, largest_quant


def _param_parts(spec: ModelSpec, settings: Settings) -> tuple[dict[str, float], int, int]:
    """`_whole_parts` as one device holds them under the strategy (`distributed_parts`); the optimizer state
    of an optimizer that keeps it in CUDA managed memory moves to `managed` (`managed_state`)."""
    whole, per_layer, largest_trained, largest_quant = _whole_parts(spec, settings)
    if weights_streamed(spec, settings):  # finetune.memory.weight_store: the layers read ahead and the one computing
        streamed, per_layer_frozen = streamed_weight_bytes(spec, settings)
        window = min(streamed, (settings.offload_weights_ahead + 1) * per_layer_frozen)
        whole = {**whole, "weights": whole["weights"] - streamed + window}
    elif experts_offloaded(spec, settings):  # finetune.memory.expert_offload
        experts, per_moe_layer = expert_weight_bytes(spec, settings)
        # on the device: the experts of the MoE layer computing and of the one arriving
        whole = {**whole, "weights": whole["weights"] - experts + min(experts, 2 * per_moe_layer)}
    parts = distributed_parts(spec, settings, whole, per_layer)
    if managed_state(spec, settings):
        parts["managed"], parts["optimizer_state"] = parts["optimizer_state"], 0.0
    else:
        parts["managed"] = 0.0
    return parts, largest_trained, largest_quant


def _over_layers(spec: ModelSpec, settings: Settings, measure: Callable[[tuple[ParamInfo, ...]], float]
                 ) -> tuple[float, float]:
    """(the whole model's, one layer's) `measure` of the parameter table, from the two cut copies."""
    la, lb = _layer_counts(spec, settings)
    key = model_key(spec.config, spec.adapter, spec.dtype, spec.planner)
    a, b = (measure(param_table_of(key, layers, spec.planner)) for layers in (la, lb))
    return _lerp(a, b, la, lb, spec.num_layers), (b - a) / (lb - la) if lb != la else b / max(lb, 1)


def _is_expert(p: ParamInfo) -> bool:
    return p.quantizable and len(p.shape) == 3


def experts_offloaded(spec: ModelSpec, settings: Settings) -> bool:
    """Whether memory.offload_experts takes the experts off the training device: a tier that frees its memory
    (host RAM does not on a CPU run, where it is the device; the disk does everywhere)."""
    return settings.offload_experts != "none" and tier_spec(settings.offload_experts).frees_device(spec.device)


def expert_weight_bytes(spec: ModelSpec, settings: Settings) -> tuple[float, float]:
    """(the whole model's, one layer's) frozen fused expert weights as stored: 4-bit with bits 4
    (finetune.model.expert_store), else 16-bit; what memory.offload_experts keeps in host RAM or on disk."""
    bits = 4 if settings.bits == 4 else None
    return _over_layers(spec, settings, lambda table: sum(
        quantized_weight_bytes(p.numel, p.out_features, bits, spec.double_quant, p.bytes_per_elem)
        for p in table if _is_expert(p)))


def weights_streamed(spec: ModelSpec, settings: Settings) -> bool:
    """Whether memory.offload_weights streams the frozen layer weights from a tier that frees the device."""
    return settings.offload_weights != "none" and tier_spec(settings.offload_weights).frees_device(spec.device)


def streamed_weight_bytes(spec: ModelSpec, settings: Settings) -> tuple[float, float]:
    """(the streamed decoder layers', one layer's) frozen weights as stored: what memory.offload_weights streams
    (the embeddings, the LM head and the first memory.offload_weights_resident layers stay)."""
    per_layer = _over_layers(spec, settings, lambda table: sum(
        _stored_bytes(p, settings.bits, spec.double_quant) for p in table if not p.trainable))[1]
    return per_layer * max(0, spec.num_layers - settings.offload_weights_resident), per_layer


def moe_elements(spec: ModelSpec, settings: Settings) -> tuple[float, float]:
    """(all weights', the fused experts') element counts of the whole model, from the cut copies' parameter
    tables (a one-layer copy misses the experts of models whose first layers are dense)."""
    return (_over_layers(spec, settings, lambda table: sum(p.numel for p in table))[0],
            _over_layers(spec, settings, lambda table: sum(p.numel for p in table if _is_expert(p)))[0])


def managed_state(spec: ModelSpec, settings: Settings) -> bool:
    """Whether the optimizer state lives in CUDA managed memory (the registry's `state_memory`, on a GPU):
    torch's allocator does not count it (its peak is what the budget is checked against) and the driver
    pages it to host RAM when the device is full, so it is priced against host RAM instead."""
    return spec.device == "cuda" and optimizer_spec(settings.optimizer).state_memory == "managed"


def traffic_bytes(spec: ModelSpec, settings: Settings) -> tuple[float, float]:
    """Bytes one device sends per optimizer step between GPUs, and over its host link (deepspeed offload).

    Ring collectives move (N-1)/N of the tensor: ddp all-reduces the gradients (2x); fsdp and zero3 gather
    the weights in forward and again in backward for every micro-batch and reduce-scatter the gradients
    once per step (no_sync during accumulation); zero2 reduce-scatters gradients and gathers the updated
    trained weights."""
    n, kind = spec.world_size, strategy_key(spec, settings.strategy)
    if n == 1:
        return 0.0, 0.0
    whole, _, _, _ = _whole_parts(spec, settings)
    ring = (n - 1) / n
    weights, trained, grads = whole["weights"] + whole["trainable_weights"], whole["trainable_weights"], whole["grads"]
    if kind == "ddp":
        link = 2 * ring * grads
    elif kind in ("fsdp", "zero3"):
        link = settings.gradient_accumulation_steps * 2 * ring * weights + ring * grads
    else:
        link = ring * grads + ring * trained
    host = 2 * trained / spec.dtype.itemsize * 4 / n if kind.startswith("zero") and spec.deepspeed_offload != "none" \
        else 0.0
    return link, host


# What each strategy splits across the N processes (the rest is replicated on every device).
SHARDS = {
    "ddp": (),
    "fsdp": ("weights", "trainable_weights", "optimizer_state", "grads"),
    "zero2": ("optimizer_state", "grads"),
    "zero3": ("weights", "trainable_weights", "optimizer_state", "grads"),
}


def strategy_key(spec: ModelSpec, strategy: str) -> str:
    """The SHARDS row of a strategy: deepspeed is split by ZeRO stage; one process shards nothing."""
    if spec.world_size == 1:
        return "ddp"
    return f"zero{spec.zero_stage}" if strategy == "deepspeed" else strategy


def distributed_parts(spec: ModelSpec, settings: Settings, whole: dict[str, float],
                      per_layer: dict[str, float]) -> dict[str, float]:
    """One device's share of the parameter parts of `whole` under the strategy, plus `communication`: the
    buffers the strategy needs besides its shards (docs/planner.md, "Several GPUs").

    - ddp: everything replicated; the reducer's flat buckets hold a copy of every trained gradient
      (gradient_as_bucket_view is off in accelerate's default), so `communication` = the gradients.
    - fsdp (FSDP2, one unit per decoder layer, the rest in the root unit): weights, trained weights,
      gradients and optimizer state / N; the root unit (embeddings, head, final norm) stays gathered from
      forward to backward, the layer being computed and the one prefetched are gathered whole (2 x a
      layer's weights), and one layer's gradients wait for their reduce-scatter. With gradient
      accumulation accelerate's no_sync keeps unsharded gradients until the last micro-batch: whole grads.
    - zero2 / zero3: gradients and optimizer state / N (zero3: weights too); DeepSpeed keeps an fp32 master
      copy of 16-bit trained weights in its optimizer partition; its buckets are hidden^2 elements each
      (accelerate's `auto`). deepspeed_offload moves the state and master copy to CPU RAM or NVMe.
    """
    n, kind = spec.world_size, strategy_key(spec, settings.strategy)
    parts = {k: v / n if k in SHARDS[kind] else v for k, v in whole.items()}
    comm = 0.0
    layer_weights = per_layer["weights"] + per_layer["trainable_weights"]
    root_weights = max(0.0, whole["weights"] + whole["trainable_weights"] - spec.num_layers * layer_weights)
    gathered = root_weights + 2 * layer_weights
    if kind == "ddp" and n > 1:
        comm = whole["grads"]
    elif kind == "fsdp":
        comm = gathered + per_layer["grads"]
        if settings.gradient_accumulation_steps > 1:
            parts["grads"] = whole["grads"]
    elif kind in ("zero2", "zero3"):
        hidden_sq = spec.hidden_size ** 2
        comm = 2 * hidden_sq * 4 + (gathered if kind == "zero3" else 0)
        if spec.dtype.itemsize < 4:  # fp32 master weights of 16-bit trained weights, in the partition
            parts["optimizer_state"] += whole["trainable_weights"] / spec.dtype.itemsize * 4 / n
        if spec.deepspeed_offload != "none":
            parts["optimizer_state"] = 0.0
    parts["communication"] = comm
    return parts


def chunked_head_gradient_bytes(spec: ModelSpec, settings: Settings, tokens: int) -> int:
    """What the chunked loss's backward holds beyond the unchunked trace (the sft trace keeps full logits,
    memory_model scales them): every chunk multiplies by the LM head's weight, so a trained head receives one
    gradient per chunk, summed in autograd's input buffer while the next chunk's is computed: one head-sized
    gradient more (tests/test_plan_accuracy.py measures it). Nothing with one chunk or a frozen head (LoRA)."""
    if not settings.loss_without_logits or spec.objective != "sft" or tokens <= default_chunk_size(
            spec.config.get_text_config().vocab_size):
        return 0
    la, _ = _layer_counts(spec, settings)
    params = param_table_of(model_key(spec.config, spec.adapter, spec.dtype, spec.planner), la, spec.planner)
    text = spec.config.get_text_config()
    shape = (text.vocab_size, spec.hidden_size)
    heads = [p for p in params if p.trainable and p.shape == shape]
    named = [p for p in heads if "lm_head" in p.name]
    # Tied embeddings: the head is the embedding, listed once under the embedding's name.
    head = named or (heads if getattr(text, "tie_word_embeddings", False) else [])
    return head[0].numel * head[0].bytes_per_elem if head else 0


def _fixed_costs(spec: ModelSpec, dynamic: float) -> float:
    if spec.device != "cuda":
        return 0.0
    return CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + ALLOCATOR_OVERHEAD * dynamic


def memory_floor(spec: ModelSpec, settings: Settings) -> int:
    """A lower bound of the peak without tracing: weights, trained weights, optimizer state, fixed costs."""
    params, _, _ = _param_parts(spec, settings)
    params.pop("grads")
    params.pop("managed")
    static = sum(params.values())  # communication buffers included
    return int(static + _fixed_costs(spec, static))


@dataclass(frozen=True)
class _Step:
    """What every window of a training step is priced from: the two cut copies' traces (`layers` layers each)
    and the parameter parts one device holds, with the scales that take them to the whole model and batch."""

    spec: ModelSpec
    settings: Settings
    traces: tuple[Trace, Trace]
    layers: tuple[int, int]
    params: dict[str, float]  # weights, trained weights, optimizer state
    grads_total: float  # the resident gradients of the whole model
    communication: float  # the strategy's buffers besides its shards
    managed: float  # optimizer state in CUDA managed memory (`managed_state`): host RAM, not in any window
    shard: float  # the share of a layer's gradients this device keeps
    dequant: float  # 4-bit: one weight dequantized into the compute dtype
    tokens: int  # of a micro-batch: micro_batch_size x seq_len x rows per example
    rows_scale: int  # the traced activations to the micro-batch's: micro_batch_size, 1 where traced whole (packed)
    logits_scale: float  # the traced logits to the micro-batch's (see `_step`)
    largest_trained: int  # bytes of the largest trained parameter (the optimizer step's temporaries)

    def lerp(self, a: float, b: float) -> float:
        """A part of the two cut copies' traces (`a` at layers[0], `b` at layers[1]) at the model's depth."""
        return _lerp(a, b, *self.layers, self.spec.num_layers)

    @property
    def no_grad_other(self) -> float:
        """`other` of a window outside the step's backward (a pass with no gradients, generation): the
        dequantized weight where forward dequantizes (CUDA), and the communication buffers."""
        return (self.dequant if self.spec.device == "cuda" else 0) + self.communication


def _step(spec: ModelSpec, settings: Settings) -> _Step:
    """The traces, parameter parts and scales of a step (`_Step`)."""
    params, largest_trained, largest_quant = _param_parts(spec, settings)
    grads_total = params.pop("grads")
    communication = params.pop("communication")
    managed = params.pop("managed")
    shard = 1 / spec.world_size if "grads" in SHARDS[strategy_key(spec, settings.strategy)] else 1.0
    # 4-bit: backward dequantizes one weight at a time into the compute dtype (on CUDA forward too; on CPU
    # the forward kernel is fused). 8-bit is emulated inside the trace.
    dequant = largest_quant * spec.dtype.itemsize if settings.bits == 4 else 0
    tokens = settings.micro_batch_size * spec.seq_len * spec.rows_per_example
    rows_scale = 1 if _layout(spec, settings) == "packed" else settings.micro_batch_size
    # sft traces keep full logits and scale them here. Preference traces ran the chunked log-probabilities,
    # whose logits are one chunk, not one per example: they grow with the micro-batch only up to a chunk. Under
    # memory.kernels: liger that is our own loss's, and Liger's fused preference loss (where the method has one)
    # takes one example's rows at every position a chunk, FUSED_CHUNK_BYTES as much a token: priced at the larger.
    chunk = default_chunk_size(spec.config.get_text_config().vocab_size)
    preference = PreferenceLoss.of_objective(spec.objective)
    if settings.chunked_loss and spec.objective != "sft" or preference is not None and settings.loss_without_logits:
        traced_tokens = spec.seq_len * spec.rows_per_example
        fused = preference is not None and settings.kernels == "liger" and fused_problem(preference) is None
        logits_scale = max(min(tokens, chunk), traced_tokens * FUSED_CHUNK_BYTES if fused else 0) / min(
            traced_tokens, chunk)
    elif settings.loss_without_logits:  # only labelled positions reach the head, a chunk at a time: no image token
        labelled = settings.micro_batch_size * max(spec.seq_len - spec.image_positions, 1)
        logits_scale = min(labelled, chunk) / (spec.seq_len * settings.micro_batch_size / rows_scale)  # of the traced
    else:
        logits_scale = rows_scale
    return _Step(spec, settings, _traces(spec, settings), _layer_counts(spec, settings), params, grads_total,
                 communication, managed, shard, dequant, tokens, rows_scale, logits_scale, largest_trained)


def predict_memory(spec: ModelSpec, settings: Settings) -> Prediction:
    """Peak bytes and breakdown of a training step (steady state: optimizer state already allocated): each
    window the step passes through priced by its own function (forward and backward, the precomputed
    reference's pass, GRPO's generation and log-prob pass, the optimizer update), the peak the largest."""
    step = _step(spec, settings)
    windows, offloaded = _step_windows(step)
    windows.update(_reference_pass_window(step))
    _text_rows(spec, settings, windows)
    grpo = of_trace_objective(spec.objective)
    if grpo is not None:
        windows.update(_grpo_windows(step, grpo))
    windows["optimizer"] = _optimizer_window(step)
    _collated_inputs(spec, settings, windows)
    for w in windows.values():
        w["other"] += _fixed_costs(spec, sum(w.values()))
    parts = {name: {k: int(round(v)) for k, v in w.items()} for name, w in windows.items()}
    phase = max(windows, key=lambda k: sum(windows[k].values()))
    breakdown = parts[phase]
    totals = {name: int(round(sum(w.values()))) for name, w in windows.items()}
    return Prediction(peak_bytes=sum(breakdown.values()), breakdown=breakdown, offloaded_bytes=int(offloaded),
                      communication_bytes=int(step.communication), managed_bytes=int(step.managed),
                      reference_pass_bytes=totals.get("reference_pass", 0), windows=parts,
                      generation_bytes=totals.get("generation", 0),
                      training_bytes=max(v for k, v in totals.items() if k != "generation") if grpo else 0)


def _step_windows(step: _Step) -> tuple[dict[str, dict[str, float]], float]:
    """The step's forward and backward windows (forward; backward at the head, the top and the bottom layers)
    and the activation bytes the offload tier moves off the device per micro-batch."""
    spec, settings = step.spec, step.settings
    (ta, tb), (la, lb) = step.traces, step.layers
    L, mb = spec.num_layers, step.rows_scale
    hidden_bytes = step.tokens * spec.hidden_size * spec.dtype.itemsize
    head_gradient = chunked_head_gradient_bytes(spec, settings, step.tokens)
    windows: dict[str, dict[str, float]] = {}
    offloaded = 0.0
    phases = [w for w in ("forward", "bwd_head", "bwd_top", "bwd_bottom") if w in ta.windows and w in tb.windows]
    twice = _traces(spec, settings, 2) if _batch_fixed_activations(spec, settings) else None
    for name in phases:
        wa, wb = ta.windows[name][1], tb.windows[name][1]
        act = _lerp(wa["activations"], wb["activations"], la, lb, L) * mb
        act_per_block = (wb["activations"] - wa["activations"]) * mb if lb != la else 0.0
        if twice is not None and name in twice[0].windows and name in twice[1].windows:
            a2, b2 = twice[0].windows[name][1]["activations"], twice[1].windows[name][1]["activations"]
            one, two = _lerp(wa["activations"], wb["activations"], la, lb, L), _lerp(a2, b2, la, lb, L)
            if two < 2 * one:  # part of it does not grow with the batch: the line through micro-batch 1 and 2
                act = one + (two - one) * (mb - 1)
                block = wb["activations"] - wa["activations"]
                act_per_block = block + ((b2 - a2) - block) * (mb - 1) if lb != la else 0.0
        logits = _lerp(wa["logits_and_loss"], wb["logits_and_loss"], la, lb, L) * step.logits_scale
        grads = _lerp(wa["gradients"], wb["gradients"], la, lb, L) * step.shard
        if spec.optimizer.layerwise:  # each gradient is consumed (and freed) as soon as it exists
            grads = min(grads, step.grads_total)
        elif settings.gradient_accumulation_steps > 1:
            grads = max(grads, step.grads_total)
        moved = 0.0
        tier = tier_spec(settings.offload) if settings.offload != "none" else None
        if tier is not None and tier.frees_device(spec.device) and name != "bwd_bottom":  # at the bottom they
            # are all back or freed. finetune.memory.offload keeps the first checkpointed input (a leaf that
            # requires grad) and the last layer on the device, and fetches the tier's prefetch_layers layers
            # ahead once backward reaches the layers.
            ahead = tier.prefetch_layers if name == "bwd_top" else 0
            if settings.activation_checkpointing:
                n_ckpt = math.ceil(L / settings.checkpoint_every_n_layers)
                moved = max(0, n_ckpt - 2 - ahead) * hidden_bytes
            else:
                moved = max(0.0, act_per_block * (L - 1 - ahead))
            moved = min(moved, act)
            act -= moved
            offloaded = max(offloaded, moved)
        in_layers = name in ("bwd_top", "bwd_bottom") or (name == "forward" and spec.device == "cuda")
        if name == "bwd_head":
            act += head_gradient
        windows[name] = {**step.params, "gradients": grads, "activations": act, "logits_and_loss": logits,
                         "other": (step.dequant if in_layers else 0) + step.communication}
    return windows, offloaded


def _text_rows(spec: ModelSpec, settings: Settings, windows: dict[str, dict[str, float]]) -> None:
    """A micro-batch whose examples do not all show images (`spec.image_rows`): the windows' activations and
    logits are those of its image rows (as traced, per row) plus those of its text rows (traced without
    images: no vision tower, every position labelled), each share of the rows; in place. The rest (weights,
    state, gradients) is the image step's: the trained tower's state exists whatever the batch."""
    shown = spec.image_rows
    if not spec.images or shown is None or shown >= settings.micro_batch_size:
        return
    text = _step(replace(spec, images=(), image_positions=0, image_rows=None), settings)
    text_windows = _step_windows(text)[0] | _reference_pass_window(text)
    share = shown / settings.micro_batch_size
    for name, window in windows.items():
        if name in text_windows:
            for part in ("activations", "logits_and_loss"):
                window[part] = window[part] * share + text_windows[name][part] * (1 - share)


def _collated_inputs(spec: ModelSpec, settings: Settings, windows: dict[str, dict[str, float]]) -> None:
    """The loop collates a step's micro-batches before the first runs and frees them after its update: the
    others' image inputs (pixel values, as large as the tower's activations at small models) wait beside each
    micro-batch's forward and backward, and all of them beside the optimizer update; in place (the trace
    prices the running micro-batch's own)."""
    if not spec.images:
        return
    rows = min(spec.image_rows if spec.image_rows is not None else settings.micro_batch_size,
               settings.micro_batch_size)
    one = image_input_bytes(spec.config, rows, spec.seq_len, spec.images)
    waiting = settings.gradient_accumulation_steps - 1
    for name in ("forward", "bwd_head", "bwd_top", "bwd_bottom"):
        if name in windows:
            windows[name]["activations"] += waiting * one
    windows["optimizer"]["activations"] += (waiting + 1) * one


def _reference_pass_window(step: _Step) -> dict[str, dict[str, float]]:
    """training.precompute_reference: the forward over the data before training (no gradients, no optimizer
    state yet, nothing kept for backward); the step itself was traced without it. None in a re-plan."""
    ta, tb = step.traces
    if not (step.spec.reference_pass and "reference_pass" in ta.windows and "reference_pass" in tb.windows):
        return {}
    wa, wb = ta.windows["reference_pass"][1], tb.windows["reference_pass"][1]
    return {"reference_pass": {
        **step.params, "optimizer_state": 0.0, "gradients": 0.0,
        "activations": step.lerp(wa["activations"], wb["activations"]) * step.settings.micro_batch_size,
        "logits_and_loss": step.lerp(wa["logits_and_loss"], wb["logits_and_loss"]) * step.logits_scale,
        "other": step.no_grad_other}}


def _optimizer_window(step: _Step) -> dict[str, float]:
    """The optimizer update: every resident gradient, no activations, the optimizer's step temporaries (the
    registry's `step_temporaries` x the largest trained parameter)."""
    return {**step.params, "gradients": step.grads_total, "activations": 0.0, "logits_and_loss": 0.0,
            "other": optimizer_spec(step.settings.optimizer).step_temporaries * step.largest_trained * step.shard
            + step.communication}


def step_completions(spec: ModelSpec, settings: Settings) -> int:
    """training.method grpo: an optimizer step's completions, its micro_batch_size x accumulation rounded up to
    whole groups of num_generations (the prompts of one optimizer step, docs/rl.md)."""
    return prompts_per_step(settings.micro_batch_size, settings.gradient_accumulation_steps,
                            spec.num_generations) * spec.num_generations


def generation_sequences(spec: ModelSpec, settings: Settings) -> int:
    """training.method grpo: completions generated at once, grpo.generation_batch_size (None: the step's all)."""
    total = step_completions(spec, settings)
    return min(settings.generation_batch_size or total, total)


def _grpo_windows(step: _Step, grpo: tuple[int, bool]) -> dict[str, dict[str, float]]:
    """GRPO's phases besides the step's forward and backward, both after the previous update freed the
    gradients (the optimizer state stays): generation (finetune.plan.generation: the static KV cache in
    `activations` with the prefill's transient, or the sampling logits in `logits_and_loss`) and, when the
    trace ran one, the no-grad log-prob pass over a micro-batch of completions (`logps_pass`)."""
    spec, settings, params, other = step.spec, step.settings, step.params, step.no_grad_other
    completion, _ = grpo
    gen = generation_memory(spec.config, generation_sequences(spec, settings), spec.seq_len - completion, completion,
                            cache_bytes=spec.dtype.itemsize, compute_bytes=spec.dtype.itemsize)
    prefill = gen.prefill >= gen.sampling_logits
    windows = {"generation": {**params, "gradients": 0.0, "activations": gen.kv_cache + (gen.prefill if prefill else 0),
                              "logits_and_loss": 0 if prefill else gen.sampling_logits, "other": other}}
    ta, tb = step.traces
    if "logps_pass" in ta.windows and "logps_pass" in tb.windows:
        wa, wb = ta.windows["logps_pass"][1], tb.windows["logps_pass"][1]
        windows["logps_pass"] = {
            **params, "gradients": 0.0,
            "activations": step.lerp(wa["activations"], wb["activations"]) * settings.micro_batch_size,
            "logits_and_loss": step.lerp(wa["logits_and_loss"], wb["logits_and_loss"]) * step.logits_scale,
            "other": other}
    return windows
