"""GGUF export of a vision-language run: the language model as its text family plus llama.cpp's projector
file (mmproj-NAME.TYPE.gguf), read back with the gguf package's GGUFReader and checked tensor by tensor and key
by key against llama.cpp's converter layout; families whose projector is not written are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from finetune.cli import main
from finetune.recipe import validate_recipe
from finetune.testing import shape_task
from finetune.train.run import run
from tests.run_support import tiny_lora_recipe

# the vision-language model_types whose two files the tests here check, in the family table's order
WRITTEN_VISION = ("qwen2_5_vl", "gemma3")

# llama.cpp's sliding-window pattern for gemma3 (five local layers, then a global one) at toy size
GEMMA3_TEXT = {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}

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


def _values(tensor) -> np.ndarray:
    """A tensor's values in the layout transformers holds them (GGUF lists dimensions innermost first)."""
    return np.asarray(tensor.data, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))


def _trained_run(tmp_path_factory, arch: str, **overrides):
    """A one-step LoRA run of a tiny random `arch` on the shape task."""
    from finetune.testing import vision_model

    folder = tmp_path_factory.mktemp(f"{arch}-run")
    model = vision_model(arch, folder / "model", **overrides)
    train, _ = shape_task(folder / "shapes", train=4, held_out=2)
    run(validate_recipe(tiny_lora_recipe(model, train, folder / "run",
                                         {"training": {"max_steps": 1, "micro_batch_size": 2}})))
    return folder / "run"


def _export(run_dir, out):
    """`finetune export RUN --format gguf --type f32`: (the projector file, the language model's file, the
    merged model they were written from, its weights as float32 arrays)."""
    from finetune.model.trained import load_run, merged_model

    assert main(["export", str(run_dir), "--out", str(out), "--format", "gguf", "--type", "f32"]) == 0
    name = run_dir.resolve().name
    assert sorted(p.name for p in out.glob("*.gguf")) == [f"mmproj-{name}.f32.gguf", f"{name}.f32.gguf"]
    model = merged_model(*load_run(run_dir))[0]
    weights = {k: v.float().numpy() for k, v in model.state_dict().items()}
    return out / f"mmproj-{name}.f32.gguf", out / f"{name}.f32.gguf", model, weights


@pytest.fixture(scope="module")
def gemma3_run(tmp_path_factory):
    return _trained_run(tmp_path_factory, "gemma3", **GEMMA3_TEXT)


def test_a_gemma3_run_exports_its_language_model_and_projector_file(gemma3_run, tmp_path):
    import gguf

    projector, text, model, weights = _export(gemma3_run, tmp_path / "gguf")
    config, vision = model.config, model.config.vision_config
    fields, tensors = _read(projector)
    assert fields["general.architecture"] == "clip" and fields["general.type"] == "mmproj"
    assert fields["clip.projector_type"] == "gemma3" and fields["clip.use_gelu"] is True
    assert fields["clip.has_vision_encoder"] is True
    assert fields["clip.vision.projection_dim"] == config.text_config.hidden_size
    for key, value in (("image_size", vision.image_size), ("patch_size", vision.patch_size),
                       ("embedding_length", vision.hidden_size), ("feed_forward_length", vision.intermediate_size),
                       ("block_count", vision.num_hidden_layers), ("attention.head_count", vision.num_attention_heads)):
        assert fields[f"clip.vision.{key}"] == value, key
    assert fields["clip.vision.image_mean"] == fields["clip.vision.image_std"] == [0.5, 0.5, 0.5]
    assert fields["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(vision.layer_norm_eps)
    # 56-pixel images of 14-pixel patches (4 x 4) pooled to 4 tokens: 2 x 2 patches per token, not llama.cpp's 4
    assert config.mm_tokens_per_image == 4 and fields["clip.vision.projector.scale_factor"] == 2

    expected = {gguf_name: weights[f"model.vision_tower.{hf}"] for hf, gguf_name in VISION_NAMES.items()}
    for i in range(vision.num_hidden_layers):
        for hf, short in VISION_LAYER_NAMES.items():
            for part in ("weight", "bias"):
                expected[f"v.blk.{i}.{short}.{part}"] = weights[f"model.vision_tower.encoder.layers.{i}.{hf}.{part}"]
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
    return _trained_run(tmp_path_factory, "qwen2_5_vl")


def test_a_qwen25vl_run_exports_its_language_model_and_projector_file(qwen25vl_run, tmp_path):
    import gguf

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
    assert set(tensors) == set(expected)
    for gguf_name, value in expected.items():
        assert tensors[gguf_name].tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(_values(tensors[gguf_name]), value, err_msg=gguf_name)

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


@pytest.mark.parametrize("arch", ["qwen3_vl", "idefics3"])
def test_a_family_without_a_projector_writer_is_refused_naming_why(arch, tmp_path):
    from transformers import AutoConfig

    from finetune.errors import UsageError
    from finetune.export.gguf_vision import check_vision_exportable
    from finetune.testing import tiny_config

    config = AutoConfig.for_model(**tiny_config(arch).to_dict())
    with pytest.raises(UsageError) as refused:
        check_vision_exportable(config)
    line = str(refused.value).splitlines()[0]  # the reason, then the hint
    assert f"{arch!r}" in line and "projector file" in line and f"(vision-language ones written: {', '.join(WRITTEN_VISION)})" in line
