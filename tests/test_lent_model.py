"""A model loaded once and lent to several runs (finetune.api.load_base, run(base=)): each run is planned and
trained as if it had loaded the model itself, and the model comes back as loaded (the GPU kit's 8B rows)."""

from __future__ import annotations

import json

import pytest
import torch

from finetune import api
from finetune.errors import UsageError
from finetune.recipe import validate_recipe
from finetune.rundir import read_jsonl


def _recipe(tmp_path, model_dir, name: str, **memory):
    data = tmp_path / "data.jsonl"
    if not data.is_file():
        data.write_text("".join(json.dumps({"text": f"the quick brown fox {i} jumps over the lazy dog " * 6}) + "\n"
                                for i in range(8)))
    return validate_recipe({
        "model": {"path": str(model_dir)}, "quantization": {"bits": None},
        "adapter": {"type": "lora", "r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"path": str(data), "format": "text", "max_seq_len": 48},
        "training": {"max_steps": 3, "micro_batch_size": 2, "learning_rate": 1e-2, "warmup_ratio": 0.0},
        "memory": {"activation_checkpointing": True, **memory},
        "output": {"dir": str(tmp_path / name), "save_steps": 100}})


def _losses(result) -> list[float]:
    return [r["loss"] for r in read_jsonl(result.run_dir / "metrics.jsonl") if "loss" in r]


def test_runs_on_a_lent_model_train_as_on_a_fresh_load(tmp_path, tiny_model_dir):
    plain = _recipe(tmp_path, tiny_model_dir, "plain")
    fresh = _losses(api.run(plain))
    base = api.load_base(plain)
    weights = {name: p.detach().clone() for name, p in base.model.named_parameters()}
    layers = [type(m) for m in base.model.modules()]
    tiled = _recipe(tmp_path, tiny_model_dir, "tiled", tiled_mlp=True, tiled_mlp_tokens=16, recompute_norms=True)
    for recipe in (tiled, plain):  # the first run changes layers (adapter, tiling): the second sees none of it
        result = api.run(recipe, base=base, overwrite=True)
        assert result.state == "completed"
        assert [type(m) for m in base.model.modules()] == layers  # handed back as loaded
        assert all(torch.equal(p, weights[name]) for name, p in base.model.named_parameters())
        assert not any(p.requires_grad for p in base.model.parameters()) and not base.model.is_activation_checkpointing
    assert _losses(result) == pytest.approx(fresh, rel=1e-5)  # same weights, same adapter init, same steps


def test_a_lent_model_refuses_a_recipe_it_does_not_match(tmp_path, tiny_model_dir):
    plain = _recipe(tmp_path, tiny_model_dir, "plain")
    base = api.load_base(plain)
    quantized = plain.model_copy(update={"quantization": plain.quantization.model_copy(update={"bits": 4})})
    with pytest.raises(UsageError, match=r"quantization.bits: 4 != None \(loaded\)"):
        api.run(quantized, base=base)
    full = plain.model_copy(update={"adapter": plain.adapter.model_copy(update={"type": "full"})})
    with pytest.raises(UsageError, match="adapter.type: full: a run on an already loaded model"):
        api.run(full, base=base)
    tower = plain.model_copy(update={"adapter": plain.adapter.model_copy(update={"vision": "full"})})
    with pytest.raises(UsageError, match="adapter.vision: full: a run on an already loaded model"):
        api.run(tower, base=base)
    experts = _recipe(tmp_path, tiny_model_dir, "plain", offload_experts="disk")  # a dense model has no experts
    with pytest.raises(UsageError, match="memory.offload_experts: model.path is a .* not a mixture-of-experts"):
        api.run(experts, base=base)
    assert not (tmp_path / "plain").exists()  # refused before anything was written
