"""The training loop as configured from a recipe: exact gradient accumulation, checkpointing changes nothing."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import DataCollatorForSeq2Seq

from finetune.model.adapter import apply_adapter
from finetune.model.load import load_model
from finetune.recipe import validate_recipe
from finetune.recipe.resolved import resolve
from finetune.train.setup import make_scheduler, simple_loop


def _examples(n: int = 8) -> Dataset:
    """Variable-length examples with partly masked labels, so per-token normalisation matters."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        length = 6 + 3 * i
        ids = torch.randint(4, 400, (length,), generator=g).tolist()
        labels = [-100] * (length // 3) + ids[length // 3:]
        rows.append({"input_ids": ids, "labels": labels})
    return Dataset.from_list(rows)


def _recipe(tmp_path, model_dir, **training):
    return validate_recipe({
        "model": {"path": str(model_dir)}, "quantization": {"bits": None},
        "adapter": {"type": "full"}, "data": {"path": "unused.jsonl", "batching": "random"},
        "training": {"max_steps": 1, "learning_rate": 1.0, "warmup_ratio": 0.0, "lr_scheduler": "constant",
                     "max_grad_norm": None, **training},
        "memory": {"activation_checkpointing": False, "chunked_loss": False, "tiled_mlp": False}, "output": {"dir": str(tmp_path / "run")},
        # with SGD at lr 1 the update IS the accumulated gradient (Adam would hide its scale)
        "optimizer": {"name": "sgd"},
    })


def _one_sgd_step(tmp_path, model_dir, tokenizer, micro: int, accum: int) -> dict[str, torch.Tensor]:
    recipe = _recipe(tmp_path, model_dir, micro_batch_size=micro, gradient_accumulation_steps=accum)
    model, _, _ = load_model(recipe.model, recipe.quantization)
    model = apply_adapter(model, recipe.adapter, checkpointing=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    simple_loop(resolve(recipe), model, _examples(), DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100), 1).fit()
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


def test_gradient_accumulation_is_exact(tmp_path, tiny_model_dir, tiny_tokenizer):
    """8x1, 4x2 and 2x4 micro-batch x accumulation give the same update (token-weighted mean loss)."""
    updates = {layout: _one_sgd_step(tmp_path, tiny_model_dir, tiny_tokenizer, *layout)
               for layout in [(8, 1), (4, 2), (2, 4)]}
    reference = updates[(8, 1)]
    assert any(u.abs().sum() > 0 for u in reference.values())
    for layout in [(4, 2), (2, 4)]:
        for name, delta in updates[layout].items():
            torch.testing.assert_close(delta, reference[name], rtol=1e-4, atol=1e-7, msg=f"{layout} {name}")


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_checkpointing_gives_same_loss_and_grads(tiny_model_dir, adapter):
    from finetune.recipe.schema import AdapterConfig, ModelConfig, QuantizationConfig

    results = []
    for checkpointing in (False, True):
        model, _, _ = load_model(ModelConfig(path=str(tiny_model_dir)), QuantizationConfig(bits=None))
        torch.manual_seed(0)  # same LoRA initialisation in both runs
        model = apply_adapter(model, AdapterConfig(type=adapter, dropout=0.0), checkpointing=checkpointing)
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        ids = torch.randint(4, 400, (2, 32), generator=torch.Generator().manual_seed(3))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    (loss0, g0), (loss1, g1) = results
    assert torch.equal(loss0, loss1)
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_learning_rate_schedules(tmp_path, tiny_model_dir, schedule):
    """Linear warmup to the peak, then the recipe's shape: cosine/linear decay to 0, constant, WSD's late decay."""
    recipe = _recipe(tmp_path, tiny_model_dir, lr_scheduler=schedule, warmup_ratio=0.2, decay_ratio=0.3,
                     learning_rate=1e-3)
    model, _, _ = load_model(recipe.model, recipe.quantization)
    optimizer = torch.optim.SGD(model.parameters(), lr=recipe.training.learning_rate)
    scheduler = make_scheduler(recipe, optimizer, 10)
    lrs = []
    for _ in range(10):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == 0 and lrs[1] == pytest.approx(5e-4) and lrs[2] == pytest.approx(1e-3)  # 2 warmup steps
    after = lrs[2:]
    if schedule == "constant":
        assert after == pytest.approx([1e-3] * 8)
    elif schedule == "wsd":  # stable until the last 3 steps (decay_ratio 0.3), then decays
        assert after[:5] == pytest.approx([1e-3] * 5) and after[5] > after[6] > after[7]
    else:
        assert all(a > b for a, b in zip(after[:-1], after[1:], strict=True)) and after[-1] < 2e-4
