"""Liger's fused preference losses (finetune.step.liger_losses) under memory.kernels: liger: where the method's
formula is ours, the preference step's loss, LoRA gradients and metrics equal our own loss's; elsewhere our own
loss runs, and the plan and run say why.

Liger's chunked losses are plain torch (no Triton kernel), so they run on the CPU; the step takes the fused path
through the public `PreferenceLoss(..., fused=True)` (what `memory.kernels: liger` resolves to), which the run
allows on CUDA only (finetune.model.kernels).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch

from finetune.step.liger_losses import LIGER_LOSSES, fused_problem, kernels_line
from finetune.step.preference import PreferenceLoss, preference_loss
from finetune.testing import tiny_config

LIGER = importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None
NO_LIGER = "liger-kernel and triton (the cuda extra) are not installed: pip install -c finetune/constraints.txt " \
           "-e \".[cuda]\""

# (method, knobs): every wired method, DPO with the reference forward in the step, reference-free and hinge.
WIRED = (("dpo", {}), ("dpo", {"loss_type": "hinge"}), ("dpo", {"reference_free": True}), ("orpo", {}),
         ("simpo", {"label_smoothing": 0.1, "simpo_gamma": 0.8}), ("cpo", {"cpo_alpha": 0.5, "label_smoothing": 0.2}))
# (method, knobs, what the reason names): formulas Liger's losses do not match.
OURS = (("kto", {}, "KL reference point"), ("dpo", {"loss_type": "ipo"}, "no ipo"),
        ("dpo", {"label_smoothing": 0.1}, "no label smoothing"),
        ("dpo", {"precompute_reference": True}, "precomputed"))


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter() -> Iterator[None]:
    """Triton's CPU interpreter, as tests/test_kernels.py runs Liger's kernels: Triton and Liger read
    TRITON_INTERPRET when this process first imports them (peft may import Triton through bitsandbytes), which
    may be here, before the model is built (Liger's chunked losses themselves are plain torch)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.fixture(scope="module")
def lora_model() -> torch.nn.Module:
    """A tiny Llama with a LoRA adapter whose B is nonzero: the reference (adapter off) differs from the policy
    and every LoRA weight gets a gradient."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0,
                                            init_lora_weights=False)).train()


def _batch(loss: PreferenceLoss) -> dict[str, torch.Tensor]:
    """Two pairs (chosen rows, then rejected rows) or four kto answers, prompts of different lengths masked."""
    ids = torch.randint(0, 500, (4, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :3] = -100
    labels[1, :6] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    if loss.method == "kto":
        batch["kto_label"] = torch.tensor([True, False, True, False])
    if loss.reference_precomputed:
        batch["ref_logps"] = torch.tensor([-120.0, -118.0, -140.0, -139.0])
    return batch


def _step(model: torch.nn.Module, loss: PreferenceLoss) -> tuple[torch.Tensor, dict, dict]:
    model.zero_grad(set_to_none=True)
    metrics: dict = {}
    value = preference_loss(model, _batch(loss), loss, metrics=metrics)
    value.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return value.detach(), grads, metrics


@pytest.fixture
def liger_calls(monkeypatch) -> list[str]:
    """The Liger fused-loss classes the step builds (a spy around liger_kernel.chunked_loss's public classes)."""
    import liger_kernel.chunked_loss as chunked

    calls: list[str] = []
    for entry in LIGER_LOSSES.values():
        if not isinstance(entry, str):
            cls = getattr(chunked, entry.name)
            monkeypatch.setattr(chunked, entry.name,
                                lambda *a, _cls=cls, _name=entry.name, **k: calls.append(_name) or _cls(*a, **k))
    return calls


@pytest.mark.skipif(not LIGER, reason=NO_LIGER)
@pytest.mark.parametrize(("method", "knobs"), WIRED, ids=lambda v: str(v))
def test_liger_fused_preference_loss_equals_ours(lora_model, liger_calls, method, knobs):
    """The fused loss (hidden states and the head's weight, the reference's hidden states from the adapter
    switched off) gives our loss, every LoRA gradient and the logged rewards, margins and log-probabilities."""
    fused = PreferenceLoss(method, beta=0.5, fused=True, **knobs)
    assert fused_problem(fused) is None and "Liger's fused" in kernels_line(fused)
    value, grads, metrics = _step(lora_model, fused)
    assert liger_calls == [LIGER_LOSSES[method].name]
    want_value, want_grads, want_metrics = _step(lora_model, PreferenceLoss(method, beta=0.5, **knobs))
    assert liger_calls == [LIGER_LOSSES[method].name]  # ours: no Liger call
    torch.testing.assert_close(value, want_value, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    assert metrics.keys() == want_metrics.keys()
    for name, (total, count) in metrics.items():
        assert count == want_metrics[name][1]
        assert total == pytest.approx(want_metrics[name][0], rel=1e-4, abs=1e-4), name


@pytest.mark.skipif(not LIGER, reason=NO_LIGER)
@pytest.mark.parametrize(("method", "knobs", "reason"), OURS, ids=lambda v: str(v))
def test_a_method_without_a_matching_liger_loss_runs_ours_and_says_why(lora_model, liger_calls, method, knobs,
                                                                       reason):
    """kto (its KL reference point and weights), dpo's ipo, label-smoothed sigmoid and a precomputed reference:
    the step runs our loss over chunked log-probabilities (the same values as unchunked), no Liger call, and the
    line the plan and run show names the reason."""
    fused = PreferenceLoss(method, beta=0.5, fused=True, **knobs)
    assert reason in fused_problem(fused)
    line = kernels_line(fused)
    assert line.startswith(f"memory.kernels: liger: the {method} loss is ours") and reason in line
    value, grads, metrics = _step(lora_model, fused)
    want_value, want_grads, want_metrics = _step(lora_model, PreferenceLoss(method, beta=0.5, **knobs))
    assert liger_calls == []
    torch.testing.assert_close(value, want_value, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    assert metrics.keys() == want_metrics.keys()


@pytest.fixture(scope="module")
def vocab_model_dir(tmp_path_factory):
    """A tiny Llama whose vocabulary (20,000: chunks of 512 tokens) makes the loss's logits the step's peak."""
    from transformers import AutoModelForCausalLM

    from finetune.testing import make_tokenizer

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("vocab")
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=20000, hidden_size=128, intermediate_size=320,
                                                 num_hidden_layers=4)).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.mark.skipif(not LIGER, reason=NO_LIGER)
@pytest.mark.parametrize(("method", "seq", "mb", "ckpt"), [("dpo", 512, 1, True), ("dpo", 256, 2, True),
                                                          ("orpo", 512, 1, False), ("kto", 512, 2, True)])
def test_the_planner_prices_the_fused_preference_loss_as_it_runs(vocab_model_dir, method, seq, mb, ckpt):
    """memory.kernels: liger priced within 5% of the tracked step (Liger's chunk: one example's rows at every
    position; kto: our chunked log-probabilities, priced exactly as memory.chunked_loss prices them, not twice)."""
    from finetune.memory.tracker import measure_step
    from finetune.plan.memory_model import Settings, predict_memory
    from finetune.plan.search import model_spec
    from finetune.plan.shapes import load_model_config
    from finetune.recipe.schema import Recipe
    from finetune.step.preference import synthetic_batch
    from finetune.step.training_step import training_step
    from finetune.train.measure import step_setup

    recipe = Recipe.model_validate({
        "model": {"path": str(vocab_model_dir)}, "data": {"path": "unused.jsonl", "max_seq_len": seq},
        "adapter": {"type": "lora", "r": 8}, "quantization": {"bits": None},
        "training": {"method": method, "micro_batch_size": mb},
        "memory": {"activation_checkpointing": ckpt, "chunked_loss": False, "tiled_mlp": False}})
    recipe, model, optimizer, vocab = step_setup(recipe)  # Liger's model kernels are CUDA's: the loss alone here
    loss = PreferenceLoss.of(recipe.training, fused=True)
    batch = synthetic_batch(loss, mb, seq, vocab, "cpu", torch.Generator().manual_seed(0))
    measured = measure_step(lambda tracker: [training_step(model, [batch], optimizer, tracker=tracker, preference=loss)
                                             for _ in range(2)],
                            model=model, optimizer=optimizer, vocab_size=vocab, device="cpu")["peak_bytes"]
    spec = model_spec(recipe, load_model_config(recipe.model.path), "cpu")
    settings = {"micro_batch_size": mb, "gradient_accumulation_steps": 1, "activation_checkpointing": ckpt,
                "checkpoint_every_n_layers": 1, "offload": "none", "bits": None, "optimizer": recipe.optimizer.name}
    liger = predict_memory(spec, Settings(**settings, chunked_loss=False, kernels="liger")).peak_bytes
    chunked = predict_memory(spec, Settings(**settings, chunked_loss=True)).peak_bytes
    assert liger == pytest.approx(measured, rel=0.05)
    assert (liger == chunked) is (fused_problem(loss) is not None)


@pytest.mark.parametrize(("method", "record", "says"), [
    ("dpo", {"prompt": "a", "chosen": "b", "rejected": "c"}, "the dpo loss is Liger's fused LigerFusedLinearDPOLoss"),
    ("kto", {"prompt": "a", "completion": "b", "label": True}, "the kto loss is ours over chunked log-probabilities"),
])
def test_the_plan_says_which_preference_loss_liger_runs(tiny_model_dir, tmp_path, method, record, says):
    """A plan with memory.kernels: liger (a CUDA plan, made here by giving the GPU's memory) notes which loss the
    preference method runs and, where it is ours, why."""
    import json

    from finetune.plan import predict
    from finetune.recipe import validate_recipe

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({**record, "label": i % 2 == 0} if method == "kto" else record) + "\n"
                            for i in range(8)))
    recipe = validate_recipe({"model": {"path": str(tiny_model_dir)}, "data": {"path": str(data), "max_seq_len": 64},
                              "training": {"method": method, "micro_batch_size": 2},
                              "memory": {"kernels": "liger"}, "output": {"dir": str(tmp_path / "out")}})
    plan = predict(recipe, gpu_memory="8GiB")
    assert plan.settings["kernels"] == "liger"
    line = next(note for note in plan.notes if note.startswith("memory.kernels: liger: "))
    assert says in line and (method != "kto" or "KL reference point" in line)
