"""Mixture-of-experts models with `quantization.bits: 4`: loaded so that the unquantized experts of the whole
model are never resident at once (each fused expert weight stored in 4 bits as it arrives), with the losses of
the load-then-quantize path; expert LoRA, full fine-tuning and DoRA planned like any other run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from finetune.cli import main
from finetune.rundir import read_jsonl
from finetune.testing import MOE_ARCHITECTURES, make_tiny_model_dir
from tests.run_support import three_step_recipe as _recipe

# experts dominate the weights and there are several MoE layers: the whole model's unquantized experts are
# many times one layer's
LAYERS = 8
BIG_EXPERTS = {"num_hidden_layers": LAYERS, "moe_intermediate_size": 64}


def _expert_bytes(folder: Path) -> tuple[int, int]:
    """(the whole model's, the largest layer's) unquantized fused expert bytes, from a model loaded plain."""
    from transformers import AutoModelForCausalLM

    from finetune.model.moe import moe_blocks

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    per_layer = [sum(getattr(b.experts, w).nbytes for w in b.weights) for b in moe_blocks(model)]
    return sum(per_layer), max(per_layer)


def _load_peak(load) -> tuple[torch.nn.Module, int]:
    """The model `load()` returns and the bytes its load held above what stays (the tensor tracker on cpu)."""
    from finetune.memory.tracker import MemoryTracker

    tracker = MemoryTracker(device="cpu")
    with tracker:
        model = load()
    return model, tracker.peak - tracker.current


def _loss_and_input_grad(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(5))
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    loss = model(inputs_embeds=embeds, labels=ids).loss
    loss.backward()
    return loss.detach(), embeds.grad


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_four_bit_load_holds_one_expert_weight_unquantized_at_a_time(tmp_path, arch):
    """bits 4: each fused expert weight is stored in 4 bits as transformers sets it, so the load's transient
    bytes stay within about one layer's unquantized experts (the load-then-quantize path holds all of them); the
    stored experts give the same loss and gradients as that path."""
    from transformers import AutoModelForCausalLM

    from finetune.memory.expert_offload import expert_bytes
    from finetune.model.expert_store import quantize_experts
    from finetune.model.load import load_model, quantization_config
    from finetune.model.moe import moe_blocks, use_finetune_experts
    from finetune.recipe.schema import ModelConfig, QuantizationConfig

    overrides = BIG_EXPERTS if arch == "qwen3_moe" else {"num_hidden_layers": LAYERS, "intermediate_size": 64,
                                                          "layer_types": ["sliding_attention", "full_attention"] * 4}
    folder = make_tiny_model_dir(tmp_path / "model", arch, **overrides)
    quant = QuantizationConfig(bits=4)
    whole, layer = _expert_bytes(folder)
    assert whole >= LAYERS * layer

    model, streamed = _load_peak(lambda: load_model(ModelConfig(path=str(folder)), quant)[0])
    blocks = moe_blocks(model)
    assert len(blocks) == LAYERS and all(not any(p.dim() == 3 for p in b.experts.parameters()) for b in blocks)
    # a layer's fused weight and the per-expert tensors transformers stacks into it: within two layers' bytes
    assert streamed <= 2 * layer < whole / 3, (streamed, layer, whole)

    def load_then_quantize():
        plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map={"": "cpu"},
                                                     quantization_config=quantization_config(quant, torch.float32))
        use_finetune_experts(plain)
        quantize_experts(plain, quant)
        return plain

    reference, after = _load_peak(load_then_quantize)
    # what the streamed load avoids: every unquantized expert at once (less their 4-bit copies, which stay)
    assert after >= whole - expert_bytes(reference)
    (loss, grad), (ref_loss, ref_grad) = _loss_and_input_grad(model), _loss_and_input_grad(reference)
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)


def test_export_load_keeps_the_experts_unquantized(tmp_path):
    """quantize=False (export's merge) loads the experts as they are, whatever quantization.bits says."""
    from finetune.model.load import load_model
    from finetune.model.moe import moe_blocks
    from finetune.recipe.schema import ModelConfig, QuantizationConfig

    folder = make_tiny_model_dir(tmp_path / "model", "qwen3_moe")
    model = load_model(ModelConfig(path=str(folder)), QuantizationConfig(bits=4), quantize=False)[0]
    assert all(getattr(b.experts, w).dim() == 3 and not getattr(b.experts, w).is_meta
               for b in moe_blocks(model) for w in b.weights)


def _trains_within_plan(tmp_path: Path, path: Path, capsys) -> list[dict]:
    """`finetune run` trains 3 steps, its plan within 5% of the measured peak; the metrics rows."""
    assert main(["run", str(path)]) == 0, capsys.readouterr().err
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["loss"] == r["loss"] for r in rows)
    planned = json.loads((tmp_path / "run" / "plan.json").read_text())["peak_bytes"]
    measured = max(r["peak_memory_bytes"] for r in rows)
    assert abs(planned - measured) <= 0.05 * measured, (planned, measured)
    return rows


METHODS = {"full": {"adapter": {"type": "full"}}, "dora": {"adapter": {"type": "dora"}},
           "qdora": {"adapter": {"type": "dora"}, "quantization": {"bits": 4}}}


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("arch", list(MOE_ARCHITECTURES))
def test_moe_family_trains_full_and_dora_with_its_plan(tmp_path, arch, method, capsys):
    """Every MoE family trains with full fine-tuning (its experts trained too) and with DoRA (on
    attention, shared and dense layers; with bits 4 over 4-bit experts), planned within 5% of the measured
    peak."""
    _trains_within_plan(tmp_path, _recipe(tmp_path, arch, METHODS[method]), capsys)
    saved = tmp_path / "run" / "adapter"
    if method == "full":  # the saved model's expert weights moved from the starting ones
        from safetensors.torch import load_file

        before, after = load_file(tmp_path / "model" / "model.safetensors"), load_file(saved / "model.safetensors")
        experts = [k for k in before if ".experts." in k]
        assert experts and any(not torch.equal(before[k], after[k]) for k in experts)
    else:
        config = json.loads((saved / "adapter_config.json").read_text())
        assert config["use_dora"] and not config.get("target_parameters")


EXPERT_LORA_CASES = [(arch, {}) for arch in MOE_ARCHITECTURES] + [
    ("qwen3_moe", {"activation_checkpointing": True, "chunked_loss": True}),
    ("gpt_oss", {"activation_checkpointing": True})]


@pytest.mark.parametrize(("arch", "memory"), EXPERT_LORA_CASES,
                         ids=[f"{a}-{'-'.join(m) or 'plain'}" for a, m in EXPERT_LORA_CASES])
def test_target_experts_plans_like_any_run(tmp_path, arch, memory, capsys):
    """adapter.target_experts needs no `memory.plan: false`: the planner traces peft's LoRA on the fused expert
    weights (the update folded into each layer's expert stack, its whole-stack gradient per routed expert)
    and the plan is within 5% of the measured peak; the expert LoRA is trained and saved."""
    path = _recipe(tmp_path, arch, {"adapter": {"target_experts": True}}, {"memory": memory})
    _trains_within_plan(tmp_path, path, capsys)
    config = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] and all(p.startswith("experts.") for p in config["target_parameters"])


@pytest.mark.parametrize(("method", "words"), [
    ("dora", ("adapter.target_experts", "adapter.type=lora", "no DoRA")),
    ("full", ("adapter.target_experts", "adapter.type=full", "already trains every weight"))])
def test_target_experts_with_dora_or_full_is_one_line(tmp_path, capsys, method, words):
    """peft's LoRA on fused expert weights has no DoRA, and a full fine-tune trains the experts anyway: the
    recipe is refused in one line naming the keys, exit 2, nothing written."""
    path = _recipe(tmp_path, "qwen3_moe", METHODS[method], {"adapter": {"target_experts": True}})
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if line.startswith("error:")]) == 1 and "Traceback" not in "\n".join(err)
    assert any(all(w in line for w in words) for line in err), err
    assert not (tmp_path / "run").exists()
