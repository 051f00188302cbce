"""Fast kernels (finetune.model.kernels): Liger's kernels applied per family through its per-model API give the
unfused model's loss and gradients; `memory.kernels` and `training.compile` as the planner resolves them.

The Liger kernels that run in Triton's CPU interpreter (TRITON_INTERPRET=1: its fused linear cross-entropy and
RoPE) are checked here on the CPU; its RMSNorm and SwiGLU/GeGLU kernels stop there and are checked on a GPU.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util

import pytest
import torch

from finetune.errors import RecipeError
from finetune.model.kernels import apply_kernels, compile_pays, kernel_choices, planned_steps
from finetune.recipe import validate_recipe
from finetune.testing import tiny_config

LIGER = importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None
NO_LIGER = "liger-kernel and triton (the cuda extra) are not installed: pip install -c finetune/constraints.txt " \
           "-e \".[cuda]\""
# A dense and a mixture-of-experts family of each kind Liger covers: Llama's and Qwen3's RoPE and head, Mixtral's
# experts with the router's load-balancing loss added to the fused loss.
FAMILIES = ("llama", "qwen3", "mixtral")


def _model_and_reference(arch: str, monkeypatch) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny LoRA model and its unfused copy; what Liger swaps in the family's modeling module (its RoPE, and
    its norm and MLP classes) is restored after the test."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = tiny_config(arch)
    model = __import__("transformers").AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    modeling = importlib.import_module(type(model).__module__)
    for name in dir(modeling):  # what Liger may swap module-wide: restored after the test
        if name == "apply_rotary_pos_emb" or name.endswith(("RMSNorm", "MLP")):
            monkeypatch.setattr(modeling, name, getattr(modeling, name))
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0,
                                             init_lora_weights=False))  # nonzero B: every LoRA weight gets a gradient
    return model.train(), copy.deepcopy(model).train()


def _loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from finetune.step.training_step import compute_loss

    loss = compute_loss(model, batch, num_items_in_batch=torch.tensor(20))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.skipif(not LIGER, reason=NO_LIGER)
@pytest.mark.parametrize("arch", FAMILIES)
def test_liger_fused_loss_and_rope_match_the_unfused_model_in_the_cpu_interpreter(arch, monkeypatch):
    """Liger's fused linear cross-entropy (no logits) and RoPE, applied to a LoRA model through the family's
    per-model function, give the unfused model's loss and LoRA gradients (the loop's loss: summed over the
    batch's labelled tokens, divided by the accumulated count; MoE: plus the router's loss)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when liger's kernels are first imported (this process)
    model, reference = _model_and_reference(arch, monkeypatch)
    fused = apply_kernels(model, "liger", only=("rope", "fused_linear_cross_entropy"))
    assert fused == ["rope", "fused_linear_cross_entropy"]
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :3] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    loss, grads = _loss_and_grads(model, batch)
    modeling = importlib.import_module(type(reference.get_base_model()).__module__)
    monkeypatch.undo()  # the family's own RoPE back for the reference
    assert modeling.apply_rotary_pos_emb.__module__ == modeling.__name__
    want_loss, want = _loss_and_grads(reference, batch)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want.keys() and len(grads) > 0
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.skipif(not (LIGER and torch.cuda.is_available()),
                    reason="GPU only: Liger's RMSNorm and SwiGLU kernels stop in Triton's CPU interpreter "
                           "('float' object has no attribute 'to')" if LIGER else NO_LIGER)
@pytest.mark.parametrize("arch", FAMILIES)
def test_every_liger_kernel_matches_the_unfused_model_on_a_gpu(arch, monkeypatch):
    """All of the family's kernels (RMSNorm, SwiGLU, RoPE, fused loss) on CUDA: the unfused loss and gradients
    to fp32 kernel tolerance."""
    model, reference = _model_and_reference(arch, monkeypatch)
    model, reference = model.cuda(), reference.cuda()
    assert "rms_norm" in apply_kernels(model, "liger")
    ids = torch.randint(0, 500, (2, 12), device="cuda")
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    loss, grads = _loss_and_grads(model, batch)
    monkeypatch.undo()  # the family's own RoPE back for the reference (its norms and MLPs were never swapped)
    want_loss, want = _loss_and_grads(reference, batch)
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-4)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-3, atol=1e-4, msg=name)


def _recipe(tiny_model_dir, tmp_path, training: dict | None = None, **memory) -> object:
    data = tmp_path / "d.jsonl"
    data.write_text("".join('{"prompt": "a", "completion": "b"}\n' for _ in range(40)))
    return validate_recipe({"model": {"path": str(tiny_model_dir)}, "data": {"path": str(data), "max_seq_len": 64},
                            "training": {"micro_batch_size": 2, **(training or {})}, "memory": memory,
                            "output": {"dir": str(tmp_path / "out")}})


def test_the_fused_loss_and_the_chunked_loss_are_one_choice(tiny_model_dir, tmp_path):
    """memory.kernels: liger replaces the chunked loss: both set is refused naming both keys."""
    with pytest.raises(RecipeError, match=r"memory\.kernels: liger .* replaces memory\.chunked_loss"):
        _recipe(tiny_model_dir, tmp_path, kernels="liger", chunked_loss=True)
    assert _recipe(tiny_model_dir, tmp_path, kernels="liger", chunked_loss="auto").memory.kernels == "liger"


def test_kernels_auto_is_none_where_liger_cannot_run_and_lora_on_the_head_is_refused(tiny_model_dir, tmp_path,
                                                                                    monkeypatch):
    import finetune.model.kernels as kernels

    recipe = _recipe(tiny_model_dir, tmp_path)
    assert kernel_choices(recipe, "cpu") == ["none"]
    monkeypatch.setattr(kernels, "liger_installed", lambda: True)
    monkeypatch.setattr(kernels, "liger_function", lambda model_type: print if model_type == "llama" else None)
    assert kernel_choices(recipe, "cuda") == ["none", "liger"]
    head = recipe.model_copy(update={"adapter": recipe.adapter.model_copy(update={"target_modules": ["q_proj",
                                                                                                      "lm_head"]})})
    assert kernel_choices(head, "cuda") == ["none"]
    assert "LoRA on lm_head" in kernels.liger_problem(head, cuda=True)


def test_compile_auto_is_on_only_for_runs_long_enough_to_repay_it(tiny_model_dir, tmp_path, monkeypatch):
    """training.compile: auto compiles where the run's steps reach twice the device's break-even count, not for
    short runs, runs it cannot count, MoE models or checkpointed layers; the planner writes the choice into the
    resolved recipe."""
    import finetune.model.kernels as kernels
    from finetune.plan import predict

    monkeypatch.setattr(kernels, "cxx_compiler", lambda: "g++")
    break_even = kernels.COMPILE["cpu"][1]
    short = _recipe(tiny_model_dir, tmp_path, {"compile": "auto", "max_steps": 10}, activation_checkpointing=False)
    long = _recipe(tiny_model_dir, tmp_path, {"compile": "auto", "max_steps": 2 * break_even},
                   activation_checkpointing=False)
    assert not compile_pays(short, "cpu") and compile_pays(long, "cpu")
    checkpointed = _recipe(tiny_model_dir, tmp_path, {"compile": "auto", "max_steps": 2 * break_even},
                           activation_checkpointing=True)
    assert not compile_pays(checkpointed, "cpu")  # a checkpointed layer breaks the graph: nothing to gain
    assert planned_steps(_recipe(tiny_model_dir, tmp_path, {"epochs": 3})) == 40 * 3 // 2  # 40 records, 2 a step
    monkeypatch.setattr(kernels, "cxx_compiler", lambda: None)
    assert not compile_pays(long, "cpu")
    monkeypatch.setattr(kernels, "_config_model_type", lambda path: "qwen3_moe")
    monkeypatch.setattr(kernels, "cxx_compiler", lambda: "g++")
    assert not compile_pays(long, "cpu")  # a mixture-of-experts model: its routing breaks the graph
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "cxx_compiler", lambda: "g++")
    for recipe, want in ((short, False), (long, True)):
        plan = predict(recipe)
        assert plan.settings["compile"] is want and plan.settings["kernels"] == "none"
        assert plan.apply(recipe).recipe.training.compile is want


def test_graph_breaks_are_counted():
    """What a compiled run reports: a region dynamo cannot capture (a tensor's value read in Python) counts."""
    from finetune.compat import graph_breaks

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        return y + 1 if y.sum().item() > 0 else y - 1  # data-dependent Python branch: a graph break

    before = graph_breaks()
    assert torch.compile(step, backend="eager")(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]
    assert graph_breaks() >= before + 1
