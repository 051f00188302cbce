"""Every model family the tool describes: a tiny model of its own config class trains through `finetune run`
with the plan within 5% of the measured peak, full-size configs of current models plan in seconds, what no
family describes is refused in one line, and docs/models.md is the family table's own text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from finetune.cli import main
from finetune.recipe.families import FAMILIES, family_for, models_markdown
from finetune.rundir import read_jsonl
from finetune.testing import (
    ARCHITECTURES,
    MOE_ARCHITECTURES,
    VISION_ARCHITECTURES,
    make_tiny_model_dir,
    tiny_config,
)
from tests.run_support import text_data

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
# Each dense family's first model_type: the text configs (Qwen3.5's vision-language one has its own test).
DENSE = [f.model_types[0] for f in FAMILIES if not f.moe]
# Each family trains with one method, the methods taking turns down the table, so every method meets several
# families with sliding-window, linear-attention and convolution layers among them, in 3 steps each.
METHODS = {"qlora": {"quantization": {"bits": 4}}, "lora": {}, "dora": {"adapter": {"type": "dora"}},
           "full": {"adapter": {"type": "full"}}}
CASES = [(t, list(METHODS)[i % len(METHODS)]) for i, t in enumerate(DENSE)]


def _data(folder: Path, max_seq_len: int) -> Path:
    """Two records, one max_seq_len tokens long with its end token, one 3 tokens shorter: every step's
    micro-batch (of 2) holds both, at the planned length and padded as chat data pads it (the plan prices the
    padded batch's attention mask)."""
    return text_data(folder / "long.jsonl", [max_seq_len - 1, max_seq_len - 4])


def _recipe(folder: Path, model: Path | str, **sections: dict) -> Path:
    recipe = {
        "model": {"path": str(model)},
        "quantization": {"bits": None},
        "adapter": {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"path": str(_data(folder, sections.get("data", {}).get("max_seq_len", 128))), "format": "text",
                 "max_seq_len": 128},
        "training": {"max_steps": 3, "micro_batch_size": 2, "learning_rate": 1e-3, "warmup_ratio": 0.0,
                     "logging_steps": 1},
        "memory": {"activation_checkpointing": True, "gpu_memory_margin": 0},
        "output": {"dir": str(folder / "run"), "save_steps": 100},
    }
    for section, values in sections.items():
        recipe[section] = {**recipe.get(section, {}), **values}
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def test_every_family_has_a_tiny_model_of_its_own_config_class():
    """Every family has a tiny model (a new family brings its own: dense ones here, mixture-of-experts ones in
    tests/test_moe.py) and every tiny model is of a family; the MoE table holds exactly the MoE families'."""
    tiny = set(ARCHITECTURES) | set(MOE_ARCHITECTURES) | set(VISION_ARCHITECTURES)
    assert all(set(f.model_types) & tiny for f in FAMILIES), [f.name for f in FAMILIES if not set(f.model_types) & tiny]
    assert tiny <= {t for f in FAMILIES for t in f.model_types}
    assert {t for t in tiny if family_for(t).moe} == set(MOE_ARCHITECTURES)
    assert {t for t in tiny if family_for(t).vision} == set(VISION_ARCHITECTURES)


def test_a_vision_language_checkpoint_of_a_text_trained_family_trains_its_text_model(tmp_path, capsys):
    """Qwen3.5's checkpoints are vision-language ones: transformers loads their text model for causal LM, the
    plan prices that model (within 5% of the peak) and the run trains and chats with it."""
    model = make_tiny_model_dir(tmp_path / "model", arch="qwen3_5")
    assert "vision_config" in json.loads((model / "config.json").read_text())
    assert main(["run", str(_recipe(tmp_path, model))]) == 0
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    measured = max(r["peak_memory_bytes"] for r in rows if "peak_memory_bytes" in r)
    planned = json.loads((tmp_path / "run" / "plan.json").read_text())["peak_bytes"]
    assert abs(planned / measured - 1) <= 0.05, (planned, measured)
    assert main(["generate", str(tmp_path / "run"), "--prompt", "Hi", "--max-new-tokens", "3"]) == 0


@pytest.mark.parametrize(("model_type", "method"), CASES, ids=[f"{t}-{m}" for t, m in CASES])
def test_each_family_trains_plans_within_5_percent_and_chats(tmp_path, capsys, model_type, method):
    model = make_tiny_model_dir(tmp_path / "model", arch=model_type)
    assert main(["run", str(_recipe(tmp_path, model, **METHODS[method]))]) == 0
    run = tmp_path / "run"
    rows = read_jsonl(run / "metrics.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    measured = max(r["peak_memory_bytes"] for r in rows if "peak_memory_bytes" in r)
    planned = json.loads((run / "plan.json").read_text())["peak_bytes"]
    assert len(losses) == 3 and all(loss == loss for loss in losses)  # three steps, no NaN
    assert abs(planned / measured - 1) <= 0.05, (model_type, method, planned, measured)
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "What is the capital of France?", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()  # the trained model answers


def test_docs_models_md_is_the_family_tables_own_text():
    """docs/models.md is generated: `finetune models --markdown > docs/models.md`."""
    assert (ROOT / "docs" / "models.md").read_text() == models_markdown()
    assert main(["models", "--markdown"]) == 0


UNSUPPORTED = {  # config.json -> what the one line must say
    "foo": ({"model_type": "foo", "hidden_size": 64}, "model_type 'foo' is not supported: no model family describes"),
    "vision": ({"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
                "vision_config": {}, "text_config": {}}, "is a vision-language model no family describes "
               "(vision-language model_types: qwen2_5_vl"),
}


@pytest.mark.parametrize("command", ["validate", "plan", "run"])
@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_a_model_no_family_describes_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, command, case):
    config, message = UNSUPPORTED[case]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    recipe = _recipe(tmp_path, model)
    assert main([command, str(recipe)]) == 2
    err = capsys.readouterr().err
    assert message in " ".join(err.split()) and "Traceback" not in err
    assert not (tmp_path / "run").exists()


# Dense models' configs; the mixture-of-experts ones (their experts priced as stored) plan in tests/test_moe.py.
FULL_SIZE = [p for p in sorted(CONFIGS.glob("*.json")) if not family_for(json.loads(p.read_text())["model_type"]).moe]


@pytest.mark.parametrize("config", FULL_SIZE, ids=[p.stem for p in FULL_SIZE])
def test_full_size_configs_of_current_models_plan_in_seconds(tmp_path, config):
    """QLoRA at 4k tokens on a 24 GB card, settings fixed (one trace, no search): the plan prices the 4-bit
    decoder weights (0.5 byte per parameter and their scales) plus the 16-bit embedding and head."""
    from finetune import api
    from finetune.plan.shapes import load_model_config, model_shapes

    recipe = api.load_recipe(_recipe(tmp_path, config, quantization={"bits": 4},
                                     data={"max_seq_len": 4096}, training={"micro_batch_size": 1},
                                     memory={"chunked_loss": True, "tiled_mlp": False, "gpu_memory": "24GiB"}))
    plan = api.plan(recipe)
    shapes = model_shapes(load_model_config(str(config)))
    quantized = shapes.num_layers * shapes.layer_linear
    assert 0.5 * quantized < plan.breakdown["weights"] < 0.6 * quantized + 2.1 * (shapes.total - quantized)
    assert plan.peak_bytes > plan.breakdown["weights"] and plan.device == "cuda"


# Deeper models of mixed layers, whose plan extrapolates from 2- and 3-layer copies: the kinds' shares and the
# costliest kind's recomputation (plan.shapes.kind_variants), sliding-window layers' additive masks.
HYBRID = {
    "gemma3_text": ["sliding_attention"] * 5 + ["full_attention"],
    "qwen3_5_text": ["linear_attention"] * 3 + ["full_attention"] * 1 + ["linear_attention"] * 2,
    "lfm2": ["conv", "conv", "full_attention", "conv", "full_attention", "conv"],
}


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "no-checkpointing"])
@pytest.mark.parametrize("model_type", list(HYBRID))
def test_mixed_layers_are_priced_as_they_run(tmp_path, model_type, checkpointing):
    kinds = HYBRID[model_type]
    model = make_tiny_model_dir(tmp_path / "model", arch=model_type, num_hidden_layers=len(kinds), layer_types=kinds)
    recipe = _recipe(tmp_path, model, data={"max_seq_len": 512}, training={"max_steps": 1},
                     memory={"activation_checkpointing": checkpointing})
    assert main(["run", str(recipe)]) == 0
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    measured = max(r["peak_memory_bytes"] for r in rows if "peak_memory_bytes" in r)
    planned = json.loads((tmp_path / "run" / "plan.json").read_text())["peak_bytes"]
    assert abs(planned / measured - 1) <= 0.05, (model_type, checkpointing, planned, measured)


def test_the_ui_refuses_a_model_no_family_describes_before_queueing(tmp_path, monkeypatch):
    from finetune.recipe.families import UnsupportedModel
    from tests.ui_support import form_values
    from ui.backend import Backend, UISettings
    from ui.runs import RunManager

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "foo"}))
    recipe = yaml.safe_load(_recipe(tmp_path, model).read_text())
    backend = Backend(UISettings([tmp_path], tmp_path / "runs"), RunManager(tmp_path / "runs"))
    queued = []
    monkeypatch.setattr(backend.manager, "submit", lambda recipe, run_dir: queued.append(recipe))
    with pytest.raises(UnsupportedModel, match="model_type 'foo' is not supported"):
        backend.start(form_values(recipe))
    assert queued == [] and not (tmp_path / "run").exists()


def test_a_loaded_config_of_another_architecture_is_named_in_one_line():
    """What transformers reads from a .gguf file or a hub id is checked once loaded, with the same line."""
    from transformers import GPT2Config

    from finetune.model.family import family_of
    from finetune.recipe.families import UnsupportedModel

    with pytest.raises(UnsupportedModel, match="model_type 'gpt2' is not supported") as err:
        family_of(GPT2Config())
    assert err.value.exit_code == 2 and "\n" not in err.value.message
    assert family_of(tiny_config("qwen3")).name == "Qwen3"
