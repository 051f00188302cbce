"""Write a (merged) Hugging Face causal LM as one GGUF file for llama.cpp and Ollama.

Tensor names come from the `gguf` package's TensorNameMap, the keys from its GGUFWriter, the quantized blocks
from gguf.quants; this module holds only what differs per architecture (ARCHS) and the two layout changes
llama.cpp expects: Llama's rotary q/k rows interleaved per head, and Gemma's norms stored as 1 + weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError, UsageError
from finetune.export.gguf_vocab import CONVERT_HINT, add_vocab, read_vocab


@dataclass(frozen=True)
class Arch:
    """How one transformers model_type is written: the GGUF architecture, and its layout rules."""

    gguf_arch: str          # gguf.MODEL_ARCH member name
    permute_qk: bool = False  # llama.cpp's rotary layout for Llama-family q/k projections
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + weight); GGUF stores the sum


ARCHS = {
    "llama": Arch("LLAMA", permute_qk=True),
    "mistral": Arch("LLAMA", permute_qk=True),  # llama.cpp runs Mistral as llama (transformers reads it back so)
    "qwen2": Arch("QWEN2"),
    "gemma2": Arch("GEMMA2", norm_plus_one=True),
    "phi3": Arch("PHI3"),
}

# Where mixture-of-experts configs give their expert count (finetune.model.moe reads the same; export imports
# no other package of finetune).
MOE_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")

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


def check_exportable(config: Any) -> Arch:
    """The Arch a model config is written with, or a one-line refusal naming what is missing."""
    experts = next((n for f in MOE_EXPERT_FIELDS if isinstance(n := getattr(config, f, None), int) and n > 0), 0)
    if experts:  # llama.cpp wants them split per projection (ffn_gate_exps, ffn_up_exps, ffn_down_exps)
        raise FinetuneError(f"export --format gguf: {config.model_type} is a mixture-of-experts model ({experts} "
                            "experts) and this exporter does not write fused 3-D expert weights (gate_up_proj, "
                            "down_proj) to GGUF yet", hint=CONVERT_HINT)
    arch = ARCHS.get(config.model_type)
    if arch is None:
        raise FinetuneError(f"export --format gguf: architecture {config.model_type!r} is not written to GGUF "
                            f"(supported: {', '.join(ARCHS)})", hint="export --format safetensors instead")
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope != "default":
        raise FinetuneError(f"export --format gguf: rope scaling {rope!r} ({config.model_type}) is not written "
                            "to GGUF yet (it needs llama.cpp's extra rope tensors)",
                            hint=CONVERT_HINT)
    if getattr(config, "query_pre_attn_scalar", None) not in (None, _head_dim(config)):
        raise FinetuneError(f"export --format gguf: query_pre_attn_scalar {config.query_pre_attn_scalar} differs "
                            f"from head_dim {_head_dim(config)}; llama.cpp scales attention by head_dim")
    return arch


def write_gguf(model: Any, tokenizer: Any, path: Path, *, qtype: str = "f16", name: str = "model") -> Path:
    """Write `model` (a transformers causal LM, adapters merged) and its tokenizer to the GGUF file `path`.

    The caller owns `path`: it is written in place, so publish it atomically (export writes into a temporary
    folder that is renamed when complete)."""
    import gguf

    check_type(qtype)
    config = model.config
    arch = check_exportable(config)
    vocab = read_vocab(tokenizer, config.vocab_size)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch.gguf_arch]])
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[qtype]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_hyperparameters(writer, config)
    add_vocab(writer, vocab)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.gguf_arch], config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied head is the embedding; readers infer the tie from output.weight's absence
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise FinetuneError(f"export --format gguf: tensor {hf_name} has no place in llama.cpp's "
                                f"{arch.gguf_arch.lower()} architecture" + (" (its output head is always tied to the "
                                "embedding)" if hf_name == "lm_head.weight" else ""))
        data = _layout(arch, config, hf_name, tensor.detach().float().cpu().numpy())
        writer.add_tensor(gguf_name, *_encode(data, qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _add_hyperparameters(writer: Any, config: Any) -> None:
    head_dim = _head_dim(config)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * (getattr(config, "partial_rotary_factor", None) or 1.0)))
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if getattr(config, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def _layout(arch: Arch, config: Any, hf_name: str, data: Any) -> Any:
    """A tensor in the layout llama.cpp computes with (the inverse of what transformers' GGUF reader undoes)."""
    if arch.permute_qk and hf_name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
        heads = config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
        # Per head, the rotary halves (x0..x(d/2), x(d/2)..xd) become interleaved pairs.
        return (data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:])
                .swapaxes(1, 2).reshape(data.shape))
    if arch.norm_plus_one and hf_name.endswith("norm.weight"):
        return data + 1
    return data


def _encode(data: Any, qtype: str) -> tuple[Any, ...]:
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
