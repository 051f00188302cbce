"""model.attn_implementation: which kernel `auto` picks per family and device, and the `chunked` kernel (no s x s
scores, no dense mask) against each family's eager attention: the same losses and gradients, padded and packed."""

from __future__ import annotations

import pytest
import torch

from finetune.compat import attn_implementation as config_attn
from finetune.model import attention
from finetune.model.load import attn_implementation, load_model, model_class
from finetune.recipe.schema import AdapterConfig, ModelConfig, QuantizationConfig
from finetune.testing import make_tiny_model_dir, tiny_config

# family: config overrides (Gemma 2 with a soft-cap that bends these tiny scores and a window shorter than the batch)
FAMILIES = {"llama": {}, "qwen2": {}, "qwen3": {}, "gemma2": {"attn_logit_softcapping": 2.0, "sliding_window": 8},
            "qwen3_moe": {}, "gpt_oss": {}}


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 16 query rows, so the 40-token batches below run in several blocks."""
    monkeypatch.setattr(attention, "CHUNK_BYTES", 1)
    monkeypatch.setattr(attention, "MIN_ROWS", 16)


def _loss_and_grads(config, impl: str, batch: dict) -> tuple[float, list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    attention.register()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float32)
    model.train()
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), [p.grad for p in model.parameters() if p.grad is not None]


def _batches(vocab: int = 500) -> dict[str, dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 31:] = 0  # the second row padded
    packed = torch.cat([torch.arange(15), torch.arange(25)])[None]  # two documents in one row
    return {"padded": {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)},
            "packed": {"input_ids": ids[:1], "labels": ids[:1], "position_ids": packed, "use_cache": False}}


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_and_the_chosen_kernel_equal_eager(family, small_blocks):
    """Losses and every gradient equal eager attention's (soft-capping, sliding windows, sinks, GQA, padding, and
    packed documents kept apart without a mask), for `chunked` and for the kernel auto picks on this CPU."""
    config = tiny_config(family, **FAMILIES[family])
    for layout, batch in _batches().items():
        chosen = attn_implementation("auto", config, "cpu", packing=layout == "packed")[0]
        assert chosen != "eager"
        ref_loss, ref_grads = _loss_and_grads(config, "eager", batch)
        for impl in {"chunked", chosen}:
            loss, grads = _loss_and_grads(config, impl, batch)
            assert loss == pytest.approx(ref_loss, rel=1e-5), (family, layout, impl)
            assert len(grads) == len(ref_grads)
            for got, want in zip(grads, ref_grads, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_packed_documents_do_not_see_each_other(small_blocks):
    """A packed row's second document gets the loss it gets alone: no attention crosses the boundary."""
    config = tiny_config("gemma2", **FAMILIES["gemma2"])
    ids = _batches()["packed"]["input_ids"]
    labels = ids.clone()
    labels[:, :16] = -100  # the second document's loss (its first token has nothing before it to predict it)
    together = {"input_ids": ids, "labels": labels, "position_ids": _batches()["packed"]["position_ids"],
                "use_cache": False}
    alone = {"input_ids": ids[:, 15:], "labels": labels[:, 15:]}
    assert _loss_and_grads(config, "chunked", together)[0] == pytest.approx(
        _loss_and_grads(config, "chunked", alone)[0], rel=1e-5)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_chunked_generates_what_eager_generates(family):
    """Generation (evaluation, GRPO's rollouts) with a KV cache and left padding: the same greedy tokens."""
    from transformers import AutoModelForCausalLM

    attention.register()
    config = tiny_config(family, **FAMILIES[family])
    ids = torch.randint(4, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    generated = []
    for impl in ("eager", "chunked"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()
        generated.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                        pad_token_id=0))
    assert torch.equal(*generated)


@pytest.mark.parametrize(("family", "device", "packing", "kernel"), [
    ("llama", "cpu", False, "sdpa"),  # nothing SDPA cannot run without s x s
    ("llama", "cpu", True, "chunked"),  # packed: SDPA would need the block-diagonal mask
    ("gemma2", "cpu", False, "chunked"),  # soft-capping; flex attention has no backward on CPU
    ("gpt_oss", "cpu", False, "chunked"),  # attention sinks
    ("llama", "cuda", False, "sdpa"),
    ("llama", "cuda", True, "flex_attention"),  # flash-attention 2 is not installed here
    ("gemma2", "cuda", False, "flex_attention"),
    ("gpt_oss", "cuda", True, "flex_attention"),  # sinks through flex attention's log-sum-exp
])
def test_auto_picks_the_best_kernel_for_the_family_and_device(family, device, packing, kernel):
    assert attn_implementation("auto", tiny_config(family), device, packing) == (kernel, None)


def test_eager_only_where_nothing_else_runs_the_family_with_the_reason():
    """A model class that declares no kernel for soft-capping (here: none at all) falls back to eager and says why."""
    name, reason = attention.choose(tiny_config("gemma2"), None, "cpu", packing=True)
    assert name == "eager"
    assert "soft-capping" in reason and "packed documents" in reason and "cpu" in reason
    assert attention.choose(tiny_config("gemma2"), model_class(tiny_config("gemma2")), "cpu", True)[0] == "chunked"


def test_a_tiny_gemma2_trains_on_cpu_without_eager_attention(tmp_path, small_blocks, capsys):
    """auto loads the soft-capped, sliding-window Gemma 2 with `chunked` on CPU (nothing printed about eager), and
    a few steps on one batch lower its loss."""
    path = make_tiny_model_dir(tmp_path / "gemma2", arch="gemma2", attn_logit_softcapping=2.0, sliding_window=8)
    model, _, _ = load_model(ModelConfig(path=str(path), dtype="fp32"), QuantizationConfig(bits=None))
    assert config_attn(model.config) == "chunked"
    assert "eager" not in capsys.readouterr().out
    model.train()
    batch = _batches(model.config.vocab_size)["padded"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(4):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("attn", ["chunked", "flex_attention"])
def test_a_packed_trace_holds_no_dense_mask(attn):
    """Two rows packed into one sequence cost what two separate rows cost under chunked (CPU) and flex attention
    (CUDA): no [1, 1, 2s, 2s] mask, no s x s scores (chunked holds one block of CHUNK_BYTES scores at these
    lengths, alike in both layouts). SDPA's packed trace holds the mask (the control)."""
    from finetune.plan.trace import trace_step

    seq = 2048
    config = tiny_config("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_hidden_layers=2)
    adapter = AdapterConfig(type="lora", r=8)

    def forward(impl: str, micro_batch: int, layout: str) -> int:
        return trace_step(config, adapter, torch.float32, impl, "cpu", micro_batch, seq, 2, 0,
                          layout=layout).windows["forward"][0]

    mask = (2 * seq) ** 2  # bytes of the boolean block-diagonal mask alone
    assert forward(attn, 2, "packed") - 2 * forward(attn, 1, "full") < mask / 4
    assert forward("sdpa", 2, "packed") - 2 * forward("sdpa", 1, "full") >= mask


def test_gpt_oss_20b_qlora_at_8k_fits_16gib_on_cuda():
    """gpt-oss-20b QLoRA at 8k tokens, planned for a 16 GiB CUDA GPU: flex attention (sinks through its log-sum-exp)
    keeps no s x s scores. With eager attention the same plan needed 40 GiB at micro-batch 1."""
    from pathlib import Path

    from finetune.plan import predict
    from finetune.recipe.load import load_recipe_text

    root = Path(__file__).resolve().parents[1]
    recipe = load_recipe_text((root / "recipes/qlora-8b-24gb.yaml").read_text(), overrides=[
        f"model.path={root / 'tests/fixtures/configs/gpt-oss-20b.json'}", "memory.offload_experts=auto"])
    plan = predict(recipe, gpu_memory="16GiB", device="cuda")
    assert plan.attention == "flex_attention"
    assert plan.fits, (plan.peak_bytes, plan.settings)
