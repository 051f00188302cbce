"""GRPO's step as parts a training loop calls: generate and score once, then forward/backward per micro-batch.

    rollout = generate_and_score(model, tokenizer, prompts, config, rewards)
    for _ in range(config.num_iterations):
        for micro in rollout.micro_batches(n):
            grpo_forward_backward(model, micro, config)
        # the loop's optimizer update (finetune.step.training_step.optimizer_update)

More in docs/rl.md, "In the code: finetune/rl/step.py".
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

import torch

from finetune.data.prompts import PromptExample, left_padded
from finetune.memory.tracker import MemoryTracker
from finetune.recipe.schema import GRPOConfig
from finetune.rl.grpo_loss import group_advantages, grpo_loss
from finetune.rl.rewards import NamedReward, score
from finetune.step.preference import reference_weights

_NULL = contextlib.nullcontext


@dataclass(frozen=True)
class MicroBatch:
    """Some completions of a rollout with what their loss needs; `accumulation` micro-batches make one update,
    whose completion tokens are `window_tokens` (dapo's normaliser)."""

    input_ids: torch.Tensor  # [rows, prompt + completion]
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor  # [rows, completion]: 1 on completion tokens (to the first EOS included)
    prompt_length: int
    advantages: torch.Tensor  # [rows]
    old_logps: torch.Tensor | None  # [rows, completion]; None: first pass, ratio 1
    ref_logps: torch.Tensor | None
    accumulation: int
    window_tokens: float


@dataclass
class Rollout:
    """One generation batch: the completions of every prompt, their rewards, advantages and log-probs."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    prompt_length: int
    rewards: torch.Tensor  # [completions], NaN where no reward applies
    advantages: torch.Tensor
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    metrics: dict[str, float] = field(default_factory=dict)  # reward mean/std (total and per reward), length
    samples: list[dict[str, Any]] = field(default_factory=list)  # a few (where, prompt, completion, reward)

    def micro_batches(self, n: int, window_tokens: float | None = None) -> list[MicroBatch]:
        """The completions in `n` micro-batches of (nearly) equal rows, in order; each carries the scaling of
        an update over all of them. `window_tokens`: dapo's normaliser when the update spans more than this
        rollout (several processes); default its completion tokens."""
        rows = self.input_ids.shape[0]
        if not 1 <= n <= rows:
            raise ValueError(f"cannot split {rows} completions into {n} micro-batches")
        window = float(self.completion_mask.sum()) if window_tokens is None else window_tokens
        bounds = [round(i * rows / n) for i in range(n + 1)]

        def part(t: torch.Tensor | None, a: int, b: int) -> torch.Tensor | None:
            return None if t is None else t[a:b]

        return [MicroBatch(self.input_ids[a:b], self.attention_mask[a:b], self.completion_mask[a:b],
                           self.prompt_length, self.advantages[a:b], part(self.old_logps, a, b),
                           part(self.ref_logps, a, b), n, window) for a, b in zip(bounds, bounds[1:], strict=False)]


def prompts_per_step(micro_batch: int, accumulation: int, num_generations: int) -> int:
    """Prompts one optimizer step generates for: its micro_batch x accumulation completions, rounded up to whole
    groups of num_generations (docs/rl.md; as TRL's generation batch)."""
    return -(-(micro_batch * accumulation) // num_generations)


def _completion_mask(completion: torch.Tensor, eos: int | None) -> torch.Tensor:
    """1 up to and including each row's first EOS (all of the row without one)."""
    steps = torch.arange(completion.shape[1], device=completion.device)
    if eos is None:
        return torch.ones_like(completion)
    is_eos = completion == eos
    first = torch.where(is_eos.any(-1), is_eos.int().argmax(-1), completion.shape[1])
    return (steps.unsqueeze(0) <= first.unsqueeze(1)).long()


def completion_logps(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     prompt_length: int, temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probabilities of the completion tokens (every column after `prompt_length`) under the
    logits divided by `temperature`; the graph is kept when gradients are on."""
    completion = input_ids.shape[1] - prompt_length
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False,
                   logits_to_keep=completion + 1).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, prompt_length:]
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def _no_grad_logps(model: torch.nn.Module, rollout: Rollout, temperature: float, rows: int,
                   autocast: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor:
    parts = []
    with torch.no_grad(), autocast():
        for a in range(0, rollout.input_ids.shape[0], rows):
            parts.append(completion_logps(model, rollout.input_ids[a:a + rows], rollout.attention_mask[a:a + rows],
                                          rollout.prompt_length, temperature))
    return torch.cat(parts)


@contextlib.contextmanager
def _evaluating(model: torch.nn.Module):
    """Eval mode (no dropout) for the block, then the mode the model had."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@dataclass
class _Answers:
    """Completions of some prompts: prompt ids (left-padded), completion ids and mask, texts, rewards."""

    ids: torch.Tensor
    mask: torch.Tensor
    completion: torch.Tensor
    completion_mask: torch.Tensor
    texts: list[str]
    expanded: list[PromptExample]  # the prompt of each completion
    totals: list[float]
    per_reward: dict[str, list[float]]
    generation_s: float


class RowSampler:
    """Sampling at `temperature`/`top_p` in which every row draws from its own generator: the Gumbel-max trick
    (argmax of the warped logits plus Gumbel noise is a sample of their softmax), as a logits processor under
    greedy decoding. A row's completion then depends on its seed alone, not on the rows generated beside it,
    so several processes, or generation in halves after an out-of-memory error, sample what one call would.
    `start` is the first row of the next generate call."""

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float):
        from transformers.generation import TopPLogitsWarper

        self.seeds, self.temperature = list(seeds), temperature
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1 else None
        self.generators: list[torch.Generator] = []
        self.start = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not self.generators:
            self.generators = [torch.Generator(scores.device).manual_seed(s) for s in self.seeds]
        scores = scores / self.temperature if self.temperature != 1.0 else scores
        if self.top_p is not None:
            scores = self.top_p(input_ids, scores)
        rows = range(self.start, self.start + scores.shape[0])
        uniform = torch.stack([torch.rand(scores.shape[-1], generator=self.generators[r], device=scores.device)
                               for r in rows])
        tiny = torch.finfo(uniform.dtype).tiny
        exponential = (-torch.log(uniform.clamp(min=tiny))).clamp(min=tiny)
        return scores - torch.log(exponential)  # + Gumbel noise


def row_seeds(seed: int, prompts: Sequence[PromptExample], copies: int) -> list[int]:
    """One seed per completion from (seed, its record, its index among the prompt's copies). The record is its
    file's name and line, not its folder: a run samples the same wherever its data lies (another machine, a
    relative path from another working directory)."""
    return [int(hashlib.sha256(f"{seed}:{_record(p.where)}:{k}".encode()).hexdigest()[:15], 16)
            for p in prompts for k in range(copies)]


def _record(where: str) -> str:
    file, _, line = where.rpartition(":")
    return f"{PurePath(file).name}:{line}" if file else where


def _answer(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[PromptExample], copies: int,
            config: GRPOConfig, rewards: Sequence[NamedReward], rows: int | None, seed: int | None,
            autocast: Callable[[], contextlib.AbstractContextManager],
            progress: Callable[[int], None] | None = None) -> _Answers:
    """`copies` completions of each prompt, generated `rows` at a time (all: None), then scored; sampled with
    RowSampler from `seed`, or greedy when `seed` is None. `progress` is told the prompts of each part done."""
    from transformers.generation import LogitsProcessorList

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in left_padded(list(prompts), copies, pad))
    width, length = ids.shape[1], config.max_completion_length
    sampler = None if seed is None else RowSampler(row_seeds(seed, prompts, copies), config.temperature, config.top_p)
    processors = LogitsProcessorList([sampler] if sampler is not None else [])
    parts, start, rows = [], time.perf_counter(), rows or ids.shape[0]
    with _evaluating(model), torch.no_grad(), autocast():
        for a in range(0, ids.shape[0], rows):
            if sampler is not None:
                sampler.start = a
            out = model.generate(input_ids=ids[a:a + rows], attention_mask=mask[a:a + rows], do_sample=False,
                                 logits_processor=processors, max_new_tokens=length, use_cache=True,
                                 cache_implementation="static", pad_token_id=pad, eos_token_id=eos)
            part = out[:, width:]  # every row ended early: pad to the full length
            parts.append(torch.nn.functional.pad(part, (0, length - part.shape[1]), value=pad))
            if progress is not None:
                progress(part.shape[0] // copies)
    completion = torch.cat(parts)
    generation_s = time.perf_counter() - start
    completion_mask = _completion_mask(completion, eos)
    lengths = completion_mask.sum(-1).tolist()
    texts = tokenizer.batch_decode([row[:n].tolist() for row, n in zip(completion, lengths, strict=True)],
                                   skip_special_tokens=True)
    expanded = [p for p in prompts for _ in range(copies)]
    totals, per_reward = score(rewards, [p.text for p in expanded], texts, [p.fields for p in expanded],
                               [p.where for p in expanded])
    return _Answers(ids, mask, completion, completion_mask, texts, expanded, totals, per_reward, generation_s)


def generate_and_score(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[PromptExample],
                       config: GRPOConfig, rewards: Sequence[NamedReward], *, logps_rows: int | None = None,
                       generation_rows: int | None = None, seed: int | None = None,
                       autocast: Callable[[], contextlib.AbstractContextManager] = _NULL,
                       samples: int = 4) -> Rollout:
    """Sample `config.num_generations` completions per prompt, score them, and compute what the loss needs
    (see the module docstring). `logps_rows`: completions per no-grad log-prob forward (default all);
    `generation_rows`: completions per generate call (default all; an out-of-memory recovery lowers it);
    `seed`: each completion is sampled from its own generator, seeded by (seed, its record, its index in the
    group), so it does not depend on the prompts generated with it (None: a seed drawn from torch's RNG);
    `autocast`: the run's mixed-precision context; `samples`: rows kept for the logs (one per prompt first).
    A reward that fails raises RewardError naming the record and the reward."""
    group = config.num_generations
    seed = int(torch.randint(2**62, ())) if seed is None else seed
    got = _answer(model, tokenizer, prompts, group, config, rewards, generation_rows, seed, autocast)
    device, width = got.ids.device, got.ids.shape[1]
    reward = torch.tensor(got.totals, dtype=torch.float32)
    rollout = Rollout(torch.cat([got.ids, got.completion], 1), torch.cat([got.mask, got.completion_mask], 1),
                      got.completion_mask, width, reward,
                      group_advantages(reward, group, config.scale_rewards).to(device), None, None)
    rows = logps_rows or got.ids.shape[0]
    with _evaluating(model):  # the scoring_passes
        if config.num_iterations > 1:
            rollout.old_logps = _no_grad_logps(model, rollout, config.temperature, rows, autocast)
        if config.beta:
            with reference_weights(model):
                rollout.ref_logps = _no_grad_logps(model, rollout, config.temperature, rows, autocast)
    tokens = float(got.completion_mask.sum())
    rollout.metrics = _reward_metrics(reward, got.per_reward, rewards) | {
        "completion_length": tokens / len(got.texts),
        "generation_tokens_per_second": tokens / max(got.generation_s, 1e-9)}
    order = sorted(range(len(got.texts)), key=lambda j: (j % group, j))[:samples]  # one per prompt first
    rollout.samples = [{"where": got.expanded[j].where, "prompt": got.expanded[j].text,
                        "completion": got.texts[j], "reward": got.totals[j]} for j in order]
    return rollout


def held_out_rewards(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[PromptExample], config: GRPOConfig,
                     rewards: Sequence[NamedReward], *, rows: int | None = None,
                     autocast: Callable[[], contextlib.AbstractContextManager] = _NULL,
                     progress: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """The greedy answer to each held-out prompt, scored: the summed reward and each reward's value per prompt
    (`reward`, `rewards/NAME`) and the completion lengths. Greedy: what the model answers, without the
    sampling noise, so before and after compare. `progress` is told the prompts each generate call answered."""
    got = _answer(model, tokenizer, prompts, 1, config, rewards, rows, None, autocast, progress)
    return {"reward": got.totals, **{f"rewards/{r.name}": got.per_reward[r.key] for r in rewards},
            "completion_length": [float(n) for n in got.completion_mask.sum(-1).tolist()]}


def _reward_metrics(total: torch.Tensor, per_reward: dict[str, list[float]],
                    rewards: Sequence[NamedReward]) -> dict[str, float]:
    """Mean and standard deviation of the summed reward and of each reward (`rewards/answer/mean`), NaNs out."""
    out = {}
    named = [("reward", total)] + [(f"rewards/{r.name}", torch.tensor(per_reward[r.key])) for r in rewards]
    for name, values in named:
        kept = values[~torch.isnan(values)]
        out[f"{name}/mean" if name != "reward" else "reward"] = float(kept.mean()) if kept.numel() else math.nan
        out[f"{name}/std" if name != "reward" else "reward_std"] = float(kept.std()) if kept.numel() > 1 else 0.0
    return out


@dataclass(frozen=True)
class LossMetrics:
    """What one micro-batch's loss logs: the loss (as scaled for backward), mean KL (None when beta is 0),
    and the fraction of completion tokens whose ratio was clipped."""

    loss: float
    kl: float | None
    clip_ratio: float


def grpo_forward_backward(model: torch.nn.Module, micro: MicroBatch, config: GRPOConfig, *,
                          autocast: Callable[[], contextlib.AbstractContextManager] = _NULL,
                          backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
                          tracker: MemoryTracker | None = None, backward_window: str = "backward") -> LossMetrics:
    """One micro-batch's policy forward (adapter on, the model's mode as the loop set it) and backward of the
    GRPO-family loss, scaled for `micro.accumulation` micro-batches as finetune.rl.grpo_loss scales it (dapo:
    by the update's completion tokens). `backward`: the run's (fp16 loss scaling); `tracker`: record the
    forward and `backward_window` phases (the planner's trace), both as in finetune.step.training_step.forward_backward."""
    with tracker.window("forward") if tracker is not None else _NULL():
        with autocast():
            logps = completion_logps(model, micro.input_ids, micro.attention_mask, micro.prompt_length,
                                     config.temperature)
        result = grpo_loss(logps, micro.old_logps, micro.advantages, micro.completion_mask,
                           loss_type=config.loss_type, epsilon_low=config.epsilon, epsilon_high=config.epsilon_high,
                           beta=config.beta, ref_logps=micro.ref_logps,
                           max_completion_length=config.max_completion_length, window_tokens=micro.window_tokens,
                           accumulation=micro.accumulation)
    with tracker.window(backward_window) if tracker is not None else _NULL():
        backward(result.loss)
    loss = result.loss.detach()
    return LossMetrics(math.nan if loss.is_meta else float(loss), result.kl, result.clip_ratio)


def scoring_passes(config: GRPOConfig) -> int:
    """No-grad log-prob passes over a step's completions between generation and training (generate_and_score):
    the old policy's (num_iterations > 1) and the reference's (beta > 0)."""
    return int(config.num_iterations > 1) + int(config.beta > 0)


def trace_objective(config: GRPOConfig) -> str:
    """What decides a GRPO step's memory, as the planner's trace key: `grpo:COMPLETION_TOKENS`, plus `:logps`
    when a no-grad log-prob pass (old policy or reference) runs between generation and training."""
    return f"grpo:{config.max_completion_length}" + (":logps" if scoring_passes(config) else "")


def of_trace_objective(objective: str) -> tuple[int, bool] | None:
    """(completion tokens, with a log-prob pass) of a `trace_objective`; None for any other objective."""
    name, *rest = objective.split(":")
    return (int(rest[0]), "logps" in rest[1:]) if name == "grpo" else None


def synthetic_micro_batch(rows: int, prompt_tokens: int, completion_tokens: int, device: Any,
                          accumulation: int = 1) -> MicroBatch:
    """A micro-batch of `rows` completions at full length with every completion token in the loss, zeros for
    ids and advantages (what the planner's trace runs on `meta`)."""
    width = prompt_tokens + completion_tokens
    ids = torch.zeros(rows, width, dtype=torch.long, device=device)
    return MicroBatch(ids, torch.ones_like(ids), torch.ones(rows, completion_tokens, dtype=torch.long, device=device),
                      prompt_tokens, torch.zeros(rows, device=device), None, None, accumulation,
                      float(rows * completion_tokens))
