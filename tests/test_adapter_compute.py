"""adapter.fp32_compute: false runs LoRA matmuls in the model's dtype with fp32 weights and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from finetune.memory.tracker import measure_step
from finetune.model.adapter import WeightCastLinear, apply_adapter
from finetune.model.load import disable_cpu_4bit_repack
from finetune.recipe.schema import AdapterConfig


def _model(model_dir, fp32_compute: bool, bits: int | None = None, adapter: str = "lora"):
    quant = None
    if bits == 4:
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, quantization_config=quant)
    disable_cpu_4bit_repack(model)
    torch.manual_seed(0)
    cfg = AdapterConfig(type=adapter, r=8, dropout=0.0, fp32_compute=fp32_compute)
    model = apply_adapter(model, cfg, checkpointing=False)
    with torch.no_grad():  # B starts at zero: give every adapter a value so all gradients are non-trivial
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.train()
    return model


def _ids() -> torch.Tensor:
    return torch.randint(4, 300, (2, 64), generator=torch.Generator().manual_seed(1))


def _grads(model) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("bits", [None, 4], ids=["lora", "qlora"])
def test_fp32_master_weights_and_grads_match_fp32_compute(tiny_model_dir, bits):
    fast, exact = _model(tiny_model_dir, False, bits), _model(tiny_model_dir, True, bits)
    assert any(isinstance(m, WeightCastLinear) for m in fast.modules())
    assert not any(isinstance(m, WeightCastLinear) for m in exact.modules())
    got, want = _grads(fast), _grads(exact)
    assert got.keys() == want.keys()
    for name, g in got.items():
        assert g.dtype == torch.float32, name
        assert dict(fast.named_parameters())[name].dtype == torch.float32
        # the same gradient up to bf16 rounding of the adapter matmuls
        cos = torch.nn.functional.cosine_similarity(g.flatten(), want[name].flatten(), dim=0)
        assert cos > 0.99, (name, cos)


def test_no_fp32_copies_of_layer_inputs(tiny_model_dir):
    def peak_above_weights(model) -> int:
        ids = _ids()
        result = measure_step(lambda _t: model(input_ids=ids, labels=ids).loss.backward(), model=model,
                              vocab_size=model.config.vocab_size)
        b = result["breakdown"]
        return result["peak_bytes"] - b["weights"] - b["trainable_weights"] - b["logits_and_loss"]

    fast, exact = peak_above_weights(_model(tiny_model_dir, False)), peak_above_weights(_model(tiny_model_dir, True))
    # seven adapted projections per layer keep a fp32 copy of their input with fp32_compute
    assert fast < 0.8 * exact, (fast, exact)


def test_training_learns_as_well(tiny_model_dir):
    """30 AdamW steps on one batch in bf16: the loss falls as far as with fp32 adapter compute."""
    finals = []
    for fp32_compute in (False, True):
        model = _model(tiny_model_dir, fp32_compute)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        ids = _ids()
        losses = []
        for _ in range(30):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < 0.5 * losses[0]
        finals.append(losses[-1])
    assert finals[0] < 1.1 * finals[1], finals


def test_dora_keeps_peft_casting(tiny_model_dir):
    from peft.tuners.lora import LoraLayer

    model = _model(tiny_model_dir, False, adapter="dora")
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    assert layers and all(m.cast_input_dtype_enabled for m in layers)
    assert not any(isinstance(m, WeightCastLinear) for m in model.modules())


def test_bf16_adapter_weights_grads_and_optimizer_state(tiny_model_dir):
    """adapter.dtype bf16: the build casts what is trained, so gradients and AdamW state are bf16 too."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    model = apply_adapter(model, AdapterConfig(r=8, dropout=0.0, dtype="bf16"), checkpointing=False)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.bfloat16 for p in trained)
    opt = torch.optim.AdamW(trained, lr=1e-3)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert all(p.grad.dtype == torch.bfloat16 for p in trained)
    assert all(s["exp_avg"].dtype == torch.bfloat16 and s["exp_avg_sq"].dtype == torch.bfloat16
               for s in opt.state.values())
    fp32 = apply_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16),
                         AdapterConfig(r=8, dropout=0.0), checkpointing=False)
    assert all(p.dtype == torch.float32 for p in fp32.parameters() if p.requires_grad)


@pytest.mark.parametrize(("adapter", "key"), [({"type": "full", "dtype": "bf16"}, "adapter.dtype=bf16 applies"),
                                              ({"dtype": "bf16", "fp32_compute": True}, "adapter.fp32_compute")])
def test_bf16_adapter_refused_where_it_cannot_apply(adapter, key):
    from pydantic import ValidationError

    from finetune.recipe.schema import Recipe

    with pytest.raises(ValidationError, match=key):
        Recipe.model_validate({"model": {"path": "m"}, "data": {"path": "d"}, "quantization": {"bits": None},
                               "adapter": adapter})
