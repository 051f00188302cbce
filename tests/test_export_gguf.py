"""GGUF export: every supported architecture round-trips through the gguf reader and transformers
(`gguf_file=`) with equal logits, each weight type stays within its tolerance, the tokenizer and chat template
travel in the metadata, and what the writer cannot express is refused by name."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.errors import FinetuneError
from finetune.export.gguf import TYPES, write_gguf
from finetune.testing import make_tiny_model_dir

TEXT = "What is the capital of France? The capital of France is Paris. 0123456789 {}"
# Gemma-2 as its real checkpoints are: head_dim == query_pre_attn_scalar, output head tied to the embedding.
# Qwen3 with head_dim 128, as every Qwen3 checkpoint has: transformers' GGUF reader does not read the head size
# back (llama.cpp does, from attention.key_length) and builds Qwen3Config's default.
ARCH_OVERRIDES = {"gemma2": {"head_dim": 256, "query_pre_attn_scalar": 256, "tie_word_embeddings": True},
                  "qwen3": {"head_dim": 128},
                  # Gemma 3 with its real layer pattern (llama.cpp's: five sliding-window layers, a global one).
                  "gemma3_text": {"head_dim": 256, "query_pre_attn_scalar": 256, "tie_word_embeddings": True,
                                  "num_hidden_layers": 6, "layer_types": None}}
# What transformers builds from each file: llama.cpp runs Mistral as llama, and so does the reader.
READ_BACK = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
             "phi3": "Phi3ForCausalLM"}


def _tiny(tmp_path: Path, arch: str, **overrides):
    folder = make_tiny_model_dir(tmp_path / arch, arch, **{**ARCH_OVERRIDES.get(arch, {}), **overrides})
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _read_back(path: Path):
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


@pytest.mark.parametrize("arch", list(READ_BACK))
def test_each_architecture_round_trips_with_equal_logits_and_tokenizer(tmp_path, arch):
    model, tokenizer = _tiny(tmp_path, arch)
    path = write_gguf(model, tokenizer, tmp_path / f"{arch}.gguf", qtype="f32", name="tiny")

    reader = gguf.GGUFReader(path)
    assert _field(reader, "general.architecture") == {"mistral": "llama", "gemma3_text": "gemma3"}.get(arch, arch)
    assert _field(reader, f"{_field(reader, 'general.architecture')}.block_count") == model.config.num_hidden_layers
    loaded = _read_back(path)
    assert type(loaded).__name__ == READ_BACK[arch]
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)
    read_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert read_tokenizer(TEXT).input_ids == ids[0].tolist()
    assert read_tokenizer.chat_template == tokenizer.chat_template


def _roundtrip(data: np.ndarray, qtype: str) -> np.ndarray:
    ggml = gguf.GGMLQuantizationType[TYPES[qtype]]
    if ggml in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return data.astype(np.float16 if qtype == "f16" else np.float32).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(data, ggml), ggml)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("types")
    return {arch: _tiny(folder, arch) for arch in READ_BACK}


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"]


@pytest.mark.parametrize("qtype", list(TYPES))
@pytest.mark.parametrize("arch", list(READ_BACK))
def test_each_type_stores_exactly_its_rounding_and_stays_within_its_tolerance(tmp_path, tiny_models, arch, qtype):
    """The file's logits equal those of the model whose 2-D weights went through the type's own rounding (so the
    layout is right for every architecture and type); for 8 bits and more they differ from the original by at
    most the type's tolerance (this toy's random weights amplify rounding: 4 and 5 bits move its logits by their
    whole range)."""
    model, tokenizer = tiny_models[arch]
    path = write_gguf(model, tokenizer, tmp_path / "m.gguf", qtype=qtype)
    rounded = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    rounded.load_state_dict({k: torch.from_numpy(_roundtrip(v.numpy(), qtype)) if v.ndim == 2 else v
                             for k, v in model.state_dict().items()})
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    loaded = _logits(_read_back(path), ids)
    torch.testing.assert_close(loaded, _logits(rounded, ids), rtol=1e-4, atol=1e-4)
    tolerance = {"f32": 1e-6, "f16": 5e-3, "bf16": 5e-2, "q8_0": 0.15}.get(qtype)
    if tolerance is not None:
        original = _logits(model, ids)
        assert (loaded - original).abs().max() <= tolerance * original.abs().max()


def test_smaller_types_write_smaller_files(tmp_path, llama):
    model, tokenizer = llama
    sizes = [write_gguf(model, tokenizer, tmp_path / f"{t}.gguf", qtype=t).stat().st_size
             for t in ("f32", "f16", "q8_0", "q4_0")]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0] / 3


def test_tokenizer_metadata_names_types_special_ids_and_the_end_of_turn(tmp_path, llama):
    model, tokenizer = llama
    reader = gguf.GGUFReader(write_gguf(model, tokenizer, tmp_path / "m.gguf"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert _field(reader, "tokenizer.ggml.model") == "gpt2" and _field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert len(tokens) == model.config.vocab_size and tokens[:len(tokenizer)] == tokenizer.convert_ids_to_tokens(
        list(range(len(tokenizer))))
    types = _field(reader, "tokenizer.ggml.token_type")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert types[im_end] == gguf.TokenType.CONTROL and types[tokenizer("Paris").input_ids[0]] == gguf.TokenType.NORMAL
    assert _field(reader, "tokenizer.ggml.eos_token_id") == im_end
    assert _field(reader, "tokenizer.ggml.padding_token_id") == tokenizer.pad_token_id
    assert _field(reader, "tokenizer.ggml.merges")[:3] == [" ".join(m) if not isinstance(m, str) else m
                                                          for m in _merges(tokenizer)[:3]]
    assert _field(reader, "tokenizer.chat_template") == tokenizer.chat_template
    assert _field(reader, "tokenizer.ggml.add_bos_token") is False


def _merges(tokenizer):
    import json

    return json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]


def test_a_chat_template_ending_turns_with_another_token_than_eos_writes_it_as_end_of_turn(tmp_path, llama):
    model, tokenizer = llama
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path, eos_token="<|endoftext|>")
    reader = gguf.GGUFReader(write_gguf(model, tokenizer, tmp_path / "m.gguf"))
    assert _field(reader, "tokenizer.ggml.eot_token_id") == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tokenizer.convert_tokens_to_ids("<|endoftext|>")


def test_smollm_digit_splitting_is_named_for_llama_cpp(tmp_path, llama):
    from tokenizers import pre_tokenizers

    model, tokenizer = llama
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    reader = gguf.GGUFReader(write_gguf(model, tokenizer, tmp_path / "m.gguf"))
    assert _field(reader, "tokenizer.ggml.pre") == "smollm"
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)


@pytest.mark.parametrize(("change", "message"), [
    (lambda m, t: setattr(m.config, "model_type", "gpt_neox"), "architecture 'gpt_neox' is not written"),
    # Phi-3's LongRoPE is written for llama.cpp's phi3, whose loader reads its factors; its llama does not
    (lambda m, t: m.config.rope_parameters.update(rope_type="longrope"), "rope scaling 'longrope' .* llama.cpp's "
                                                                          "llama architecture"),
    (lambda m, t: setattr(t.backend_tokenizer, "pre_tokenizer", _whitespace()), "pre-tokenizer"),
], ids=["architecture", "rope-scaling", "pre-tokenizer"])
def test_what_gguf_cannot_carry_is_refused_by_name_and_nothing_is_written(tmp_path, change, message):
    model, tokenizer = _tiny(tmp_path, "llama")
    change(model, tokenizer)
    with pytest.raises(FinetuneError, match=message):
        write_gguf(model, tokenizer, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def _whitespace():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Whitespace()


@pytest.mark.parametrize(("arch", "message"), [
    ("gemma4_text", "architecture 'gemma4_text' is not written to GGUF: its per-layer head sizes"),
    ("gemma3_text", "sliding-window layers differ from llama.cpp's"),
], ids=["family-without-gguf", "gemma3-layer-pattern"])
def test_what_a_family_cannot_write_is_refused_by_its_reason(tmp_path, arch, message):
    """The family table says which families are written and, for the others, why not: one line each."""
    model, tokenizer = _tiny(tmp_path, arch, **({"layer_types": ["sliding_attention"] * 6} if arch == "gemma3_text" else {}))
    with pytest.raises(FinetuneError, match=message):
        write_gguf(model, tokenizer, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_an_untied_gemma2_head_is_refused_naming_the_tensor(tmp_path):
    model, tokenizer = _tiny(tmp_path, "gemma2", tie_word_embeddings=False)
    with pytest.raises(FinetuneError, match="lm_head.weight .*always tied"):
        write_gguf(model, tokenizer, tmp_path / "m.gguf")


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_a_sentencepiece_style_tokenizer_round_trips_with_scores_and_byte_tokens(tmp_path, arch):
    from finetune.testing import make_spm_tokenizer, tiny_config

    tokenizer = make_spm_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab_size=len(tokenizer)), dtype=torch.float32)
    path = write_gguf(model.eval(), tokenizer, tmp_path / "spm.gguf", qtype="f32")

    reader = gguf.GGUFReader(path)
    assert _field(reader, "tokenizer.ggml.model") == "llama" and "tokenizer.ggml.pre" not in reader.fields
    assert _field(reader, "tokenizer.ggml.add_space_prefix") is True
    types, scores = _field(reader, "tokenizer.ggml.token_type"), _field(reader, "tokenizer.ggml.scores")
    assert types[0] == gguf.TokenType.UNKNOWN and types[3 + 0xC3] == gguf.TokenType.BYTE
    assert types[tokenizer.convert_tokens_to_ids("<|im_end|>")] == gguf.TokenType.CONTROL
    first, second = (tokenizer.convert_tokens_to_ids("".join(m.split())) for m in _field(
        reader, "tokenizer.ggml.merges")[:2])
    assert scores[first] > scores[second], "earlier merges score higher"
    text = "What is the capital of France?  The capital of  France is Paris. 0123 ü"  # ü: byte fallback
    read_tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert read_tokenizer(text).input_ids == tokenizer(text).input_ids
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert read_tokenizer(chat, add_special_tokens=False).input_ids == tokenizer(
        chat, add_special_tokens=False).input_ids
    ids = torch.tensor([tokenizer(text).input_ids])
    torch.testing.assert_close(_logits(_read_back(path), ids), _logits(model, ids), rtol=1e-5, atol=1e-5)


def test_a_sentencepiece_style_tokenizer_that_splits_otherwise_is_refused(tmp_path):
    from finetune.testing import make_spm_tokenizer, tiny_config

    tokenizer = make_spm_tokenizer()
    tokenizer.backend_tokenizer.pre_tokenizer = _whitespace()
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer)))
    with pytest.raises(FinetuneError, match="sentencepiece-style tokenizer with pre-tokenizer") as err:
        write_gguf(model, tokenizer, tmp_path / "m.gguf")
    assert "convert_hf_to_gguf" in err.value.hint


def test_an_unknown_type_names_the_choices_and_how_to_make_k_quants(tmp_path, llama):
    model, tokenizer = llama
    with pytest.raises(FinetuneError, match="q8_0") as err:
        write_gguf(model, tokenizer, tmp_path / "m.gguf", qtype="q4_k_m")
    assert "llama-quantize" in err.value.hint


def test_gemma3_linear_rope_scaling_is_written_for_llama_cpp(tmp_path):
    """Gemma 3 4B and larger scale their global layers' positions linearly (factor 8): written as llama.cpp's
    rope scaling keys, the global base as the rope base."""
    model, tokenizer = _tiny(tmp_path, "gemma3_text")
    model.config.rope_parameters["full_attention"].update(rope_type="linear", factor=8.0)
    reader = gguf.GGUFReader(write_gguf(model, tokenizer, tmp_path / "m.gguf", qtype="f32"))
    assert _field(reader, "gemma3.rope.scaling.type") == "linear"
    assert _field(reader, "gemma3.rope.scaling.factor") == 8.0
    assert _field(reader, "gemma3.rope.freq_base") == model.config.rope_parameters["full_attention"]["rope_theta"]
