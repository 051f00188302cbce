"""Load the base model and tokenizer as the recipe says: dtype from the hardware, bitsandbytes 4/8-bit."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune.errors import ModelLoadError
from finetune.model.attention import choose, register
from finetune.model.building import BUILDING
from finetune.model.expert_store import quantize_experts, quantize_on_arrival
from finetune.model.family import VISION_PARTS, family_of
from finetune.model.moe import use_finetune_experts
from finetune.model.source import resolve_model_path
from finetune.recipe.families import check_config_file
from finetune.recipe.schema import ModelConfig, QuantizationConfig
from finetune.units import dtype_name, torch_dtype


def compute_dtype(model_cfg: ModelConfig) -> torch.dtype:
    """model.dtype on this machine: auto is bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU."""
    cuda = torch.cuda.is_available()
    return torch_dtype(dtype_name(model_cfg.dtype, "cuda" if cuda else "cpu", cuda and torch.cuda.is_bf16_supported()))


def attn_implementation(choice: str, config, device: str = "cpu", packing: bool = False) -> tuple[str, str | None]:
    """model.attn_implementation for training on `device` (cpu | cuda), and why where auto falls back to eager.

    auto: the best kernel that runs the family's attention (soft-capping, sinks, sliding windows) and packed
    documents without s x s memory (finetune.model.attention.choose)."""
    register()
    if choice != "auto":
        return choice, None
    return choose(config, model_class(config), device, packing)


def auto_model(config) -> Any:
    """The transformers auto class a config loads with: the causal LM, or for a vision-language family the
    image-text-to-text model (vision tower, projector and language model)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if family_of(config).vision is not None else AutoModelForCausalLM


def load_full(folder: Path) -> torch.nn.Module:
    """A full fine-tune as a run saved it (its config picks the class: a vision-language model loads whole)."""
    from transformers import AutoConfig

    with BUILDING:
        return auto_model(AutoConfig.from_pretrained(folder)).from_pretrained(folder, dtype="auto", use_safetensors=True)


def model_class(config) -> type | None:
    """The transformers class a config trains as: its causal LM, or for a vision-language family the whole
    image-text-to-text model (vision tower, projector, language model)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    vision = family_of(config).vision is not None
    return (MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING if vision else MODEL_FOR_CAUSAL_LM_MAPPING).get(type(config), None)


def quantization_config(quant: QuantizationConfig, dtype: torch.dtype, *, sharded: bool = False,
                        vision: bool = False):
    """The transformers BitsAndBytesConfig for the recipe, or None.

    sharded (FSDP): 4-bit weights are stored in the compute dtype instead of uint8, so FSDP can flatten and
    shard them with the other weights (FSDP-QLoRA); the packed bytes are the same. vision: a vision-language
    model, whose vision tower and projector stay in 16 bits (only the language model is quantized)."""
    if quant.bits in (None, "auto"):
        return None
    from transformers import BitsAndBytesConfig

    # transformers matches these from the start of a module name (or as its suffix): the parts at any depth
    skip = {"llm_int8_skip_modules": [*(rf"(.*\.)?{part}" for part in VISION_PARTS), "lm_head"]} if vision else {}
    if quant.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, **skip)
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant.quant_type,
        bnb_4bit_use_double_quant=quant.double_quant, bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype if sharded else torch.uint8, **skip,
    )


def disable_cpu_4bit_repack(model: torch.nn.Module) -> int:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference.

    On CPUs with AVX512-BF16, any no-grad forward (eval, generate) repacks Linear4bit weights into an
    inference layout; afterwards gradients through those layers are silently zero. Returns the count fixed.
    """
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def _load_error(what: str, model_cfg: ModelConfig, exc: Exception) -> ModelLoadError:
    """One message for any part of the model folder that cannot load; custom code gets its own hint."""
    if "trust_remote_code" in str(exc):
        return ModelLoadError(
            f"model.path: the {what} of {model_cfg.path} needs custom code (auto_map) to load",
            hint="set model.trust_remote_code: true only if you trust the checkpoint's author")
    return ModelLoadError(f"model.path: cannot load the {what} of {model_cfg.path}: {exc}")


def load_tokenizer(path: Path, model_cfg: ModelConfig):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    except (ValueError, OSError) as exc:
        raise _load_error("tokenizer", model_cfg, exc) from None
    if tokenizer.pad_token is None:
        # Padding never carries loss (labels are -100 there), so reusing EOS as pad is safe.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def local_tokenizer(model_cfg: ModelConfig) -> tuple[Any, str | None]:
    """(model.path's tokenizer, None) where it can be read now without a download or a conversion
    (`finetune.model.source.tokenizer_source`), else (None, why not): what the planner tokenizes the data with."""
    from transformers import AutoTokenizer

    from finetune.model.source import tokenizer_source

    source = tokenizer_source(model_cfg.path, model_cfg.revision)
    if isinstance(source, str):
        return None, source
    folder, gguf = source
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf, trust_remote_code=model_cfg.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - a folder without a tokenizer, a broken file: said, not raised
        return None, f"no tokenizer readable in {folder / gguf if gguf else folder} ({type(exc).__name__})"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, None


def load_model(model_cfg: ModelConfig, quant: QuantizationConfig, *, quantize: bool = True, sharded: bool = False,
               packing: bool = False, arriving: AbstractContextManager | None = None):
    """Return (model, tokenizer, local_path). `quantize=False` loads full precision (used by export);
    `sharded`: the weights will be sharded by FSDP (see quantization_config); `packing` (data.packing): the batches join documents, which model.attn_implementation auto keeps apart without a mask;
    `arriving` (memory.offload_weights or offload_experts, `finetune.memory.weight_store.stream_on_arrival`):
    entered around the load, it takes each weight as it is set (already quantized); they load onto the device."""

    path = resolve_model_path(model_cfg.path, model_cfg.revision)
    dtype = compute_dtype(model_cfg)
    from transformers import AutoConfig

    check_config_file(path)  # an architecture no family describes: one line before transformers tries
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    except ValueError as exc:
        raise _load_error("config", model_cfg, exc) from None
    vision = family_of(config).vision is not None
    qconfig = quantization_config(quant, dtype, sharded=sharded, vision=vision) if quantize else None
    attn, eager_reason = attn_implementation(model_cfg.attn_implementation, config,
                                             "cuda" if torch.cuda.is_available() else "cpu", packing)
    if eager_reason:
        print(f"model.attn_implementation auto: {eager_reason}")
    kwargs = dict(dtype=dtype, attn_implementation=attn, use_safetensors=True,
                  trust_remote_code=model_cfg.trust_remote_code)
    if qconfig is not None:
        kwargs["quantization_config"] = qconfig
    if qconfig is not None or arriving is not None:  # streamed weights cannot move after the load
        kwargs["device_map"] = {"": _device_index()}
    # bits 4: each fused expert weight is stored in 4 bits as it loads, so the 16-bit experts of the whole
    # model are never on the device at once (bitsandbytes quantizes Linear layers only)
    try:
        with quantize_on_arrival(quant) if qconfig is not None else nullcontext(), \
                arriving or nullcontext():
            model = _from_pretrained(model_cfg.path, path, config, kwargs)
    except ValueError as exc:
        raise _load_error("model", model_cfg, exc) from None
    if qconfig is None and arriving is None and torch.cuda.is_available():
        model.to("cuda")
    disable_cpu_4bit_repack(model)
    if use_finetune_experts(model) and qconfig is not None:
        quantize_experts(model, quant)  # what did not arrive through the hook; the placeholders go
    model.config.use_cache = False
    return model, load_tokenizer(path, model_cfg), path


@dataclass
class LoadedModel:
    """A base model loaded once and lent to several runs (`finetune.train.run.run(base=...)`): a benchmark or a
    sweep re-plans and trains each recipe on the same weights without loading them again. Each run gets the
    model as `load_model` returned it and hands it back so (adapters and layer changes removed)."""

    model: torch.nn.Module
    tokenizer: Any
    path: Path
    model_cfg: ModelConfig
    quant: QuantizationConfig

    def mismatch(self, model_cfg: ModelConfig, quant: QuantizationConfig) -> str | None:
        """The first recipe key whose value differs from what this model was loaded with, as `key: a != b`."""
        for section, loaded, wanted in (("model", self.model_cfg, model_cfg), ("quantization", self.quant, quant)):
            for key, value in loaded.model_dump().items():
                if getattr(wanted, key) != value:
                    return f"{section}.{key}: {getattr(wanted, key)!r} != {value!r} (loaded)"
        return None


def load_base(model_cfg: ModelConfig, quant: QuantizationConfig) -> LoadedModel:
    """Load the model once for several runs (see LoadedModel)."""
    model, tokenizer, path = load_model(model_cfg, quant)
    return LoadedModel(model, tokenizer, path, model_cfg, quant)


def _from_pretrained(model_path: str, folder: Path, config, kwargs: dict):
    """from_pretrained on the folder's weights, or (random:FOLDER) on random weights quantized the same way."""
    from finetune.model.random_weights import random_folder, random_state_dict

    if random_folder(model_path) is None:
        with BUILDING:
            return auto_model(config).from_pretrained(folder, **kwargs)
    state = random_state_dict(config, kwargs["dtype"], "cuda" if torch.cuda.is_available() else "cpu")
    kwargs = {k: v for k, v in kwargs.items() if k != "use_safetensors"}
    with BUILDING:
        return model_class(config).from_pretrained(None, config=config, state_dict=state, **kwargs)


def _device_index():
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
