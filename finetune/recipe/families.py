"""The model-family table: one entry per text family the tool trains, the one list everything else reads.

Most of what the tool needs from a model is discovered from the model itself (finetune.model.family: the decoder
layers, the text config, the embedding, final norm and LM head, each layer's MLP and attention kind). This table
holds only what differs per family and cannot be discovered: which transformers `model_type`s it covers, the
models people know it by, how it is written to GGUF (or why not), and the hook for mixture-of-experts layers.

`family_for(model_type)` finds an entry; a config no entry covers is refused in one line by
`finetune.model.family.check_config` (validate, plan, run and the UI call it through `finetune.api.preflight`).
docs/models.md is generated from this table (`finetune models --markdown`).

This module imports neither torch nor transformers (it sits at the bottom of the import graph): a
mixture-of-experts family names its expert logic as "module:function" (imported only when a model is built).

How to add a model family: docs/architecture.md, "How to add a model family".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from finetune.errors import UsageError

ADAPTER_KINDS = ("QLoRA", "LoRA", "DoRA", "full")  # how a family trains; training.method is recipe/methods.py


@dataclass(frozen=True)
class GGUFLayout:
    """How a family is written to GGUF: the gguf.MODEL_ARCH member and llama.cpp's layout rules."""

    arch: str  # gguf.MODEL_ARCH member name
    permute_qk: bool = False  # llama.cpp's rotary layout for Llama-family q/k projections
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + weight); GGUF stores the sum
    # False: llama.cpp's architecture attends to the whole context, so a sliding window shorter than the context
    # (Mistral-7B-v0.1's) is refused; one as long as the context (Ministral-8B's) changes nothing.
    sliding_window: bool = True
    # Config values llama.cpp hard-codes for this architecture: (config attribute, the value llama.cpp assumes).
    # A model whose config differs is refused naming the attribute (its GGUF would compute something else).
    fixed: tuple[tuple[str, Any], ...] = ()
    # Config attributes llama.cpp assumes equal for this architecture (OLMoE: no grouped-query attention).
    equal: tuple[tuple[str, str], ...] = ()
    # Extra metadata: (gguf.GGUFWriter method, config attribute), written where the config sets the attribute.
    keys: tuple[tuple[str, str], ...] = ()
    expert_gating: str | None = None  # gguf.ExpertGatingFuncType member of a router that is not a softmax
    # DeepSeek's multi-head latent attention: kv_b_proj split into llama.cpp's per-head k_b/v_b tensors, the
    # cache one compressed KV head wide
    latent_attention: bool = False
    # gpt-oss: experts stored [experts, in, out] with the gate and up columns interleaved (gate, up, gate, ...)
    interleaved_experts: bool = False
    yarn: bool = False  # its YaRN rotary is written (checked against llama.cpp's logits for this family)
    note: str = ""  # what of the family is not written, for docs/models.md
    # llama.cpp's fixed layer pattern: every n-th layer global, the others sliding-window (0: none)
    swa_every: int = 0
    mrope: bool = False  # Qwen2-VL's multimodal rotary: its rope sections (time, height, width) written
    # llama.cpp's YaRN log_mul per unit of the rope's mscale_all_dim: DeepSeek's converter writes 0.1 x it,
    # Mistral 3's writes it as it is (the mistral3 loader applies the 0.1)
    yarn_log_mul: float = 0.1


@dataclass(frozen=True)
class VisionLayout:
    """What a vision-language family's checkpoints need besides their config: how images become tokens."""

    image_processor: str  # the transformers image processor class with a Pillow backend (no torchvision)
    image_token: str  # the token repeated once per image feature in the language model's input
    # the input of the model's forward that marks which tokens are images (Qwen's mm_token_type_ids: the
    # multimodal rotary positions; Gemma 3's token_type_ids: images attend to themselves both ways)
    token_types: str | None = None
    # how an image becomes tokens: the module of this name in finetune/vision/ (qwen2_vl: patch grid, gemma3: a
    # fixed count, idefics3: tiles of the image plus the whole image, pixtral: rows of merged patches with
    # breaks, mllama: one token per image whose tiles the text reads through cross-attention layers)
    kind: str = "qwen2_vl"
    # the token the chat template writes for an image, when not image_token, and the text the processor puts
    # around the repeated image tokens in its place (Gemma 3: "\n\n<start_of_image>", "<end_of_image>\n\n")
    written: str | None = None
    wrap: tuple[str, str] = ("", "")
    # the gguf.VisionProjectorType member of llama.cpp's projector file (mmproj-NAME.TYPE.gguf) this family's
    # vision tower is written as; "" where it is not written (its `no_gguf` says why)
    projector: str = ""
    # kind pixtral (Mistral 3): an image's merged patches row by row, each row followed by the first token, the
    # last row by the second in its place ([IMG_BREAK], [IMG_END])
    breaks: tuple[str, str] = ("", "")


@dataclass(frozen=True)
class Family:
    """Everything the tool knows about one model family that the model itself does not say."""

    name: str  # as people call it ("Qwen3")
    model_types: tuple[str, ...]  # transformers config.model_type values it covers (text configs)
    models: str  # the checkpoints people fine-tune, for docs/models.md
    layers: str  # what its decoder layers are, for docs/models.md (attention kinds, convolutions)
    gguf: GGUFLayout | None = None  # None: not written to GGUF, for the reason in `no_gguf`
    no_gguf: str = ""  # why GGUF export refuses this family (one clause)
    # Mixture-of-experts hook: "module:function" naming `experts_of(layer) -> nn.Module | None` in the build
    # layer (finetune/model/moe.py), the expert block of one decoder layer, None for a dense layer. A family
    # with `experts` set is a MoE family: the tiled MLP leaves its expert blocks out, docs/models.md says MoE.
    experts: str | None = None
    adapter_kinds: tuple[str, ...] = ADAPTER_KINDS  # what trains it (docs/models.md's methods column)
    # Its vision-language checkpoints (a config with a vision part) load as their text model: transformers maps
    # them to the causal LM and leaves the vision tower unloaded, so they train, chat and export as text models.
    text_of_vision: bool = False
    # Its attention adds a learned sink logit to every softmax (gpt-oss): sdpa and flash-attention 2 cannot run it
    # (finetune.model.attention picks the kernel).
    attention_sinks: bool = False

    # A vision-language family: its checkpoints load whole (vision tower, projector, language model) with the
    # image-text-to-text auto class; None: a text family.
    vision: VisionLayout | None = None

    @property
    def moe(self) -> bool:
        return self.experts is not None


# Mixture-of-experts families: their expert block through finetune/model/moe.py (docs/moe.md).
_MOE = "finetune.model.moe:moe_block_of"
_LLAMA = GGUFLayout("LLAMA", permute_qk=True, sliding_window=False)  # llama.cpp runs Mistral's models as Llama
# DeepSeek-V3-style routing (GLM-4-MoE's too): dense first layers, shared experts, grouped and scaled routing.
_SHARED_EXPERT_KEYS = (
    ("add_expert_shared_count", "n_shared_experts"), ("add_leading_dense_block_count", "first_k_dense_replace"),
    ("add_expert_weights_scale", "routed_scaling_factor"), ("add_expert_weights_norm", "norm_topk_prob"),
    ("add_expert_group_count", "n_group"), ("add_expert_group_used_count", "topk_group"))
_MOE_ADAPTER_KINDS = ("QLoRA", "LoRA")  # the ones tests/test_moe.py trains (4-bit experts, LoRA beside frozen experts)

# Vision-language families: the language model is adapted (QLoRA, LoRA), the vision tower too with adapter.vision.
_VISION_ADAPTER_KINDS = ("QLoRA", "LoRA", "full")
_PROJECTOR_NOTE = "the vision tower and projector in a second file, mmproj-NAME.TYPE.gguf"
_GEMMA3 = GGUFLayout("GEMMA3", norm_plus_one=True, swa_every=6)

_QWEN_VL = VisionLayout("Qwen2VLImageProcessorPil", "<|image_pad|>", token_types="mm_token_type_ids")

FAMILIES: tuple[Family, ...] = (
    Family("Llama 3.x", ("llama",), "Llama-3.1-8B, Llama-3.2-1B/3B, Llama-3.3-70B", "full attention",
           gguf=_LLAMA),
    Family("Mistral", ("mistral",), "Mistral-7B-v0.3, Mistral-Nemo-12B, Mistral-Small-24B", "full attention "
           "(sliding window where the config sets one)", gguf=_LLAMA),
    Family("Ministral", ("ministral",), "Ministral-8B", "sliding-window and full attention layers",
           gguf=_LLAMA),
    Family("Qwen2.5", ("qwen2",), "Qwen2.5-0.5B ... 72B, Qwen2.5-Coder", "full attention (q/k/v biases)",
           gguf=GGUFLayout("QWEN2")),
    Family("Qwen3", ("qwen3",), "Qwen3-0.6B ... 32B", "full attention with q/k norms", gguf=GGUFLayout("QWEN3")),
    Family("Qwen3.5", ("qwen3_5_text", "qwen3_5"), "Qwen3.5 (its text model; the vision tower is not loaded)",
           "gated linear attention (Gated DeltaNet) and full attention layers", no_gguf="its Gated DeltaNet layers "
           "(state, convolution and gate tensors) are not written in llama.cpp's qwen35 layout yet",
           text_of_vision=True),
    Family("Gemma 2", ("gemma2",), "gemma-2-2b/9b/27b", "sliding-window and full attention, alternating; soft-capped "
           "logits", gguf=GGUFLayout("GEMMA2", norm_plus_one=True)),
    Family("Gemma 3 (text)", ("gemma3_text",), "gemma-3-1b, the text part of gemma-3-4b/12b/27b",
           "five sliding-window layers per full attention layer, q/k norms",
           gguf=_GEMMA3),
    Family("Gemma 4 (text)", ("gemma4_text",), "the text part of Gemma 4", "sliding-window and full attention "
           "layers of different head sizes", no_gguf="its per-layer head sizes and per-layer input embeddings "
           "need llama.cpp keys this writer does not write yet"),
    Family("Phi-3 / Phi-4", ("phi3",), "Phi-3-mini/medium, Phi-3.5-mini, Phi-4, Phi-4-mini",
           "full attention, fused qkv and gate/up projections", gguf=GGUFLayout("PHI3")),
    Family("SmolLM3", ("smollm3",), "SmolLM3-3B", "full attention, rotary left out every fourth layer",
           gguf=GGUFLayout("SMOLLM3", permute_qk=True)),
    Family("OLMo 2", ("olmo2",), "OLMo-2-1B/7B/13B", "full attention, norms after attention and MLP, q/k norms",
           gguf=GGUFLayout("OLMO2")),
    Family("Granite", ("granite",), "granite-3.x-2b/8b", "full attention, scaled embeddings, residuals and logits",
           gguf=GGUFLayout("GRANITE", permute_qk=True, keys=(
               ("add_attention_scale", "attention_multiplier"), ("add_embedding_scale", "embedding_multiplier"),
               ("add_residual_scale", "residual_multiplier"), ("add_logit_scale", "logits_scaling")))),
    Family("LFM2", ("lfm2",), "LFM2-350M/700M/1.2B/2.6B", "hybrid: short gated convolutions and full attention "
           "layers", gguf=GGUFLayout("LFM2", fixed=(("conv_bias", False),),
                                                   keys=(("add_shortconv_l_cache", "conv_L_cache"),))),
    Family("Qwen3-MoE", ("qwen3_moe",), "Qwen3-30B-A3B, Qwen3-235B-A22B", "full attention with q/k norms; "
           "routed experts (128, top-8)", experts=_MOE,
           gguf=GGUFLayout("QWEN3MOE", fixed=(("norm_topk_prob", True), ("decoder_sparse_step", 1),
                                              ("mlp_only_layers", []))), adapter_kinds=_MOE_ADAPTER_KINDS),
    Family("Mixtral", ("mixtral",), "Mixtral-8x7B, Mixtral-8x22B", "full attention; routed experts (8, top-2)",
           gguf=_LLAMA, experts=_MOE, adapter_kinds=_MOE_ADAPTER_KINDS),
    Family("OLMoE", ("olmoe",), "OLMoE-1B-7B", "full attention with q/k norms; routed experts (64, top-8)",
           gguf=GGUFLayout("OLMOE", fixed=(("norm_topk_prob", False), ("clip_qkv", None)),
                           equal=(("num_key_value_heads", "num_attention_heads"),)), experts=_MOE,
           adapter_kinds=_MOE_ADAPTER_KINDS),
    Family("gpt-oss", ("gpt_oss",), "gpt-oss-20b, gpt-oss-120b", "sliding-window and full attention, "
           "alternating, with attention sinks; routed experts (32/128, top-4)",
           gguf=GGUFLayout("GPT_OSS", interleaved_experts=True, yarn=True, swa_every=2, fixed=(("swiglu_limit", 7.0),),
                           keys=(("add_expert_feed_forward_length", "intermediate_size"),)),
           experts=_MOE, adapter_kinds=_MOE_ADAPTER_KINDS, attention_sinks=True),
    Family("DeepSeek-V2/V3", ("deepseek_v2", "deepseek_v3"), "DeepSeek-V2-Lite, DeepSeek-V3-style models",
           "multi-head latent attention (compressed KV); routed and shared experts after dense first layers",
           experts=_MOE, adapter_kinds=_MOE_ADAPTER_KINDS,
           gguf=GGUFLayout("DEEPSEEK2", latent_attention=True, yarn=True, expert_gating="SIGMOID", keys=_SHARED_EXPERT_KEYS,
                           fixed=(("rope_interleave", True),),
                           note="DeepSeek-V3-style; DeepSeek-V2's softmax router is refused")),
    Family("GLM-4-MoE", ("glm4_moe",), "GLM-4.5-Air, GLM-4.5", "full attention; routed and shared experts "
           "after a dense first layer", experts=_MOE, adapter_kinds=_MOE_ADAPTER_KINDS,
           gguf=GGUFLayout("GLM4_MOE", expert_gating="SIGMOID", keys=_SHARED_EXPERT_KEYS)),
    Family("Qwen2.5-VL", ("qwen2_5_vl",), "Qwen2.5-VL-3B/7B/32B/72B-Instruct", "vision transformer (window "
           "attention, merged 2x2 patches) before full attention text layers with multimodal rotary positions",
           gguf=GGUFLayout("QWEN2VL", mrope=True, note=_PROJECTOR_NOTE), adapter_kinds=_VISION_ADAPTER_KINDS,
           vision=replace(_QWEN_VL, projector="QWEN25VL")),
    Family("Gemma 3", ("gemma3",), "gemma-3-4b/12b/27b-it", "SigLIP vision encoder, pooled to 256 tokens per "
           "image, before five sliding-window layers per full attention layer; images attend to themselves both "
           "ways", adapter_kinds=_VISION_ADAPTER_KINDS,
           gguf=replace(_GEMMA3, note=_PROJECTOR_NOTE),
           vision=VisionLayout("Gemma3ImageProcessorPil", "<image_soft_token>", token_types="token_type_ids",
                               kind="gemma3", written="<start_of_image>",
                               wrap=("\n\n<start_of_image>", "<end_of_image>\n\n"), projector="GEMMA3")),
    Family("Qwen3-VL", ("qwen3_vl",), "Qwen3-VL-2B/4B/8B/32B-Instruct", "vision transformer (merged 2x2 patches, "
           "its features also added to the first text layers) before full attention text layers with q/k norms "
           "and interleaved multimodal rotary positions", adapter_kinds=_VISION_ADAPTER_KINDS,
           gguf=GGUFLayout("QWEN3VL", mrope=True, note=_PROJECTOR_NOTE,
                           keys=(("add_num_deepstack_layers", "num_deepstack_layers"),)),
           vision=replace(_QWEN_VL, projector="QWEN3VL")),
    # SmolVLM v1 checkpoints are idefics3 configs; SmolVLM2's are smolvlm (the same image processing).
    Family("SmolVLM / Idefics3", ("idefics3", "smolvlm"), "SmolVLM-256M/500M/2.2B-Instruct, SmolVLM2, Idefics3-8B",
           "SigLIP vision encoder over the image's tiles and the whole image, pixel-shuffled into the text model's "
           "tokens, before full attention text layers", adapter_kinds=_VISION_ADAPTER_KINDS,
           gguf=replace(_LLAMA, note=_PROJECTOR_NOTE),
           vision=VisionLayout("Idefics3ImageProcessorPil", "<image>", kind="idefics3",
                               wrap=("<fake_token_around_image><global-img>", "<fake_token_around_image>"),
                               projector="IDEFICS3")),
    # Mistral Small 3.1/3.2 carry a mistral text model, Ministral 3's vision checkpoints a ministral3 one.
    Family("Mistral 3", ("mistral3",), "Mistral-Small-3.1/3.2-24B-Instruct, Ministral-3-3B/8B/14B (BF16 checkpoints)",
           "Pixtral vision encoder (2D rotary positions, any aspect ratio), 2x2 patches merged into one token, before "
           "full attention text layers", adapter_kinds=_VISION_ADAPTER_KINDS,
           gguf=GGUFLayout("MISTRAL3", permute_qk=True, sliding_window=False, yarn=True, yarn_log_mul=1.0,
                           note=_PROJECTOR_NOTE + ", with the [IMG_BREAK] embedding"),
           vision=VisionLayout("PixtralImageProcessorPil", "[IMG]", kind="pixtral",
                               breaks=("[IMG_BREAK]", "[IMG_END]"), projector="PIXTRAL")),
    Family("Llama 3.2 Vision", ("mllama",), "Llama-3.2-11B/90B-Vision(-Instruct)", "vision transformer over up "
           "to 4 tiles of each image (a local and a gated global encoder), read by cross-attention layers placed "
           "between the full attention text layers; one token per image in the text",
           adapter_kinds=_VISION_ADAPTER_KINDS,
           no_gguf="llama.cpp has no Llama 3.2 Vision support (its cross-attention layers and tiled vision tower)",
           vision=VisionLayout("MllamaImageProcessorPil", "<|image|>", kind="mllama")),
)

VISION_HINT = "use a text-only checkpoint of the family, or a vision-language family docs/models.md lists"


def family_for(model_type: str) -> Family | None:
    """The family covering a transformers model_type, or None."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def model_types() -> tuple[str, ...]:
    """Every model_type some family covers (for messages naming what is supported)."""
    return tuple(t for f in FAMILIES for t in f.model_types)


class UnsupportedModel(UsageError):
    """A model no family describes, or a vision-language model: one line, exit 2, before anything loads."""


def check_config_data(config: dict[str, Any], where: str) -> Family:
    """The family of a model config (config.json's content, or a transformers config's `to_dict()`), or
    UnsupportedModel naming the architecture and what is missing. `where` names the config for the message."""
    model_type = str(config.get("model_type") or "")
    archs = config.get("architectures") or []
    named = f"architecture {archs[0]} (model_type {model_type!r})" if archs else f"model_type {model_type!r}"
    family = family_for(model_type)
    vision = any(key in config for key in ("vision_config", "vision_tower", "visual"))
    if vision and not (family is not None and (family.text_of_vision or family.vision is not None)):
        supported = ", ".join(t for f in FAMILIES if f.vision is not None for t in f.model_types)
        raise UnsupportedModel(f"model.path {where}: {named} is a vision-language model no family describes "
                               f"(vision-language model_types: {supported})", hint=VISION_HINT)
    if family is None:
        raise UnsupportedModel(
            f"model.path {where}: {named} is not supported: no model family describes its decoder "
            f"layers, adapter targets and export (supported model_types: {', '.join(model_types())})",
            hint="docs/models.md lists the supported families; docs/architecture.md says how to add one")
    return family


def check_config_file(file: Path) -> Family | None:
    """The family of the config.json at `file` (a .json file or a folder holding config.json), None where there
    is no such file to read (a hub id, a .gguf file: checked once transformers reads them). Torch-free and
    fast: `finetune.api.preflight` runs it before anything loads."""
    file = file / "config.json" if file.is_dir() else file
    if file.suffix != ".json" or not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModel(f"model.path {file}: not a readable config.json ({exc})") from None
    if not isinstance(data, dict):
        raise UnsupportedModel(f"model.path {file}: not a config.json (a JSON object of the model's settings)")
    return check_config_data(data, str(file))


def _gguf_text(f: Family) -> str:
    if f.gguf is None:
        return f"no: {f.no_gguf}"
    return f"yes ({f.gguf.arch.lower()}{'; ' + f.gguf.note if f.gguf.note else ''})"


def _offload_text(f: Family) -> str:
    """Activations offload (memory.offload: cpu, disk) in every family; expert weights in MoE families."""
    return "activations, experts" if f.moe else "activations"


def models_text() -> str:
    """`finetune models`: one line per family."""
    return "".join(f"{f.name} ({', '.join(f.model_types)}): {f.layers}; {', '.join(f.adapter_kinds)}; "
                   f"{'MoE' if f.moe else 'dense'}; {'images and text' if f.vision else 'text'}; "
                   f"GGUF {_gguf_text(f)}\n" for f in FAMILIES)


def models_markdown() -> str:
    """docs/models.md: every family and what the tool supports for it, from this table."""
    rows = ["| family | model_type | models | layers | methods | MoE | vision | offload | GGUF export |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for f in FAMILIES:
        rows.append(f"| {f.name} | {', '.join(f'`{t}`' for t in f.model_types)} | {f.models} | {f.layers} | "
                    f"{', '.join(f.adapter_kinds)} | {'yes' if f.moe else 'no (dense)'} | {'images' if f.vision else 'text'} | "
                    f"{_offload_text(f)} | {_gguf_text(f)} |")
    return "\n".join([
        "# Supported models",
        "",
        "Generated from the family table (`finetune/recipe/families.py`) by `finetune models --markdown`; "
        "tests/test_families.py fails when this file and the table differ.",
        "",
        "Each family trains with every method listed, is planned before it trains (the plan's peak within 5% "
        "of the measured one on a tiny model of the family's own config class, tests/test_families.py; every "
        "family with every method: benchmarks/families.py), chats "
        "with `finetune generate` and exports merged safetensors. A config of another architecture is refused "
        "in one line before anything loads, and so is a vision-language one of a family not marked vision below "
        "(Qwen3.5's checkpoints are vision-language ones whose text model trains, chats and exports, the vision "
        "tower not loaded). A vision family trains on records with images: the vision tower and projector stay "
        "in 16 bits, frozen unless `adapter.vision` says lora or full; the language model is quantized for QLoRA. "
        "The image budget (`data.max_pixels`) the planner picks for each vision family's full-size checkpoint on "
        "an 8, 16 and 24 GB GPU, with the predicted peak: the pixel-budget table in [vision.md](vision.md#memory-the-image-tokens).",
        "",
        *rows,
        "",
    ])
