"""Preference training (training.method dpo, orpo, kto) through `finetune run`: the reference is the base with
the adapter off, DPO raises the held-out reward margin, metrics reach metrics.jsonl, resume is exact."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from pydantic import ValidationError

from finetune.recipe.load import recipe_to_yaml
from finetune.recipe.schema import Recipe
from finetune.rundir import read_jsonl
from finetune.step.preference import reference_logps, sequence_logps
from finetune.train.run import run

COLOURS = ["red", "blue", "green", "black", "white", "pink", "grey", "gold"]


def _pairs(path, n=24, seed=0):
    """A learnable preference: the chosen answer names the colour asked about, the rejected one another."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        colour, other = rng.sample(COLOURS, 2)
        rows.append({"prompt": f"Say {colour}.", "chosen": f"{colour} {colour}.", "rejected": f"{other} {other}."})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _recipe(tmp_path, model_dir, name="run", **sections) -> Recipe:
    data = {
        "model": {"path": str(model_dir)}, "quantization": {"bits": None},
        "adapter": {"type": "lora", "r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"path": str(_pairs(tmp_path / "pairs.jsonl")), "max_seq_len": 64, "validation_split": 0.25},
        "training": {"method": "dpo", "max_steps": 12, "micro_batch_size": 2, "learning_rate": 1e-2,
                     "warmup_ratio": 0.0},
        "memory": {"activation_checkpointing": True},
        "output": {"dir": str(tmp_path / name), "save_steps": 100},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return Recipe.model_validate(data)


def test_knob_of_another_method_is_refused_naming_the_key():
    base = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}}
    with pytest.raises(ValidationError, match=r"training.loss_type: applies only to dpo, not kto"):
        Recipe.model_validate({**base, "training": {"method": "kto", "loss_type": "ipo"}})
    with pytest.raises(ValidationError, match=r"training.desirable_weight: applies only to kto, not sft"):
        Recipe.model_validate({**base, "training": {"desirable_weight": 2.0}})
    with pytest.raises(ValidationError, match=r"training.label_smoothing: applies only to loss_type sigmoid"):
        Recipe.model_validate({**base, "training": {"method": "dpo", "loss_type": "hinge", "label_smoothing": 0.1}})
    with pytest.raises(ValidationError, match=r"adapter.type=full: the reference model is the base"):
        Recipe.model_validate({**base, "training": {"method": "dpo"}, "adapter": {"type": "full"},
                               "quantization": {"bits": None}})
    Recipe.model_validate({**base, "training": {"method": "orpo", "beta": 0.2}, "adapter": {"type": "full"},
                           "quantization": {"bits": None}})


def test_reference_is_the_base_model_with_the_adapter_off(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from finetune.model.adapter import apply_adapter
    from finetune.recipe.schema import AdapterConfig

    torch.manual_seed(0)
    model = apply_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), AdapterConfig(r=4, dropout=0.1),
                          checkpointing=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)  # an adapter that changes the answers
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.randint(4, 400, (4, 24))
    labels = ids.clone()
    labels[:, :8] = -100
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    model.train()
    reference = reference_logps(model, batch)
    assert model.training  # back in training mode
    expected = sequence_logps(base.eval(), batch)[0]
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-5)
    # Several processes: the Trainer hands the step a DDP-wrapped model, which has no adapter switch itself.
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        torch.testing.assert_close(reference_logps(wrapped, batch), expected, rtol=1e-5, atol=1e-5)
    finally:
        torch.distributed.destroy_process_group()
    for chunked in (False, True):
        policy = sequence_logps(model.eval(), batch, chunked)[0]
        assert (policy - expected).abs().max() > 1e-2  # the adapter is on outside the reference
    torch.testing.assert_close(sequence_logps(model, batch, True)[0], sequence_logps(model, batch)[0])


def test_dpo_raises_the_held_out_margin_and_logs_rewards(tmp_path, tiny_model_dir):
    result = run(_recipe(tmp_path, tiny_model_dir, memory={"chunked_loss": True}))
    results = json.loads((result.run_dir / "results.json").read_text())
    before, after = results["eval_before"], results["eval_after"]
    assert before["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # LoRA starts as the reference
    assert after["eval_rewards/margins"] > 0.5 and after["eval_rewards/accuracies"] > 0.5
    rows = [r for r in read_jsonl(result.run_dir / "metrics.jsonl") if "loss" in r]
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"} <= set(rows[-1])
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert (result.run_dir / "loss.png").is_file()


@pytest.mark.parametrize("training", [
    pytest.param({"method": "orpo", "beta": 0.5}, id="orpo"),
    pytest.param({"method": "kto"}, id="kto-from-pairs"),
])
def test_other_methods_train_with_layerwise_optimizer(tmp_path, tiny_model_dir, training):
    """Checkpointing and a layer-wise optimizer (updates inside backward) with each preference loss."""
    result = run(_recipe(tmp_path, tiny_model_dir, training={**training, "max_steps": 8},
                         optimizer={"name": "adamw", "layerwise": True}))
    after = json.loads((result.run_dir / "results.json").read_text())["eval_after"]
    assert after["eval_rewards/margins"] > 0
    rows = [r for r in read_jsonl(result.run_dir / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 8 and all(r["grad_norm"] > 0 for r in rows)


def test_resume_is_exact(tmp_path, tiny_model_dir):
    """3 steps, then --resume to 6 (constant schedule: max_steps changes), equal to 6 straight steps."""
    constant = {"lr_scheduler": "constant"}
    straight = run(_recipe(tmp_path, tiny_model_dir, "straight", training={"max_steps": 6, **constant},
                           adapter={"dropout": 0.1}, data={"validation_split": 0.0}))
    reference = {r["step"]: r for r in read_jsonl(straight.run_dir / "metrics.jsonl") if "loss" in r}
    first = _recipe(tmp_path, tiny_model_dir, "resumed", training={"max_steps": 3, **constant},
                    adapter={"dropout": 0.1},
                    data={"validation_split": 0.0}, output={"save_steps": 3})
    run(first)
    resumed = run(first.model_copy(update={"training": first.training.model_copy(update={"max_steps": 6})}),
                  resume=True)
    rows = {r["step"]: r for r in read_jsonl(resumed.run_dir / "metrics.jsonl") if "loss" in r}
    assert sorted(rows) == list(range(1, 7))
    for step in range(4, 7):
        for key in ("loss", "rewards/margins"):
            assert rows[step][key] == pytest.approx(reference[step][key], rel=1e-5, abs=1e-7), (step, key)


def test_generate_compare_shows_base_sft_and_dpo_side_by_side(tmp_path, tiny_model_dir, capsys):
    from finetune import api
    from finetune.cli import main

    sft_data = tmp_path / "sft.jsonl"
    sft_data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Say {c}."},
                                                           {"role": "assistant", "content": f"{c}!"}]})
                                  for c in COLOURS) + "\n")
    sft = run(_recipe(tmp_path, tiny_model_dir, "sft", training={"method": "sft", "max_steps": 3},
                      data={"path": str(sft_data), "validation_split": 0.0}))
    dpo = run(_recipe(tmp_path, tiny_model_dir, "dpo", training={"max_steps": 3}, data={"validation_split": 0.0}))
    answers = api.compare_runs([sft.run_dir, dpo.run_dir], "Say red.", max_new_tokens=6)
    assert [name for name, _ in answers] == ["base model", "sft", "dpo"]
    assert answers[0][1] == api.generate(dpo.run_dir, "Say red.", max_new_tokens=6, use_adapter=False)
    assert answers[1][1] == api.generate(sft.run_dir, "Say red.", max_new_tokens=6)
    assert answers[2][1] == api.generate(dpo.run_dir, "Say red.", max_new_tokens=6)
    capsys.readouterr()
    assert main(["generate", str(dpo.run_dir), "--compare", str(sft.run_dir), "--prompt", "Say red.",
                 "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "base model" in out and "sft" in out and "dpo" in out


def test_orpo_term_matches_trl():
    from types import SimpleNamespace

    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    from finetune.step.preference import PreferenceLoss, orpo_loss

    torch.manual_seed(0)
    counts_c, counts_r = torch.tensor([5, 9, 3]), torch.tensor([7, 2, 4])
    pc, pr = -torch.rand(3) * counts_c, -torch.rand(3) * 2 * counts_r
    fake = SimpleNamespace(beta=0.3, accelerator=SimpleNamespace(device="cpu"))
    terms, chosen, rejected, *_ = ORPOTrainer.odds_ratio_loss(fake, pc / counts_c, pr / counts_r)
    loss, stats = orpo_loss(PreferenceLoss("orpo", beta=0.3), pc, pr, None, None, counts_c, counts_r)
    nll = -pc.sum() / counts_c.sum()
    torch.testing.assert_close(loss, nll - terms.mean())
    torch.testing.assert_close(stats["rewards/chosen"][0], chosen.sum())
    torch.testing.assert_close(stats["rewards/rejected"][0], rejected.sum())


def _trl_cpo(loss_type, **config):
    """TRL's CPOTrainer.cpo_loss bound to a config (what its trainer reads from self), without a trainer."""
    from types import SimpleNamespace

    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    fake = SimpleNamespace(loss_type=loss_type, alpha=0.0, accelerator=SimpleNamespace(device="cpu"), **config)
    return lambda pc, pr: CPOTrainer.cpo_loss(fake, pc, pr)


def _fixed_pairs():
    torch.manual_seed(0)
    counts_c, counts_r = torch.tensor([5, 9, 3, 6]), torch.tensor([7, 2, 4, 6])
    pc = (-torch.rand(4) * counts_c).requires_grad_()
    pr = (-torch.rand(4) * 2 * counts_r).requires_grad_()
    return pc, pr, counts_c, counts_r


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_simpo_loss_and_gradients_match_trl(label_smoothing):
    """SimPO is TRL's CPO loss_type simpo (with cpo_alpha 0: no NLL term) on length-averaged log-probs."""
    from finetune.step.preference import PreferenceLoss, simpo_loss

    knobs = {"beta": 2.0, "simpo_gamma": 0.7, "label_smoothing": label_smoothing}
    pc, pr, counts_c, counts_r = _fixed_pairs()
    losses, chosen, rejected = _trl_cpo("simpo", **knobs)(pc / counts_c, pr / counts_r)
    expected_grads = torch.autograd.grad(losses.mean(), (pc, pr))
    loss, stats = simpo_loss(PreferenceLoss("simpo", **knobs), pc, pr, None, None, counts_c, counts_r)
    torch.testing.assert_close(loss, losses.mean())
    for ours, theirs in zip(torch.autograd.grad(loss, (pc, pr)), expected_grads, strict=True):
        torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(stats["rewards/chosen"][0], chosen.sum())
    torch.testing.assert_close(stats["rewards/rejected"][0], rejected.sum())


@pytest.mark.parametrize("label_smoothing, cpo_alpha", [(0.0, 1.0), (0.1, 0.5), (0.0, 0.0)])
def test_cpo_loss_and_gradients_match_trl(label_smoothing, cpo_alpha):
    """CPO is TRL's CPO loss_type sigmoid plus cpo_alpha x the NLL of the chosen answers; compared from the same
    logits (TRL's own log-probs and cross-entropy), gradients with respect to the logits."""
    import torch.nn.functional as F
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    from finetune.step.preference import PreferenceLoss, cpo_loss

    torch.manual_seed(0)
    logits = torch.randn(6, 9, 11, requires_grad=True)  # 3 chosen rows, then 3 rejected
    labels = torch.randint(0, 11, (6, 9))
    labels[:, :3] = -100  # the prompt
    labels[0, 7:] = labels[4, 5:] = -100  # answers of different lengths (padding)
    knobs = {"beta": 0.3, "label_smoothing": label_smoothing, "cpo_alpha": cpo_alpha}
    logps = CPOTrainer.get_batch_logps(logits, labels)
    losses, chosen, rejected = _trl_cpo("sigmoid", **knobs)(logps[:3], logps[3:])
    nll = F.cross_entropy(logits[:3, :-1].reshape(-1, 11), labels[:3, 1:].reshape(-1))  # TRL's cross_entropy_loss
    expected = losses.mean() + cpo_alpha * nll
    (expected_grad,) = torch.autograd.grad(expected, logits, retain_graph=True)  # logps serve both
    counts = (labels[:, 1:] != -100).sum(-1)
    loss, stats = cpo_loss(PreferenceLoss("cpo", **knobs), logps[:3], logps[3:], None, None, counts[:3], counts[3:])
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], expected_grad)
    torch.testing.assert_close(stats["rewards/chosen"][0], chosen.sum())
    torch.testing.assert_close(stats["rewards/rejected"][0], rejected.sum())
    torch.testing.assert_close(stats["nll_loss"][0] / 3, nll.detach())


@pytest.mark.parametrize("training", [
    pytest.param({"method": "simpo", "beta": 2.0, "simpo_gamma": 0.5}, id="simpo"),
    pytest.param({"method": "cpo", "beta": 0.5, "cpo_alpha": 0.5}, id="cpo"),
])
def test_reference_free_methods_train_and_plan_no_reference(tmp_path, tiny_model_dir, training):
    """Three steps through `finetune run`: a falling loss and finite logged rewards; the plan has no
    reference forward (the method needs no reference model, so it trains a full fine-tune too)."""
    from finetune.cli import main
    from finetune.step.preference import PreferenceLoss

    recipe = _recipe(tmp_path, tiny_model_dir, training={**training, "max_steps": 3, "learning_rate": 5e-3},
                     memory={"plan": True})
    assert not recipe.training.uses_reference and not PreferenceLoss.of(recipe.training).reference_in_step
    Recipe.model_validate({**recipe.model_dump(), "adapter": {"type": "full"}})
    (tmp_path / "recipe.yaml").write_text(recipe_to_yaml(recipe))
    assert main(["plan", str(tmp_path / "recipe.yaml"), "--gpu-memory", "4GiB"]) == 0
    assert main(["run", str(tmp_path / "recipe.yaml")]) == 0
    run_dir = tmp_path / "run"
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 3 and rows[-1]["loss"] < rows[0]["loss"]
    assert all(math.isfinite(r["rewards/margins"]) and math.isfinite(r["rewards/chosen"]) for r in rows)
    assert (run_dir / "plan.json").is_file()
