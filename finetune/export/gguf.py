"""Write a (merged) Hugging Face causal LM as one GGUF file for llama.cpp and Ollama.

Tensor names come from the `gguf` package's TensorNameMap, the keys from its GGUFWriter, the quantized blocks
from gguf.quants; what differs per family (the GGUF architecture and its layout rules, the config values
llama.cpp hard-codes, extra metadata, or why a family is not written) is its `gguf` entry in the family table
(finetune/recipe/families.py). This module applies the layout changes llama.cpp's convert_hf_to_gguf.py makes:
Llama's rotary q/k rows interleaved per head, Gemma's norms stored as 1 + weight, transformers' fused 3-D
experts split into stacked per-projection tensors (gpt-oss's transposed, interleaved ones too), DeepSeek's
kv_b_proj split per head, LFM2's convolutions made 2-D; and the rope scalings llama.cpp reads as tensors (Llama 3's
rope_freqs, Phi-3's LongRoPE factors) computed as that converter computes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetune.console import progress_bar
from finetune.errors import FinetuneError, UsageError
from finetune.export.gguf_vocab import CONVERT_HINT, add_vocab, read_vocab
from finetune.recipe.families import FAMILIES, GGUFLayout, family_for

# --type: the file's weight type; 1-D tensors (norms, biases) stay F32, as llama.cpp's converter keeps them.
TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q5_1": "Q5_1", "q5_0": "Q5_0",
         "q4_1": "Q4_1", "q4_0": "Q4_0"}
FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
              "q5_1": "MOSTLY_Q5_1", "q5_0": "MOSTLY_Q5_0", "q4_1": "MOSTLY_Q4_1", "q4_0": "MOSTLY_Q4_0"}
K_QUANT_HINT = ("k-quants (Q4_K_M, Q5_K_M, Q6_K) need llama.cpp's quantizer: export --type f16, then run "
                "llama-quantize MODEL.f16.gguf MODEL.Q4_K_M.gguf Q4_K_M")


def check_type(qtype: str) -> None:
    """Refuse a --type this writer does not produce (before minutes of loading and merging)."""
    if qtype not in TYPES:
        raise UsageError(f"export --type {qtype}: not a type this exporter writes (choose from {', '.join(TYPES)})",
                         hint=K_QUANT_HINT)


def check_exportable(config: Any, layout: GGUFLayout | None = None) -> GGUFLayout:
    """The layout a model config is written with (its family's `gguf` entry, or `layout`: a vision-language
    family's for its language model), or a one-line refusal naming what is missing."""
    family = family_for(config.model_type)
    arch = layout or (family.gguf if family is not None else None)
    if arch is None:
        why = family.no_gguf if family is not None else "no model family describes it"
        written = ", ".join(t for f in FAMILIES if f.gguf for t in f.model_types)
        raise UsageError(f"export --format gguf: architecture {config.model_type!r} is not written to GGUF: "
                         f"{why} (written: {written})", hint="export --format safetensors instead")
    if config.model_type == "deepseek_v2":
        raise UsageError("export --format gguf: DeepSeek-V2's softmax router is not written to GGUF yet (DeepSeek-V3-"
                         "style models, with a sigmoid router and its correction bias, are)", hint=CONVERT_HINT)
    for attr, value in arch.fixed:
        if getattr(config, attr, value) != value:
            raise UsageError(f"export --format gguf: this {config.model_type} model has {attr}="
                             f"{getattr(config, attr)!r}, but llama.cpp's {arch.arch.lower()} architecture "
                             f"always computes with {value!r}", hint="export --format safetensors instead")
    for one, other in arch.equal:
        if getattr(config, one) != getattr(config, other):
            raise UsageError(f"export --format gguf: this {config.model_type} model has {one}="
                             f"{getattr(config, one)} and {other}={getattr(config, other)}, but llama.cpp's "
                             f"{arch.arch.lower()} architecture assumes they are equal",
                             hint="export --format safetensors instead")
    window = getattr(config, "sliding_window", None)
    if not arch.sliding_window and window and window < config.max_position_embeddings and "sliding_attention" in (
            getattr(config, "layer_types", None) or ["sliding_attention"]):
        raise UsageError(f"export --format gguf: this {config.model_type} model attends through a sliding window of "
                         f"{window} tokens within its {config.max_position_embeddings}-token context, but llama.cpp's "
                         f"{arch.arch.lower()} architecture attends to the whole context",
                         hint="export --format safetensors instead")
    if arch.swa_every and list(config.layer_types) != [
            "full_attention" if (i + 1) % arch.swa_every == 0 else "sliding_attention"
            for i in range(config.num_hidden_layers)]:
        raise UsageError(f"export --format gguf: this {config.model_type} model's sliding-window layers differ from "
                         f"llama.cpp's ({arch.swa_every - 1} sliding-window layers, then a global one)",
                         hint="export --format safetensors instead")
    rope = _rope(config).get("rope_type", "default")
    if config.model_type == "gemma3_text":
        _check_gemma3(config)
    if config.model_type == "smollm3":
        _check_smollm3(config)
    if rope != "default" and not (rope == "linear" and config.model_type == "gemma3_text") and not (
            rope == "yarn" and arch.yarn) and ROPE_TENSORS.get(rope) != arch.arch:
        raise UsageError(f"export --format gguf: rope scaling {rope!r} ({config.model_type}) is not written to GGUF "
                         f"for llama.cpp's {arch.arch.lower()} architecture", hint=CONVERT_HINT)
    if config.model_type == "ministral3":
        _check_ministral3(config)
    if getattr(config, "query_pre_attn_scalar", None) not in (None, _head_dim(config)):
        raise UsageError(f"export --format gguf: query_pre_attn_scalar {config.query_pre_attn_scalar} differs "
                         f"from head_dim {_head_dim(config)}; llama.cpp scales attention by head_dim")
    return arch


def write_gguf(model: Any, tokenizer: Any, path: Path, *, qtype: str = "f16", name: str = "model",
               layout: GGUFLayout | None = None) -> Path:
    """Write `model` (a transformers causal LM, adapters merged) and its tokenizer to the GGUF file `path`
    (with `layout`: as check_exportable takes it).

    The caller owns `path`: it is written in place, so publish it atomically (export writes into a temporary
    folder that is renamed when complete)."""
    import gguf

    check_type(qtype)
    config = model.config
    arch = check_exportable(config, layout)
    vocab = read_vocab(tokenizer, config.vocab_size)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch.arch]])
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[qtype]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_hyperparameters(writer, config, arch)
    add_vocab(writer, vocab)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.arch], config.num_hidden_layers)
    for gguf_name, data in _rope_tensors(config):  # first, as llama.cpp's converter writes them
        writer.add_tensor(gguf_name, *encode(data, qtype))
    # a large model's tensors take minutes to convert (and quantize): progress per weight of the model
    with progress_bar(f"GGUF {qtype} tensors") as bar:
        task = bar.add_task("tensors", total=len(model.state_dict()))
        for hf_name, data in _tensors(model, arch, lambda: bar.update(task, advance=1)):
            if hf_name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # a tied head is the embedding; readers infer the tie from output.weight's absence
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise FinetuneError(f"export --format gguf: tensor {hf_name} has no place in llama.cpp's "
                                    f"{arch.arch.lower()} architecture" + (" (its output head is always tied to "
                                    "the embedding)" if hf_name == "lm_head.weight" else ""))
            writer.add_tensor(gguf_name, *encode(_layout(arch, config, hf_name, data), qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Rope scalings llama.cpp computes from extra tensors, and the architecture whose converter writes them:
# Llama 3.x's `llama3` as rope_freqs (LlamaModel), Phi-3's `longrope` as rope_factors_long/short (Phi3MiniModel).
ROPE_TENSORS = {"llama3": "LLAMA", "longrope": "PHI3"}


def _rope(config: Any) -> dict[str, Any]:
    """The rotary parameters of the (global) attention layers: Gemma 3 keeps one set per layer kind."""
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get("full_attention", rope)


# llama.cpp's gemma3 hard-codes its sliding-window layers (every sixth layer global) and their rotary base.
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def _check_gemma3(config: Any) -> None:
    """Refuse a Gemma 3 whose local rotary base llama.cpp would not reproduce."""
    local = (config.rope_parameters.get("sliding_attention") or {}).get("rope_theta", GEMMA3_LOCAL_ROPE_BASE)
    if local != GEMMA3_LOCAL_ROPE_BASE:
        raise UsageError(f"export --format gguf: Gemma 3 local rotary base {local} differs from llama.cpp's "
                         f"{GEMMA3_LOCAL_ROPE_BASE:g}", hint="export --format safetensors instead")


# llama.cpp's smollm3 leaves rotary position out of every fourth layer, whatever the config says.
SMOLLM3_NO_ROPE_STEP = 4


def _check_smollm3(config: Any) -> None:
    """Refuse a SmolLM3 whose layers without rotary position, or whose sliding window, llama.cpp would not
    reproduce."""
    pattern = [int((i + 1) % SMOLLM3_NO_ROPE_STEP != 0) for i in range(config.num_hidden_layers)]
    if list(config.no_rope_layers) != pattern or config.use_sliding_window:
        raise UsageError("export --format gguf: this SmolLM3's layers without rotary position (or its sliding "
                         "window) differ from llama.cpp's (rotary position left out of every fourth layer, no "
                         "sliding window)", hint="export --format safetensors instead")


def _check_ministral3(config: Any) -> None:
    """Refuse a Ministral 3 text model llama.cpp's mistral3 architecture would not reproduce: it takes the
    attention temperature's floor from the YaRN original context (so needs YaRN, as llama.cpp's converter
    asserts) and computes YaRN's attention factor with mscale 1."""
    rope = _rope(config)
    if rope.get("rope_type") != "yarn" or rope.get("mscale", 1.0) != 1.0:
        raise UsageError(f"export --format gguf: this Ministral 3 model's rope ({rope.get('rope_type')!r}, mscale "
                         f"{rope.get('mscale', 1.0)}) is not what llama.cpp's mistral3 architecture computes (YaRN "
                         "with mscale 1)", hint="export --format safetensors instead")


def _rope_tensors(config: Any) -> list[tuple[str, Any]]:
    """The rope scaling llama.cpp reads as tensors, each (GGUF name, float32 array of rotary dims / 2).

    `llama3` (Llama 3.1 and later): rope_freqs, what llama.cpp divides each rotary frequency by, computed as its
    converter (LlamaModel.generate_extra_tensors) computes it, in float32: 1 where the wavelength is shorter than
    the original context / high_freq_factor, `factor` where it is longer than the original context /
    low_freq_factor, smoothly between. The original context is the rope's `original_max_position_embeddings`, the
    one transformers computes with (the converter reads the config's top level, where Llama 3.x configs have none,
    so its default 8192: the value every published Llama 3.x has).
    `longrope` (Phi-3 128k, Phi-3.5, Phi-4-mini): the long and short factors as they are; llama.cpp divides by
    the long ones where its context is longer than the original context, else by the short ones."""
    import numpy as np
    import torch

    rope = _rope(config)
    if rope.get("rope_type") == "llama3":
        dim = _head_dim(config)
        freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
        original = rope.get("original_max_position_embeddings", 8192)
        wavelength = 2 * math.pi / freqs
        smooth = (original / wavelength - low) / (high - low)
        factors = torch.where(wavelength < original / high, 1.0, torch.where(
            wavelength > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))
        return [("rope_freqs.weight", factors.to(torch.float32).numpy())]
    if rope.get("rope_type") == "longrope":
        return [(f"rope_factors_{kind}.weight", np.asarray(rope[f"{kind}_factor"], dtype=np.float32))
                for kind in ("long", "short")]
    return []


def _longrope_attention_factor(config: Any) -> float:
    """The scale LongRoPE multiplies cos and sin by: the config's `attention_factor`, else from the ratio of the
    context to the original one, as transformers computes it (and llama.cpp's converter, from the context ratio,
    for every published Phi-3: they set no `factor` or `attention_factor`)."""
    rope = _rope(config)
    if rope.get("attention_factor") is not None:
        return rope["attention_factor"]
    original = _longrope_original_context(config)
    scale = rope.get("factor") or config.max_position_embeddings / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0


def _longrope_original_context(config: Any) -> int:
    return _rope(config).get("original_max_position_embeddings") or config.original_max_position_embeddings


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _tensors(model: Any, arch: GGUFLayout, done: Callable[[], None] = lambda: None) -> Any:
    """(name, float32 array) of every weight, as llama.cpp's converter names them: transformers' fused 3-D
    expert parameters (`experts.gate_up_proj` [experts, 2 x ff, hidden], gate rows first, and
    `experts.down_proj` [experts, hidden, ff], both without a .weight suffix) become the stacked per-projection
    weights `experts.{gate,up,down}_proj.weight` that map to llama.cpp's ffn_{gate,up,down}_exps; DeepSeek's
    kv_b_proj [heads x (nope + v), kv rank] becomes k_b_proj [heads, kv rank, nope] and v_b_proj [heads, v, kv
    rank] (llama.cpp multiplies them into the compressed cache). `done()` after each weight's tensors were taken."""
    config = model.config
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().cpu().numpy()
        if arch.latent_attention and name.endswith("kv_b_proj.weight"):
            nope = config.qk_nope_head_dim
            per_head = data.reshape(config.num_attention_heads, nope + config.v_head_dim, data.shape[-1])
            yield name.replace("kv_b_proj", "k_b_proj"), per_head[:, :nope].transpose(0, 2, 1)
            yield name.replace("kv_b_proj", "v_b_proj"), per_head[:, nope:]
        elif arch.interleaved_experts and name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
            # gpt-oss: [experts, hidden, 2 x ff] (bias [experts, 2 x ff]), gate and up columns alternating
            suffix = "bias" if name.endswith("_bias") else "weight"
            data = data if suffix == "bias" else data.swapaxes(-1, -2)
            base = name.removesuffix("_bias").removesuffix("gate_up_proj")
            yield f"{base}gate_proj.{suffix}", data[:, 0::2]
            yield f"{base}up_proj.{suffix}", data[:, 1::2]
        elif arch.interleaved_experts and name.endswith("experts.down_proj"):
            yield f"{name}.weight", data.swapaxes(-1, -2)  # gpt-oss: [experts, ff, hidden]
        elif name.endswith("experts.gate_up_proj"):
            half = data.shape[-2] // 2
            yield name.removesuffix("gate_up_proj") + "gate_proj.weight", data[..., :half, :]
            yield name.removesuffix("gate_up_proj") + "up_proj.weight", data[..., half:, :]
        elif name.endswith((".weight", ".bias")):
            yield name, data
        elif name.endswith("_bias"):  # a router's e_score_correction_bias: llama.cpp's exp_probs_b.bias
            yield f"{name.removesuffix('_bias')}.bias", data
        else:
            yield f"{name}.weight", data
        done()


def _feed_forward_length(config: Any) -> int:
    """The MLP width the weights have: LFM2's config may give it before its own rounding rule."""
    if not getattr(config, "block_auto_adjust_ff_dim", False):
        return config.intermediate_size
    width = int(2 * config.intermediate_size / 3)
    if config.block_ffn_dim_multiplier is not None:
        width = int(config.block_ffn_dim_multiplier * width)
    return config.block_multiple_of * -(-width // config.block_multiple_of)


def _first(config: Any, *attrs: str) -> Any:
    return next((v for a in attrs if (v := getattr(config, a, None)) is not None), None)


def _add_hyperparameters(writer: Any, config: Any, arch: GGUFLayout) -> None:
    import gguf

    head_dim = _head_dim(config)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(_feed_forward_length(config))
    writer.add_head_count(config.num_attention_heads)
    kinds = getattr(config, "layer_types", None) or []
    rope = _rope(config)
    if arch.latent_attention:  # one compressed KV head: keys [kv rank + rope dims], values [kv rank]
        writer.add_head_count_kv(1)
        writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
        writer.add_value_length(config.kv_lora_rank)
        writer.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
        writer.add_value_length_mla(config.v_head_dim)
        writer.add_kv_lora_rank(config.kv_lora_rank)
        if config.q_lora_rank is not None:
            writer.add_q_lora_rank(config.q_lora_rank)
        writer.add_rope_dimension_count(config.qk_rope_head_dim)
    else:
        # LFM2: llama.cpp tells its convolution layers by their zero KV heads
        writer.add_head_count_kv([0 if kind == "conv" else config.num_key_value_heads for kind in kinds]
                                 if "conv" in kinds else config.num_key_value_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(int(head_dim * (_first(config, "partial_rotary_factor")
                                                        or rope.get("partial_rotary_factor") or 1.0)))
    writer.add_rope_freq_base(rope["rope_theta"])
    if arch.mrope:  # llama.cpp reads four sections (time, height, width, unused)
        sections = list(rope["mrope_section"])
        writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    if rope.get("rope_type") == "linear":  # Gemma 3 (4B and larger): its global layers' positions scaled
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":  # DeepSeek-V3, gpt-oss: long context by YaRN
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for method, key in (("beta_fast", "beta_fast"), ("beta_slow", "beta_slow"), ("attn_factor", "attention_factor")):
            if rope.get(key) is not None:
                getattr(writer, f"add_rope_scaling_yarn_{method}")(rope[key])
        if rope.get("mscale_all_dim"):
            writer.add_rope_scaling_yarn_log_mul(arch.yarn_log_mul * rope["mscale_all_dim"])
    if rope.get("rope_type") == "longrope":  # Phi-3: llama.cpp picks the long or short factors by this context
        writer.add_rope_scaling_orig_ctx_len(_longrope_original_context(config))
        writer.add_rope_scaling_attn_factors(_longrope_attention_factor(config))
    if rope.get("llama_4_scaling_beta") is not None:  # Ministral 3: queries scaled up with the position
        writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    writer.add_layer_norm_rms_eps(_first(config, "rms_norm_eps", "norm_eps"))
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if getattr(config, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if experts := _first(config, "num_local_experts", "num_experts", "n_routed_experts"):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if expert_ff := getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(expert_ff)
    if arch.expert_gating:
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType[arch.expert_gating])
    for method, attr in arch.keys:
        if (value := getattr(config, attr, None)) is not None:
            getattr(writer, method)(value)


def _layout(arch: GGUFLayout, config: Any, hf_name: str, data: Any) -> Any:
    """A tensor in the layout llama.cpp computes with (the inverse of what transformers' GGUF reader undoes)."""
    if arch.permute_qk and hf_name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
        return permute_rotary(data, config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads)
    if arch.norm_plus_one and hf_name.endswith("norm.weight"):
        return data + 1
    if hf_name.endswith("conv.conv.weight"):  # LFM2's depthwise convolution [channels, 1, width]: 2-D in llama.cpp
        return data[:, 0]
    return data


def permute_rotary(data: Any, heads: int) -> Any:
    """A q or k projection's rows (weight or bias) in llama.cpp's rotary layout (its converter's permute): per
    head, the rotary halves (x0..x(d/2), x(d/2)..xd) become interleaved pairs."""
    return data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)


def encode(data: Any, qtype: str) -> tuple[Any, ...]:
    """(array, shape, GGML type) for GGUFWriter.add_tensor: 1-D tensors F32, the others `qtype` where their rows
    split into its blocks, else F16."""
    import gguf
    import numpy as np

    ggml_type = gguf.GGMLQuantizationType[TYPES[qtype]]
    block = gguf.GGML_QUANT_SIZES[ggml_type][0]
    if data.ndim == 1 or ggml_type == gguf.GGMLQuantizationType.F32:
        return data.astype(np.float32), None, gguf.GGMLQuantizationType.F32
    if ggml_type == gguf.GGMLQuantizationType.F16 or data.shape[-1] % block:
        return data.astype(np.float16), None, gguf.GGMLQuantizationType.F16
    return gguf.quants.quantize(data, ggml_type), None, ggml_type
