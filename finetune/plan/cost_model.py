"""Predicted tokens/s of a configuration: a roofline-style model, used only to rank candidates.

step time = compute / (peak FLOPs x utilisation) + dequantization + exposed transfer time.

More in docs/planner.md, "The speed model (finetune/plan/cost_model.py)".
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.model.kernels import kernel_speedup
from finetune.model.moe import moe_config
from finetune.plan.generation import generation_memory
from finetune.plan.memory_model import (
    ModelSpec,
    Settings,
    expert_weight_bytes,
    generation_sequences,
    moe_elements,
    step_completions,
    traffic_bytes,
)
from finetune.plan.shapes import ModelShapes
from finetune.plan.weight_stream import link_seconds
from finetune.recipe.offload_tiers import tier_spec
from finetune.rl.step import of_trace_objective
from finetune.step.preference import PreferenceLoss

DEVICE = {
    # peak dense FLOP/s, memory bandwidth B/s: a consumer GPU (RTX 4090 class, bf16) and a desktop CPU.
    "cuda": {"flops": 165e12, "mem_bw": 1.0e12},
    "cpu": {"flops": 0.2e12, "mem_bw": 50e9},
}
# Seconds a decoder layer's forward costs beyond its FLOPs and bytes: eager PyTorch and peft run a LoRA layer's
# ~75 ops one by one from Python, which bounds generation's small decode steps. CPU: measured on the 2-core
# development machine (benchmarks/grpo_speed_model.py: 2.8 ms, SmolLM2-135M + LoRA, one thread). GPU: assumed
# (~75 kernel launches at ~8 us), not yet measured (the GPU kit's rows print predicted against measured tokens/s).
LAYER_OVERHEAD_S = {"cuda": 6e-4, "cpu": 3e-3}
DEVICE_BASIS = {"cuda": "an RTX 4090-class GPU in bf16", "cpu": "a desktop CPU"}  # whose figures DEVICE holds
# Bytes/s of each offload link where it was not measured: PCIe 4.0 x16 with pinned memory, achieved; an NVMe
# SSD, sequential. Host<->device on a CPU run is a memory copy (the device's mem_bw).
LINK_BYTES_PER_S = {"host_device": 20e9, "disk": 3e9}
UTIL_HALF_TOKENS = 1024  # tokens per micro-batch at which utilisation reaches half of peak (GPU)
CHUNKED_LOSS_OVERHEAD = 0.01  # relative cost of running the LM head in chunks


@dataclass(frozen=True)
class Rollout:
    """training.method grpo: what a step generates and scores before it trains (finetune.rl)."""

    sequences: int  # completions generated at once (grpo.generation_batch_size)
    calls: int  # generate calls per step: the step's completions over `sequences`
    prompt_tokens: int
    completion_tokens: int
    kv_bytes_per_token: float  # KV cache bytes per cached token of one sequence
    scoring_passes: int  # no-grad forwards over the completions before training (reference, old policy)
    iterations: int = 1  # updates trained on the same completions (grpo.num_iterations)


def rollout_of(spec: ModelSpec, settings: Settings) -> Rollout | None:
    """GRPO's generation and scoring before each step under `settings`; None for the other methods."""
    grpo = of_trace_objective(spec.objective)
    if grpo is None:
        return None
    completion = grpo[0]
    kv_per_token = generation_memory(spec.config, 1, 1, 1, cache_bytes=spec.dtype.itemsize).kv_cache
    at_once = generation_sequences(spec, settings)
    return Rollout(at_once, -(-step_completions(spec, settings) // at_once), spec.seq_len - completion, completion,
                   kv_per_token, spec.scoring_passes, spec.iterations)


def calibrated(probe: dict[str, float]) -> dict[str, float]:
    """The device figures of a measured CPU (`probe`: finetune.memory.bandwidth.measure_cpu's `flops@N` rates
    and `mem_bw`): the peak and half_tokens of rate(t) = peak * t / (t + half_tokens) through the smallest and
    the largest row count measured (1/rate is linear in 1/t), and the memory bandwidth."""
    points = sorted((int(key.split("@")[1]), rate) for key, rate in probe.items() if key.startswith("flops@"))
    (t1, r1), (t2, r2) = points[0], points[-1]
    slope = max(0.0, (1 / r1 - 1 / r2) / (1 / t1 - 1 / t2))  # half_tokens / peak; noise can make it negative
    peak = 1 / (1 / r2 - slope / t2)
    return {"flops": peak, "half_tokens": slope * peak, "mem_bw": probe["mem_bw"]}


def figures_of(device: str, probe: dict[str, float] | None = None) -> dict[str, float]:
    """The figures tokens_per_second prices `device` with: measured (`probe`, a CPU) or DEVICE's constants, and
    its layer overhead (`layer_s`, LAYER_OVERHEAD_S)."""
    if probe is not None:
        return {**calibrated(probe), "layer_s": LAYER_OVERHEAD_S[device]}
    return {**DEVICE[device], "half_tokens": UTIL_HALF_TOKENS, "layer_s": LAYER_OVERHEAD_S[device]}


def tokens_per_second(spec: ModelSpec, shapes: ModelShapes, settings: Settings, *, offloaded_bytes: float = 0,
                      bandwidth: dict[str, float] | None = None, figures: dict[str, float] | None = None) -> float:
    """Tokens per second of one optimizer step of the model and run `spec` (its layers' sizes: `shapes`) under
    `settings` (see module docstring). What the step computes comes from the spec: the weights (a
    mixture-of-experts model's tokens compute top_k of the experts, memory.offload_experts brings the experts
    from the host in each forward and backward), the method (a preference pair's two sequences, a reference
    forward in the step, GRPO's rollout), the tiled MLP's recompute, the processes' traffic.

    `offloaded_bytes`: activation bytes the offload tier moves per micro-batch (memory_model's prediction).
    `bandwidth`: measured bytes/s per offload link (finetune.memory.bandwidth.transfer_bandwidth); the
    constants above stand in for what was not measured.
    `figures`: the device's figures (figures_of); default DEVICE's constants.
    """
    device, seq_len, hidden, num_layers = spec.device, spec.seq_len, spec.hidden_size, spec.num_layers
    params, quantized_params, offloaded_experts = _weights(spec, shapes, settings)
    mlp_params = shapes.num_layers * shapes.mlp_linear  # recomputed once more with a tiled MLP
    dtype_bytes, rows_per_example = spec.dtype.itemsize, spec.rows_per_example
    loss = PreferenceLoss.of_objective(spec.objective)
    reference_forward = loss is not None and loss.reference_in_step
    dev = figures or figures_of(device)
    tokens = settings.micro_batch_size * seq_len  # counted in tokens/s
    rows = tokens * rows_per_example  # computed: chosen and rejected of a pair
    fwd = 2 * params * rows + 4 * seq_len * hidden * num_layers * rows
    passes = 2 + (1 if spec.adapter.type == "full" else 0)
    recompute = 0.0
    if settings.activation_checkpointing:
        recompute = fwd / settings.checkpoint_every_n_layers
    tiles = settings.tiled_mlp and seq_len > spec.tiled_mlp_tokens  # one chunk runs the plain MLP
    if tiles:
        recompute += 2 * mlp_params * rows
    util = rows / (rows + dev["half_tokens"])
    compute = (fwd * (passes + (1 if reference_forward else 0)) + recompute) / (dev["flops"] * util)
    if settings.loss_without_logits:
        compute *= 1 + CHUNKED_LOSS_OVERHEAD
    compute /= kernel_speedup(settings, device)
    dequant = 0.0
    if settings.bits:
        per_pass = quantized_params * (settings.bits / 8 + dtype_bytes) / dev["mem_bw"]
        dq_passes = 2 + (1 if settings.activation_checkpointing else 0) + (1 if reference_forward else 0)
        dequant = per_pass * dq_passes
        if tiles:
            chunks = -(-seq_len // spec.tiled_mlp_tokens)
            mlp_pass = per_pass * mlp_params / max(quantized_params, 1)
            dequant += mlp_pass * (chunks * (dq_passes + 1) - dq_passes)
    transfer = overhead = 0.0
    if settings.offload != "none":
        tier = tier_spec(settings.offload)
        bw = _link_bytes_per_s(tier.link, device, dev, bandwidth or {})
        transfer = max(0.0, 2 * offloaded_bytes / bw - compute)
        overhead = tier.overhead
    if offloaded_experts:
        tier = tier_spec(settings.offload_experts)
        fetches = 2 + (1 if settings.activation_checkpointing else 0)
        transfer += max(0.0, fetches * offloaded_experts / _link_bytes_per_s(tier.link, device, dev,
                                                                              bandwidth or {}) - compute)
        overhead += tier.overhead
    if settings.offload_weights != "none":  # finetune.plan.weight_stream
        tier = tier_spec(settings.offload_weights)
        transfer += max(0.0, link_seconds(spec, settings, stream_links(tier.name, device, dev, bandwidth)) - compute)
        overhead += tier.overhead
    step = (compute * (1 + overhead) + dequant + transfer) * settings.gradient_accumulation_steps
    link, host = traffic_bytes(spec, settings)
    step += max(0.0, link / spec.interconnect_bandwidth - 2 / 3 * compute * settings.gradient_accumulation_steps)
    step += host / _link_bytes_per_s("host_device", device, dev, bandwidth or {})
    rollout = rollout_of(spec, settings)
    if rollout is not None:
        weights = Weights(params, quantized_params if settings.bits else 0, settings.bits or 0, dtype_bytes,
                          num_layers, hidden)
        step += rollout_seconds(rollout, weights, dev, settings.micro_batch_size)
    return spec.world_size * tokens * settings.gradient_accumulation_steps / step


def _weights(spec: ModelSpec, shapes: ModelShapes, settings: Settings) -> tuple[int, int, float]:
    """The weight elements a token computes, those of them stored quantized (dequantized in every pass), and
    the expert bytes memory.offload_experts fetches per pass. A token computes top_k of a mixture-of-experts
    block's experts; a batch of tokens touches them all."""
    quantized = shapes.num_layers * shapes.layer_linear if settings.bits else 0
    params, fetched = shapes.total, 0.0
    moe = moe_config(spec.config)
    if moe is not None:
        total, experts = moe_elements(spec, settings)
        params = int(total - experts * (1 - moe.top_k / moe.num_experts))
        quantized += int(experts) if settings.bits == 4 else 0
        fetched = expert_weight_bytes(spec, settings)[0] if settings.offload_experts != "none" else 0.0
    return params, quantized, fetched


@dataclass(frozen=True)
class Weights:
    """The weights a forward reads (rollout_seconds)."""

    params: int
    quantized: int  # of those, stored in `bits` bits and dequantized in every forward
    bits: int
    dtype_bytes: int
    num_layers: int
    hidden: int


def _forward_seconds(w: Weights, dev: dict[str, float], rows: int, context: float, cached_bytes: float = 0.0
                     ) -> float:
    """One no-grad forward over `rows` tokens, each attending to `context` tokens: the larger of its compute at
    peak (a roofline: a decode step's few rows are bound by the bytes, not by a utilisation curve fitted to
    training's matmuls) and its memory time (every weight read once, plus `cached_bytes` of KV cache), plus
    the dequantization and the layers' launch overhead."""
    flops = 2 * w.params * rows + 4 * context * w.num_layers * w.hidden * rows
    compute = flops / dev["flops"]
    memory = (w.params * w.dtype_bytes + cached_bytes) / dev["mem_bw"]
    dequant = w.quantized * (w.bits / 8 + w.dtype_bytes) / dev["mem_bw"]
    return max(compute, memory) + dequant + w.num_layers * dev.get("layer_s", 0.0)


def rollout_seconds(r: Rollout, w: Weights, dev: dict[str, float], micro_batch: int) -> float:
    """Seconds per update of GRPO's generation (per generate call: prefill, then a decode step per completion
    token at the mean context) and scoring passes (in micro-batches), shared by the updates of one generation."""
    p, c = r.prompt_tokens, r.completion_tokens
    prefill = _forward_seconds(w, dev, r.sequences * p, p)
    context = p + c / 2
    decode = c * _forward_seconds(w, dev, r.sequences, context, r.sequences * context * r.kv_bytes_per_token)
    batches = -(-r.sequences * r.calls // micro_batch)
    scoring = r.scoring_passes * batches * _forward_seconds(w, dev, micro_batch * (p + c), p + c)
    return ((prefill + decode) * r.calls + scoring) / r.iterations


def tier_bytes_per_s(tier: str, device: str, figures: dict[str, float], measured: dict[str, float] | None) -> float:
    """The bandwidth offload tier `tier`'s transfers are priced at: measured, else the link's constant."""
    return _link_bytes_per_s(tier_spec(tier).link, device, figures, measured or {})


def stream_links(tier: str, device: str, figures: dict[str, float], measured: dict[str, float] | None
                 ) -> tuple[float, ...]:
    """The bytes/s of each link weight streaming from `tier` crosses, in order (finetune.plan.weight_stream's
    `link_seconds`): the tier's own, then PCIe where the disk tier feeds a GPU."""
    first = tier_bytes_per_s(tier, device, figures, measured)
    if tier_spec(tier).link == "disk" and device == "cuda":
        return first, _link_bytes_per_s("host_device", device, figures, measured or {})
    return (first,)


def _link_bytes_per_s(link: str, device: str, dev: dict[str, float], measured: dict[str, float]) -> float:
    if link == "host_device" and device != "cuda":
        return dev["mem_bw"]
    return measured.get(link, LINK_BYTES_PER_S[link])
