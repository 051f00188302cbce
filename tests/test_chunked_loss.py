"""The chunked loss equals transformers' loss and gradients, and never holds all the logits."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from finetune.errors import FinetuneError
from finetune.memory.chunked_loss import causal_lm_loss, default_chunk_size
from finetune.testing import make_tiny_model_dir

CHUNK = 7  # does not divide the number of labelled tokens: the last chunk is short


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    # A soft-cap small enough to bend these tiny logits (Gemma-2 ships 30 for real ones).
    return make_tiny_model_dir(tmp_path_factory.mktemp("gemma2"), arch="gemma2", final_logit_softcapping=0.2)


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 300, (2, 24), generator=g)
    labels = ids.clone()
    labels[:, :6] = -100  # prompt tokens
    labels[1, 18:] = -100  # padding
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def loss_and_grads(model, fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss = fn()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def assert_same(model, inputs, num_items_in_batch=None):
    kwargs = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
    want, want_grads = loss_and_grads(model, lambda: model(**inputs, **kwargs).loss)
    got, got_grads = loss_and_grads(
        model, lambda: causal_lm_loss(model, inputs, num_items_in_batch=num_items_in_batch, chunk_size=CHUNK))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert len(got_grads) == len(want_grads) > 0
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)  # fp32, summed over chunks in another order
    return got


def load(path, **kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    model.train()
    return model


@pytest.mark.parametrize("num_items", [None, 29], ids=["mean", "num_items_in_batch"])
def test_matches_plain_loss(tiny_model_dir, num_items):
    model = load(tiny_model_dir)
    loss = assert_same(model, make_batch(), None if num_items is None else torch.tensor(num_items))
    assert torch.isfinite(loss)


def test_num_items_in_batch_gives_exact_accumulation(tiny_model_dir):
    """Two micro-batches each divided by the total label count sum to the loss of the whole batch."""
    model = load(tiny_model_dir)
    a, b = make_batch(0), make_batch(1)
    total = sum(int((x["labels"][:, 1:] != -100).sum()) for x in (a, b))
    both = {k: torch.cat([a[k], b[k]]) for k in a}
    whole = causal_lm_loss(model, both, chunk_size=CHUNK)
    parts = sum(causal_lm_loss(model, x, num_items_in_batch=torch.tensor(total), chunk_size=CHUNK) for x in (a, b))
    torch.testing.assert_close(parts, whole, rtol=1e-6, atol=0)


def test_gemma2_soft_capping(gemma2_dir):
    model = load(gemma2_dir, attn_implementation="eager")
    assert model.config.final_logit_softcapping == 0.2
    assert_same(model, make_batch())
    model.config.final_logit_softcapping = None  # the cap matters: without it the loss differs
    uncapped = causal_lm_loss(model, make_batch(), chunk_size=CHUNK)
    model.config.final_logit_softcapping = 0.2
    assert abs(uncapped.item() - causal_lm_loss(model, make_batch(), chunk_size=CHUNK).item()) > 1e-3


@pytest.mark.parametrize("placement", ["lora_on_lm_head", "lm_head_in_modules_to_save"])
def test_peft_model(tiny_model_dir, placement):
    from peft import LoraConfig, get_peft_model

    if placement == "lora_on_lm_head":
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"])
    else:
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                            modules_to_save=["lm_head"])
    model = get_peft_model(load(tiny_model_dir), config)
    head_params = [n for n, p in model.named_parameters() if p.requires_grad and "lm_head" in n]
    assert head_params  # the head itself is trained, so its gradients are compared too
    # Make LoRA B non-zero so the adapted head differs from the base head.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(3))
    assert_same(model, make_batch(), torch.tensor(31))


class LargestLogits(TorchDispatchMode):
    """The largest tensor any op returns whose last dimension is the vocabulary: logits and their gradient,
    leaving out the LM head weight (hidden x vocab when transposed) and its gradient."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.vocab, self.largest = model.config.vocab_size, 0
        self.weight_shape = (model.config.hidden_size, self.vocab)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (isinstance(out, torch.Tensor) and out.dim() and out.shape[-1] == self.vocab
                and tuple(out.shape) != self.weight_shape):
            self.largest = max(self.largest, out.numel())
        return out


def test_full_logits_never_exist(tiny_model_dir):
    model = load(tiny_model_dir)
    vocab = model.config.vocab_size
    inputs = make_batch()
    with LargestLogits(model) as plain:
        model(**inputs).loss.backward()
    with LargestLogits(model) as chunked:
        causal_lm_loss(model, inputs, chunk_size=CHUNK).backward()
    assert plain.largest == inputs["input_ids"].numel() * vocab
    assert 0 < chunked.largest <= CHUNK * vocab


def test_default_chunk_size_bounds_logits():
    for vocab in (512, 32_000, 128_256, 256_000):
        size = default_chunk_size(vocab)
        assert size & (size - 1) == 0 and 64 <= size <= 8192
        assert size * vocab * 4 <= 64 << 20 or size == 64


def test_heads_that_rescale_logits_are_refused(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path, arch="llama")
    model = load(model_dir)
    model.config.logits_scaling = 4.0  # as Granite's config has
    with pytest.raises(FinetuneError, match="logits_scaling") as info:
        causal_lm_loss(model, make_batch())
    assert "memory.chunked_loss: false" in info.value.hint
