"""The planner prices preference methods: chosen and rejected in one batch, the reference forward (adapter
off, no activations kept), chunked log-probabilities. Predicted peak vs the CPU tracker on the real step, and
vs `finetune run` itself, within 5%."""

from __future__ import annotations

import json

import pytest

from finetune.plan.memory_model import Settings, predict_memory
from finetune.plan.search import model_spec
from finetune.plan.shapes import load_model_config
from finetune.recipe.methods import METHODS
from finetune.recipe.schema import Recipe
from finetune.train.measure import measure

DIMS = {"hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 4}

# model, method, seq, micro-batch (examples), checkpointing, chunked loss, optimizer, more keys
MATRIX = [
    ("small", "dpo", 256, 1, False, False, {}),
    ("small", "dpo", 256, 2, True, False, {"training.reference_free": True}),
    ("small", "orpo", 256, 2, True, False, {}),
    ("small", "kto", 128, 4, False, False, {"optimizer.name": "sgd"}),
    ("small", "simpo", 256, 2, True, False, {}),  # reference-free: no reference forward priced
    ("big", "cpo", 256, 2, True, True, {}),
    ("small", "dpo", 256, 2, True, False, {"optimizer.layerwise": True}),
    ("big", "dpo", 256, 2, True, True, {}),  # 1024 tokens: two chunks of 512
    ("big", "dpo", 256, 2, True, False, {}),
    ("big", "orpo", 512, 1, False, True, {}),
    ("big", "kto", 512, 2, True, True, {}),
    ("big", "dpo", 512, 1, True, True, {"memory.offload": "disk", "memory.offload_min_size": 1024}),
    # no reference forward in the step; measure runs the pass before the steps, as a run does
    ("small", "dpo", 256, 2, True, False, {"training.precompute_reference": True}),
    ("big", "kto", 256, 2, True, True, {"training.precompute_reference": True}),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.testing import make_tokenizer, tiny_config

    dirs = {}
    for name, vocab in (("small", 512), ("big", 20000)):  # big: chunks of 512 tokens
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(name)
        AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=vocab, **DIMS)).save_pretrained(path)
        make_tokenizer().save_pretrained(path)
        dirs[name] = path
    return dirs


def _recipe(path, method, seq, mb, ckpt, chunked, extra) -> Recipe:
    data = {"model": {"path": str(path)}, "data": {"path": "unused.jsonl", "max_seq_len": seq},
            "adapter": {"type": "lora", "r": 8}, "quantization": {"bits": None},
            "training": {"method": method, "micro_batch_size": mb},
            "memory": {"activation_checkpointing": ckpt, "chunked_loss": chunked, "tiled_mlp": False}}
    for key, value in extra.items():
        section, name = key.split(".")
        data.setdefault(section, {})[name] = value
    return Recipe.model_validate(data)


def test_predicted_peak_matches_the_tracker(model_dirs):
    rows, failures = [], []
    for name, method, seq, mb, ckpt, chunked, extra in MATRIX:
        recipe = _recipe(model_dirs[name], method, seq, mb, ckpt, chunked, extra)
        measured = measure(recipe, steps=2)["peak_bytes"]
        spec = model_spec(recipe, load_model_config(recipe.model.path), "cpu")
        m = recipe.memory
        predicted = predict_memory(spec, Settings(mb, 1, ckpt, 1, m.offload, chunked, None, recipe.optimizer.name,
                                                  False)).peak_bytes
        err = predicted / measured - 1
        rows.append(f"{name} {method} s={seq} mb={mb} ckpt={ckpt} chunked={chunked} {extra}: measured {measured} "
                    f"predicted {predicted} {err:+.1%}")
        if abs(err) > 0.05:
            failures.append(rows[-1])
    assert {row[1] for row in MATRIX} == {m.name for m in METHODS if m.preference}
    print("\n".join(rows))
    assert not failures, "\n".join(failures + ["", *rows])


@pytest.mark.parametrize("name, method, seq, mb, chunked", [("small", "dpo", 256, 2, False),
                                                          ("big", "kto", 512, 4, False), ("big", "dpo", 256, 2, True)])
def test_precomputed_reference_pass_peak_matches_the_tracker(model_dirs, name, method, seq, mb, chunked):
    """training.precompute_reference: the pass over the data before training (weights and one forward under
    no_grad) is priced on its own; measure with 0 steps runs only that pass."""
    recipe = _recipe(model_dirs[name], method, seq, mb, True, chunked, {"training.precompute_reference": True})
    measured = measure(recipe, steps=0)["peak_bytes"]
    spec = model_spec(recipe, load_model_config(recipe.model.path), "cpu")
    prediction = predict_memory(spec, Settings(mb, 1, True, 1, "none", chunked, None, recipe.optimizer.name, False))
    assert prediction.reference_pass_bytes == pytest.approx(measured, rel=0.05)
    assert prediction.peak_bytes >= prediction.reference_pass_bytes  # the plan's peak is the larger


def test_plan_matches_the_real_run(model_dirs, tmp_path):
    """`finetune run` on full-length pairs peaks where its plan.json said, for each method."""
    from finetune.rundir import read_jsonl
    from finetune.train.run import run

    data = tmp_path / "pairs.jsonl"
    long = "the quick brown fox jumps over the lazy dog " * 60
    data.write_text("\n".join(json.dumps({"prompt": f"q{i}", "chosen": long, "rejected": long[::-1]})
                              for i in range(8)) + "\n")
    errors = []
    for i, (method, chunked) in enumerate([("dpo", True), ("orpo", False), ("kto", True)]):
        recipe = _recipe(model_dirs["big"], method, 256, 2, True, chunked, {
            "data.path": str(data), "training.max_steps": 2, "output.dir": str(tmp_path / f"run{i}")})
        run(recipe)
        planned = json.loads((tmp_path / f"run{i}" / "plan.json").read_text())["peak_bytes"]
        measured = max(r["peak_memory_bytes"] for r in read_jsonl(tmp_path / f"run{i}" / "metrics.jsonl")
                       if "peak_memory_bytes" in r)
        errors.append((method, planned / measured - 1))
    assert all(abs(e) <= 0.05 for _, e in errors), errors
