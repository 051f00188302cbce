"""finetune.rl.step: generate and score once, then the GRPO-family loss per micro-batch, on a 16-token toy model.

The tokenizer is a stub (token i is the letter chr(97 + i)), so a reward can ask for one token: a random
16-token model samples it often enough to learn from within a few seconds on a CPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from finetune.data.prompts import PromptExample
from finetune.model.adapter import apply_adapter
from finetune.recipe.schema import AdapterConfig, GRPOConfig
from finetune.rl.grpo_loss import LOSS_TYPES, grpo_loss
from finetune.rl.rewards import NamedReward, RewardError
from finetune.rl.step import completion_logps, generate_and_score, grpo_forward_backward
from finetune.testing import tiny_config

VOCAB, EOS, PAD, TARGET = 16, 2, 3, 5  # tiny_config's eos and pad ids


class Letters:
    """What generate_and_score asks of a tokenizer: pad and EOS ids, and decoding."""

    pad_token_id, eos_token_id = PAD, EOS

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(chr(97 + t) for t in row if not (skip_special_tokens and t in (EOS, PAD))) for row in rows]


def share_of_target(prompts, completions, **fields):
    """The fraction of the completion's letters that are the target token's."""
    return [c.count(chr(97 + TARGET)) / max(len(c), 1) for c in completions]


REWARD = [NamedReward("rewards[0]", "share_of_target", 1.0, share_of_target)]


def _model(seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=VOCAB), dtype=torch.float32)
    return apply_adapter(model, AdapterConfig(r=8, alpha=16, dropout=0.0), checkpointing=False)


def _prompts(n: int = 4) -> list[PromptExample]:
    return [PromptExample(f"data.jsonl:{i + 1}", f"prompt {i}", [7 + i % 4, 8, 9][: 1 + i % 3], {"n": i})
            for i in range(n)]


def _config(**keys) -> GRPOConfig:
    return GRPOConfig(**{"num_generations": 4, "max_completion_length": 6, **keys})


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_step_loss_is_grpo_loss_of_the_same_log_probs(loss_type):
    torch.manual_seed(1)
    model = _model()
    cfg = _config(loss_type=loss_type, beta=0.04, num_iterations=2, temperature=0.7)
    rollout = generate_and_score(model, Letters(), _prompts(), cfg, REWARD)
    assert rollout.old_logps is not None and rollout.ref_logps is not None
    assert rollout.completion_mask.shape == (16, 6) and rollout.input_ids.shape == (16, rollout.prompt_length + 6)
    micros = rollout.micro_batches(2)
    for micro in micros:
        with torch.no_grad():
            logps = completion_logps(model, micro.input_ids, micro.attention_mask, micro.prompt_length, 0.7)
        expected = grpo_loss(logps, micro.old_logps, micro.advantages, micro.completion_mask, loss_type=loss_type,
                             beta=0.04, ref_logps=micro.ref_logps, max_completion_length=6,
                             window_tokens=float(rollout.completion_mask.sum()), accumulation=2)
        got = grpo_forward_backward(model, micro, cfg)
        assert got.loss == pytest.approx(float(expected.loss), rel=1e-5, abs=1e-7)
        assert got.kl == pytest.approx(expected.kl) and got.clip_ratio == 0.0  # old = current weights
    if loss_type != "bnpo":  # bnpo means over each micro-batch's own tokens: two halves are not the whole
        split = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad()
        grpo_forward_backward(model, rollout.micro_batches(1)[0], cfg)
        whole = [p.grad for p in model.parameters() if p.requires_grad]
        for a, b in zip(split, whole, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def _full_length_forwards(model, width: int) -> list[int]:
    """Counts forwards over whole sequences (prompt + completion): the log-prob passes, not generate's steps."""
    seen = []

    def hook(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] == width:
            seen.append(ids.shape[0])

    model.get_base_model().register_forward_pre_hook(hook, with_kwargs=True)
    return seen


@pytest.mark.parametrize(("beta", "iterations", "forwards"), [(0.0, 1, 0), (0.1, 1, 2), (0.1, 2, 4), (0.0, 3, 2)])
def test_beta_zero_runs_no_reference_forward(beta, iterations, forwards):
    model = _model()
    cfg = _config(beta=beta, num_iterations=iterations)
    width = max(len(p.input_ids) for p in _prompts()) + cfg.max_completion_length
    seen = _full_length_forwards(model, width)
    rollout = generate_and_score(model, Letters(), _prompts(), cfg, REWARD, logps_rows=8)
    assert len(seen) == forwards and all(rows == 8 for rows in seen)  # 16 completions, 8 per pass
    assert (rollout.ref_logps is None) == (beta == 0) and (rollout.old_logps is None) == (iterations == 1)
    assert model.training  # back to train mode after generating


def test_a_failing_reward_names_the_record_and_the_function():
    def boom(prompts, completions, n, **fields):
        if 2 in n:
            raise ValueError("no answer for two")
        return [0.0] * len(completions)

    with pytest.raises(RewardError) as err:
        generate_and_score(_model(), Letters(), _prompts(), _config(),
                           [NamedReward("rewards[0]", "my.py:boom", 1.0, boom)])
    assert str(err.value).startswith("data.jsonl:3: reward rewards[0] (my.py:boom) raised ValueError: no answer")
    assert err.value.exit_code == 2


def test_metrics_and_samples_of_a_rollout():
    torch.manual_seed(2)
    rollout = generate_and_score(_model(), Letters(), _prompts(), _config(), REWARD, samples=5)
    values = rollout.rewards
    assert rollout.metrics["reward"] == pytest.approx(float(values.mean()))
    assert rollout.metrics["rewards/share_of_target/std"] == pytest.approx(float(values.std()))
    assert rollout.metrics["completion_length"] == pytest.approx(float(rollout.completion_mask.sum(-1).float().mean()))
    assert [s["where"] for s in rollout.samples] == [f"data.jsonl:{i}" for i in (1, 2, 3, 4, 1)]
    assert rollout.advantages.view(4, 4).sum(-1).abs().max() < 1e-4  # each group's advantages centre on 0


def test_mean_reward_rises_when_trained_with_the_step():
    """A plain loop: AdamW, one rollout per step, two micro-batches; the reward is the target token's share."""
    torch.manual_seed(0)
    model = _model(seed=3)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    cfg = _config(num_generations=8, max_completion_length=8)
    prompts = _prompts(4)
    rewards = []
    for _ in range(25):
        rollout = generate_and_score(model, Letters(), prompts, cfg, REWARD)
        rewards.append(rollout.metrics["reward"])
        for micro in rollout.micro_batches(2):
            grpo_forward_backward(model, micro, cfg)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.5, rewards


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.5, 1.0), (1.0, 0.7)])
def test_row_sampler_draws_from_the_warped_softmax(temperature, top_p):
    """Argmax of the processed scores (greedy decoding) is distributed as softmax(logits / temperature), cut to
    the top_p nucleus: 20000 draws of one row against the exact probabilities."""
    from finetune.rl.step import RowSampler

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    sampler = RowSampler([7], temperature, top_p)
    counts = torch.zeros(5)
    for _ in range(20000):
        counts[int(sampler(torch.zeros(1, 1, dtype=torch.long), logits.clone()).argmax())] += 1
    probs = torch.softmax(logits[0] / temperature, -1)
    if top_p < 1:  # the smallest set of the most likely tokens reaching top_p, renormalised
        order = probs.argsort(descending=True)
        keep = order[:int((probs[order].cumsum(0) < top_p).sum()) + 1]
        probs = torch.zeros(5).index_put_((keep,), probs[keep]) / probs[keep].sum()
    assert torch.allclose(counts / counts.sum(), probs, atol=0.012), (counts / counts.sum(), probs)


def test_a_completion_does_not_depend_on_what_is_generated_beside_it():
    """The same prompts generated all at once, in halves, and the second half alone: each row's completion is
    the same (its own seeded generator), and another seed samples other completions."""
    from finetune.rl.step import row_seeds

    model, prompts, cfg = _model(), _prompts(4), _config(num_generations=2, max_completion_length=6)
    whole = generate_and_score(model, Letters(), prompts, cfg, REWARD, seed=11)
    halves = generate_and_score(model, Letters(), prompts, cfg, REWARD, seed=11, generation_rows=4)
    alone = generate_and_score(model, Letters(), prompts[2:], cfg, REWARD, seed=11)
    width = whole.prompt_length
    completions = whole.input_ids[:, width:]
    assert torch.equal(halves.input_ids[:, width:], completions)
    assert torch.equal(alone.input_ids[:, alone.prompt_length:], completions[4:])
    other = generate_and_score(model, Letters(), prompts, cfg, REWARD, seed=12)
    assert not torch.equal(other.input_ids[:, width:], completions)
    assert row_seeds(11, prompts[:1], 2) == row_seeds(11, prompts[:1], 2) != row_seeds(12, prompts[:1], 2)
    here, moved = ([replace(p, where=f"{folder}/{p.where}") for p in prompts] for folder in ("/here", "../there"))
    assert row_seeds(11, here, 2) == row_seeds(11, moved, 2) == row_seeds(11, prompts, 2)  # the data elsewhere
    assert row_seeds(11, prompts[:1], 2) != row_seeds(11, prompts[1:2], 2)  # another record
