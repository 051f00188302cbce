"""GGUF export of the mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE: transformers' fused 3-D experts
split into llama.cpp's stacked per-projection tensors), of OLMo 2, Granite and SmolLM3, and of the rope scalings
llama.cpp reads as tensors (Llama 3.x's `llama3`, Phi-3's `longrope`).

Each file is checked against its source model: every tensor by name, shape and value in the layout llama.cpp's
convert_hf_to_gguf.py gives it, the metadata keys llama.cpp's loader reads for the architecture, transformers'
read-back where transformers reads the architecture (Qwen3-MoE), and llama.cpp's own logits where its library
(the llama-cpp-py-sync wheel) loads on this machine. What llama.cpp hard-codes and a config contradicts is
refused in one line, nothing written."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.errors import FinetuneError
from finetune.export.gguf import write_gguf
from finetune.recipe.families import family_for
from finetune.testing import make_tiny_model_dir

TEXT = "What is the capital of France? The capital of France is Paris. 0123456789 {}"
# Llama 3.1's rope (factor 8, low/high frequency factors 1 and 4) with its original context scaled down with the
# model (8192 -> 64, base 500000 -> 10000), so that these few positions feel each of its three bands
LLAMA3_ROPE = {"max_position_embeddings": 512, "rope_parameters": {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64}}
# Phi-3-mini-128k's LongRoPE: a context 4x the original one (131072 of 32768 there, 2048 of 512 here), one factor
# per rotary frequency for long contexts and one for short ones
LONGROPE = {"original_max_position_embeddings": 512, "rope_parameters": {
    "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(8)],
    "long_factor": [2.0 + i for i in range(8)]}}
# model_type: (GGUF architecture, the tiny model as the real checkpoints are, keys llama.cpp reads for it)
WRITTEN = {
    "qwen3_moe": ("qwen3moe", {"norm_topk_prob": True}, ("expert_count", "expert_used_count",
                                                          "expert_feed_forward_length")),
    "mixtral": ("llama", {}, ("expert_count", "expert_used_count")),
    # GLM-4.5-Air's biases, with expert groups, scaled routing and q/k norms on too
    "glm4_moe": ("glm4moe", {"attention_bias": True, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
                             "use_qk_norm": True},
                 ("expert_count", "expert_used_count", "expert_feed_forward_length", "expert_shared_count",
                  "leading_dense_block_count", "expert_gating_func", "expert_weights_scale", "expert_weights_norm",
                  "expert_group_count", "expert_group_used_count")),
    # DeepSeek-V3-style: latent attention, sigmoid router with its bias, expert groups, shared experts, and
    # DeepSeek-V3's YaRN long-context rotary (factor 40 there, 4 here: it moves these logits by 2.5)
    "deepseek_v3": ("deepseek2", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}, ("expert_count", "expert_used_count", "expert_feed_forward_length",
                                      "expert_shared_count", "leading_dense_block_count", "expert_gating_func",
                                      "attention.kv_lora_rank", "attention.q_lora_rank", "attention.key_length_mla",
                                      "attention.value_length_mla", "rope.scaling.type", "rope.scaling.factor",
                                      "rope.scaling.original_context_length", "rope.scaling.yarn_log_multiplier")),
    # gpt-oss: experts stored transposed with gate/up interleaved, expert and router biases, attention sinks,
    # YaRN (truncated: llama.cpp has no truncate=False, gpt-oss's; see docs/export.md)
    "gpt_oss": ("gpt-oss", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": True, "original_max_position_embeddings": 512}},
        ("expert_count", "expert_used_count", "expert_feed_forward_length", "attention.sliding_window",
         "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length")),
    "olmoe": ("olmoe", {"num_key_value_heads": 4}, ("expert_count", "expert_used_count")),
    "olmo2": ("olmo2", {}, ()),
    "granite": ("granite", {"attention_multiplier": 0.25, "embedding_multiplier": 12.0, "residual_multiplier": 0.5,
                            "logits_scaling": 4.0}, ("attention.scale", "embedding_scale", "residual_scale",
                                                     "logit_scale")),
    "smollm3": ("smollm3", {}, ()),
    # Ministral-8B's window is its whole context (32768 of 32768): llama.cpp's llama computes the same
    "ministral": ("llama", {"sliding_window": 2048}, ()),
    # LFM2 as its checkpoints are: the MLP width rounded from the config's by LFM2's own rule (192 -> 128)
    "lfm2": ("lfm2", {"block_auto_adjust_ff_dim": True, "intermediate_size": 192, "block_multiple_of": 32},
             ("shortconv.l_cache",)),
    # the rope scalings written as tensors (their other keys: none for llama3, as llama.cpp's converter writes)
    "llama": ("llama", LLAMA3_ROPE, ()),
    "phi3": ("phi3", LONGROPE, ("rope.scaling.original_context_length", "rope.scaling.attn_factor")),
}
COMMON_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
               "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base")


def test_every_family_written_to_gguf_is_checked():
    """Here, or in tests/test_export_gguf.py's round trips through transformers (the families written first), or
    (vision-language families, with their projector files) in tests/test_gguf_vision.py."""
    from finetune.recipe.families import FAMILIES
    from tests.test_export_gguf import READ_BACK as ROUND_TRIPS
    from tests.test_gguf_vision import WRITTEN_VISION

    checked = set(WRITTEN) | set(ROUND_TRIPS) | set(WRITTEN_VISION)
    assert [f.name for f in FAMILIES if f.gguf and not checked & set(f.model_types)] == []


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    """model_type -> (source model, tokenizer, f32 GGUF path)."""
    folder = tmp_path_factory.mktemp("families")
    result = {}
    for arch, (_, overrides, _) in WRITTEN.items():
        model_dir = make_tiny_model_dir(folder / arch, arch, **overrides)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        torch.manual_seed(1)
        for name, buffer in model.named_buffers():  # a trained router's bias (zeros at initialisation)
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.5)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        result[arch] = model, tokenizer, write_gguf(model, tokenizer, folder / f"{arch}.gguf", qtype="f32")
    return result


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rotary halves as interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _converter_rope_tensors(config) -> dict[str, np.ndarray]:
    """The rope tensors of llama.cpp's converter, step by step as it computes them (LlamaModel's rope_freqs for
    `llama3`, frequency by frequency in float32; Phi3MiniModel's long and short factors), from the rope's original
    context (the converter's from the config's top level: 8192, the rope's own in every published Llama 3.x)."""
    rope = config.rope_parameters
    if rope["rope_type"] == "longrope":
        return {f"rope_factors_{kind}.weight": np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
                for kind in ("long", "short")}
    dim = config.head_dim
    original, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    factors = []
    for freq in 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            factors.append(1)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": torch.tensor(factors, dtype=torch.float32).numpy()}


def _expected_tensors(model) -> dict[str, np.ndarray]:
    """The GGUF tensors llama.cpp's converter makes from this model, by name (numpy shapes, GGML's reversed)."""
    config = model.config
    arch = family_for(config.model_type).gguf
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.arch], config.num_hidden_layers)
    expected = _converter_rope_tensors(config) if config.rope_parameters.get("rope_type") in (
        "llama3", "longrope") else {}
    for name, tensor in model.state_dict().items():
        data = tensor.float().numpy()
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        layer = name.split(".")[2] if ".layers." in name else None
        if arch.interleaved_experts and "experts." in name:  # gpt-oss: [experts, in, out], gate/up alternating
            if name.endswith("gate_up_proj"):
                data = np.swapaxes(data, 1, 2)
            if "gate_up_proj" in name:
                kind = "bias" if name.endswith("_bias") else "weight"
                expected[f"blk.{layer}.ffn_gate_exps.{kind}"] = data[:, 0::2]
                expected[f"blk.{layer}.ffn_up_exps.{kind}"] = data[:, 1::2]
            else:
                kind = "bias" if name.endswith("_bias") else "weight"
                expected[f"blk.{layer}.ffn_down_exps.{kind}"] = data if kind == "bias" else np.swapaxes(data, 1, 2)
            continue
        if name.endswith("self_attn.sinks"):
            expected[f"blk.{layer}.attn_sinks.weight"] = data
            continue
        if name.endswith("experts.gate_up_proj"):  # [experts, 2 x ff, hidden]: gate rows, then up rows
            layer = name.split(".")[2]
            ff = data.shape[1] // 2
            expected[f"blk.{layer}.ffn_gate_exps.weight"] = data[:, :ff]
            expected[f"blk.{layer}.ffn_up_exps.weight"] = data[:, ff:]
            continue
        if name.endswith("experts.down_proj"):
            expected[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"] = data
            continue
        if name.endswith("kv_b_proj.weight"):  # llama.cpp's DeepseekV2Model: per head, k_b transposed
            heads, nope = config.num_attention_heads, config.qk_nope_head_dim
            kv_b = data.reshape(heads, nope + config.v_head_dim, data.shape[-1])
            expected[f"blk.{name.split('.')[2]}.attn_k_b.weight"] = np.swapaxes(kv_b[:, :nope], 1, 2)
            expected[f"blk.{name.split('.')[2]}.attn_v_b.weight"] = kv_b[:, nope:]
            continue
        if name.endswith("gate.e_score_correction_bias"):
            expected[f"blk.{name.split('.')[2]}.exp_probs_b.bias"] = data
            continue
        if name.endswith("conv.conv.weight"):  # LFM2's [channels, 1, width] convolution: squeezed to 2-D
            data = data[:, 0]
        if arch.permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _permute(data, config.num_attention_heads if "q_proj" in name else config.num_key_value_heads)
        expected[names.get_name(name, try_suffixes=(".weight", ".bias"))] = data
    return expected


@pytest.mark.parametrize("arch", list(WRITTEN))
def test_every_tensor_is_in_llama_cpp_layout_with_the_source_values(exported, arch):
    model, _, path = exported[arch]
    reader = gguf.GGUFReader(path)
    got = {t.name: np.asarray(t.data) for t in reader.tensors}
    expected = _expected_tensors(model)
    assert sorted(got) == sorted(expected)
    for name, data in expected.items():
        assert got[name].shape == data.shape, name
        np.testing.assert_array_equal(got[name], data.astype(np.float32), err_msg=name)
    if family_for(arch).moe:
        experts = next(getattr(model.config, a) for a in ("num_local_experts", "num_experts", "n_routed_experts")
                       if hasattr(model.config, a))
        last = model.config.num_hidden_layers - 1  # GLM-4-MoE's first layer is dense
        assert got[f"blk.{last}.ffn_gate_exps.weight"].shape[0] == experts  # stacked [experts, ff, hidden]


@pytest.mark.parametrize("arch", list(WRITTEN))
def test_the_metadata_llama_cpp_reads_is_the_configs(exported, arch):
    model, _, path = exported[arch]
    config = model.config
    name, _, extra = WRITTEN[arch]
    fields = gguf.GGUFReader(path).fields
    assert fields["general.architecture"].contents() == name
    missing = [k for k in (*COMMON_KEYS, *extra) if f"{name}.{k}" not in fields]
    assert not missing, missing
    value = {k: fields[f"{name}.{k}"].contents() for k in (*COMMON_KEYS, *extra)}
    assert value["block_count"] == config.num_hidden_layers
    # LFM2: llama.cpp tells its convolution layers by their zero KV heads; DeepSeek caches one latent KV head
    assert value["attention.head_count_kv"] == ([0, config.num_key_value_heads] if arch == "lfm2" else 1
                                                if arch == "deepseek_v3" else config.num_key_value_heads)
    if arch == "deepseek_v3":
        assert (value["attention.kv_lora_rank"], value["attention.key_length_mla"]) == (
            config.kv_lora_rank, config.qk_nope_head_dim + config.qk_rope_head_dim)
    if arch == "glm4_moe":
        assert (value["expert_gating_func"], value["expert_weights_scale"], value["leading_dense_block_count"],
                value["expert_group_count"]) == (gguf.ExpertGatingFuncType.SIGMOID, 2.5, 1, 2)
    if family_for(arch).moe:
        assert value["expert_used_count"] == config.num_experts_per_tok
        if arch == "qwen3_moe":
            assert value["expert_feed_forward_length"] == config.moe_intermediate_size
    if not family_for(arch).moe:  # the width the MLP weights have (Phi-3's gate and up rows fused)
        gate = {"lfm2": "feed_forward.w1", "phi3": "mlp.gate_up_proj"}.get(arch, "mlp.gate_proj")
        assert value["feed_forward_length"] == model.get_parameter(f"model.layers.0.{gate}.weight").shape[0] // (
            2 if arch == "phi3" else 1)
    if arch == "phi3":  # Phi3MiniModel's: the original context, LongRoPE's scale from the context ratio
        original = config.original_max_position_embeddings
        assert value["rope.scaling.original_context_length"] == original == 512
        assert value["rope.scaling.attn_factor"] == pytest.approx(math.sqrt(
            1 + math.log(config.max_position_embeddings / original) / math.log(original)), rel=1e-7)
    if arch == "llama":  # llama3 is the rope_freqs tensor alone: llama.cpp scales no other way
        assert not [k for k in fields if ".rope.scaling." in k]
    if arch == "granite":
        assert (value["attention.scale"], value["embedding_scale"], value["residual_scale"],
                value["logit_scale"]) == (0.25, 12.0, 0.5, 4.0)


# transformers' reader does not read Qwen3-MoE's expert width back (llama.cpp does, from
# expert_feed_forward_length) and builds Qwen3MoeConfig's default, 768: that model has that width.
READ_BACK = {"qwen3_moe": {"norm_topk_prob": True, "moe_intermediate_size": 768}, "lfm2": WRITTEN["lfm2"][1]}


@pytest.mark.parametrize("arch", list(READ_BACK))
def test_what_transformers_reads_back_has_equal_logits(tmp_path, arch):
    model_dir = make_tiny_model_dir(tmp_path / "model", arch, **READ_BACK[arch])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    path = write_gguf(model, tokenizer, tmp_path / "m.gguf", qtype="f32")
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def _rotary_from_file(path: Path, long: bool) -> tuple[torch.Tensor, float]:
    """The rotary frequencies and cos/sin scale llama.cpp computes from the file: the base frequencies divided by
    rope_freqs (llama3) or by the long or short LongRoPE factors, cos and sin times rope.scaling.attn_factor."""
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    dims = reader.fields[f"{arch}.rope.dimension_count"].contents()
    base = reader.fields[f"{arch}.rope.freq_base"].contents()
    tensors = {t.name: torch.from_numpy(np.array(t.data, dtype=np.float32)) for t in reader.tensors}
    factors = tensors.get("rope_freqs.weight", tensors.get(f"rope_factors_{'long' if long else 'short'}.weight"))
    scale = reader.fields.get(f"{arch}.rope.scaling.attn_factor")
    inv_freq = 1.0 / (factors * base ** (torch.arange(0, dims, 2, dtype=torch.int64).float() / dims))
    return inv_freq, scale.contents() if scale is not None else 1.0


@pytest.mark.parametrize(("arch", "length"), [("llama", 40), ("phi3", 40), ("phi3", 600)],
                         ids=["llama3", "longrope-short", "longrope-long"])
def test_rope_scaling_read_back_with_the_files_rotary_has_equal_logits(exported, arch, length):
    """transformers' GGUF reader reads the weights of these files but neither rope_freqs (llama) nor the LongRoPE
    factors and attn_factor (phi3): it builds an unscaled rope (logits several units off). So the check is the
    strongest one here without llama.cpp: the weights it reads back, with the rotary llama.cpp computes from the
    file's tensors and keys, give the model's logits. LongRoPE past the original context (512): the long factors,
    which llama.cpp takes for a context longer than that, transformers for a longer sequence."""
    model, _, path = exported[arch]
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    rotary = loaded.model.rotary_emb
    rotary.inv_freq, rotary.attention_scaling = _rotary_from_file(path, long=length > 512)
    ids = torch.randint(4, 400, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_llama3_rope_freqs_at_llama_3_1s_numbers_are_the_converters_and_give_transformers_frequencies(tmp_path):
    """With Llama-3.1-8B's rope (base 500000, head size 128, factor 8, original context 8192; a toy width), the
    file's rope_freqs are the converter's, value for value, and the base frequencies divided by them are the ones
    the model computes with."""
    model_dir = make_tiny_model_dir(tmp_path / "model", "llama", head_dim=128, max_position_embeddings=131072,
                                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8192})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    path = write_gguf(model, AutoTokenizer.from_pretrained(model_dir), tmp_path / "m.gguf", qtype="q8_0")
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "rope_freqs.weight")
    assert tensor.tensor_type == gguf.GGMLQuantizationType.F32  # whatever --type, as the converter keeps it
    factors = np.asarray(tensor.data)
    np.testing.assert_array_equal(factors, _converter_rope_tensors(model.config)["rope_freqs.weight"])
    assert factors.shape == (64,) and factors[0] == 1 and factors[-1] == 8 and 1 < factors[30] < 8
    inv_freq, scale = _rotary_from_file(path, long=False)
    torch.testing.assert_close(inv_freq, model.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    assert scale == 1.0


def _llama_cpp():
    """llama.cpp's library through the llama-cpp-py-sync wheel, or the reason it does not load here."""
    try:
        from llama_cpp_py_sync import Llama
        from llama_cpp_py_sync._cffi_bindings import get_lib
        get_lib()
    except (ImportError, RuntimeError, OSError) as exc:
        return None, f"llama.cpp's library does not load here ({str(exc)[:160]})"
    return Llama, ""


def _llama_cpp_logits(llama_class, path: Path, ids: list[int], n_ctx: int = 128) -> np.ndarray:
    """Every position's logits as llama.cpp computes them from the file, in a context of llama.cpp's own (n_ctx
    tokens) with an f32 KV cache and no embeddings output (the wheel's context keeps embeddings, and LFM2's graph
    then makes no logits)."""
    llm = llama_class(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=1)
    lib, ffi = llm._lib, llm._ffi
    params = lib.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
    params.n_threads = params.n_threads_batch = 1
    params.type_k = params.type_v = 0  # GGML_TYPE_F32
    params.embeddings = False
    params.flash_attn_type = 0  # off: its CPU kernel rounds through f16
    ctx = lib.llama_init_from_model(llm._model, params)
    batch = lib.llama_batch_init(len(ids), 0, 1)
    try:
        batch.n_tokens = len(ids)
        for i, token in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, 1
            batch.seq_id[i][0] = 0
        assert lib.llama_decode(ctx, batch) == 0
        return np.stack([np.frombuffer(ffi.buffer(lib.llama_get_logits_ith(ctx, i), 4 * llm.n_vocab),
                                       dtype=np.float32).copy() for i in range(len(ids))])
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        llm.close()


@pytest.mark.parametrize("arch", list(WRITTEN))
def test_llama_cpp_computes_the_models_logits_from_the_file(exported, arch):
    """The real consumer: llama.cpp loads the file, tokenizes as the tokenizer does and gives the same logits."""
    llama_class, why = _llama_cpp()
    if llama_class is None:
        pytest.skip(why)
    model, tokenizer, path = exported[arch]
    ids = tokenizer(TEXT).input_ids
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_llama_cpp_logits(llama_class, path, ids), reference, rtol=1e-4, atol=1e-4)


def test_llama_cpp_takes_longropes_long_factors_in_a_context_past_the_original_one(exported):
    """llama.cpp divides by the long LongRoPE factors where its context is longer than the original one (512
    here; the short ones in the 128-token context above): 600 tokens in a 1024-token context give the model's
    logits (transformers takes the long factors for a sequence past the original context)."""
    llama_class, why = _llama_cpp()
    if llama_class is None:
        pytest.skip(why)
    model, _, path = exported["phi3"]
    ids = torch.randint(4, 400, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_llama_cpp_logits(llama_class, path, ids, n_ctx=1024), reference, rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize(("arch", "overrides", "message"), [
    ("qwen3_moe", {"norm_topk_prob": False}, "norm_topk_prob=False, but llama.cpp's qwen3moe architecture "
                                              "always computes with True"),
    ("olmoe", {}, "num_key_value_heads=2 and num_attention_heads=4, but llama.cpp's olmoe architecture assumes"),
    ("smollm3", {"no_rope_layers": [1, 0]}, "layers without rotary position .* differ from llama.cpp's"),
    ("ministral", {}, "attends through a sliding window of 8 tokens within its 2048-token context, but "
                      "llama.cpp's llama architecture attends to the whole context"),
    ("mistral", {"sliding_window": 1024}, "sliding window of 1024 tokens"),
    ("gpt_oss", {"swiglu_limit": 5.0}, "gpt_oss model has swiglu_limit=5.0, but llama.cpp's gpt_oss architecture always computes "
                    "with 7.0"),
    ("gpt_oss", {"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window layers differ from "
                                                                          "llama.cpp's"),
    ("deepseek_v3", {"rope_interleave": False}, "rope_interleave=False, but llama.cpp's deepseek2 architecture"),
], ids=["qwen3moe-unnormalized-routing", "olmoe-grouped-query", "smollm3-rope-pattern", "ministral-window",
        "mistral-window", "gpt-oss-swiglu-limit", "gpt-oss-layer-pattern", "deepseek-rope-halves"])
def test_what_llama_cpp_would_compute_otherwise_is_refused_in_one_line(tmp_path, arch, overrides, message):
    model_dir = make_tiny_model_dir(tmp_path / arch, arch, **overrides)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with pytest.raises(FinetuneError, match=message) as err:
        write_gguf(model, AutoTokenizer.from_pretrained(model_dir), tmp_path / "m.gguf")
    assert "\n" not in err.value.message and err.value.exit_code == 2
    assert not (tmp_path / "m.gguf").exists()


def _trained(tmp_path: Path, arch: str, **overrides) -> Path:
    from finetune.recipe import validate_recipe
    from finetune.train.run import run
    from tests.run_support import sums_data, tiny_lora_recipe

    model_dir = make_tiny_model_dir(tmp_path / "model", arch, **overrides)
    recipe = tiny_lora_recipe(model_dir, sums_data(tmp_path / "sums.jsonl", 8), tmp_path / "run",
                              {"training": {"max_steps": 2, "micro_batch_size": 2, "learning_rate": 1e-2}})
    run(validate_recipe(recipe))
    return tmp_path / "run"


def test_a_trained_moe_run_exports_to_gguf_equal_to_its_merged_export(tmp_path, capsys):
    """`finetune export --format gguf` of a Qwen3-MoE LoRA run: the file transformers reads back computes what the
    merged safetensors export computes (the expert width transformers' reader assumes, as above)."""
    from finetune.cli import main

    run_dir = _trained(tmp_path, "qwen3_moe", **READ_BACK["qwen3_moe"])
    assert main(["export", str(run_dir), "--out", str(tmp_path / "merged")]) == 0
    assert main(["export", str(run_dir), "--out", str(tmp_path / "gguf"), "--format", "gguf", "--type", "f32"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", gguf_file="run.f32.gguf",
                                                  dtype=torch.float32).eval()
    ids = torch.randint(4, 400, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_exporting_a_family_not_written_is_one_line_exit_2_and_nothing_written(tmp_path, capsys):
    """Refused from the config alone, before minutes of loading and merging."""
    from finetune.cli import main

    run_dir = _trained(tmp_path, "gemma4_text")
    capsys.readouterr()
    assert main(["export", str(run_dir), "--out", str(tmp_path / "gguf"), "--format", "gguf"]) == 2
    out, err = capsys.readouterr()
    assert "merging the adapter" not in out
    assert "architecture 'gemma4_text' is not written to GGUF: its per-layer head sizes" in " ".join(
        err.split()) and "Traceback" not in err
    assert not (tmp_path / "gguf").exists()


def test_deepseek_v2s_softmax_router_is_refused_by_name(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "model", "deepseek_v3")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.model_type = "deepseek_v2"
    with pytest.raises(FinetuneError, match="DeepSeek-V2's softmax router is not written to GGUF yet"):
        write_gguf(model, AutoTokenizer.from_pretrained(model_dir), tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("qtype", ["f16", "q8_0", "q4_0"])
def test_stacked_experts_are_quantized_like_any_matrix(tmp_path, qtype):
    """The 3-D expert tensors go through the type's blocks row by row: the file read back equals the model whose
    matrices and expert stacks went through that rounding."""
    model_dir = make_tiny_model_dir(tmp_path / "model", "qwen3_moe", **READ_BACK["qwen3_moe"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    path = write_gguf(model, tokenizer, tmp_path / "m.gguf", qtype=qtype)
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type.name for t in reader.tensors if "_exps" in t.name} == {qtype.upper()}
    ggml = gguf.GGMLQuantizationType[qtype.upper()]

    def rounded(data: np.ndarray) -> np.ndarray:
        if ggml == gguf.GGMLQuantizationType.F16:
            return data.astype(np.float16).astype(np.float32)
        return gguf.quants.dequantize(gguf.quants.quantize(data, ggml), ggml)

    reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    reference.load_state_dict({k: torch.from_numpy(rounded(v.numpy())) if v.ndim >= 2 else v
                               for k, v in model.state_dict().items()})
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
