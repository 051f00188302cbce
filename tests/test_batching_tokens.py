"""training.effective_batch_tokens: a step carries about N real tokens instead of N examples. Its steps reach the
target without overshooting by more than the example that reached it, keep their examples under another
micro-batch (an out-of-memory recovery's), give the loss and gradient of the step's labelled-token mean, resume
exactly, and combinations that cannot work are one error naming the key."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from finetune.data.batching import Batching, epoch_steps
from finetune.data.packing import make_collator
from finetune.plan.search import auto_batching
from finetune.recipe import validate_recipe
from finetune.recipe.resolved import resolve
from finetune.rundir import read_jsonl
from finetune.train.policy import Policy
from finetune.train.run import run
from finetune.train.setup import simple_loop
from tests.run_support import text_data, tiny_lora_recipe
from tests.test_optim import load_model

LENGTHS = [3 + (37 * i) % 60 for i in range(200)]  # 3..62 tokens, in no order
TARGET = 300


def _steps(kind: str, micro: int = 4, seed: int = 1, epoch: int = 0) -> list[list[list[int]]]:
    order = torch.randperm(len(LENGTHS), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    cut = Batching(kind, micro, 1, token_budget=micro * max(LENGTHS), step_tokens=TARGET)
    return epoch_steps(order, LENGTHS, cut, seed, epoch)


@pytest.mark.parametrize("kind", ["random", "length_grouped", "token_budget"])
def test_each_step_reaches_the_token_target_and_passes_it_by_less_than_one_micro_batch(kind):
    steps = _steps(kind)
    flat = [i for s in steps for mb in s for i in mb]
    assert sorted(flat) == list(range(len(LENGTHS)))  # every example once
    for step in steps[:-1]:
        tokens = sum(LENGTHS[i] for mb in step for i in mb)
        assert tokens >= TARGET
        assert tokens - TARGET < sum(LENGTHS[i] for i in step[-1])  # over by less than its last micro-batch
    rows = [sum(map(len, s)) for s in steps[:-1]]
    assert len(set(rows)) > 1  # steps of short examples hold more of them
    if kind == "token_budget":
        assert all(len(mb) * max(LENGTHS[i] for i in mb) <= 4 * max(LENGTHS) for s in steps for mb in s)
    # the steps do not depend on the micro-batch: a recovery's smaller one (or a resume with it) keeps them
    examples = [sorted(i for mb in s for i in mb) for s in steps]
    assert [sorted(i for mb in s for i in mb) for s in _steps(kind, micro=2)] == examples
    assert [sorted(i for mb in s for i in mb) for s in _steps(kind, epoch=1)] != examples
    if kind != "random":  # grouped by length, in a shuffled order of steps
        longest = [max(LENGTHS[i] for mb in s for i in mb) for s in steps]
        assert longest != sorted(longest) and longest != sorted(longest, reverse=True)


def test_auto_prices_the_batchings_with_steps_of_tokens():
    recipe = validate_recipe({"model": {"path": "m"}, "data": {"path": "d.jsonl"},
                              "training": {"effective_batch_tokens": TARGET}})
    one = {"micro_batch_size": 4, "gradient_accumulation_steps": 1}
    assert auto_batching(recipe, one, LENGTHS, 100)[0] != "random"  # a step of tokens has rows to group
    single = {"micro_batch_size": 1, "gradient_accumulation_steps": 1}
    assert auto_batching(recipe, single, LENGTHS, 100)[1] != "one example per step: nothing to group"


class Seen(Policy):
    """Each update's gradient, the step's rows and its loss; applies nothing (the learning rate is ~0)."""

    def __init__(self):
        self.grads, self.rows, self.losses, self.passes = [], [], [], []

    def on_step_begin(self, loop, step):
        self.rows.append([r for rows in step.batches for r in rows])
        self.passes.append(len(step.batches))

    def before_update(self, loop, update):
        self.grads.append({n: p.grad.clone() for n, p in loop.model.named_parameters() if p.grad is not None})

    def on_step_end(self, loop, step):
        self.losses.append(float(step.loss))


@pytest.mark.parametrize("kind", ["length_grouped", "token_budget"])
def test_a_step_of_tokens_has_the_loss_and_gradient_of_its_labelled_token_mean(tiny_model_dir, tiny_tokenizer,
                                                                               kind):
    lengths = [3, 45, 7, 30, 9, 40, 5, 35, 12, 50]  # 236 tokens: a first step of >= 120, the rest a second
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": [-100] * 2 + ids[2:]}
            for ids in (torch.randint(4, 400, (n,), generator=gen).tolist() for n in lengths)]
    config = resolve(validate_recipe({
        "model": {"path": str(tiny_model_dir)}, "data": {"path": "unused.jsonl", "batching": kind},
        "adapter": {"type": "full"}, "quantization": {"bits": None},
        "training": {"max_steps": 2, "micro_batch_size": 2, "effective_batch_tokens": 120, "learning_rate": 1e-9,
                     "noise_scale": False, "max_grad_norm": None},
        "memory": {"activation_checkpointing": False, "chunked_loss": False, "tiled_mlp": False}}))
    model = load_model(tiny_model_dir)
    reference = copy.deepcopy(model)
    seen = Seen()
    collator = make_collator(tiny_tokenizer, packed=False)
    simple_loop(config, model, data, collator, 2, policies=[seen]).fit()
    tokens = [sum(len(r["input_ids"]) for r in rows) for rows in seen.rows]
    assert tokens[0] >= 120 and sum(tokens) == sum(lengths) and max(seen.passes) > 1  # accumulated micro-batches
    # the reference: the first step's examples as one padded batch, the loss their labelled tokens' mean
    batch = collator(seen.rows[0])
    out = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
    out.loss.backward()
    assert seen.losses[0] == pytest.approx(float(out.loss.detach()), rel=1e-5)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(seen.grads[0][name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_steps_of_tokens_resume_exactly_and_an_epoch_counts_its_steps(tmp_path, tiny_model_dir):
    data = text_data(tmp_path / "data.jsonl", [4 + (11 * i) % 58 for i in range(36)])
    recipe = tiny_lora_recipe(tiny_model_dir, data, tmp_path / "whole", {
        "data": {"batching": "length_grouped"},
        "training": {"epochs": 1, "micro_batch_size": 2, "effective_batch_tokens": 200, "learning_rate": 1e-3},
        "output": {"save_steps": 3, "save_total_limit": 10}})
    whole = run(validate_recipe(recipe))
    losses = {r["step"]: r["loss"] for r in read_jsonl(whole.run_dir / "metrics.jsonl") if "loss" in r}
    assert json.loads((whole.run_dir / "results.json").read_text())["batch"]["effective_batch_tokens"] == 200
    tokens = sum(4 + (11 * i) % 58 for i in range(36)) + 36  # each record's text and its end-of-text token
    assert len(losses) in (tokens // 200, tokens // 200 + 1)  # one epoch of steps of >= 200 tokens
    last = max(losses)
    copied = tmp_path / "resumed"
    shutil.copytree(whole.run_dir, copied)
    assert last > 3
    for later in (copied / "checkpoints").iterdir():
        if later.name != "checkpoint-3":
            shutil.rmtree(later)
    run(validate_recipe({**recipe, "output": {**recipe["output"], "dir": str(copied)}}), resume=True)
    again = {r["step"]: r["loss"] for r in read_jsonl(copied / "metrics.jsonl") if "loss" in r}
    assert sorted(again) == sorted(losses) == list(range(1, last + 1))
    for step, loss in losses.items():
        assert again[step] == pytest.approx(loss, rel=1e-6), step


@pytest.mark.parametrize(("sections", "says"), [
    ({"training": {"effective_batch_size": 32}}, "training.effective_batch_size=32"),
    ({"training": {"effective_batch_size": "auto"}}, "training.effective_batch_size=auto"),
    ({"training": {"method": "grpo"}}, "training.method=grpo"),
    ({"training": {"reference_batch_size": 16}}, "training.reference_batch_size=16"),
    ({"data": {"path": "d", "packing": True}}, "data.packing"),
    ({"distributed": {"gpus": 2}}, "distributed.gpus=2"),
    ({"optimizer": {"layerwise": True}}, "optimizer.layerwise"),
])
def test_a_combination_steps_of_tokens_cannot_run_is_one_error_naming_both_keys(sections, says):
    from finetune.errors import RecipeError

    recipe = {"model": {"path": "m"}, "data": {"path": "d"}, **sections}
    recipe["training"] = {**recipe.get("training", {}), "effective_batch_tokens": 4096}
    with pytest.raises(RecipeError) as info:
        validate_recipe(recipe)
    message = str(info.value) + " ".join(info.value.problems)
    assert "training.effective_batch_tokens" in message and says in message
