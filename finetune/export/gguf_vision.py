"""A vision-language model as the two GGUF files llama.cpp's multimodal tools load (llama-mtmd-cli,
llama-server --mmproj): the language model, written by finetune.export.gguf as its text family, and the vision
encoder with its projector, `mmproj-NAME.TYPE.gguf` (GGUF architecture "clip").

Which families are written, and with which llama.cpp projector type, is the family table's `gguf` and
`vision.projector` (finetune/recipe/families.py). The tensor names, keys and layout changes follow llama.cpp's
convert_hf_to_gguf.py (its MmprojModel and the family's vision model class): names from the gguf package's
TensorNameMap for MODEL_ARCH.MMPROJ, keys from GGUFWriter.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError, UsageError
from finetune.export.gguf import FILE_TYPES, check_exportable, check_type, encode, permute_rotary
from finetune.recipe.families import FAMILIES, GGUFLayout, family_for

# transformers keeps a vision-language model's language model under one of these prefixes (its head outside):
# model.text_model. is Idefics3's and SmolVLM's
LANGUAGE_PREFIXES = ("model.language_model.", "model.text_model.")


@dataclass(frozen=True)
class LanguageModel:
    """A vision-language model's language model as finetune.export.gguf reads a causal LM: the text config, the
    weights named as the text family's (model.layers..., lm_head.weight) and the family's GGUF layout."""

    config: Any
    weights: dict[str, Any]
    layout: GGUFLayout

    def state_dict(self) -> dict[str, Any]:
        return self.weights


def language_model(model: Any) -> LanguageModel:
    """The language model of a (merged) vision-language model, for write_gguf: a head tied to the embedding
    (the model's own setting) is left out, as llama.cpp reads a missing output.weight as tied. Qwen3-VL's text
    config gains `num_deepstack_layers` (how many vision layers' features its first text layers add), which
    llama.cpp's qwen3vl reads with the text model's keys."""
    config = model.config.text_config
    tied = model.config.tie_word_embeddings or config.tie_word_embeddings
    weights = {}
    for name, tensor in model.state_dict().items():
        prefix = next((p for p in LANGUAGE_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            weights["model." + name.removeprefix(prefix)] = tensor
        elif name == "lm_head.weight" and not tied:
            weights[name] = tensor
    if (deepstack := getattr(model.config.vision_config, "deepstack_visual_indexes", None)) is not None:
        config = copy.deepcopy(config)
        config.num_deepstack_layers = len(deepstack)
    return LanguageModel(config, weights, family_for(model.config.model_type).gguf)


def check_vision_exportable(config: Any) -> None:
    """Refuse in one line a vision-language config whose projector file is not written (its family's
    `no_gguf` says why), and one whose language model the text writer refuses."""
    family = family_for(config.model_type)
    if family is None or family.gguf is None or not family.vision or family.vision.projector not in _PROJECTORS:
        why = family.no_gguf if family is not None else "no model family describes it"
        written = ", ".join(t for f in FAMILIES if f.vision and f.vision.projector for t in f.model_types)
        raise UsageError(f"export --format gguf: vision-language architecture {config.model_type!r} is not written "
                         f"to GGUF: {why} (vision-language ones written: {written})",
                         hint="export --format safetensors instead (the default)")
    check_exportable(config.text_config, family.gguf)
    if (check := _CONFIG_CHECKS.get(family.vision.projector)) is not None:
        check(config)


def projector_path(folder: Path, name: str, qtype: str) -> Path:
    """Where the projector file goes beside NAME.TYPE.gguf (llama.cpp's converter names it mmproj-...)."""
    return folder / f"mmproj-{name}.{qtype}.gguf"


def write_projector(model: Any, image_processor: Any, path: Path, *, qtype: str = "f16", name: str = "model",
                    tokenizer: Any = None) -> Path:
    """Write the vision encoder and projector of `model` (a merged vision-language model) to `path`, with the
    image normalisation of `image_processor` (the processor the run trained with) and, for a family whose image
    rows end in a break token (Pixtral's [IMG_BREAK]), that token's embedding, found by `tokenizer` (the run's).
    The caller publishes `path` atomically, as for write_gguf."""
    import gguf

    check_type(qtype)
    family = family_for(model.config.model_type)
    projector = family.vision.projector if family is not None and family.vision is not None else ""
    if projector not in _PROJECTORS:
        raise FinetuneError(f"export --format gguf: {model.config.model_type} has no projector file writer")
    vision = model.config.vision_config
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[qtype]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(model.config.text_config.hidden_size)
    writer.add_vision_image_size(_image_size(vision))
    writer.add_vision_patch_size(vision.patch_size)
    writer.add_vision_embedding_length(vision.hidden_size)
    writer.add_vision_feed_forward_length(vision.intermediate_size)
    blocks = _first(vision, "num_hidden_layers", "depth")
    writer.add_vision_block_count(blocks)
    writer.add_vision_head_count(_first(vision, "num_attention_heads", "num_heads"))
    writer.add_vision_image_mean(list(image_processor.image_mean))
    writer.add_vision_image_std(list(image_processor.image_std))
    keys, tensors = _PROJECTORS[projector]
    keys(writer, model.config, image_processor)
    # the projector's MLP layers (mm.0, mm.2) are numbered as blocks are: a map as deep as either
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(blocks, PROJECTOR_LAYERS))
    for hf_name, data, forced in tensors(model, qtype):
        gguf_name = hf_name if hf_name.startswith(("v.", "mm.")) else names.get_name(
            hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise FinetuneError(f"export --format gguf: vision tensor {hf_name} has no place in llama.cpp's "
                                f"{projector.lower()} projector file")
        if forced is None and gguf_name.startswith(POSITION_EMBEDDING):
            forced = "f32"  # llama.cpp's converter keeps position embeddings F32 whatever the file's type
        writer.add_tensor(gguf_name, *encode(data, forced or qtype))
    if family.vision.breaks[0]:  # llama.cpp's pixtral graph appends this embedding after each row but the last
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_TOK_EMBD_IMG_BREAK],
                          *encode(_token_embedding(model, tokenizer, family.vision.breaks[0], projector), qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


PROJECTOR_LAYERS = 3  # the most mm.N layers a projector written here has

# llama.cpp's converter's image size for a tower that takes images of any size (Qwen2.5-VL's)
DEFAULT_IMAGE_SIZE = 560
POSITION_EMBEDDING = "v.position_embd."


def _first(config: Any, *attrs: str) -> Any:
    return next(getattr(config, a) for a in attrs if getattr(config, a, None) is not None)


def _image_size(vision: Any) -> int:
    """The image size llama.cpp's converter writes: the tower's own; for Qwen3-VL the square its learned
    position grid covers (sqrt(num_position_embeddings) patches a side); else DEFAULT_IMAGE_SIZE."""
    if getattr(vision, "image_size", None) is not None:
        return vision.image_size
    if getattr(vision, "num_position_embeddings", None) is not None:
        return int(vision.num_position_embeddings ** 0.5 * vision.patch_size)
    return DEFAULT_IMAGE_SIZE


# Gemma 3: llama.cpp pools the SigLIP patches to 256 tokens per image (4 x 4 patches each) unless told otherwise.
GEMMA3_POOL = 4


def _gemma3_keys(writer: Any, config: Any, image_processor: Any) -> None:
    import gguf

    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_attention_layernorm_eps(config.vision_config.layer_norm_eps)
    writer.add_vision_use_gelu(True)
    pool = (config.vision_config.image_size // config.vision_config.patch_size) // int(config.mm_tokens_per_image ** 0.5)
    if pool != GEMMA3_POOL:
        writer.add_vision_projector_scale_factor(pool)


def _gemma3_tensors(model: Any, qtype: str) -> Any:
    """(llama.cpp's checkpoint name, float32 array, forced --type or None): the SigLIP tower as
    vision_tower.vision_model.*, its unused attention-pooling head left out, the projector's soft-embedding norm
    stored as 1 + weight (Gemma's RMSNorm), the embeddings F32 and the input projection F16 (as llama.cpp's
    converter forces them)."""
    for name, tensor in model.state_dict().items():
        if name.startswith("model.vision_tower.head."):
            continue
        data = tensor.detach().float().cpu().numpy()
        if name.startswith("model.vision_tower."):
            yield ("vision_tower.vision_model." + name.removeprefix("model.vision_tower."), data,
                   "f32" if ".embeddings." in name else None)
        elif name.startswith("model.multi_modal_projector."):
            name = name.removeprefix("model.").replace("_weight", ".weight")
            if name.endswith("soft_emb_norm.weight"):
                yield name, data + 1, None
            else:
                yield name, data, "f16"


# llama.cpp's qwen2.5vl projector attends within windows of this many pixels a side (its graph's own constant,
# the published checkpoints' window_size; no key in the file changes it)
QWEN25VL_WINDOW = 112


def _qwen25vl_keys(writer: Any, config: Any, image_processor: Any) -> None:
    """Qwen2.5-VL: SiLU, RMSNorm, and window attention in every layer but each n-th (fullatt_block_indexes),
    within QWEN25VL_WINDOW-pixel windows."""
    import gguf

    window = config.vision_config.window_size
    if window != QWEN25VL_WINDOW:
        raise UsageError(f"export --format gguf: this Qwen2.5-VL's vision windows are {window} pixels; llama.cpp's "
                         f"projector attends within {QWEN25VL_WINDOW}-pixel windows",
                         hint="export --format safetensors instead")
    writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
    writer.add_vision_use_silu(True)
    full = list(config.vision_config.fullatt_block_indexes)
    every = full[0] + 1
    if any(b - a != every for a, b in zip(full, full[1:], strict=False)):
        raise UsageError(f"export --format gguf: this Qwen2.5-VL's full-attention vision layers {full} are not "
                         "evenly spaced, as llama.cpp's window-attention pattern needs",
                         hint="export --format safetensors instead")
    writer.add_vision_n_wa_pattern(every)
    writer.add_vision_attention_layernorm_eps(getattr(config, "rms_norm_eps", None) or 1e-6)


def _weights(model: Any, *prefixes: str) -> Any:
    """(name, float32 array) of the model's weights whose names start with one of `prefixes`."""
    for name, tensor in model.state_dict().items():
        if name.startswith(prefixes):
            yield name, tensor.detach().float().cpu().numpy()


def _qwen_visual(model: Any, qtype: str) -> Any:
    """(llama.cpp's checkpoint name, float32 array, forced --type or None) of a Qwen-VL tower, as visual.*: its
    3-D patch embedding (two frames) split into two 2-D ones (v.patch_embd.weight and .weight.1, F32 unless the
    file is F16, as llama.cpp's converter writes them)."""
    for name, data in _weights(model, "model.visual."):
        name = name.removeprefix("model.")
        if name.endswith("patch_embed.proj.weight"):
            if data.shape[2] != 2:
                raise UsageError(f"export --format gguf: this {model.config.model_type} model's patches span "
                                 f"{data.shape[2]} frames; llama.cpp's projector takes two",
                                 hint="export --format safetensors instead")
            for i, suffix in enumerate(("", ".1")):
                yield f"v.patch_embd.weight{suffix}", data[:, :, i], "f16" if qtype == "f16" else "f32"
        else:
            yield name, data, None


def _qwen25vl_tensors(model: Any, qtype: str) -> Any:
    """Qwen2.5-VL's tower (_qwen_visual) with its fused qkv split into q, k and v."""
    import numpy as np

    for name, data, forced in _qwen_visual(model, qtype):
        if ".qkv." in name:
            for part, rows in zip("qkv", np.split(data, 3), strict=True):
                yield name.replace(".qkv.", f".{part}."), rows, None
        else:
            yield name, data, forced


def _qwen3vl_keys(writer: Any, config: Any, image_processor: Any) -> None:
    """Qwen3-VL: GELU, spatial_merge_size x spatial_merge_size patches merged per token, the text model's RMSNorm
    epsilon for the tower's norms (where llama.cpp's converter takes it from), and which vision layers feed a
    deepstack merger (deepstack_visual_indexes, one flag per layer)."""
    import gguf

    vision = config.vision_config
    writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN3VL)
    writer.add_vision_use_gelu(True)
    writer.add_vision_spatial_merge_size(vision.spatial_merge_size)
    writer.add_vision_attention_layernorm_eps(getattr(config.text_config, "rms_norm_eps", None) or 1e-6)
    flags = [False] * vision.depth
    for layer in vision.deepstack_visual_indexes:
        flags[layer] = True
    writer.add_vision_is_deepstack_layers(flags)


def _qwen3vl_tensors(model: Any, qtype: str) -> Any:
    """Qwen3-VL's tower (_qwen_visual) with its fused qkv kept (llama.cpp's graph reads attn_qkv), the merger's
    norm as v.post_ln and its two layers as mm.0 and mm.2, and the k-th deepstack merger as
    v.deepstack.L.{norm,fc1,fc2}, L its vision layer (the k-th of deepstack_visual_indexes)."""
    import gguf

    names, kinds = gguf.TENSOR_NAMES, gguf.MODEL_TENSOR
    merger = {"norm": names[kinds.V_POST_NORM], "linear_fc1": names[kinds.V_MMPROJ].format(bid=0),
              "linear_fc2": names[kinds.V_MMPROJ].format(bid=2)}
    deepstack = {"norm": kinds.V_DS_NORM, "linear_fc1": kinds.V_DS_FC1, "linear_fc2": kinds.V_DS_FC2}
    layers = model.config.vision_config.deepstack_visual_indexes
    for name, data, forced in _qwen_visual(model, qtype):
        parts = name.split(".")  # visual.merger.norm.weight, visual.deepstack_merger_list.0.norm.weight
        if parts[1] == "merger" and parts[2] in merger:
            yield f"{merger[parts[2]]}.{parts[-1]}", data, forced
        elif parts[1] == "deepstack_merger_list" and parts[3] in deepstack:
            yield f"{names[deepstack[parts[3]]].format(bid=layers[int(parts[2])])}.{parts[-1]}", data, forced
        else:
            yield name, data, forced


def _idefics3_keys(writer: Any, config: Any, image_processor: Any) -> None:
    """SmolVLM / Idefics3: GELU, the SigLIP tower's LayerNorm epsilon, the pixel shuffle's scale factor (tokens
    per tile = patches / scale_factor^2), and the image processor's longest edge, which llama.cpp resizes an
    image to before cutting it into tiles."""
    import gguf

    writer.add_clip_projector_type(gguf.VisionProjectorType.IDEFICS3)
    writer.add_vision_attention_layernorm_eps(getattr(config.vision_config, "layer_norm_eps", None) or 1e-5)
    writer.add_vision_projector_scale_factor(getattr(config, "scale_factor", None) or 2)
    writer.add_vision_use_gelu(True)
    size = dict(getattr(image_processor, "size", None) or {})
    writer.add_vision_preproc_image_size(size.get("longest_edge") or _image_size(config.vision_config))


def _idefics3_tensors(model: Any, qtype: str) -> Any:
    """The SigLIP tower (model.vision_model.*) and the connector's modality projection (mm.model.fc) under their
    transformers names, which the gguf package maps; the embeddings F32, as llama.cpp's converter forces them."""
    for name, data in _weights(model, "model.vision_model.", "model.connector."):
        yield name, data, "f32" if ".embeddings." in name else None


def _token_embedding(model: Any, tokenizer: Any, token: str, projector: str) -> Any:
    """The language model's input embedding of `token`, its id the run's tokenizer's (as llama.cpp's converter
    reads it from the model folder's tokenizer files)."""
    token_id = tokenizer.convert_tokens_to_ids(token) if tokenizer is not None else None
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise UsageError(f"export --format gguf: the run's tokenizer has no {token} token, whose embedding "
                         f"llama.cpp's {projector.lower()} projector file holds",
                         hint="export --format safetensors instead")
    return model.get_input_embeddings().weight[token_id].detach().float().cpu().numpy()


# Mistral 3: llama.cpp's pixtral graph rotates the tower's patches with this base whatever the file says, takes the
# last vision layer's features, and projects them with GELU; its RMSNorm epsilon (transformers' Pixtral
# hard-codes it) is the one the graph's projector norm uses too.
PIXTRAL_ROPE_THETA = 10000.0
PIXTRAL_NORM_EPS = 1e-5


def _check_pixtral(config: Any) -> None:
    """Refuse in one line a Mistral 3 whose projector llama.cpp's pixtral graph, which hard-codes these, would
    compute otherwise (or whose tower activation its converter refuses)."""
    vision = config.vision_config
    theta = (getattr(vision, "rope_parameters", None) or {}).get("rope_theta", PIXTRAL_ROPE_THETA)
    per_head = vision.hidden_size // vision.num_attention_heads  # llama.cpp's head size
    for what, value, allowed in (
            ("vision_config rope_theta", theta, (PIXTRAL_ROPE_THETA,)),
            ("vision_config.head_dim", getattr(vision, "head_dim", None) or per_head, (per_head,)),
            ("vision_config.hidden_act", vision.hidden_act, ("silu", "gelu")),
            ("projector_hidden_act", config.projector_hidden_act, ("gelu",)),
            ("vision_feature_layer", config.vision_feature_layer, (-1,)),
            ("text_config.rms_norm_eps (the projector norm's)", config.text_config.rms_norm_eps, (PIXTRAL_NORM_EPS,))):
        if value not in allowed:
            raise UsageError(f"export --format gguf: this Mistral 3 model has {what}={value!r}, but llama.cpp's "
                             f"pixtral projector computes with {' or '.join(map(repr, allowed))}",
                             hint="export --format safetensors instead")


def _pixtral_keys(writer: Any, config: Any, image_processor: Any) -> None:
    """Mistral 3's Pixtral tower (checked by _check_pixtral): its activation (SiLU or GELU), RMSNorm epsilon and
    the patch merger's spatial_merge_size, as llama.cpp's converter writes them."""
    import gguf

    _check_pixtral(config)
    vision = config.vision_config
    writer.add_clip_projector_type(gguf.VisionProjectorType.PIXTRAL)
    writer.add_vision_attention_layernorm_eps(getattr(vision, "layer_norm_eps", None) or PIXTRAL_NORM_EPS)
    if vision.hidden_act == "silu":
        writer.add_vision_use_silu(True)
    else:
        writer.add_vision_use_gelu(True)
    writer.add_vision_spatial_merge_size(config.spatial_merge_size)


def _pixtral_tensors(model: Any, qtype: str) -> Any:
    """The Pixtral tower (vision_tower.*) and the projector (multi_modal_projector.*: its norm, patch merger and
    two layers) under their transformers names, which the gguf package maps; the tower's q and k rows in
    llama.cpp's rotary layout (its converter permutes them as Llama's), the patch embedding and the patch merger
    F16 in an f16 file, else F32 (as the converter forces them)."""
    heads = model.config.vision_config.num_attention_heads
    for name, data in _weights(model, "model.vision_tower.", "model.multi_modal_projector."):
        name = name.removeprefix("model.")
        if name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            data = permute_rotary(data, heads)
        patchwise = name.endswith(("patch_conv.weight", "merging_layer.weight"))
        yield name, data, ("f16" if qtype == "f16" else "f32") if patchwise else None


# projector type (the family table's vision.projector) -> (its metadata keys: keys(writer, config, image_processor),
# its tensors: tensors(model, qtype) yielding (name, float32 array, forced --type or None))
_PROJECTORS = {"GEMMA3": (_gemma3_keys, _gemma3_tensors), "QWEN25VL": (_qwen25vl_keys, _qwen25vl_tensors),
               "QWEN3VL": (_qwen3vl_keys, _qwen3vl_tensors), "IDEFICS3": (_idefics3_keys, _idefics3_tensors)}
_PROJECTORS["PIXTRAL"] = (_pixtral_keys, _pixtral_tensors)
# projector type -> a check of the config alone that check_vision_exportable runs before the model loads
_CONFIG_CHECKS = {"PIXTRAL": _check_pixtral}
