"""training.precompute_reference: the reference log-probabilities computed once before training (and kept in
the run directory) instead of a reference forward in every step: the same values, the same losses, no
recomputation on --resume, a plan without the reference forward, and a speed estimate that counts it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from finetune.errors import FinetuneError
from finetune.recipe.schema import Recipe
from finetune.rundir import read_jsonl
from finetune.step import preference
from finetune.step.preference import PreferenceLoss, reference_logps
from finetune.train.run import run
from tests.run_support import assert_same_steps
from tests.test_preference_train import _pairs, _recipe


def test_precompute_with_a_method_without_reference_is_refused_naming_the_key():
    base = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}}
    with pytest.raises(ValidationError, match=r"training.precompute_reference: applies only to dpo or kto, not orpo"):
        Recipe.model_validate({**base, "training": {"method": "orpo", "precompute_reference": True}})
    with pytest.raises(ValidationError, match=r"training.precompute_reference: applies only to dpo or kto, not sft"):
        Recipe.model_validate({**base, "training": {"precompute_reference": True}})
    with pytest.raises(ValidationError, match=r"training.precompute_reference: reference_free dpo has no reference"):
        Recipe.model_validate({**base, "training": {"method": "dpo", "reference_free": True,
                                                    "precompute_reference": True}})
    with pytest.raises(ValidationError, match=r"training.precompute_reference with 2 processes"):
        Recipe.model_validate({**base, "training": {"method": "dpo", "precompute_reference": True},
                               "distributed": {"gpus": 2, "strategy": "ddp"}})
    Recipe.model_validate({**base, "training": {"method": "kto", "precompute_reference": True}})


def test_precomputed_values_equal_the_in_step_reference(tiny_model_dir, tiny_tokenizer):
    """The pass's values (per example, any batching) are the reference forward of the step's own batch."""
    from transformers import AutoModelForCausalLM

    from finetune.data.packing import make_collator
    from finetune.model.adapter import apply_adapter
    from finetune.recipe.schema import AdapterConfig
    from finetune.train.reference_pass import compute_reference

    torch.manual_seed(0)
    model = apply_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), AdapterConfig(r=4),
                          checkpointing=False)
    lengths = [(9, 5), (14, 11), (6, 12), (10, 10)]
    examples = []
    for n_chosen, n_rejected in lengths:
        ids_c, ids_r = torch.randint(4, 400, (n_chosen,)).tolist(), torch.randint(4, 400, (n_rejected,)).tolist()
        examples.append({"chosen_input_ids": ids_c, "chosen_labels": [-100] * 3 + ids_c[3:],
                         "rejected_input_ids": ids_r, "rejected_labels": [-100] * 3 + ids_r[3:]})
    collator = make_collator(tiny_tokenizer, False, "pair")
    loss = PreferenceLoss("dpo", precompute_reference=True)
    batch = collator(examples)
    in_step = reference_logps(model, {k: v for k, v in batch.items()})  # the step's reference, chosen then rejected
    for chunked in (False, True):
        for micro_batch in (4, 1, 3):
            values = compute_reference(model, examples, collator, loss, micro_batch, chunked)
            column = collator([{**e, "ref_logps": v} for e, v in zip(examples, values, strict=True)])["ref_logps"]
            torch.testing.assert_close(column, in_step, rtol=1e-5, atol=1e-4)
    same = compute_reference(model, examples, collator, loss, 4)  # the very batch: the very values
    assert collator([{**e, "ref_logps": v} for e, v in zip(examples, same, strict=True)])["ref_logps"].tolist() \
        == in_step.tolist()

    # the loss takes the batch's values; a batch without them is a bug, not a cue to use another reference
    with_values = collator([{**e, "ref_logps": v} for e, v in zip(examples, same, strict=True)])
    torch.testing.assert_close(preference.preference_loss(model, with_values, loss),
                               preference.preference_loss(model, batch, PreferenceLoss("dpo")))
    with pytest.raises(FinetuneError, match="internal inconsistency: training.precompute_reference is on but "
                                            "the batch has no ref_logps"):
        preference.preference_loss(model, batch, loss)


def _counting_reference(monkeypatch) -> list[int]:
    calls = []
    original = preference.reference_logps

    def counted(model, inputs, *args):
        if not inputs["input_ids"].is_meta:  # not the planner's trace
            calls.append(inputs["input_ids"].shape[0])
        return original(model, inputs, *args)

    monkeypatch.setattr(preference, "reference_logps", counted)
    return calls


def test_run_with_precompute_trains_like_one_without_and_resume_reads_the_file(tmp_path, tiny_model_dir,
                                                                              monkeypatch):
    """Same losses and rewards as the reference forward in each step; the steps run no reference forward;
    --resume reads the stored values (no pass) and continues exactly."""
    constant = {"lr_scheduler": "constant", "max_steps": 4}
    plain = run(_recipe(tmp_path, tiny_model_dir, "plain", training=constant))
    calls = _counting_reference(monkeypatch)
    recipe = _recipe(tmp_path, tiny_model_dir, "pre", training={**constant, "precompute_reference": True,
                                                                 "max_steps": 2}, output={"save_steps": 2})
    first = run(recipe)
    stored = json.loads((first.run_dir / "reference_logps.json").read_text())
    assert len(stored["train"]) == 18 and len(stored["eval"]) == 6 and all(len(v) == 2 for v in stored["train"])
    assert sum(calls) == 2 * 24  # one pass over the data (both sequences of each pair), none in steps or evals
    before = json.loads((first.run_dir / "results.json").read_text())["eval_before"]
    assert before["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # LoRA starts as the reference
    written = (first.run_dir / "reference_logps.json").stat().st_mtime_ns
    calls.clear()
    resumed = run(recipe.model_copy(update={"training": recipe.training.model_copy(update={"max_steps": 4})}),
                  resume=True)
    assert calls == [] and (first.run_dir / "reference_logps.json").stat().st_mtime_ns == written
    assert "values read from the run directory" in (resumed.run_dir / "train.log").read_text()
    assert_same_steps(resumed.run_dir, plain.run_dir, ("loss", "rewards/margins", "rewards/chosen"), [1, 2, 3, 4])
    after = [r for r in read_jsonl(resumed.run_dir / "metrics.jsonl") if "eval_loss" in r][-1]
    plain_after = [r for r in read_jsonl(plain.run_dir / "metrics.jsonl") if "eval_loss" in r][-1]
    for key in ("eval_loss", "eval_rewards/margins", "eval_rewards/accuracies"):
        assert after[key] == pytest.approx(plain_after[key], rel=1e-4, abs=1e-6), key


def test_stored_values_belong_to_their_data_and_a_stopped_pass_writes_nothing(tmp_path, tiny_model_dir):
    """The stored values name the data they belong to: other data computes them again; Ctrl-C during the pass
    stops it with nothing written."""
    from finetune.data import build_datasets
    from finetune.model.adapter import apply_adapter
    from finetune.model.load import load_model
    from finetune.rundir import RunDir
    from finetune.train.reference_pass import attach_reference

    recipe = _recipe(tmp_path, tiny_model_dir, training={"method": "kto", "precompute_reference": True})
    model, tokenizer, _ = load_model(recipe.model, recipe.quantization)
    model = apply_adapter(model, recipe.adapter, checkpointing=False)
    run_dir = RunDir(tmp_path / "run")
    data = build_datasets(recipe.data, tokenizer, 0, "kto")
    with pytest.raises(KeyboardInterrupt):
        attach_reference(model, data, recipe, run_dir, should_stop=lambda: True)
    assert not run_dir.reference_logps.exists()
    first = attach_reference(model, data, recipe, run_dir)
    assert len(first.train) == len(data.train) and len(first.train[0]["ref_logps"]) == 1  # kto: one answer
    rows = [first.train[i] for i in range(4)]
    kto = PreferenceLoss("kto", precompute_reference=True)
    with torch.no_grad():  # the kto loss from the stored values equals the one with a reference forward
        torch.testing.assert_close(preference.preference_loss(model, data.collator(rows), kto),
                                   preference.preference_loss(model, data.collator([
                                       {k: v for k, v in r.items() if k != "ref_logps"} for r in rows]),
                                       PreferenceLoss("kto")))
    stored = run_dir.reference_logps.read_text()
    again = attach_reference(model, build_datasets(recipe.data, tokenizer, 0, "kto"), recipe, run_dir)
    assert again.train["ref_logps"] == first.train["ref_logps"] and run_dir.reference_logps.read_text() == stored
    assert run_dir.log.read_text().count("values read from the run directory") == 1
    other = recipe.data.model_copy(update={"path": str(_pairs(tmp_path / "other.jsonl", seed=1))})
    attach_reference(model, build_datasets(other, tokenizer, 0, "kto"), recipe, run_dir)
    assert run_dir.reference_logps.read_text() != stored


def test_traced_step_has_no_reference_forward(tiny_model_dir, monkeypatch):
    """The planner's trace of a precomputed-reference step runs the reference only in its `reference_pass`
    window (the pass before training), never inside the step."""
    from finetune.plan import trace
    from finetune.plan.shapes import load_model_config
    from finetune.recipe.schema import AdapterConfig

    seen: list[str | None] = []
    original = preference.reference_logps
    trackers: list = []
    real_tracker = trace.MemoryTracker

    def tracker(*args, **kwargs):
        trackers.append(real_tracker(*args, **kwargs))
        return trackers[-1]

    def spied(model, inputs, *args):
        seen.append(trackers[-1]._window)
        return original(model, inputs, *args)

    monkeypatch.setattr(preference, "reference_logps", spied)
    monkeypatch.setattr(trace, "MemoryTracker", tracker)
    key = trace.model_key(load_model_config(str(tiny_model_dir)), AdapterConfig(r=4), torch.float32)
    windows = {}
    for objective in ("dpo", "dpo:precompute_reference", "kto:precompute_reference"):
        seen.clear()
        result = trace._direct_trace(key, "sdpa", 1, 32, 2, 1, False, False, 0, objective, True)
        windows[objective] = (list(seen), set(result.windows))
    assert windows["dpo"][0] == ["forward"] and "reference_pass" not in windows["dpo"][1]
    for objective in ("dpo:precompute_reference", "kto:precompute_reference"):
        assert windows[objective][0] == ["reference_pass"] and "reference_pass" in windows[objective][1]


def test_speed_estimate_counts_the_pairs_and_the_reference_forward(tiny_model_dir):
    """At equal settings DPO is slower than SFT (two sequences per example and a reference forward), and
    DPO with a precomputed reference sits between them; the same for the planner's estimates (what
    api.speed_estimate shows)."""
    from finetune.plan import predict
    from finetune.plan.cost_model import tokens_per_second
    from finetune.plan.search import model_spec
    from finetune.plan.trace import model_facts, planned_config
    from finetune.recipe.settings import Settings

    settings = Settings(2, 1, True, 1, "none", True, 4, "adamw", False)
    path = str(Path(__file__).parent / "fixtures" / "configs" / "llama-3.1-8b.json")
    config = planned_config(path)
    shapes = model_facts(config, "sdpa")[0]

    def estimated(**training) -> float:
        recipe = Recipe.model_validate({
            "model": {"path": path, "dtype": "bf16"}, "data": {"path": "unused.jsonl", "max_seq_len": 1024},
            "adapter": {"type": "lora"}, "quantization": {"bits": 4}, "training": training})
        return tokens_per_second(model_spec(recipe, config, "cuda"), shapes, settings)

    sft = estimated()
    dpo = estimated(method="dpo")
    precomputed = estimated(method="dpo", precompute_reference=True)
    kto = estimated(method="kto")
    assert dpo < precomputed < sft and kto < sft

    def planned(training: dict) -> float:
        recipe = Recipe.model_validate({
            "model": {"path": str(tiny_model_dir)}, "data": {"path": "unused.jsonl", "max_seq_len": 256},
            "adapter": {"type": "lora", "r": 8}, "quantization": {"bits": None},
            "training": {"micro_batch_size": 2, **training},
            "memory": {"activation_checkpointing": True, "chunked_loss": True, "tiled_mlp": False}})
        plan = predict(recipe, gpu_memory="24GiB", device="cuda")
        return plan.tokens_per_s

    speeds = {name: planned(training) for name, training in (
        ("sft", {}), ("dpo", {"method": "dpo"}), ("precomputed", {"method": "dpo", "precompute_reference": True}))}
    assert speeds["dpo"] < speeds["precomputed"] < speeds["sft"]


def test_replan_after_an_oom_prices_the_training_step_without_the_finished_pass(tmp_path, tiny_model_dir,
                                                                                monkeypatch):
    """An out-of-memory recovery in a precomputed-reference run re-plans the training step alone: the pass
    before training is over, so plan.json holds no pass window and its peak is the step's, also when the
    pass's window would be the larger (here made so by inflating its traced activations)."""
    from dataclasses import replace

    from finetune.plan import memory_model, predict
    from finetune.recipe.load import load_recipe
    from finetune.train.recovery import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "1")
    result = run(_recipe(tmp_path, tiny_model_dir, training={"precompute_reference": True, "max_steps": 2,
                                                             "micro_batch_size": 2}, data={"validation_split": 0.0}))
    monkeypatch.delenv(FAULT_ENV)
    assert any(r.get("event") == "oom_recovered" for r in read_jsonl(result.run_dir / "metrics.jsonl"))
    recovered = load_recipe(result.run_dir / "recipe.yaml")
    assert recovered.training.micro_batch_size == 1
    replanned = json.loads((result.run_dir / "plan.json").read_text())
    step, with_pass = predict(recovered, training_only=True), predict(recovered)
    assert replanned["reference_pass_bytes"] == step.reference_pass_bytes == 0 < with_pass.reference_pass_bytes
    assert replanned["peak_bytes"] == step.peak_bytes

    real = memory_model.trace_step

    def big_pass(*args, **kwargs):
        trace = real(*args, **kwargs)
        peak, parts = trace.windows["reference_pass"]
        return replace(trace, windows={**trace.windows, "reference_pass": (
            peak, {**parts, "activations": parts["activations"] + 10 * 2**20})})

    monkeypatch.setattr(memory_model, "trace_step", big_pass)
    inflated, inflated_step = predict(recovered), predict(recovered, training_only=True)
    assert inflated.peak_bytes == inflated.reference_pass_bytes > step.peak_bytes  # the pass is the peak
    assert inflated_step.peak_bytes == step.peak_bytes and inflated_step.breakdown == step.breakdown
