"""Issue 26: what the planner learnt from published GPU figures, on the meta device: a paged optimizer's state
outside the device peak, bf16 adapters priced at half, offload saving at the backward's real peak, and
the published comparison itself (benchmarks/published.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from finetune.plan import predict
from finetune.plan.memory_model import predict_memory
from finetune.plan.search import model_spec
from finetune.plan.trace import planned_config
from finetune.recipe.schema import Recipe
from finetune.recipe.settings import Settings

CONFIG_3B = str(Path(__file__).parents[1] / "benchmarks/published/llama-3.2-3b.json")


def _recipe(path: str, adapter: dict, optimizer: str = "adamw", offload: str = "none", **training) -> Recipe:
    return Recipe.model_validate({
        "model": {"path": path, "dtype": "bf16", "attn_implementation": "sdpa"},
        "data": {"path": "unused.jsonl", "max_seq_len": 4096}, "quantization": {"bits": None}, "adapter": adapter,
        "training": {"micro_batch_size": 2, **training},
        "memory": {"activation_checkpointing": True, "chunked_loss": True, "tiled_mlp": False, "offload": offload,
                   "gpu_memory_margin": 0},
        "optimizer": {"name": optimizer, "layerwise": adapter["type"] == "full"}})


def _predict(recipe: Recipe):
    spec = model_spec(recipe, planned_config(recipe.model.path), "cuda")
    st = Settings(micro_batch_size=recipe.training.micro_batch_size,
                  gradient_accumulation_steps=recipe.training.gradient_accumulation_steps, activation_checkpointing=True,
                  checkpoint_every_n_layers=1, offload=recipe.memory.offload, chunked_loss=True, bits=None,
                  optimizer=recipe.optimizer.name)
    return predict_memory(spec, st)


def test_paged_optimizer_state_is_managed_memory_not_device_peak():
    plain = _predict(_recipe(CONFIG_3B, {"type": "full"}, "adamw_8bit"))
    paged = _predict(_recipe(CONFIG_3B, {"type": "full"}, "paged_adamw_8bit"))
    assert paged.breakdown["optimizer_state"] == 0 and plain.managed_bytes == 0
    assert paged.managed_bytes == plain.breakdown["optimizer_state"] > 5 * 2**30  # 3.2 B weights, 2 B each
    assert paged.peak_bytes < plain.peak_bytes - paged.managed_bytes * 0.95


def test_paged_optimizer_rejected_when_host_ram_cannot_hold_its_state(monkeypatch):
    import finetune.plan.search as search

    real = search._free_memory
    monkeypatch.setattr(search, "_free_memory", lambda device: 2**30 if device == "cpu" else real(device))
    plan = predict(_recipe(CONFIG_3B, {"type": "full"}, "paged_adamw_8bit"), gpu_memory="80GiB", device="cuda")
    assert not plan.fits
    assert "managed memory, paged to host RAM" in plan.rejected[0].reason
    assert "1.00 GiB free" in plan.rejected[0].reason or "1 GiB free" in plan.rejected[0].reason


def test_bf16_adapter_halves_trained_weights_gradients_and_state():
    lora = {"type": "lora", "r": 64, "alpha": 128, "dropout": 0.0,
            "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    fp32 = _predict(_recipe(CONFIG_3B, lora, optimizer="adamw", gradient_accumulation_steps=2))
    bf16 = _predict(_recipe(CONFIG_3B, {**lora, "dtype": "bf16"}, optimizer="adamw", gradient_accumulation_steps=2))
    assert bf16.breakdown["trainable_weights"] * 2 == fp32.breakdown["trainable_weights"]
    for part in ("optimizer_state", "gradients"):
        assert bf16.breakdown[part] < 0.51 * fp32.breakdown[part], part
    saved = sum(fp32.breakdown[k] - bf16.breakdown[k] for k in ("trainable_weights", "optimizer_state", "gradients"))
    assert abs(saved / 2**30 - 0.67) < 0.01  # torchtune's rank-64 adapter on Llama-3.2-3B, fp32 -> bf16


def test_cpu_offload_saves_the_checkpointed_inputs_at_the_real_peak():
    """Full fine-tune, tied embeddings, optimizer in backward: the checkpointed inputs are alive at the top of
    the backward, which is the peak; cpu offload removes them until the bottom layer's window (the embedding's
    gradient copies, where offload has nothing left to move) is the peak."""
    for mb, least in ((2, 0.2), (4, 2.0)):
        kept = _predict(_recipe(CONFIG_3B, {"type": "full"}, micro_batch_size=mb))
        moved = _predict(_recipe(CONFIG_3B, {"type": "full"}, offload="cpu", micro_batch_size=mb))
        inputs = mb * 4096 * 3072 * 2  # one checkpointed layer input: micro-batch x tokens x hidden x bf16
        saving = kept.peak_bytes - moved.peak_bytes
        assert least * 2**30 < saving < 28 * inputs * 1.06, mb


@pytest.mark.parametrize("mb", [2, 4])
def test_weight_sized_backward_tensors_do_not_scale_with_the_batch(mb):
    """At micro-batch 1 the peak is the bottom layer's window, which holds the tied embedding's three gradient
    copies (0.73 GiB each); scaling them by the micro-batch was the old error."""
    one = _predict(_recipe(CONFIG_3B, {"type": "full"}, micro_batch_size=1))
    many = _predict(_recipe(CONFIG_3B, {"type": "full"}, micro_batch_size=mb))
    assert one.breakdown["activations"] > 3 * 0.7 * 2**30
    assert many.peak_bytes < one.peak_bytes + (mb - 1) * one.breakdown["activations"] - 2**30


def test_published_comparison_is_current(capsys):
    """benchmarks/published.py: every torchtune row is a valid recipe and the committed results are what it
    prints now (regenerate: python benchmarks/published.py > benchmarks/results/published.txt)."""
    from benchmarks.published import ROWS, main

    main()
    printed = capsys.readouterr().out
    assert printed == (Path(__file__).parents[1] / "benchmarks/results/published.txt").read_text()
    assert all(label in printed for label, *_ in ROWS) and len(ROWS) == 12


def test_bf16_adapter_run_learns_and_saves_bf16_and_liger_is_refused_on_cpu(tiny_model_dir, tmp_path, capsys):
    """`finetune run` end to end: adapter.dtype bf16 trains (the loss falls) and saves a bf16 adapter;
    memory.kernels: liger on a CPU run stops before training with exit code 2 and a line naming the key."""
    import yaml
    from safetensors.torch import load_file

    from finetune.cli import main
    from finetune.rundir import RunDir, read_jsonl
    from tests.run_support import sums_data, tiny_lora_recipe

    data = sums_data(tmp_path / "sums.jsonl", 32)
    recipe = tiny_lora_recipe(tiny_model_dir, data, tmp_path / "bf16", {"adapter": {"dtype": "bf16"}},
                              {"training": {"max_steps": 12, "learning_rate": 5e-3, "noise_scale": False}})
    path = tmp_path / "bf16.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["run", str(path)]) == 0
    run = RunDir(tmp_path / "bf16")
    losses = [r["loss"] for r in read_jsonl(run.metrics) if "loss" in r]
    assert sum(losses[-3:]) < sum(losses[:3])
    tensors = load_file(next(run.adapter.glob("*.safetensors")))
    assert tensors and all(t.dtype == torch.bfloat16 for t in tensors.values())

    recipe = tiny_lora_recipe(tiny_model_dir, data, tmp_path / "fused", {"training": {"max_steps": 2}},
                              {"memory": {"kernels": "liger", "chunked_loss": False}})
    path.write_text(yaml.safe_dump(recipe))
    capsys.readouterr()
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "memory.kernels: liger" in err and "CUDA" in err and "Traceback" not in err


def test_prediction_keeps_every_window_and_the_peak_is_the_largest():
    """benchmarks/published.py prices torchtune's loss in the plan's own windows: they must be the plan's."""
    pred = _predict(_recipe(CONFIG_3B, {"type": "full"}))
    assert {"forward", "bwd_head", "bwd_top", "bwd_bottom", "optimizer"} <= set(pred.windows)
    assert max(sum(parts.values()) for parts in pred.windows.values()) == pred.peak_bytes
    assert pred.breakdown in pred.windows.values()


def test_chunked_loss_prices_the_trained_heads_summed_gradient():
    """A trained (here tied) LM head gets one gradient per loss chunk, summed in autograd's buffer: one
    head-sized gradient in the loss's backward (tests/test_plan_accuracy.py measures it on a tiny model);
    a LoRA run's frozen head has none."""
    from finetune.plan.memory_model import chunked_head_gradient_bytes

    full = _recipe(CONFIG_3B, {"type": "full"})
    spec = model_spec(full, planned_config(full.model.path), "cuda")
    st = Settings(micro_batch_size=2, gradient_accumulation_steps=1, activation_checkpointing=True,
                  checkpoint_every_n_layers=1, offload="none", chunked_loss=True, bits=None, optimizer="adamw")
    assert chunked_head_gradient_bytes(spec, st, 2 * 4096) == 128256 * 3072 * 2
    lora = _recipe(CONFIG_3B, {"type": "lora", "r": 8, "target_modules": ["q_proj"]})
    assert chunked_head_gradient_bytes(model_spec(lora, planned_config(lora.model.path), "cuda"), st, 8192) == 0
    assert chunked_head_gradient_bytes(spec, replace(st, chunked_loss=False), 8192) == 0
