"""Recomputed norms and the tiled MLP: the same gradients as the plain layers, less memory, hooks once."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from finetune.memory.layer_recompute import apply_layer_recompute, recompute_norms, tile_mlps
from finetune.memory.offload import ActivationOffload
from finetune.memory.tracker import measure_step
from finetune.model.adapter import apply_adapter
from finetune.recipe.schema import AdapterConfig
from finetune.testing import tiny_config

SEQ = 96  # 6 chunks of 16, the last one full; 100 below tests a ragged last chunk


def _model(arch: str, adapter: str, checkpointing: bool, dtype=torch.float32, dropout: float = 0.0,
           layers: int = 2, **dims):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, num_hidden_layers=layers, **dims), dtype=dtype)
    model = apply_adapter(model, AdapterConfig(type=adapter, r=4, dropout=dropout), checkpointing=checkpointing)
    if adapter != "full":  # B starts at zero: give the adapters a value so every gradient is non-trivial
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    model.train()
    return model


def _ids(seq: int = SEQ, batch: int = 2) -> torch.Tensor:
    return torch.randint(4, 500, (batch, seq), generator=torch.Generator().manual_seed(1))


def _loss_and_grads(model, ids, offload=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    if offload is None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    else:
        with offload:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_close(got, want, rtol=1e-4, atol=1e-6):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
@pytest.mark.parametrize("arch,adapter", [("llama", "lora"), ("llama", "full"), ("gemma2", "lora"),
                                          ("phi3", "lora"), ("qwen2", "full"), ("mistral", "lora")])
def test_same_loss_and_gradients_as_plain_layers(arch, adapter, checkpointing):
    plain = _model(arch, adapter, checkpointing)
    tiled = copy.deepcopy(plain)
    assert recompute_norms(tiled, 16) > 0
    assert tile_mlps(tiled, 16) == 2
    for seq in (SEQ, 100):
        want_loss, want = _loss_and_grads(plain, _ids(seq))
        got_loss, got = _loss_and_grads(tiled, _ids(seq))
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
        assert all(g.abs().sum() > 0 for g in got.values())
        _assert_close(got, want)


def test_gradients_with_dropout_are_those_of_the_forward():
    """LoRA dropout draws different masks per chunk than the plain MLP does, so compare with the derivative of
    the loss the tiled forward computed: central differences in float64 with the same random seed. A
    backward that replayed other masks than its forward would miss this by orders of magnitude."""
    model = _model("llama", "lora", checkpointing=True, dtype=torch.float64, dropout=0.3)
    apply_layer_recompute(model, True, 16)
    ids = _ids(48, 1)

    def loss() -> torch.Tensor:  # in float64 (transformers' own loss upcasts to float32 only)
        torch.manual_seed(0)
        logits = model(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    params = {n: p for n, p in model.named_parameters() if p.requires_grad and "mlp" in n}
    analytic_grads = torch.autograd.grad(loss(), list(params.values()))
    direction = [torch.randn_like(p) for p in params.values()]

    def loss_at(eps: float) -> float:  # with grad enabled: the tiled path, whose chunks draw the masks
        with torch.no_grad():
            for p, d in zip(params.values(), direction, strict=True):
                p.add_(d, alpha=eps)
        value = loss().item()
        with torch.no_grad():
            for p, d in zip(params.values(), direction, strict=True):
                p.sub_(d, alpha=eps)
        return value

    eps = 1e-5
    numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
    analytic = sum((g * d).sum().item() for g, d in zip(analytic_grads, direction, strict=True))
    # RMSNorm computes in float32 even in a float64 model: agreement to ~1e-3, a wrong mask is off by O(1)
    assert analytic == pytest.approx(numeric, rel=1e-2)


def test_gradient_hooks_fire_once_per_backward():
    """The chunks' parameter gradients are summed before autograd sees them: layer-wise optimizers step once."""
    model = _model("llama", "lora", checkpointing=True)
    apply_layer_recompute(model, True, 16)
    calls: dict[str, int] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _p, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    _loss_and_grads(model, _ids())
    assert calls and set(calls.values()) == {1}
    assert any("mlp" in n for n in calls)


def test_with_disk_offload(tmp_path):
    plain = _model("llama", "lora", checkpointing=True, layers=4)
    tiled = copy.deepcopy(plain)
    apply_layer_recompute(tiled, True, 16)
    _, want = _loss_and_grads(plain, _ids())
    offload = ActivationOffload(tiled, "disk", min_size=1024, offload_dir=tmp_path)
    try:
        _, got = _loss_and_grads(tiled, _ids(), offload)
        assert offload.stats["offloaded_tensors"] > 0
    finally:
        offload.close()
    _assert_close(got, want)
    assert not any(tmp_path.iterdir())


def _peak(model, ids) -> int:
    """Peak bytes above the model's own weights."""
    def step(_tracker):
        model(input_ids=ids, labels=ids).loss.backward()
    result = measure_step(step, model=model, vocab_size=model.config.vocab_size)
    model.zero_grad(set_to_none=True)
    return result["peak_bytes"] - result["breakdown"]["weights"] - result["breakdown"]["trainable_weights"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peak_activations_shrink(dtype):
    """Checkpointed LoRA at a sequence 16x the chunk: recomputed norms shave the norms' fp32 work, the tiled
    MLP the MLP intermediates (intermediate 4x hidden, so they dominate the recomputed layer)."""
    dims = {"hidden_size": 256, "intermediate_size": 1024}
    ids = _ids(512, 1)
    plain = _model("llama", "lora", True, dtype, **dims)
    norms = copy.deepcopy(plain)
    recompute_norms(norms, 32)
    both = copy.deepcopy(norms)
    tile_mlps(both, 32)
    sizes = [_peak(m, ids) for m in (plain, norms, both)]
    assert sizes[1] < sizes[0]
    assert sizes[2] < 0.6 * sizes[0], sizes


def test_eval_and_short_inputs_use_the_plain_forward():
    model = _model("llama", "lora", checkpointing=False)
    reference = copy.deepcopy(model)
    apply_layer_recompute(model, True, 16)
    ids = _ids(SEQ)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
    short = _ids(8)
    _, got = _loss_and_grads(model, short)
    _, want = _loss_and_grads(reference, short)
    _assert_close(got, want)


def test_compile_applied_per_layer_on_the_cpu_too(tiny_model_dir):
    """training.compile: every decoder layer is compiled in place, on the CPU as on CUDA (lazily: nothing is
    built before the first forward; benchmarks/compile.py trains both ways and compares)."""
    from finetune.memory import layer_recompute
    from finetune.model.family import decoder_layers

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    layers = decoder_layers(model)
    assert layer_recompute.compile_layers(model, False) == 0
    assert all(layer._compiled_call_impl is None for layer in layers)
    assert layer_recompute.compile_layers(model, True) == len(layers) > 0
    assert all(layer._compiled_call_impl is not None for layer in layers)
