"""Tiny offline models for tests, benchmarks and demos: no hub, built in a second.

`make_tiny_model_dir` writes a Hugging Face folder (config, safetensors weights, a byte-level BPE
tokenizer trained on the spot, a ChatML chat template) that loads exactly like a real checkpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from finetune.data.chat import CHATML_TEMPLATE

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Fine-tuning adapts a pretrained language model to a task with a small dataset.",
    "user assistant system function observation tool call answer question instruction input output",
    "What is the capital of France? The capital of France is Paris.",
    "Memory, gradients, activations, optimizer state and logits decide what fits on a GPU.",
    "0123456789 {}[]():;,.!?\"' -+*/=<>_#@$%&",
]

# One entry per model family (finetune/recipe/families.py), keyed by its transformers model_type: the family's
# own config class at toy size, with what each needs to be small and to keep every kind of layer it has (two
# layers: a sliding-window and a full attention layer, LFM2's convolution and attention, Qwen3.5's linear and
# full attention).
ARCHITECTURES = {
    # name: (transformers config class name, extra config kwargs)
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "qwen3_5_text": ("Qwen3_5TextConfig", {
        "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "layer_types": ["linear_attention", "full_attention"]}),
    # Qwen3.5's real checkpoints are vision-language ones whose text model trains: a tiny one around the above.
    "qwen3_5": ("Qwen3_5Config", {"text_config": "qwen3_5_text", "vision_config": {
        "depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64}}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "ministral": ("MinistralConfig", {"head_dim": 16, "sliding_window": 8,
                                      "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                                         "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma4_text": ("Gemma4TextConfig", {"head_dim": 16, "global_head_dim": 32, "sliding_window": 8,
                                         "vocab_size_per_layer_input": 512, "hidden_size_per_layer_input": 8,
                                         "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("Phi3Config", {}),
    "smollm3": ("SmolLM3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {}),
    "lfm2": ("Lfm2Config", {"layer_types": ["conv", "full_attention"], "block_auto_adjust_ff_dim": False}),
}

# Mixture-of-experts families at toy size: 8 experts (4 for Mixtral, gpt-oss), top-2, expert width 32;
# DeepSeek-V3 with MLA attention and a shared expert, GLM-4-MoE with a shared expert, both after one dense layer.
MOE_ARCHITECTURES = {
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "head_dim": 16}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                                  "sliding_window": None}),
    "olmoe": ("OlmoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}),
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                                 "head_dim": 16, "sliding_window": 8,
                                 "layer_types": ["sliding_attention", "full_attention"],
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}),
    "deepseek_v3": ("DeepseekV3Config", {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2,
                                         "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32,
                                         "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
                                         "num_key_value_heads": 4}),
    "glm4_moe": ("Glm4MoeConfig", {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                   "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                                   "topk_group": 1, "head_dim": 16}),
}


# Vision-language families at toy size: the family's own config class with a two-block vision tower (one window
# and one full attention block for Qwen2.5-VL) in front of a two-layer language model, the special tokens its
# processor writes, and the image processor's preprocessor_config.json with a small pixel budget (tiny images
# give a few image tokens each).
QWEN_VL_TOKENS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                  "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}


def _parts_template(image: str) -> str:
    """ChatML whose turns may be lists of text and image parts, an image written as `image` (what the family's
    own chat template writes for one)."""
    return ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}"
            f"{{% if part['type'] == 'image' %}}{{{{ '{image}' }}}}"
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
            "{{ '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


QWEN_VL_TEMPLATE = _parts_template("<|vision_start|><|image_pad|><|vision_end|>")
# SmolVLM's published chat_template.json (HuggingFaceTB/SmolVLM-256M-Instruct): "User:" and
# "Assistant:" turns, each ended by <end_of_utterance> (the eos); a turn's content is a list of parts.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
VISION_ARCHITECTURES = {
    # name: (config class name, config kwargs, special tokens {config key: token}, chat template, preprocessor)
    # Qwen2.5-VL: 112-pixel vision windows, as published and as llama.cpp's projector has them
    "qwen2_5_vl": ("Qwen2_5_VLConfig", {
        "text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        "vision_config": {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                          "out_hidden_size": 64, "fullatt_block_indexes": [1], "window_size": 112,
                          "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}},
        QWEN_VL_TOKENS, QWEN_VL_TEMPLATE,
        {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56, "max_pixels": 112 * 112,
         "size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}, "patch_size": 14, "temporal_patch_size": 2,
         "merge_size": 2}),
    "qwen3_vl": ("Qwen3VLConfig", {
        "text_config": {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                            "mrope_section": [2, 3, 3], "mrope_interleaved": True}},
        "vision_config": {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                          "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}},
        QWEN_VL_TOKENS, QWEN_VL_TEMPLATE,
        {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 32 * 32, "max_pixels": 128 * 128,
         "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}, "patch_size": 16, "temporal_patch_size": 2,
         "merge_size": 2}),
    # Gemma 3 4B and up: a SigLIP tower at 56 x 56 pixels (4 x 4 patches) pooled to 4 tokens per image
    "gemma3": ("Gemma3Config", {
        "text_config": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                        "layer_types": ["sliding_attention", "full_attention"]},
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "image_size": 56, "patch_size": 14},
        "mm_tokens_per_image": 4},
        {"image_token_index": "<image_soft_token>", "boi_token_index": "<start_of_image>",
         "eoi_token_index": "<end_of_image>"}, _parts_template("<start_of_image>"),
        {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 56, "width": 56}, "do_pan_and_scan": False,
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}),
    # SmolVLM / Idefics3: a SigLIP tower over 56 x 56 tiles (4 x 4 patches, pixel-shuffled 2 x 2: 4 tokens per
    # tile); images up to 112 pixels on the long side, so up to 2 x 2 tiles and the whole image. The tokens the
    # processor writes around an image's are recorded beside the image token's id.
    "idefics3": ("Idefics3Config", {
        "text_config": {"model_type": "llama"},
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "image_size": 56, "patch_size": 14},
        "scale_factor": 2},
        {"image_token_id": "<image>", "fake_image_token_id": "<fake_token_around_image>",
         "global_image_token_id": "<global-img>"}, SMOLVLM_TEMPLATE,
        {"image_processor_type": "Idefics3ImageProcessor", "size": {"longest_edge": 112},
         "max_image_size": {"longest_edge": 56}, "do_image_splitting": True,
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}),
}
# Mistral 3: a Pixtral tower over 14-pixel patches, merged 2 x 2 into one [IMG] token per 28 x 28 block, images up
# to 112 pixels on the long side (4 x 4 blocks), before a two-layer Mistral; the template writes [IMG] per image
# and the processor's row breaks and image end are the tokenizer's special tokens (recorded beside the image
# token's id, as the full processor holds them).
VISION_ARCHITECTURES["mistral3"] = ("Mistral3Config", {
    "text_config": {"model_type": "mistral", "sliding_window": None},
    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                      "head_dim": 16, "patch_size": 14, "image_size": 112},
    "spatial_merge_size": 2},
    {"image_token_index": "[IMG]", "image_break_token_id": "[IMG_BREAK]", "image_end_token_id": "[IMG_END]"},
    _parts_template("[IMG]"),
    {"image_processor_type": "PixtralImageProcessor", "patch_size": {"height": 14, "width": 14},
     "size": {"longest_edge": 112}})
# Llama 3.2 Vision (mllama): a two-block tower (one global block) over 56 x 56 tiles, at most 2 tiles per image,
# read by the middle of three text layers, a cross-attention one; the text holds one <|image|> token per image.
VISION_ARCHITECTURES["mllama"] = ("MllamaConfig", {
    "text_config": {"num_hidden_layers": 3, "cross_attention_layers": [1], "bos_token_id": 1},
    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_global_layers": 1,
                      "attention_heads": 2, "image_size": 56, "patch_size": 14, "max_num_tiles": 2,
                      "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]], "intermediate_layers_indices": [0],
                      "vision_output_dim": 64}},
    {"image_token_index": "<|image|>"}, _parts_template("<|image|>"),
    {"image_processor_type": "MllamaImageProcessor", "size": {"height": 56, "width": 56}, "max_image_tiles": 2,
     "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]})
# SmolVLM2: Idefics3's layout under its own config class and image processor name
VISION_ARCHITECTURES["smolvlm"] = ("SmolVLMConfig", *VISION_ARCHITECTURES["idefics3"][1:4],
                                   {**VISION_ARCHITECTURES["idefics3"][4], "image_processor_type": "SmolVLMImageProcessor"})


# What a family's published folder has besides the above: more special tokens in its tokenizer, its eos, text the
# tiny tokenizer trains on so that it splits like the real one, and processor_config.json. SmolVLM / Idefics3
# (SmolLM2's tokenizer): the tile markers <row_R_col_C> (R, C 1..6) and <end_of_utterance> special tokens,
# <end_of_utterance> the eos, "\n\n" one token; processor_config.json's image_seq_len, the tokens per tile.
_TILE_MARKERS = tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))
VISION_EXTRAS = {
    arch: {"specials": (*_TILE_MARKERS, "<end_of_utterance>"), "eos": "<end_of_utterance>",
           "corpus": ("A paragraph ends.\n\n", "\n\n"),
           "processor": {"image_seq_len": 4, "processor_class": f"{name}Processor"}}
    for arch, name in (("idefics3", "Idefics3"), ("smolvlm", "SmolVLM"))}


def architecture(arch: str) -> tuple[str, dict]:
    """A tiny model's (config class name, extra kwargs), dense, mixture-of-experts or vision-language."""
    if arch in VISION_ARCHITECTURES:
        return VISION_ARCHITECTURES[arch][:2]
    return ARCHITECTURES[arch] if arch in ARCHITECTURES else MOE_ARCHITECTURES[arch]


def make_tokenizer(vocab_size: int = 512, extra_specials: tuple[str, ...] = (), corpus: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer with ChatML special tokens (and `extra_specials`, a vision model's image
    tokens), trained offline in well under a second on a small corpus (and `corpus`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([*_CORPUS, *corpus] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|pad|>",
        unk_token=None, additional_special_tokens=["<|im_start|>", "<|endoftext|>", *extra_specials],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def make_spm_tokenizer(vocab_size: int = 300):
    """A sentencepiece-style BPE tokenizer (Llama 2, Mistral: "▁" for spaces, <0xXX> byte fallback) with ChatML
    special tokens, trained offline like make_tokenizer's."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.train_from_iterator(_CORPUS * 20, trainer=trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    trained = json.loads(tok.to_str())["model"]
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += sorted(trained["vocab"], key=trained["vocab"].get)
    spm = LlamaTokenizer(vocab={p: i for i, p in enumerate(pieces)}, merges=[tuple(m) for m in trained["merges"]])
    spm.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    spm.chat_template = CHATML_TEMPLATE
    return spm


_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False, pad_token_id=3,
             eos_token_id=2, bos_token_id=None, initializer_range=0.2)


def tiny_config(arch: str = "llama", vocab_size: int = 512, **overrides):
    """A config of the given architecture family at toy size (override any field).

    initializer_range is 0.2, not the usual 0.02: a trained model's LM head produces confident logits, but a
    64-wide RMS-normalised hidden state times a 0.02-scale head caps every logit near 1.3, so a LoRA-only
    fine-tune of such a toy could never fit anything and tests of learning would measure nothing.
    """
    import transformers

    cls_name, extra = architecture(arch)
    if arch in VISION_ARCHITECTURES:  # the language model at the dense entries' toy size, the tiny vision tower
        text = {**_TINY, "vocab_size": vocab_size, **extra["text_config"], **overrides}
        rest = {k: v for k, v in extra.items() if k not in ("text_config", "vision_config")}
        return getattr(transformers, cls_name)(text_config=text, vision_config=extra["vision_config"],
                                               pad_token_id=3, eos_token_id=2, tie_word_embeddings=False, **rest)
    if "text_config" in extra:  # a vision-language config around the tiny text config of another entry
        text = tiny_config(extra["text_config"], vocab_size, **overrides)
        return getattr(transformers, cls_name)(text_config=text.to_dict(), vision_config=extra["vision_config"])
    kwargs = dict(_TINY, vocab_size=vocab_size)
    kwargs.update(extra)
    kwargs.update(overrides)
    return getattr(transformers, cls_name)(**kwargs)


def make_tiny_model_dir(path: str | Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a tiny random model with tokenizer to `path` (safetensors) and return the path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from finetune.model.building import BUILDING

    if arch in VISION_ARCHITECTURES:
        return vision_model(arch, path, seed, **overrides)
    path = Path(path)
    tokenizer = make_tokenizer()
    config = tiny_config(arch, vocab_size=len(tokenizer), **overrides)
    torch.manual_seed(seed)
    vision = "vision_config" in architecture(arch)[1]  # the whole vision-language checkpoint, as published
    with BUILDING:
        model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def vision_tokenizer(arch: str):
    """A tiny vision-language model's tokenizer: its image tokens special, its chat template and eos, split as
    the family's published tokenizer splits (VISION_EXTRAS)."""
    _, _, tokens, template, _ = VISION_ARCHITECTURES[arch]
    extra = VISION_EXTRAS.get(arch, {})
    tokenizer = make_tokenizer(extra_specials=(*tokens.values(), *extra.get("specials", ())),
                               corpus=extra.get("corpus", ()))
    tokenizer.chat_template = template
    if "eos" in extra:
        tokenizer.eos_token = extra["eos"]
    return tokenizer


def vision_model(arch: str, folder: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a tiny random vision-language model to `folder` as the Hub ships one (config.json, safetensors,
    tokenizer with the image tokens and chat template, preprocessor_config.json, chat_template.json) and
    return the folder."""
    import json

    import torch
    from transformers import AutoModelForImageTextToText

    from finetune.model.building import BUILDING

    folder = Path(folder)
    _, _, tokens, template, preprocessor = VISION_ARCHITECTURES[arch]
    extra = VISION_EXTRAS.get(arch, {})
    tokenizer = vision_tokenizer(arch)
    config = tiny_config(arch, vocab_size=len(tokenizer), **overrides)
    for key, token in tokens.items():
        setattr(config, key, tokenizer.convert_tokens_to_ids(token))
    torch.manual_seed(seed)
    with BUILDING:
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # transformers starts Gemma 3's projector at zero: a random model must see its images
        for weight in model.parameters():
            if weight.ndim > 1 and not weight.any():
                weight.normal_(0.0, config.get_text_config().initializer_range)
        for name, param in model.named_parameters():  # Llama 3.2 Vision's cross-attention gates start closed
            if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                param.fill_(1.0)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2))
    if "processor" in extra:
        (folder / "processor_config.json").write_text(json.dumps(extra["processor"], indent=2))
    return folder


# The synthetic vision task: one coloured shape per image, "what colour is the shape?", a one-word answer. A
# tiny random VLM answers it at chance before training and learns it in minutes on a CPU, so a test or a
# demonstration can show held-out answers improving (benchmarks/vision_demo.py, recipes/vision-demo-cpu.yaml).
SHAPE_COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 70, 230), "yellow": (240, 210, 20)}
SHAPE_QUESTION = "What colour is the shape?"


def shape_image(colour: str, kind: str, box: tuple[int, int, int, int], size: int = 56):
    """A white `size`-pixel square image holding one filled shape (circle, square or triangle) in `box`."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    fill = SHAPE_COLOURS[colour]
    x0, y0, x1, y1 = box
    if kind == "circle":
        draw.ellipse(box, fill=fill)
    elif kind == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return image


def shape_task(folder: str | Path, *, train: int = 64, held_out: int = 32, size: int = 56,
               seed: int = 0) -> tuple[Path, Path]:
    """Write the coloured-shape task to `folder`: images/NNNN.png and two LLaMA-Factory-format files, train.json
    and held_out.json (`messages` with an `<image>` marker, `images` relative to the file). Returns their paths.

    Colours cycle so every colour is equally common in both splits; shape kind, size and place are drawn with
    `seed`, so the answer is only in the colour. Deterministic: the same arguments write the same bytes."""
    import json
    import random

    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    colours = sorted(SHAPE_COLOURS)
    records = []
    for i in range(train + held_out):
        colour = colours[i % len(colours)]
        side = rng.randint(size // 3, size * 3 // 4)
        x, y = rng.randint(0, size - side), rng.randint(0, size - side)
        name = f"images/{i:04d}.png"
        shape_image(colour, rng.choice(("circle", "square", "triangle")), (x, y, x + side - 1, y + side - 1),
                    size).save(folder / name, optimize=False)
        records.append({"messages": [{"role": "user", "content": f"<image>{SHAPE_QUESTION}"},
                                     {"role": "assistant", "content": colour}], "images": [name]})
    rng.shuffle(records)
    paths = folder / "train.json", folder / "held_out.json"
    for path, part in zip(paths, (records[:train], records[train:]), strict=True):
        path.write_text(json.dumps(part, indent=1) + "\n", encoding="utf-8")
    return paths


@contextmanager
def stated_machine(host_ram: int | None = None, disk_free: int | None = None,
                   typical_disk: bool = False, disk_bytes_per_s: float | None = None) -> Iterator[None]:
    """Plan as on the machine a recipe names ("with 64 GB of RAM", "an NVMe SSD with 200 GB free, 3 GB/s"), not
    this one: psutil's available RAM and every disk's free space read as given (None: as they are); the disk's
    bandwidth (both directions) as `disk_bytes_per_s`, or with `typical_disk` the cost model's typical speed,
    else as measured here. What fits a weight-streaming recipe, and how fast, depends on them; the tests and
    the benchmarks that plan those recipes use this."""
    import shutil
    from types import SimpleNamespace
    from unittest import mock

    import psutil

    from finetune.memory import bandwidth

    patches = []
    if typical_disk:
        patches.append(mock.patch.object(bandwidth, "disk_bandwidth", lambda *args, **kwargs: None))
    elif disk_bytes_per_s is not None:
        measured = {"read": disk_bytes_per_s, "write": disk_bytes_per_s}
        patches.append(mock.patch.object(bandwidth, "disk_bandwidth", lambda directory, refresh=False: measured))
    if host_ram is not None:
        ram = SimpleNamespace(total=host_ram, available=host_ram, percent=0.0, used=0, free=host_ram)
        patches.append(mock.patch.object(psutil, "virtual_memory", lambda: ram))
    if disk_free is not None:
        patches.append(mock.patch.object(shutil, "disk_usage",
                                         lambda path: SimpleNamespace(total=disk_free, used=0, free=disk_free)))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield
