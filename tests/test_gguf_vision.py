"""GGUF export of a vision-language run: the language model as its text family plus llama.cpp's projector
file (mmproj-NAME.TYPE.gguf), read back with the gguf package's GGUFReader and checked tensor by tensor and key
by key against llama.cpp's converter layout, and, where llama.cpp's multimodal library loads, loaded by
llama.cpp, whose image embeddings and logits are compared with transformers'; families whose projector is not
written are refused in one line."""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import pytest

from finetune.cli import main
from finetune.recipe import validate_recipe
from finetune.testing import shape_task
from finetune.train.run import run
from tests.run_support import tiny_lora_recipe

# the vision-language model_types whose two files the tests here check, in the family table's order
WRITTEN_VISION = ("qwen2_5_vl", "gemma3", "qwen3_vl", "idefics3", "smolvlm", "mistral3")

# llama.cpp's sliding-window pattern for gemma3 (five local layers, then a global one) at toy size
GEMMA3_TEXT = {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
# Qwen2.5-VL's published RMSNorm epsilon, 1e-6 (llama.cpp's qwen2vl does not read the file's and takes 0; at the
# toy config's 1e-5 that alone moves its logits by 5e-4 of their largest value)
QWEN25VL_TEXT = {"rms_norm_eps": 1e-6}
# Qwen3-VL's rotary sections as llama.cpp interleaves them: it rotates a frequency pair past 3 x its section by
# a fourth position (0 for text), where transformers takes the time position, so the toy's [2, 3, 3] over 8
# pairs differs in one pair, and the published [24, 20, 20] over 64 in two of the slowest; [3, 3, 2] agrees
QWEN3VL_TEXT = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2],
                                    "mrope_interleaved": True}}

# The SigLIP tower's tensors (transformers' names inside model.vision_tower) and llama.cpp's names for them
VISION_NAMES = {
    "embeddings.patch_embedding.weight": "v.patch_embd.weight",
    "embeddings.patch_embedding.bias": "v.patch_embd.bias",
    "embeddings.position_embedding.weight": "v.position_embd.weight",
    "post_layernorm.weight": "v.post_ln.weight",
    "post_layernorm.bias": "v.post_ln.bias",
}
VISION_LAYER_NAMES = {
    "layer_norm1": "ln1", "layer_norm2": "ln2", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
}


def _read(path):
    import gguf

    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    return fields, tensors


def _projector(path, config, projector_type: str, vision_keys: dict) -> tuple[dict, dict]:
    """The projector file's (fields, tensors), after checking what llama.cpp reads from every one: the file
    type, the projector type, GELU, a vision encoder, the projection width (the text model's hidden size) and
    `vision_keys` (clip.vision.KEY: value)."""
    fields, tensors = _read(path)
    assert fields["general.architecture"] == "clip" and fields["general.type"] == "mmproj"
    assert fields["clip.projector_type"] == projector_type
    assert fields["clip.use_gelu"] is True and fields["clip.has_vision_encoder"] is True
    assert fields["clip.vision.projection_dim"] == config.text_config.hidden_size
    for key, value in vision_keys.items():
        assert fields[f"clip.vision.{key}"] == value, key
    return fields, tensors


def _siglip_keys(vision) -> dict:
    """The clip.vision sizes of a SigLIP tower (Gemma 3's, Idefics3's) as llama.cpp's converter writes them."""
    return {"image_size": vision.image_size, "patch_size": vision.patch_size, "embedding_length": vision.hidden_size,
            "feed_forward_length": vision.intermediate_size, "block_count": vision.num_hidden_layers,
            "attention.head_count": vision.num_attention_heads}


def _siglip_expected(weights: dict, prefix: str, layers: int) -> dict:
    """llama.cpp's names for a SigLIP tower's weights (under `prefix` in transformers' state dict)."""
    expected = {gguf_name: weights[f"{prefix}.{hf}"] for hf, gguf_name in VISION_NAMES.items()}
    for i in range(layers):
        for hf, short in VISION_LAYER_NAMES.items():
            for part in ("weight", "bias"):
                expected[f"v.blk.{i}.{short}.{part}"] = weights[f"{prefix}.encoder.layers.{i}.{hf}.{part}"]
    return expected


def _assert_written_f32(tensors: dict, expected: dict) -> None:
    """The file holds exactly the `expected` tensors (llama.cpp name: transformers' values), each F32 and equal."""
    import gguf

    assert set(tensors) == set(expected)
    for gguf_name, value in expected.items():
        assert tensors[gguf_name].tensor_type == gguf.GGMLQuantizationType.F32, gguf_name
        np.testing.assert_array_equal(_values(tensors[gguf_name]), value, err_msg=gguf_name)


def _values(tensor) -> np.ndarray:
    """A tensor's values in the layout transformers holds them (GGUF lists dimensions innermost first)."""
    return np.asarray(tensor.data, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))


def _llama_expected(weights: dict, text, prefix: str) -> dict:
    """llama.cpp's converter's tensors for a Llama-layout language model (its weights under `prefix` in
    transformers' state dict, the head outside): every layer's, the embedding, final norm and head, with the
    rotary q/k rows interleaved per head (its LlamaModel permute), as llama.cpp's llama and mistral3 read them."""
    from tests.test_gguf_families import _permute

    expected = {"token_embd.weight": weights[f"{prefix}embed_tokens.weight"],
                "output_norm.weight": weights[f"{prefix}norm.weight"], "output.weight": weights["lm_head.weight"]}
    for b in range(text.num_hidden_layers):
        layer = f"{prefix}layers.{b}"
        for hf, short in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                          ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                          ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")):
            expected[f"blk.{b}.{short}.weight"] = weights[f"{layer}.{hf}.weight"]
        for hf, short, heads in (("q_proj", "attn_q", text.num_attention_heads),
                                 ("k_proj", "attn_k", text.num_key_value_heads)):
            expected[f"blk.{b}.{short}.weight"] = _permute(weights[f"{layer}.self_attn.{hf}.weight"], heads)
    return expected


def _trained_run(tmp_path_factory, arch: str, **overrides):
    """A one-step LoRA run of a tiny random `arch` on the shape task."""
    from finetune.testing import vision_model

    folder = tmp_path_factory.mktemp(f"{arch}-run")
    model = vision_model(arch, folder / "model", **overrides)
    train, _ = shape_task(folder / "shapes", train=4, held_out=2)
    run(validate_recipe(tiny_lora_recipe(model, train, folder / "run",
                                         {"training": {"max_steps": 1, "micro_batch_size": 2}})))
    return folder / "run"


def _export(run_dir, out, qtype: str = "f32"):
    """`finetune export RUN --format gguf --type QTYPE`: (the projector file, the language model's file, the
    merged model they were written from, its weights as float32 arrays)."""
    from finetune.model.trained import load_run, merged_model

    assert main(["export", str(run_dir), "--out", str(out), "--format", "gguf", "--type", qtype]) == 0
    name = run_dir.resolve().name
    assert sorted(p.name for p in out.glob("*.gguf")) == [f"mmproj-{name}.{qtype}.gguf", f"{name}.{qtype}.gguf"]
    model = merged_model(*load_run(run_dir))[0]
    weights = {k: v.float().numpy() for k, v in model.state_dict().items()}
    return out / f"mmproj-{name}.{qtype}.gguf", out / f"{name}.{qtype}.gguf", model, weights


@pytest.fixture(scope="module")
def gemma3_run(tmp_path_factory):
    return _trained_run(tmp_path_factory, "gemma3", **GEMMA3_TEXT)


def test_a_gemma3_run_exports_its_language_model_and_projector_file(gemma3_run, tmp_path):
    import gguf

    projector, text, model, weights = _export(gemma3_run, tmp_path / "gguf")
    config, vision = model.config, model.config.vision_config
    fields, tensors = _projector(projector, config, "gemma3", _siglip_keys(vision))
    assert fields["clip.vision.image_mean"] == fields["clip.vision.image_std"] == [0.5, 0.5, 0.5]
    assert fields["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(vision.layer_norm_eps)
    # 56-pixel images of 14-pixel patches (4 x 4) pooled to 4 tokens: 2 x 2 patches per token, not llama.cpp's 4
    assert config.mm_tokens_per_image == 4 and fields["clip.vision.projector.scale_factor"] == 2

    expected = _siglip_expected(weights, "model.vision_tower", vision.num_hidden_layers)
    expected["mm.input_projection.weight"] = weights["model.multi_modal_projector.mm_input_projection_weight"]
    expected["mm.soft_emb_norm.weight"] = weights["model.multi_modal_projector.mm_soft_emb_norm.weight"] + 1
    assert set(tensors) == set(expected)  # the attention-pooling head llama.cpp does not use is left out
    for gguf_name, value in expected.items():
        tensor = tensors[gguf_name]
        forced_f16 = gguf_name == "mm.input_projection.weight"  # llama.cpp's converter keeps it F16
        assert tensor.tensor_type == (gguf.GGMLQuantizationType.F16 if forced_f16 else gguf.GGMLQuantizationType.F32)
        np.testing.assert_allclose(_values(tensor), value, rtol=1e-3 if forced_f16 else 0, atol=1e-4 if forced_f16
                                   else 0, err_msg=gguf_name)

    fields, tensors = _read(text)
    text = config.text_config
    assert fields["general.architecture"] == "gemma3" and fields["gemma3.block_count"] == text.num_hidden_layers
    assert fields["gemma3.embedding_length"] == text.hidden_size and fields["gemma3.vocab_size"] == text.vocab_size
    assert not any(n.startswith(("v.", "mm.")) for n in tensors)  # the vision part is only in the projector file
    np.testing.assert_array_equal(_values(tensors["token_embd.weight"]),
                                  weights["model.language_model.embed_tokens.weight"])
    np.testing.assert_array_equal(_values(tensors["output.weight"]), weights["lm_head.weight"])
    np.testing.assert_array_equal(_values(tensors["blk.5.attn_q.weight"]),
                                  weights["model.language_model.layers.5.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(_values(tensors["blk.0.attn_norm.weight"]),  # Gemma's norms stored as 1 + w
                                  weights["model.language_model.layers.0.input_layernorm.weight"] + 1)
    assert len(tensors) == len([k for k in weights if k.startswith("model.language_model.")]) + 1


@pytest.fixture(scope="module")
def qwen25vl_run(tmp_path_factory):
    return _trained_run(tmp_path_factory, "qwen2_5_vl", **QWEN25VL_TEXT)


def test_a_qwen25vl_run_exports_its_language_model_and_projector_file(qwen25vl_run, tmp_path):

    projector, text_file, model, weights = _export(qwen25vl_run, tmp_path / "gguf")
    config, vision = model.config, model.config.vision_config
    fields, tensors = _read(projector)
    assert fields["general.type"] == "mmproj" and fields["clip.projector_type"] == "qwen2.5vl_merger"
    assert fields["clip.use_silu"] is True and "clip.use_gelu" not in fields
    assert fields["clip.vision.projection_dim"] == config.text_config.hidden_size
    assert fields["clip.vision.block_count"] == vision.depth and fields["clip.vision.image_size"] == 560
    assert fields["clip.vision.attention.head_count"] == vision.num_heads
    full = vision.fullatt_block_indexes
    assert fields["clip.vision.n_wa_pattern"] == full[0] + 1
    assert fields["clip.vision.image_mean"] == pytest.approx([0.48145466, 0.4578275, 0.40821073])

    patch = weights["model.visual.patch_embed.proj.weight"]  # [out, channels, 2 frames, h, w]
    expected = {"v.patch_embd.weight": patch[:, :, 0], "v.patch_embd.weight.1": patch[:, :, 1],
                "v.post_ln.weight": weights["model.visual.merger.ln_q.weight"]}
    for i in (0, 2):
        for part in ("weight", "bias"):
            expected[f"mm.{i}.{part}"] = weights[f"model.visual.merger.mlp.{i}.{part}"]
    for b in range(vision.depth):
        layer = f"model.visual.blocks.{b}"
        for hf, short in (("norm1", "ln1"), ("norm2", "ln2")):
            expected[f"v.blk.{b}.{short}.weight"] = weights[f"{layer}.{hf}.weight"]
        for part in ("weight", "bias"):
            q, k, v = np.split(weights[f"{layer}.attn.qkv.{part}"], 3)  # the fused rows: q, then k, then v
            expected.update({f"v.blk.{b}.attn_q.{part}": q, f"v.blk.{b}.attn_k.{part}": k,
                             f"v.blk.{b}.attn_v.{part}": v,
                             f"v.blk.{b}.attn_out.{part}": weights[f"{layer}.attn.proj.{part}"]})
            for hf, short in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                expected[f"v.blk.{b}.{short}.{part}"] = weights[f"{layer}.mlp.{hf}.{part}"]
    _assert_written_f32(tensors, expected)

    fields, tensors = _read(text_file)
    assert fields["general.architecture"] == "qwen2vl"
    sections = config.text_config.rope_parameters["mrope_section"]
    assert fields["qwen2vl.rope.dimension_sections"] == [*sections, 0]  # llama.cpp reads four
    assert not any(n.startswith(("v.", "mm.")) for n in tensors)
    np.testing.assert_array_equal(_values(tensors["blk.1.attn_k.bias"]),
                                  weights["model.language_model.layers.1.self_attn.k_proj.bias"])
    np.testing.assert_array_equal(_values(tensors["output.weight"]), weights["lm_head.weight"])


def test_ollama_is_refused_for_a_vision_run_in_one_line(gemma3_run, tmp_path, capsys):
    capsys.readouterr()
    out = tmp_path / "ollama"
    assert main(["export", str(gemma3_run), "--out", str(out), "--format", "gguf", "--ollama"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "Traceback" not in err and "--mmproj" in err and not out.exists()


@pytest.fixture(scope="module")
def qwen3vl_run(tmp_path_factory):
    return _trained_run(tmp_path_factory, "qwen3_vl", **QWEN3VL_TEXT)


def _qwen3vl_expected(weights: dict, vision) -> dict:
    """llama.cpp's converter's Qwen3-VL projector tensors from transformers' weights: the two-frame patch
    embedding split in two, the fused qkv kept, the merger as v.post_ln / mm.0 / mm.2, and the k-th deepstack
    merger named after its vision layer (the k-th of deepstack_visual_indexes)."""
    def visual(name):
        return weights[f"model.visual.{name}"]

    patch = visual("patch_embed.proj.weight")  # [out, channels, 2 frames, h, w]
    expected = {"v.patch_embd.weight": patch[:, :, 0], "v.patch_embd.weight.1": patch[:, :, 1],
                "v.patch_embd.bias": visual("patch_embed.proj.bias"),
                "v.position_embd.weight": visual("pos_embed.weight")}
    for part in ("weight", "bias"):
        for hf, gguf_name in (("norm", "v.post_ln"), ("linear_fc1", "mm.0"), ("linear_fc2", "mm.2")):
            expected[f"{gguf_name}.{part}"] = visual(f"merger.{hf}.{part}")
        for k, layer in enumerate(vision.deepstack_visual_indexes):
            for hf, short in (("norm", "norm"), ("linear_fc1", "fc1"), ("linear_fc2", "fc2")):
                expected[f"v.deepstack.{layer}.{short}.{part}"] = visual(f"deepstack_merger_list.{k}.{hf}.{part}")
        for b in range(vision.depth):
            for hf, short in (("norm1", "ln1"), ("norm2", "ln2"), ("attn.qkv", "attn_qkv"), ("attn.proj", "attn_out"),
                              ("mlp.linear_fc1", "ffn_up"), ("mlp.linear_fc2", "ffn_down")):
                expected[f"v.blk.{b}.{short}.{part}"] = visual(f"blocks.{b}.{hf}.{part}")
    return expected


def test_a_qwen3vl_run_exports_its_language_model_and_projector_file(qwen3vl_run, tmp_path):
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    projector, text_file, model, weights = _export(qwen3vl_run, tmp_path / "gguf")
    config, vision = model.config, model.config.vision_config
    # no image_size in the config: the converter's is the square the 8 x 8 learned position grid covers
    assert vision.num_position_embeddings == 64
    fields, tensors = _projector(projector, config, "qwen3vl_merger", {
        "image_size": 8 * vision.patch_size, "patch_size": vision.patch_size, "embedding_length": vision.hidden_size,
        "feed_forward_length": vision.intermediate_size, "block_count": vision.depth,
        "attention.head_count": vision.num_heads, "spatial_merge_size": vision.spatial_merge_size})
    # the tower's norms take the text model's epsilon, as llama.cpp's converter writes it
    assert fields["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(config.text_config.rms_norm_eps)
    assert vision.deepstack_visual_indexes == [0] and fields["clip.vision.is_deepstack_layers"] == [True, False]
    assert fields["clip.vision.image_mean"] == pytest.approx(OPENAI_CLIP_MEAN)  # the run's image processor's
    assert fields["clip.vision.image_std"] == pytest.approx(OPENAI_CLIP_STD)

    expected = _qwen3vl_expected(weights, vision)
    _assert_written_f32(tensors, expected)

    fields, tensors = _read(text_file)
    text = config.text_config
    assert fields["general.architecture"] == "qwen3vl" and fields["qwen3vl.block_count"] == text.num_hidden_layers
    assert fields["qwen3vl.n_deepstack_layers"] == len(vision.deepstack_visual_indexes) == 1
    sections = text.rope_parameters["mrope_section"]
    assert fields["qwen3vl.rope.dimension_sections"] == [*sections, 0]  # llama.cpp reads four
    assert fields["qwen3vl.attention.key_length"] == fields["qwen3vl.attention.value_length"] == text.head_dim
    assert not any(n.startswith(("v.", "mm.")) for n in tensors)
    for gguf_name, hf in (("token_embd.weight", "embed_tokens.weight"),
                          ("blk.1.attn_q_norm.weight", "layers.1.self_attn.q_norm.weight"),
                          ("blk.1.attn_k_norm.weight", "layers.1.self_attn.k_norm.weight"),
                          ("blk.0.attn_q.weight", "layers.0.self_attn.q_proj.weight"),  # Qwen: no rotary permute
                          ("blk.0.ffn_gate.weight", "layers.0.mlp.gate_proj.weight")):
        np.testing.assert_array_equal(_values(tensors[gguf_name]), weights[f"model.language_model.{hf}"],
                                      err_msg=gguf_name)
    np.testing.assert_array_equal(_values(tensors["output.weight"]), weights["lm_head.weight"])
    assert len(tensors) == len([k for k in weights if k.startswith("model.language_model.")]) + 1


def _f16_types(run_dir, out) -> dict:
    """The GGML type names of an f16 export's projector tensors, after checking its 1-D ones (norms, biases)
    are F32 as llama.cpp's converter keeps them."""
    _, tensors = _read(_export(run_dir, out, "f16")[0])
    types = {name: tensor.tensor_type.name for name, tensor in tensors.items()}
    assert all(types[name] == "F32" for name, tensor in tensors.items() if len(tensor.shape) == 1)
    return types


def test_a_qwen3vl_f16_projector_keeps_the_types_llama_cpp_converter_forces(qwen3vl_run, tmp_path):
    types = _f16_types(qwen3vl_run, tmp_path / "gguf")
    assert types["v.position_embd.weight"] == "F32"  # position embeddings always F32
    assert types["v.patch_embd.weight"] == types["v.patch_embd.weight.1"] == "F16"  # F16 in an f16 file
    assert types["v.blk.0.attn_qkv.weight"] == types["mm.0.weight"] == types["v.deepstack.0.fc2.weight"] == "F16"


def test_each_qwen3vl_deepstack_merger_is_named_after_its_vision_layer(tmp_path):
    """deepstack_visual_indexes [1, 2] of three vision layers: merger k is written as v.deepstack.(its layer)."""
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from finetune.export.gguf_vision import write_projector
    from finetune.testing import tiny_config, vision_model

    config = tiny_config("qwen3_vl")
    config.vision_config.depth, config.vision_config.deepstack_visual_indexes = 3, [1, 2]
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    processor = AutoImageProcessor.from_pretrained(vision_model("qwen3_vl", tmp_path / "model"))
    fields, tensors = _read(write_projector(model, processor, tmp_path / "mmproj.gguf", qtype="f32"))
    assert fields["clip.vision.is_deepstack_layers"] == [False, True, True]
    weights = {k: v.float().numpy() for k, v in model.state_dict().items()}
    expected = _qwen3vl_expected(weights, config.vision_config)
    assert {n for n in tensors if n.startswith("v.deepstack.")} == {n for n in expected if n.startswith("v.deepstack.")}
    np.testing.assert_array_equal(_values(tensors["v.deepstack.1.fc1.weight"]),
                                  weights["model.visual.deepstack_merger_list.0.linear_fc1.weight"])
    np.testing.assert_array_equal(_values(tensors["v.deepstack.2.norm.bias"]),
                                  weights["model.visual.deepstack_merger_list.1.norm.bias"])


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def idefics3_run(request, tmp_path_factory):
    return _trained_run(tmp_path_factory, request.param)


def test_an_idefics3_run_exports_its_language_model_and_projector_file(idefics3_run, tmp_path):

    projector, text_file, model, weights = _export(idefics3_run, tmp_path / "gguf")
    config, vision = model.config, model.config.vision_config
    fields, tensors = _projector(projector, config, "idefics3", _siglip_keys(vision))
    assert fields["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(vision.layer_norm_eps)
    assert config.scale_factor == 2 and fields["clip.vision.projector.scale_factor"] == 2
    # the image processor's longest edge (112 pixels), not the tile size (56): llama.cpp resizes to it first
    assert fields["clip.vision.preproc_image_size"] == 112 != vision.image_size
    assert fields["clip.vision.image_mean"] == fields["clip.vision.image_std"] == [0.5, 0.5, 0.5]

    expected = _siglip_expected(weights, "model.vision_model", vision.num_hidden_layers)
    # the connector: the pixel shuffle has no weights, its modality projection (no bias) is mm.model.fc
    expected["mm.model.fc.weight"] = weights["model.connector.modality_projection.proj.weight"]
    _assert_written_f32(tensors, expected)

    fields, tensors = _read(text_file)
    text = config.text_config
    assert fields["general.architecture"] == "llama" and fields["llama.block_count"] == text.num_hidden_layers
    assert fields["llama.embedding_length"] == text.hidden_size and fields["llama.vocab_size"] == text.vocab_size
    _assert_written_f32(tensors, _llama_expected(weights, text, "model.text_model."))


def test_an_idefics3_f16_projector_keeps_its_embeddings_f32(idefics3_run, tmp_path):
    types = _f16_types(idefics3_run, tmp_path / "gguf")
    assert types["v.patch_embd.weight"] == types["v.position_embd.weight"] == "F32"  # the converter forces them
    assert types["v.blk.0.attn_q.weight"] == types["mm.model.fc.weight"] == "F16"


def test_a_vision_architecture_without_a_projector_writer_is_refused_naming_why():
    """Every vision-language family whose projector file is not written (none where every one is) and an
    architecture no family describes: one line naming it, why, and the ones written."""
    from types import SimpleNamespace

    from finetune.errors import UsageError
    from finetune.export.gguf_vision import check_vision_exportable
    from finetune.recipe.families import FAMILIES

    unwritten = [(t, f.no_gguf) for f in FAMILIES if f.vision and not f.vision.projector for t in f.model_types]
    for model_type, why in [*unwritten, ("llava", "no model family describes it")]:
        with pytest.raises(UsageError) as refused:
            check_vision_exportable(SimpleNamespace(model_type=model_type))
        line = str(refused.value).splitlines()[0]  # the reason, then the hint
        assert f"{model_type!r}" in line and why in line, line
        assert f"(vision-language ones written: {', '.join(WRITTEN_VISION)})" in line


def _projector_refusal(tmp_path, arch: str, **vision) -> str:
    """The UsageError write_projector raises for a tiny random `arch` whose vision config has `vision`, after
    checking that no projector file was left behind."""
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from finetune.errors import UsageError
    from finetune.export.gguf_vision import write_projector
    from finetune.testing import tiny_config, vision_model

    config = tiny_config(arch)
    for key, value in vision.items():
        setattr(config.vision_config, key, value)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    processor = AutoImageProcessor.from_pretrained(vision_model(arch, tmp_path / "model"))
    with pytest.raises(UsageError) as refused:
        write_projector(model, processor, tmp_path / "mmproj.gguf")
    assert not (tmp_path / "mmproj.gguf").exists()
    return str(refused.value)


def test_a_qwen3vl_whose_patches_span_other_than_two_frames_is_refused_in_one_line(tmp_path):
    assert "qwen3_vl model's patches span 3 frames; llama.cpp's projector takes two" in _projector_refusal(
        tmp_path, "qwen3_vl", temporal_patch_size=3)


# llama.cpp itself: the two files loaded by its multimodal library (libmtmd, through the llama-cpp-py-sync wheel),
# one image encoded, and the image embeddings it hands the language model compared with transformers'.

# an image size (width, height) per family that llama.cpp's preprocessing and the tiny model's image processor both take as it
# is (no resize, so both see the same pixels): Gemma 3's 56-pixel square; for Qwen-VL a size within the
# processor's pixel range and at or above llama.cpp's fixed minimum of 8 image tokens (Qwen2.5-VL's 6 x 2 merged
# patches wider than one 112-pixel window, so that its window attention is exercised);
# for Idefics3 the processor's longest edge, cut into 2 x 2 tiles (the whole-image tile is downscaled by each
# with its own filter); for Mistral 3 whole 28-pixel blocks (patch times spatial merge, which each rounds to)
# within the 112-pixel longest edge, not square, so that rows and their breaks are told apart
LLAMA_CPP_IMAGE = {"gemma3": (56, 56), "qwen2_5_vl": (168, 56), "qwen3_vl": (128, 96), "idefics3": (112, 112),
                   "smolvlm": (112, 112), "mistral3": (112, 84)}

# llama.cpp's CPU GELU reads a float16 table (GGML_GELU_FP16) and Gemma 3's input projection is F16 in every file
# (its converter forces it): its image embeddings agree with transformers' to a few parts in ten thousand of their
# largest value, not to float32 rounding, and so do the logits after them, but for Qwen2.5-VL's two parts in a
# thousand (llama.cpp's qwen2vl language model takes 0 for the RMSNorm epsilon; see
# benchmarks/results/gguf_vision_llamacpp.txt)
EMBEDDING_RTOL, LOGITS_RTOL = 2e-3, 5e-3


def _mtmd():
    """(llama.cpp's library, its multimodal library, their cffi) through the llama-cpp-py-sync wheel, with
    llama.cpp's log silenced, or (None, the reason they do not load here)."""
    try:
        from llama_cpp_py_sync._cffi_bindings import get_ffi, get_lib, get_mtmd_lib
        lib, mtmd, ffi = get_lib(), get_mtmd_lib(), get_ffi()
    except (ImportError, RuntimeError, OSError) as exc:
        return None, f"llama.cpp's multimodal library does not load here ({str(exc)[:400]})"
    if not _LOG_SINK:
        _LOG_SINK.append(ffi.callback("void(enum ggml_log_level, const char *, void *)", lambda *_: None))
    for set_log in (lib.llama_log_set, mtmd.mtmd_log_set, mtmd.mtmd_helper_log_set):
        set_log(_LOG_SINK[0], ffi.NULL)
    return (lib, mtmd, ffi), ""


_LOG_SINK: list = []  # the callback llama.cpp logs to, alive as long as the library may call it


def llama_cpp_image_prompt(libs, text_file, projector, image: np.ndarray, prompt: str = "",
                           embeddings: np.ndarray | None = None) -> tuple[list, list, np.ndarray]:
    """What llama.cpp makes of `image` (height x width x RGB bytes) followed by `prompt`, from the language
    model's file and the projector file: (the image embeddings it hands its language model, one [tokens, width]
    array per image chunk (Idefics3: one per tile, then the whole image), width the language model's input
    width (Qwen3-VL's deepstack features after its hidden size); the prompt as its chunks, a text chunk's token
    ids or an image chunk's token count; the last position's logits, in a context with an f32 KV cache and
    flash attention off, the language model given `embeddings` (all image tokens' rows) in place of its own
    where they are given)."""
    with _zeroed_allocations():
        return _llama_cpp_image_prompt(libs, text_file, projector, image, prompt, embeddings)


M_PERTURB = -6  # glibc's mallopt parameter (malloc.h)


@contextlib.contextmanager
def _zeroed_allocations():
    """Within it, memory glibc's malloc hands out is zeroed (its M_PERTURB byte 0xff: freshly allocated bytes are
    filled with 0xff ^ 0xff): llama.cpp's pixtral graph makes the rows it appends [IMG_BREAK]'s embedding to by
    scaling a tensor it never wrote by 0, so where that memory held NaN (heap reused after training in the same
    process) those rows, and every logit after them, are NaN; zeroed, as in the fresh pages a full-size model's
    compute buffer gets, they are the embedding itself."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(M_PERTURB, 0xFF)
    try:
        yield
    finally:
        if mallopt is not None:
            mallopt(M_PERTURB, 0)


def _llama_cpp_image_prompt(libs, text_file, projector, image: np.ndarray, prompt: str,
                            embeddings: np.ndarray | None) -> tuple[list, list, np.ndarray]:
    lib, mtmd, ffi = libs
    params = lib.llama_model_default_params()
    params.n_gpu_layers = 0
    model = lib.llama_model_load_from_file(str(text_file).encode(), params)
    assert model != ffi.NULL, f"llama.cpp does not load {text_file}"
    context_params = mtmd.mtmd_context_params_default()
    context_params.use_gpu, context_params.n_threads, context_params.warmup = False, 1, False
    context_params.flash_attn_type = 0  # off
    ctx = mtmd.mtmd_init_from_file(str(projector).encode(), model, context_params)
    pixels = np.ascontiguousarray(image, dtype=np.uint8)
    bitmap = mtmd.mtmd_bitmap_init(pixels.shape[1], pixels.shape[0], ffi.from_buffer(pixels))
    chunks = mtmd.mtmd_input_chunks_init()
    llama_params = lib.llama_context_default_params()
    llama_params.n_ctx = llama_params.n_batch = llama_params.n_ubatch = 256
    llama_params.n_threads = llama_params.n_threads_batch = 1
    llama_params.type_k = llama_params.type_v = 0  # GGML_TYPE_F32
    llama_params.flash_attn_type, llama_params.embeddings = 0, False
    lctx = lib.llama_init_from_model(model, llama_params)
    try:
        assert ctx != ffi.NULL, f"llama.cpp's multimodal library does not load {projector}"
        text = ffi.string(mtmd.mtmd_default_marker()) + prompt.encode()
        marked = ffi.new("char[]", text)
        parts = ffi.new("struct mtmd_input_text *", {"text": marked, "text_len": len(text), "add_special": False,
                                                     "parse_special": True})
        assert mtmd.mtmd_tokenize(ctx, chunks, parts, ffi.new("mtmd_bitmap *[1]", [bitmap]), 1) == 0
        width, ours, layout, n_past = lib.llama_model_n_embd_inp(model), [], [], ffi.new("llama_pos *")
        given = iter(() if embeddings is None else np.ascontiguousarray(embeddings, dtype=np.float32))
        last = mtmd.mtmd_input_chunks_size(chunks) - 1
        for i in range(last + 1):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                assert mtmd.mtmd_encode_chunk(ctx, chunk) == 0
                ours.append(np.frombuffer(ffi.buffer(mtmd.mtmd_get_output_embd(ctx), 4 * n * width),
                                          dtype=np.float32).reshape(n, width).copy())
                decoded = np.stack([next(given) for _ in range(n)]) if embeddings is not None else ours[-1]
                assert mtmd.mtmd_helper_decode_image_chunk(ctx, lctx, chunk, ffi.from_buffer("float[]", decoded),
                                                           n_past[0], 0, 256, n_past, ffi.NULL, ffi.NULL) == 0
                layout.append(n)
            else:
                tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ffi.new("size_t *"))
                layout.append([tokens[j] for j in range(n)])
                assert mtmd.mtmd_helper_eval_chunk_single(ctx, lctx, chunk, n_past[0], 0, 256, i == last, n_past) == 0
        vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        logits = np.frombuffer(ffi.buffer(lib.llama_get_logits_ith(lctx, -1), 4 * vocab), dtype=np.float32).copy()
        return ours, layout, logits
    finally:
        lib.llama_free(lctx)
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
        if ctx != ffi.NULL:
            mtmd.mtmd_free(ctx)
        lib.llama_model_free(model)


def transformers_image_prompt(model, image_processor, image: np.ndarray, layout: list | None = None):
    """transformers' side of llama_cpp_image_prompt: (the model's image features for `image` as its image
    processor prepares it, [tokens, width] in the order of its image tokens (Idefics3: tile by tile, the whole
    image last), Qwen3-VL's deepstack features after the hidden size as llama.cpp lays them out, Pixtral's with
    [IMG_BREAK]'s embedding after each row but the last as llama.cpp appends it; with `layout` (llama.cpp's
    chunks: token ids, or an image's token count, written as the model's image token, Pixtral's rows with their
    breaks), the last position's logits, else None)."""
    import inspect

    import torch
    from PIL import Image

    inputs = dict(image_processor(images=[Image.fromarray(image)], return_tensors="pt"))
    accepted = inspect.signature(model.get_image_features).parameters
    with torch.no_grad():
        out = model.get_image_features(**{k: v for k, v in inputs.items() if k in accepted})

    def rows(features):
        features = torch.cat(list(features)) if isinstance(features, (list, tuple)) else features
        return features.reshape(-1, features.shape[-1]).float().numpy()

    features = np.hstack([rows(out.pooler_output), *map(rows, getattr(out, "deepstack_features", None) or ())])
    config = model.config
    image_token = config.image_token_id if getattr(config, "image_token_id", None) is not None \
        else config.image_token_index
    image_ids = None  # an image chunk's ids: as many image tokens as it counts, but Pixtral's below
    if getattr(config, "image_break_token_id", None) is not None:  # Pixtral: a break after each row but the last
        block = config.vision_config.patch_size * config.spatial_merge_size
        height, width = (int(n) // block for n in inputs["image_sizes"][0])
        row_break = model.get_input_embeddings().weight[config.image_break_token_id].detach().float().numpy()
        features = np.vstack([part for r in range(height) for part in (
            features[r * width:(r + 1) * width], *([row_break[None]] if r < height - 1 else []))])
        image_ids = ([image_token] * width + [config.image_break_token_id]) * height
        image_ids.pop()
    if layout is None:
        return features, None
    ids = [t for part in layout for t in (part if isinstance(part, list) else image_ids or [image_token] * part)]
    inputs.pop("num_crops", None)
    ids = torch.tensor([ids])
    # which tokens are the image's, as the full processor returns them: Qwen-VL's multimodal rotary positions,
    # Gemma 3's bidirectional attention within an image
    accepted = inspect.signature(model.forward).parameters
    for key in ("mm_token_type_ids", "token_type_ids"):
        if key in accepted:
            inputs[key] = (ids == image_token).long()
    with torch.no_grad():
        logits = model(input_ids=ids, **inputs).logits[0, -1]
    return features, logits.float().numpy()


def llama_cpp_comparison(run_dir, out, seed: int = 0, prompt: str = "What colour is the shape?",
                         qtype: str = "f32") -> dict:
    """Export `run_dir` to GGUF (`qtype`) and give one random image of LLAMA_CPP_IMAGE's size for its model, then
    `prompt`, to llama.cpp and to transformers: {"error": max |llama.cpp - transformers| of the image embeddings
    over the tokens both take from the same pixels, "scale": their largest |value|, "tokens": how many,
    "other_image": max |transformers(image) - transformers(another image)| (how far apart a wrong encoding
    could land), "logits_error" / "logits_scale": the same for the last position's logits after the image and prompt}."""
    from transformers import AutoImageProcessor

    from finetune.model.trained import load_run

    libs, why = _mtmd()
    if libs is None:
        pytest.skip(why)
    projector, text_file, model, _ = _export(run_dir, out, qtype)
    model.eval()
    processor = AutoImageProcessor.from_pretrained(load_run(run_dir)[0].model.path)
    width, height = LLAMA_CPP_IMAGE[model.config.model_type]
    image, other = np.random.default_rng(seed).integers(0, 256, (2, height, width, 3), dtype=np.uint8)
    ours, layout, our_logits = llama_cpp_image_prompt(libs, text_file, projector, image, prompt)
    theirs, their_logits = transformers_image_prompt(model, processor, image, layout)
    ours = np.concatenate(ours)
    assert ours.shape == theirs.shape
    given_theirs = llama_cpp_image_prompt(libs, text_file, projector, image, prompt, theirs)[2]
    return {"error": float(np.abs(ours - theirs).max()), "scale": float(np.abs(theirs).max()), "tokens": len(ours),
            "other_image": float(np.abs(transformers_image_prompt(model, processor, other)[0] - theirs).max()),
            "logits_error": float(np.abs(our_logits - their_logits).max()),
            "logits_scale": float(np.abs(their_logits).max()),
            "language_model_error": float(np.abs(given_theirs - their_logits).max())}

def _assert_llama_cpp_encodes_as_transformers(run_dir, out) -> None:
    result = llama_cpp_comparison(run_dir, out)
    assert result["tokens"] > 0 and result["error"] <= EMBEDDING_RTOL * result["scale"], result
    assert result["other_image"] > 10 * result["error"], result  # the comparison tells images apart
    assert result["logits_error"] <= LOGITS_RTOL * result["logits_scale"], result
    assert result["language_model_error"] <= LOGITS_RTOL * result["logits_scale"], result


@pytest.mark.parametrize("run_fixture", ["gemma3_run", "qwen25vl_run", "qwen3vl_run"])
def test_llama_cpp_encodes_an_image_from_the_two_files_as_transformers_does(run_fixture, request, tmp_path):
    """The real consumer: llama.cpp's multimodal library loads the language model's file and the projector file,
    turns one image into the embeddings transformers' model gives for it, token for token, and gives the
    model's logits after the image and a prompt."""
    _assert_llama_cpp_encodes_as_transformers(request.getfixturevalue(run_fixture), tmp_path / "gguf")


def test_llama_cpp_encodes_an_idefics3_image_tile_by_tile_as_transformers_does(idefics3_run, tmp_path):
    _assert_llama_cpp_encodes_as_transformers(idefics3_run, tmp_path / "gguf")


def test_a_qwen25vl_whose_vision_windows_llama_cpp_cannot_hold_is_refused_in_one_line(tmp_path):
    """llama.cpp's Qwen2.5-VL projector attends within 112-pixel windows whatever the file says: a model with
    other windows would encode images differently there, so its projector file is refused."""
    assert "Qwen2.5-VL's vision windows are 56 pixels; llama.cpp's projector attends within 112-pixel" in (
        _projector_refusal(tmp_path, "qwen2_5_vl", window_size=56))


# Mistral 3's two text models: Mistral Small 3.1/3.2's mistral, Ministral 3's ministral3 (YaRN rotary and
# position-scaled queries); both with the 1e-5 RMSNorm epsilon llama.cpp's pixtral graph uses for the projector norm.
# Ministral 3's original context is 16 positions, so that the llama.cpp comparison's image and prompt (22) cross
# it: its queries are scaled from there on (by 1 + beta x log(1 + floor(position / 16)))
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "llama_4_scaling_beta": 0.1}
MISTRAL3_TEXT = {"mistral": {"rms_norm_eps": 1e-5},
                 "ministral3": {"rms_norm_eps": 1e-5, "model_type": "ministral3", "head_dim": 16,
                                "rope_parameters": MINISTRAL3_ROPE}}


@pytest.fixture(scope="module", params=list(MISTRAL3_TEXT))
def mistral3_run(request, tmp_path_factory):
    return _trained_run(tmp_path_factory, "mistral3", **MISTRAL3_TEXT[request.param])


def _pixtral_expected(weights: dict, vision, break_id: int) -> dict:
    """llama.cpp's converter's pixtral projector tensors from transformers' weights: the tower's q and k rows
    interleaved per head (its Llama permute), the projector's norm, patch merger and two layers, and the
    [IMG_BREAK] token's row of the language model's embedding."""
    from tests.test_gguf_families import _permute

    def tower(name):
        return weights[f"model.vision_tower.{name}"]

    projector = "model.multi_modal_projector"
    expected = {"v.patch_embd.weight": tower("patch_conv.weight"), "v.pre_ln.weight": tower("ln_pre.weight"),
                "mm.input_norm.weight": weights[f"{projector}.norm.weight"],
                "mm.patch_merger.weight": weights[f"{projector}.patch_merger.merging_layer.weight"],
                "mm.1.weight": weights[f"{projector}.linear_1.weight"],
                "mm.2.weight": weights[f"{projector}.linear_2.weight"],
                "v.token_embd.img_break": weights["model.language_model.embed_tokens.weight"][break_id]}
    for b in range(vision.num_hidden_layers):
        layer = f"transformer.layers.{b}"
        for hf, short in (("attention_norm", "ln1"), ("ffn_norm", "ln2"), ("attention.v_proj", "attn_v"),
                          ("attention.o_proj", "attn_out"), ("feed_forward.gate_proj", "ffn_gate"),
                          ("feed_forward.up_proj", "ffn_up"), ("feed_forward.down_proj", "ffn_down")):
            expected[f"v.blk.{b}.{short}.weight"] = tower(f"{layer}.{hf}.weight")
        for hf, short in (("q_proj", "attn_q"), ("k_proj", "attn_k")):
            expected[f"v.blk.{b}.{short}.weight"] = _permute(tower(f"{layer}.attention.{hf}.weight"),
                                                             vision.num_attention_heads)
    return expected


def test_a_mistral3_run_exports_its_language_model_and_projector_file(mistral3_run, tmp_path):
    import gguf
    from transformers import AutoTokenizer
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    projector, text_file, model, weights = _export(mistral3_run, tmp_path / "gguf")
    config, vision = model.config, model.config.vision_config
    fields, tensors = _projector(projector, config, "pixtral", {
        "image_size": vision.image_size, "patch_size": vision.patch_size, "embedding_length": vision.hidden_size,
        "feed_forward_length": vision.intermediate_size, "block_count": vision.num_hidden_layers,
        "attention.head_count": vision.num_attention_heads, "spatial_merge_size": config.spatial_merge_size})
    assert vision.hidden_act == "gelu" and "clip.use_silu" not in fields  # the tower's own activation
    assert fields["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-5)  # Pixtral's, not in the config
    assert fields["clip.vision.image_mean"] == pytest.approx(OPENAI_CLIP_MEAN)  # the run's image processor's
    assert fields["clip.vision.image_std"] == pytest.approx(OPENAI_CLIP_STD)
    # the [IMG_BREAK] id is the run's tokenizer's (the config does not carry it in Mistral's own checkpoints)
    break_id = AutoTokenizer.from_pretrained(mistral3_run.parent / "model").convert_tokens_to_ids("[IMG_BREAK]")
    assert break_id not in (None, config.image_token_index)
    _assert_written_f32(tensors, _pixtral_expected(weights, vision, break_id))

    fields, tensors = _read(text_file)
    text, arch = config.text_config, "mistral3"
    assert fields["general.architecture"] == arch and fields[f"{arch}.block_count"] == text.num_hidden_layers
    assert fields[f"{arch}.attention.key_length"] == text.head_dim == fields[f"{arch}.rope.dimension_count"]
    assert fields[f"{arch}.attention.head_count_kv"] == text.num_key_value_heads
    assert fields[f"{arch}.vocab_size"] == text.vocab_size and fields[f"{arch}.embedding_length"] == text.hidden_size
    keys, rope = gguf.Keys, text.rope_parameters
    assert fields[f"{arch}.rope.freq_base"] == rope["rope_theta"]
    assert fields[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(text.rms_norm_eps)
    _assert_written_f32(tensors, _llama_expected(weights, text, "model.language_model."))
    scaling = {keys.Rope.SCALING_FACTOR: rope.get("factor"),
               keys.Rope.SCALING_ORIG_CTX_LEN: rope.get("original_max_position_embeddings"),
               keys.Rope.SCALING_YARN_BETA_FAST: rope.get("beta_fast"),
               keys.Rope.SCALING_YARN_BETA_SLOW: rope.get("beta_slow"),
               # llama.cpp's mistral3 loader takes mscale_all_dim itself (DeepSeek's converter writes 0.1 x it)
               keys.Rope.SCALING_YARN_LOG_MUL: rope.get("mscale_all_dim"),
               keys.Attention.TEMPERATURE_SCALE: rope.get("llama_4_scaling_beta")}
    if text.model_type == "ministral3":
        assert fields[keys.Rope.SCALING_TYPE.format(arch=arch)] == "yarn"
        for key, value in scaling.items():
            assert fields[key.format(arch=arch)] == pytest.approx(value), key
    else:  # Mistral Small: plain rotary, no query scaling
        assert not any(key.format(arch=arch) in fields for key in (keys.Rope.SCALING_TYPE, *scaling))


def test_a_mistral3_f16_projector_keeps_the_types_llama_cpp_converter_forces(mistral3_run, tmp_path):
    types = _f16_types(mistral3_run, tmp_path / "gguf")
    assert types["v.patch_embd.weight"] == types["mm.patch_merger.weight"] == "F16"  # F16 in an f16 file
    assert types["v.token_embd.img_break"] == types["mm.input_norm.weight"] == "F32"
    assert types["v.blk.0.attn_q.weight"] == types["mm.1.weight"] == "F16"


@pytest.fixture(scope="module")
def mistral3_folder(tmp_path_factory):
    """A tiny Mistral 3 folder (its image processor and tokenizer)."""
    from finetune.testing import vision_model

    return vision_model("mistral3", tmp_path_factory.mktemp("mistral3") / "model")


def _mistral3_config(**changes):
    """A tiny Mistral 3 config that `changes` sets (vision_config.KEY for a vision setting)."""
    from finetune.testing import tiny_config

    config = tiny_config("mistral3", rms_norm_eps=1e-5)
    for key, value in changes.items():
        owner, _, attr = key.rpartition(".")
        setattr(config.vision_config if owner else config, attr, value)
    return config


def _mistral3_projector(folder, path, tokenizer=None, **changes):
    """write_projector on a random tiny Mistral 3 (_mistral3_config(**changes)), with the folder's image
    processor and tokenizer (or `tokenizer`)."""
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from finetune.export.gguf_vision import write_projector

    model = AutoModelForImageTextToText.from_config(_mistral3_config(**changes), dtype=torch.float32)
    return write_projector(model, AutoImageProcessor.from_pretrained(folder), path, qtype="f32",
                           tokenizer=tokenizer or AutoTokenizer.from_pretrained(folder))


@pytest.mark.parametrize("changes, named", [
    ({"vision_config.rope_parameters": {"rope_type": "axial", "rope_theta": 20000.0}}, "vision_config rope_theta=20000.0"),
    ({"projector_hidden_act": "silu"}, "projector_hidden_act='silu'"),
    ({"vision_feature_layer": -2}, "vision_feature_layer=-2"),
    ({"vision_config.hidden_act": "relu"}, "vision_config.hidden_act='relu'"),
])
def test_a_mistral3_projector_llama_cpp_computes_otherwise_is_refused_in_one_line(mistral3_folder, tmp_path,
                                                                                changes, named):
    """What llama.cpp's pixtral graph hard-codes (the tower's rotary base, the projector's GELU, the last vision
    layer's features) or its converter refuses (a tower activation other than SiLU or GELU): refused from the
    config before the model loads, and by the writer itself."""
    from finetune.errors import UsageError
    from finetune.export.gguf_vision import check_vision_exportable

    for refuse in (lambda: check_vision_exportable(_mistral3_config(**changes)),
                   lambda: _mistral3_projector(mistral3_folder, tmp_path / "mmproj.gguf", **changes)):
        with pytest.raises(UsageError) as refused:
            refuse()
        line = str(refused.value).splitlines()[0]  # the reason, then the hint
        assert named in line and "llama.cpp's pixtral projector computes with" in line, line
        assert "safetensors" in refused.value.hint


def test_a_mistral3_projector_silu_tower_is_written_with_silu(mistral3_folder, tmp_path):
    """Mistral Small 3.1's tower is SiLU (the tiny one GELU): the file says which, as llama.cpp's converter does."""
    fields, _ = _read(_mistral3_projector(mistral3_folder, tmp_path / "mmproj.gguf", **{"vision_config.hidden_act":
                                                                                           "silu"}))
    assert fields["clip.use_silu"] is True and "clip.use_gelu" not in fields


def test_a_mistral3_projector_without_an_img_break_token_is_refused_in_one_line(mistral3_folder, tmp_path):
    from finetune.errors import UsageError
    from finetune.testing import make_tokenizer

    with pytest.raises(UsageError) as refused:
        _mistral3_projector(mistral3_folder, tmp_path / "mmproj.gguf", tokenizer=make_tokenizer())
    assert str(refused.value).splitlines()[0] == ("export --format gguf: the run's tokenizer has no [IMG_BREAK] "
                                                  "token, whose embedding llama.cpp's pixtral projector file holds")


def test_a_ministral3_llama_cpp_would_scale_otherwise_is_refused_before_loading():
    """llama.cpp's mistral3 computes YaRN's attention factor with mscale 1 and needs YaRN for its query scaling:
    a Ministral 3 with another mscale, or without YaRN, is refused from its config in one line."""
    from transformers import AutoConfig

    from finetune.errors import UsageError
    from finetune.export.gguf_vision import check_vision_exportable
    from finetune.testing import tiny_config

    for rope, named in (({**MINISTRAL3_ROPE, "mscale": 2.0}, "('yarn', mscale 2.0)"),
                        ({"rope_type": "default", "rope_theta": 10000.0}, "('default', mscale 1.0)")):
        config = tiny_config("mistral3", **{**MISTRAL3_TEXT["ministral3"], "rope_parameters": rope})
        with pytest.raises(UsageError) as refused:
            check_vision_exportable(AutoConfig.for_model(**config.to_dict()))
        line = str(refused.value).splitlines()[0]
        assert f"Ministral 3 model's rope {named}" in line and "llama.cpp's mistral3" in line, line


def test_llama_cpp_encodes_a_mistral3_image_with_its_row_breaks_as_transformers_does(mistral3_run, tmp_path):
    """Both text models (Mistral Small's mistral, Ministral 3's YaRN and scaled queries): llama.cpp's image
    embeddings are transformers' image features with [IMG_BREAK]'s embedding after each row but the last, and its
    logits after them and [IMG_END] and the prompt are the model's."""
    _assert_llama_cpp_encodes_as_transformers(mistral3_run, tmp_path / "gguf")


def test_llama_cpp_rotates_a_mistral3_towers_patches_as_transformers_does(mistral3_run, mistral3_folder, tmp_path):
    """The tiny tower's attention is nearly uniform (leaving its rotary out moves the image features by 3e-5 of
    their largest value, under the comparison's tolerance): with its q and k 20x, swapping the patches' rows and
    columns moves them by 2e-2, and llama.cpp, from the file's q and k rows in its rotary layout, still gives
    transformers' features."""
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from finetune.export.gguf_vision import write_projector

    libs, why = _mtmd()
    if libs is None:
        pytest.skip(why)
    text_file = _export(mistral3_run, tmp_path / "gguf")[1]
    tokenizer = AutoTokenizer.from_pretrained(mistral3_folder)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(_mistral3_config(
        image_break_token_id=tokenizer.convert_tokens_to_ids("[IMG_BREAK]")), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.vision_tower.transformer.layers:
            layer.attention.q_proj.weight.mul_(20)
            layer.attention.k_proj.weight.mul_(20)
    processor = AutoImageProcessor.from_pretrained(mistral3_folder)
    projector = write_projector(model, processor, tmp_path / "mmproj.gguf", qtype="f32", tokenizer=tokenizer)
    width, height = LLAMA_CPP_IMAGE["mistral3"]
    image = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    ours = np.concatenate(llama_cpp_image_prompt(libs, text_file, projector, image)[0])
    theirs = transformers_image_prompt(model, processor, image)[0]
    assert np.abs(ours - theirs).max() <= EMBEDDING_RTOL * np.abs(theirs).max()
