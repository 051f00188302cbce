"""data.batching (finetune/data/batching.py): length-grouped and token-budget micro-batches pad far less than
random ones, keep the order shuffled, give the full-batch gradient and resume exactly."""

from __future__ import annotations

import copy
import shutil
from dataclasses import replace

import pytest
import torch

from finetune.data.batching import Batching, epoch_order, epoch_shape, epoch_steps, run_micro_batches
from finetune.data.packing import make_collator
from finetune.plan.search import auto_batching
from finetune.recipe import validate_recipe
from finetune.recipe.resolved import resolve
from finetune.rundir import read_jsonl
from finetune.train.loop import TrainLoop
from finetune.train.policy import Policy
from finetune.train.run import run
from finetune.train.setup import simple_loop
from tests.run_support import text_data, tiny_lora_recipe
from tests.test_optim import load_model

LENGTHS = [3 + (37 * i) % 60 for i in range(200)]  # 3..62 tokens, in no order


def _steps(kind: str, seed: int, epoch: int = 0, micro: int = 4, accumulation: int = 2) -> list[list[list[int]]]:
    order = torch.randperm(len(LENGTHS), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return epoch_steps(order, LENGTHS, Batching(kind, micro, accumulation, token_budget=micro * max(LENGTHS)),
                       seed, epoch)


@pytest.mark.parametrize("step_tokens", [None, 400], ids=["examples", "tokens"])
@pytest.mark.parametrize("kind", ["random", "length_grouped"])
def test_the_planner_cuts_the_loops_micro_batches_and_a_recoverys_halves(kind, step_tokens):
    """run_micro_batches (what the plan prices) are the loop's micro-batches, from the loop's permutation, over
    the run's steps; at half the micro-batch and twice the accumulation (an out-of-memory recovery's re-plan)
    they are the halves the loop then runs (TrainLoop.cut_rows: consecutive parts of part_rows rows)."""
    cut = Batching(kind, 4, 2, step_tokens=step_tokens)
    steps = epoch_steps(epoch_order(len(LENGTHS), 7, 0), LENGTHS, cut, 7, 0)
    assert run_micro_batches(LENGTHS, cut, 7, 1.0, None, 4) == [mb for step in steps for mb in step]
    assert run_micro_batches(LENGTHS, cut, 7, 1.0, 3, 4) == [mb for step in steps[:3] for mb in step]
    halves = run_micro_batches(LENGTHS, replace(cut, micro_batch=2, accumulation=4), 7, 2.0, None, 4)
    assert halves == [mb[i:i + 2] for e in range(2) for step in
                      epoch_steps(epoch_order(len(LENGTHS), 7, e), LENGTHS, cut, 7, e) for mb in step
                      for i in range(0, len(mb), 2)]
    assert run_micro_batches(LENGTHS, cut, 7, 5.0, None, 4) is None  # more epochs than cut: the plan's bound


@pytest.mark.parametrize("kind", ["length_grouped", "token_budget"])
def test_every_example_once_per_epoch_in_an_order_that_follows_the_seed_and_the_epoch(kind):
    first = _steps(kind, seed=1)
    flat = [i for step in first for mb in step for i in mb]
    assert sorted(flat) == list(range(len(LENGTHS)))  # all seen, none twice
    assert [sum(map(len, s)) for s in first[:-1]] == [8] * (len(first) - 1)  # the effective batch in examples
    assert _steps(kind, seed=1) == first  # a function of (seed, epoch): a resume finds the same steps
    for other in (_steps(kind, seed=2), _steps(kind, seed=1, epoch=1)):
        assert sorted(i for s in other for mb in s for i in mb) == list(range(len(LENGTHS)))
        assert [sorted(i for mb in s for i in mb) for s in other] != [sorted(i for mb in s for i in mb) for s in first]
    # shuffled at the step level: the steps' longest examples are not in sorted order
    longest = [max(LENGTHS[i] for mb in s for i in mb) for s in first]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)


def test_token_budget_micro_batches_hold_more_short_rows_within_the_budget():
    steps = _steps("token_budget", seed=0)
    budget = 4 * max(LENGTHS)
    rows = [len(mb) for s in steps for mb in s]
    assert max(rows) > 4  # short examples: more rows than the micro-batch
    assert all(len(mb) * max(LENGTHS[i] for i in mb) <= budget for s in steps for mb in s)
    assert sum(map(len, steps)) < sum(map(len, _steps("length_grouped", seed=0)))  # fewer forward/backwards


def test_grouped_micro_batches_of_alpaca_en_demo_are_nearly_all_real_tokens(shared_datasets, tiny_tokenizer):
    from finetune.data import build_datasets
    from finetune.recipe.schema import DataConfig

    bundle = build_datasets(DataConfig(path=str(shared_datasets / "alpaca_en_demo.json"), max_seq_len=4096),
                            tiny_tokenizer, seed=0)
    lengths = [len(ids) for ids in bundle.train["input_ids"]]
    assert len(lengths) == 999
    shares = {kind: epoch_shape(lengths, Batching(kind, 8, 4, token_budget=8 * max(lengths))).real_share
              for kind in ("random", "length_grouped", "token_budget")}
    assert shares["random"] < 0.6  # about half of a random padded batch is padding
    assert shares["length_grouped"] > 0.95 and shares["token_budget"] > 0.95, shares


def test_auto_picks_grouping_where_it_saves_padding_and_random_where_nothing_is_grouped():
    recipe = validate_recipe({"model": {"path": "m"}, "data": {"path": "d.jsonl"}})
    settings = {"micro_batch_size": 8, "gradient_accumulation_steps": 1}
    assert auto_batching(recipe, settings, LENGTHS, 100)[0] == "length_grouped"
    assert auto_batching(recipe, {**settings, "gradient_accumulation_steps": 4}, LENGTHS, 4096)[0] == "token_budget"
    assert auto_batching(recipe, settings, [50] * 100, 100)[0] == "random"  # equal lengths: no padding to save
    assert auto_batching(recipe, {"micro_batch_size": 1, "gradient_accumulation_steps": 1}, LENGTHS, 100)[0] == "random"
    assert auto_batching(recipe, settings, None, 100)[0] == "random"  # lengths not known: nothing priced
    packed = validate_recipe({"model": {"path": "m"}, "data": {"path": "d.jsonl", "packing": True}})
    assert auto_batching(packed, settings, LENGTHS, 100)[0] == "random"


class Grads(Policy):
    """Keeps each update's complete gradient and the step's rows; applies nothing (the learning rate is 0)."""

    def __init__(self):
        self.grads, self.rows, self.micro_rows = [], [], []

    def on_step_begin(self, loop, step):
        self.rows.append([r for rows in step.batches for r in rows])
        self.micro_rows.append([len(p.batch.input_ids) for u in step.updates for p, _ in loop.parts(u, False)])

    def before_update(self, loop, update):
        self.grads.append({n: p.grad.clone() for n, p in loop.model.named_parameters() if p.grad is not None})


@pytest.mark.parametrize("kind", ["length_grouped", "token_budget"])
def test_one_step_of_grouped_micro_batches_has_the_full_batch_gradient(tiny_model_dir, tiny_tokenizer, kind):
    lengths = [3, 45, 7, 30, 9, 40, 5, 35]  # one step of 8: token_budget runs 4 short rows, then 2 and 2
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(4, 400, (n,), generator=gen).tolist()
                                                           for n in lengths)]
    config = resolve(validate_recipe({
        "model": {"path": str(tiny_model_dir)}, "data": {"path": "unused.jsonl", "batching": kind},
        "adapter": {"type": "full"}, "quantization": {"bits": None},
        "training": {"max_steps": 1, "micro_batch_size": 2, "gradient_accumulation_steps": 4, "learning_rate": 1e-9,
                     "noise_scale": False, "max_grad_norm": None},
        "memory": {"activation_checkpointing": False, "chunked_loss": False, "tiled_mlp": False}}))
    model = load_model(tiny_model_dir)
    reference = copy.deepcopy(model)
    grads = Grads()
    collator = make_collator(tiny_tokenizer, packed=False)
    simple_loop(config, model, data, collator, 1, policies=[grads]).fit()
    assert grads.micro_rows[0] == ([4, 2, 2] if kind == "token_budget" else [2, 2, 2, 2])
    # the reference: the step's 8 examples as one padded batch, the loss their labelled tokens' mean
    batch = collator(grads.rows[0])
    reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).loss.backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads.grads[0][name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_token_budget_batches_resume_exactly(tmp_path, tiny_model_dir, monkeypatch):
    rows_per_pass = []
    run_step = TrainLoop.run_step

    def spy(self, step):
        rows_per_pass.extend(len(rows) for rows in step.batches)
        return run_step(self, step)

    monkeypatch.setattr(TrainLoop, "run_step", spy)
    data = text_data(tmp_path / "data.jsonl", [4 + (11 * i) % 58 for i in range(36)])
    recipe = tiny_lora_recipe(tiny_model_dir, data, tmp_path / "whole", {
        "data": {"batching": "token_budget"},
        "training": {"max_steps": 8, "micro_batch_size": 2, "gradient_accumulation_steps": 2, "learning_rate": 1e-3},
        "output": {"save_steps": 3, "save_total_limit": 10}})
    whole = run(validate_recipe(recipe))
    assert max(rows_per_pass) > 2 and len(rows_per_pass) < 16  # short steps ran as one micro-batch of 4
    copied = tmp_path / "resumed"
    shutil.copytree(whole.run_dir, copied)
    for later in ("checkpoint-6", "checkpoint-8"):
        shutil.rmtree(copied / "checkpoints" / later)
    run(validate_recipe({**recipe, "output": {**recipe["output"], "dir": str(copied)}}), resume=True)
    losses = {r["step"]: r["loss"] for r in read_jsonl(whole.run_dir / "metrics.jsonl") if "loss" in r}
    again = {r["step"]: r["loss"] for r in read_jsonl(copied / "metrics.jsonl") if "loss" in r}
    assert sorted(again) == sorted(losses) == list(range(1, 9))
    for step, loss in losses.items():
        assert again[step] == pytest.approx(loss, rel=1e-6), step


@pytest.mark.parametrize(("sections", "says"), [
    ({"data": {"path": "d", "batching": "token_budget"}, "distributed": {"gpus": 2}},
     "data.batching=token_budget with several processes"),
    ({"data": {"path": "d", "batching": "length_grouped"}, "training": {"method": "grpo"}},
     "data.batching=length_grouped with training.method=grpo"),
    ({"data": {"path": "d", "batching": "by_length"}}, "data.batching"),
])
def test_a_batching_the_run_cannot_use_is_one_error_naming_the_key(sections, says):
    from finetune.errors import RecipeError

    with pytest.raises(RecipeError) as info:
        validate_recipe({"model": {"path": "m"}, **sections})
    assert says in str(info.value) + " ".join(info.value.problems)


def test_the_plan_decides_batching_auto_from_the_lengths_and_the_run_config_carries_it(tiny_model_dir):
    from finetune.plan import predict

    recipe = validate_recipe({"model": {"path": str(tiny_model_dir)}, "data": {"path": "d.jsonl", "max_seq_len": 64},
                              "quantization": {"bits": None}, "adapter": {"type": "lora"},
                              "training": {"micro_batch_size": 4, "gradient_accumulation_steps": 1}})
    plan = predict(recipe, gpu_memory="4GiB", device="cpu", lengths=LENGTHS)
    assert plan.settings["batching"] == "length_grouped"
    assert any(n.startswith("data.batching auto: length_grouped (real tokens per micro-batch: random") for n in plan.notes)
    assert plan.apply(recipe).settings.batching == "length_grouped"
    fixed = predict(recipe.model_copy(update={"data": recipe.data.model_copy(update={"batching": "random"})}),
                    gpu_memory="4GiB", device="cpu", lengths=LENGTHS)
    assert fixed.settings["batching"] == "random" and not any("data.batching" in n for n in fixed.notes)


@pytest.mark.parametrize("tokens", [None, 150])
def test_an_out_of_memory_recovery_keeps_token_budget_steps_and_their_losses(tmp_path, tiny_model_dir, monkeypatch,
                                                                             tokens):
    """The recovery halves the micro-batch and doubles the accumulation: the steps keep their examples (steps of
    examples, or of training.effective_batch_tokens), the token budget halves, and each step's loss (a token
    mean over the step) is the uninterrupted run's."""
    from finetune.train.recovery import FAULT_ENV

    data = text_data(tmp_path / "data.jsonl", [4 + (11 * i) % 58 for i in range(24)])

    def recipe(name: str) -> dict:
        return tiny_lora_recipe(tiny_model_dir, data, tmp_path / name, {
            "data": {"batching": "token_budget"},
            "training": {"max_steps": 4, "micro_batch_size": 4, "gradient_accumulation_steps": 1,
                         "learning_rate": 1e-2, "effective_batch_tokens": tokens}})

    whole = run(validate_recipe(recipe("whole")))
    monkeypatch.setenv(FAULT_ENV, "2")
    recovered = run(validate_recipe(recipe("recovered")))
    rows = read_jsonl(recovered.run_dir / "metrics.jsonl")
    [event] = [r for r in rows if r.get("event") == "oom_recovered"]
    assert event["to"] == {"micro_batch_size": 2, "gradient_accumulation_steps": 2}
    losses = {r["step"]: r["loss"] for r in read_jsonl(whole.run_dir / "metrics.jsonl") if "loss" in r}
    again = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(again) == sorted(losses) == [1, 2, 3, 4]
    for step, loss in losses.items():
        assert again[step] == pytest.approx(loss, rel=1e-5), step
