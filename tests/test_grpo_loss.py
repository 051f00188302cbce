"""The GRPO-family loss and advantages equal TRL's, computed by TRL's own GRPOTrainer on the same inputs.

One real `trl.GRPOTrainer` is built on the tiny model; its `_compute_loss` runs with the per-token log-probs
replaced by given ones (its `_get_per_token_logps_and_entropies` is the one method swapped on the instance), and
its `_generate_and_score_completions` generates with the tiny model and scores with a reward function that
returns chosen rewards, so the advantages come from TRL's code path too.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from finetune.rl.grpo_loss import LOSS_TYPES, group_advantages, grpo_loss

GROUP = 4
MAX_COMPLETION = 6


@pytest.fixture(scope="module")
def trl_trainer(tiny_model_dir, tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    queued: list[list[float]] = []

    def queued_reward(prompts, completions, **kwargs):
        return queued.pop(0)

    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl-grpo")), per_device_train_batch_size=2 * GROUP,
                      num_generations=GROUP, max_completion_length=MAX_COMPLETION, report_to=[], use_cpu=True,
                      logging_steps=1, max_steps=1, beta=0.0)
    data = Dataset.from_list([{"prompt": "What is 2 + 2?"}, {"prompt": "What is 3 + 5?"}] * 4)
    trainer = GRPOTrainer(model=model, reward_funcs=queued_reward, args=args, train_dataset=data,
                          processing_class=tokenizer)
    trainer.queued = queued
    return trainer


def _trl_loss(trainer, logps, old, ref, advantages, mask, *, loss_type, beta, eps_low, eps_high, accumulation,
              window_tokens):
    trainer.model.train()  # TRL divides by the accumulation in train mode only
    trainer.loss_type, trainer.beta = loss_type, beta
    trainer.epsilon_low, trainer.epsilon_high = eps_low, eps_high
    trainer.current_gradient_accumulation_steps = accumulation
    trainer.args.steps_per_generation = accumulation  # dapo: num_items_in_batch then spans one window
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    b, t = mask.shape
    inputs = {"prompt_ids": torch.ones(b, 2, dtype=torch.long), "prompt_mask": torch.ones(b, 2, dtype=torch.long),
              "completion_ids": torch.ones(b, t, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": torch.tensor(float(window_tokens))}
    try:
        return trainer._compute_loss(trainer.model, inputs)
    finally:
        del trainer._get_per_token_logps_and_entropies  # the class's method again


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    b, t = 2 * GROUP, MAX_COMPLETION
    logps = (-torch.rand(b, t, generator=g) * 3)
    old = logps + torch.randn(b, t, generator=g) * 0.4  # ratios well outside 1 +- 0.2: the clip is exercised
    ref = logps + torch.randn(b, t, generator=g) * 0.3
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    advantages = torch.randn(b, generator=g)
    return logps, old, ref, advantages, mask


@pytest.mark.parametrize(("loss_type", "beta", "eps_high", "accumulation"),
                         [(lt, beta, eh, acc) for lt, (beta, eh, acc) in
                          itertools.product(LOSS_TYPES, [(0.0, 0.2, 1), (0.04, 0.28, 2)])])
def test_loss_and_gradient_equal_trls(trl_trainer, loss_type, beta, eps_high, accumulation):
    logps, old, ref, advantages, mask = _batch(LOSS_TYPES.index(loss_type) * 10 + accumulation)
    window = int(mask.sum()) * accumulation + 5  # dapo's normaliser is the window's tokens, not this batch's
    mine_in, trl_in = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    ours = grpo_loss(mine_in, old, advantages, mask, loss_type=loss_type, epsilon_low=0.2, epsilon_high=eps_high,
                     beta=beta, ref_logps=ref if beta else None, max_completion_length=MAX_COMPLETION,
                     window_tokens=window, accumulation=accumulation)
    theirs = _trl_loss(trl_trainer, trl_in, old, ref, advantages, mask, loss_type=loss_type, beta=beta,
                       eps_low=0.2, eps_high=eps_high, accumulation=accumulation, window_tokens=window)
    ours.loss.backward()
    theirs.backward()
    assert ours.loss.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-7)
    assert torch.allclose(mine_in.grad, trl_in.grad, rtol=1e-5, atol=1e-7)
    assert mine_in.grad.abs().sum() > 0
    assert 0 < ours.clip_ratio < 1  # some tokens clipped, some not: the clip is in play
    if beta:
        assert ours.kl == pytest.approx(trl_trainer._metrics["train"]["kl"][-1], rel=1e-5)
    else:
        assert ours.kl is None


def test_loss_types_differ_on_the_same_batch():
    """The variants are not aliases: uneven completion lengths give four different losses."""
    logps, old, _, advantages, mask = _batch(7)
    values = {lt: grpo_loss(logps, old, advantages, mask, loss_type=lt, max_completion_length=MAX_COMPLETION,
                            window_tokens=100).loss.item() for lt in LOSS_TYPES}
    assert len({round(v, 6) for v in values.values()}) == len(LOSS_TYPES), values


def test_first_pass_ratio_is_one_and_beta_needs_a_reference():
    logps, _, _, advantages, mask = _batch(3)
    first = grpo_loss(logps, None, advantages, mask)
    assert first.clip_ratio == 0
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(logps, None, advantages, mask, beta=0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(logps, None, advantages, mask, loss_type="dr_grpo")


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls(trl_trainer, scale):
    rewards = [1.0, 0.0, 0.5, 0.0, 2.0, 2.0, 2.0, 2.0]  # the second group is all equal: advantages 0
    trl_trainer.scale_rewards, trl_trainer.beta = scale, 0.0  # beta 0: no reference forward
    trl_trainer.queued.append(list(rewards))
    trl_trainer.model.train()
    inputs = [{"prompt": p} for p in ["What is 2 + 2?"] * GROUP + ["What is 3 + 5?"] * GROUP]
    out = trl_trainer._generate_and_score_completions(inputs)
    ours = group_advantages(torch.tensor(rewards), GROUP, scale)
    assert torch.allclose(ours, out["advantages"], atol=1e-6)
    assert ours[:GROUP].abs().sum() > 0 and ours[GROUP:].abs().sum() == 0


def test_advantages_leave_unscored_completions_out():
    rewards = torch.tensor([1.0, float("nan"), 0.0, 1.0])
    adv = group_advantages(rewards, 4)
    assert adv[1] == 0 and adv[0] > 0 > adv[2]
    assert adv[0] == pytest.approx((1 - 2 / 3) / (torch.tensor([1.0, 0.0, 1.0]).std().item() + 1e-4))
    with pytest.raises(ValueError, match="whole groups"):
        group_advantages(torch.ones(5), 4)
