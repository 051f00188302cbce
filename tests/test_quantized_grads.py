"""QLoRA: 4-bit layers are real Linear4bit and LoRA gradients through them equal an fp32 reference."""

from __future__ import annotations

import copy

import pytest
import torch

from finetune.model.adapter import apply_adapter
from finetune.model.load import disable_cpu_4bit_repack, load_model
from finetune.recipe.schema import AdapterConfig, ModelConfig, QuantizationConfig

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is a core dependency; its absence is an install bug")


def _dequantized_fp32_copy(model4: torch.nn.Module) -> torch.nn.Module:
    """An fp32 model whose Linear weights are exactly the dequantized 4-bit weights, same LoRA weights."""
    ref = copy.deepcopy(model4)
    for module in list(ref.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, bnb.nn.Linear4bit):
                w = bnb.functional.dequantize_4bit(child.weight.data, child.weight.quant_state).float()
                lin = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                lin.weight.data.copy_(w)
                lin.weight.requires_grad_(False)
                if child.bias is not None:
                    lin.bias.data.copy_(child.bias.data.float())
                setattr(module, child_name, lin)
    return ref


def _lora_grads(model, ids) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture
def qlora_model(tiny_model_dir):
    model, _, _ = load_model(ModelConfig(path=str(tiny_model_dir)), QuantizationConfig(bits=4))
    model = apply_adapter(model, AdapterConfig(r=8, dropout=0.0), checkpointing=False)
    torch.manual_seed(0)
    for n, p in model.named_parameters():  # give lora_B non-zero values so lora_A gets gradients too
        if "lora_B" in n:
            p.data.normal_(0, 0.02)
    return model


def test_layers_are_real_linear4bit(qlora_model):
    linears = [m for m in qlora_model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    assert all(m.weight.dtype == torch.uint8 for m in linears)
    assert all(m.support_avx512bf16_for_cpu is False for m in linears)


def test_lora_grads_match_fp32_dequantized_reference(qlora_model):
    ids = torch.randint(4, 400, (2, 24), generator=torch.Generator().manual_seed(1))
    reference = _dequantized_fp32_copy(qlora_model)
    got, want = _lora_grads(qlora_model, ids), _lora_grads(reference, ids)
    assert got.keys() == want.keys() and len(got) > 0
    for name in got:
        assert got[name].abs().sum() > 0, f"{name}: gradient is zero"
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_grads_survive_eval_and_generate(qlora_model):
    """The AVX512-BF16 repack pitfall: a no-grad forward must not zero later gradients."""
    ids = torch.randint(4, 400, (1, 16), generator=torch.Generator().manual_seed(2))
    before = _lora_grads(qlora_model, ids)
    qlora_model.eval()
    with torch.no_grad():
        qlora_model(input_ids=ids)
        qlora_model.generate(input_ids=ids[:, :4], max_new_tokens=3, do_sample=False)
    qlora_model.train()
    after = _lora_grads(qlora_model, ids)
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=1e-4, atol=1e-6, msg=name)


def test_repack_guard_is_what_keeps_the_flag_off(qlora_model):
    """The loader's guard sets the flag that bitsandbytes checks before repacking for inference."""
    linears = [m for m in qlora_model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in linears:
        m.support_avx512bf16_for_cpu = True
    assert disable_cpu_4bit_repack(qlora_model) == len(linears)
    assert not any(m.support_avx512bf16_for_cpu for m in linears)
