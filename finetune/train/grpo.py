"""GRPO in the training loop: each step generates and scores completions of its prompts, then trains on them.

    loader batch (the step's prompts: micro_batch_size x accumulation completions / num_generations of them)
      plan_updates:     finetune.rl.step.generate_and_score -> a Rollout of prompts x num_generations completions
                        -> num_iterations updates, each every completion in micro-batches of micro_batch_size
      forward_backward: finetune.rl.step.grpo_forward_backward on one micro-batch (the loop's Objective)
      evaluate:         the greedy answer to each held-out prompt, scored (eval_reward, eval_rewards/NAME)

More in docs/rl.md, "In the code: finetune/train/grpo.py".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from finetune.console import console
from finetune.data.prompts import PromptExample
from finetune.errors import FinetuneError
from finetune.recipe.resolved import RunConfig
from finetune.recipe.schema import GRPOConfig
from finetune.rl.rewards import NamedReward, build_rewards
from finetune.rl.step import MicroBatch, Rollout, generate_and_score, grpo_forward_backward, held_out_rewards
from finetune.rundir import EVAL_PREFIX
from finetune.train import distributed
from finetune.train.loop import first_line, free_cached_memory
from finetune.train.objectives import MethodContext
from finetune.train.policy import Micro, Part, Policy, Step, Update

METRIC_PREFIXES = ("reward", "completion_length", "clip_ratio", "kl", "generation_tokens_per_second",
                   "training_tokens_per_second")


class GRPO(Policy):
    """The GRPO step as a loop policy and objective (module docstring). Its completions per forward/backward
    are the loop's `Geometry.completion_rows`; `on_samples(rows)`: a few sampled completions per logged step (the run's
    completions.jsonl); `on_recovery(event)`: an out-of-memory recovery, for the run log."""

    key = "grpo"
    evaluates_before = True  # the held-out rewards before training, for results.json

    def __init__(self, config: GRPOConfig, rewards: Sequence[NamedReward], tokenizer: Any, *,
                 on_samples: Callable[[list[dict]], None] | None = None,
                 on_recovery: Callable[[str], None] | None = None, samples: int = 4,
                 generation_rows: int | None = None):
        self.config, self.rewards, self.tokenizer = config, list(rewards), tokenizer
        self._resumed_rows: int | None = None  # a checkpoint of an earlier version's completions per pass
        self.generation_rows = generation_rows  # completions per generate call (the planned
        # grpo.generation_batch_size); None: the step's all
        self.on_samples, self.on_recovery, self.samples = on_samples, on_recovery, samples
        self.rollout: Rollout | None = None
        # what a training row gets, in one order on every process (their sums are added across processes)
        self.keys = ["reward", "reward_std", *(f"rewards/{r.name}/{s}" for r in self.rewards for s in ("mean", "std")),
                     "completion_length", "generation_tokens_per_second", "training_tokens_per_second", "clip_ratio",
                     *(["kl"] if config.beta else [])]
        self._sums: dict[str, list[float]] = {}  # metric -> [sum, count] since the last logged row
        self._latest: list[dict] = []
        self._trained_from = 0.0

    # -- generation ---------------------------------------------------------------------------------------
    def plan_updates(self, loop, step: Step, updates: list[Update]) -> list[Update]:
        prompts: list[PromptExample] = [row for batch in step.batches for row in batch]
        while True:
            try:
                self.rollout = self._generate(loop, prompts, step.number)
                break
            except torch.OutOfMemoryError as exc:
                failure = first_line(exc)
            free_cached_memory()
            total = len(prompts) * self.config.num_generations
            rows = min(self.generation_rows or total, total)
            if rows <= self.config.num_generations:
                raise FinetuneError(
                    f"out of memory generating step {step.number}'s answers even one prompt's "
                    f"{self.config.num_generations} at a time ({failure}); {loop.kept()}",
                    hint="lower grpo.num_generations or grpo.max_completion_length, or free GPU memory, then run "
                         "again (with --resume if a checkpoint was kept)")
            self.generation_rows = max(self.config.num_generations, rows // 2)
            self._said(f"out of memory generating step {step.number} ({failure}): generating "
                       f"{self.generation_rows} completions at a time")
        for key, value in self.rollout.metrics.items():
            self._add(key, value)
        self._latest = [{"step": step.number, **row} for row in self.rollout.samples]
        step.tokens = self.rollout.attention_mask.sum()  # prompts and completions
        self._trained_from = _now()
        return self._updates(loop)

    def _generate(self, loop, prompts: list[PromptExample], step: int) -> Rollout:
        """The step's rollout; its sampling seed is a function of the run's seed and the step alone."""
        model = loop.accelerator.unwrap_model(loop.model)
        return generate_and_score(model, self.tokenizer, prompts, self.config, self.rewards,
                                  logps_rows=loop.geometry.completion_rows, generation_rows=self.generation_rows,
                                  seed=loop.schedule.seed * 1_000_003 + step, autocast=loop.accelerator.autocast,
                                  samples=self.samples)

    def _updates(self, loop) -> list[Update]:
        """num_iterations updates over the rollout's completions in micro-batches of the geometry's
        completion_rows."""
        rollout = self.rollout
        rows = rollout.input_ids.shape[0]
        window = None
        if loop.processes > 1 and self.config.loss_type == "dapo":  # every process's tokens, then DDP averages
            tokens = loop.accelerator.gather(rollout.completion_mask.sum().reshape(1).float())
            window = float(tokens.sum()) / loop.processes
        micro = rollout.micro_batches(math.ceil(rows / loop.geometry.completion_rows), window)
        return [Update(micro_batches=[Micro(batch=m) for m in micro], share=1 / self.config.num_iterations)
                for _ in range(self.config.num_iterations)]

    # -- training -----------------------------------------------------------------------------------------
    def forward_backward(self, loop, part: Part) -> torch.Tensor:
        micro: MicroBatch = part.batch
        result = grpo_forward_backward(loop.model, micro, self.config, autocast=loop.accelerator.autocast,
                                       backward=loop.backward)
        self._add("clip_ratio", result.clip_ratio)
        if result.kl is not None:
            self._add("kl", result.kl)
        return torch.tensor(result.loss, device=loop.accelerator.device)

    def on_oom(self, loop, step: Step, failure: str, phase: str) -> bool:
        """A forward/backward ran out of memory: halve the micro-batch and run the step's remaining updates
        again over the same completions."""
        rows = loop.geometry.completion_rows
        if phase != "step" or rows <= 1 or self.rollout is None:
            return False
        loop.set_geometry(completion_rows=max(1, rows // 2))
        redone = self._updates(loop)
        step.updates[step.applied:] = redone[step.applied:]
        self._said(f"out of memory in step {step.number}'s forward/backward ({failure}): training "
                   f"micro-batch {loop.geometry.completion_rows} completions")
        return True

    def on_step_end(self, loop, step: Step) -> None:
        """Training tokens per second of the step (its forward/backwards and updates, generation left out)."""
        tokens = float(step.tokens) * self.config.num_iterations
        self._add("training_tokens_per_second", tokens / max(_now() - self._trained_from, 1e-9))
        self.rollout = None  # its tensors are not needed any more

    # -- evaluation and logs ------------------------------------------------------------------------------
    def evaluate(self, loop) -> dict[str, float]:
        """The held-out prompts' greedy answers, scored; means over every process's prompts."""
        data = loop.data.eval
        mine = [data[j] for j in range(loop.rank, len(data), loop.processes)]
        model = loop.accelerator.unwrap_model(loop.model)
        rows = self.generation_rows or loop.geometry.micro_batch * self.config.num_generations  # as a step's
        with loop.evaluation_progress(len(mine), f"held-out prompts, greedy answers of at most "
                                      f"{self.config.max_completion_length} tokens") as advance:
            values = held_out_rewards(model, self.tokenizer, mine, self.config, self.rewards, rows=rows,
                                      autocast=loop.accelerator.autocast, progress=advance) if mine else {}
        out = {}
        for name, column in values.items():
            kept = torch.tensor([v for v in column if not math.isnan(v)], dtype=torch.float64)
            total = torch.stack([kept.sum(), torch.tensor(float(kept.numel()), dtype=torch.float64)])
            if loop.processes > 1:
                total = loop.accelerator.gather(total.to(loop.accelerator.device).reshape(1, 2)).sum(0).cpu()
            out[f"{EVAL_PREFIX}{name}"] = float(total[0] / total[1]) if total[1] else math.nan
        return out

    def training_metrics(self, loop) -> dict[str, float]:
        """Each metric's mean since the last training row, over every process."""
        totals = torch.tensor([self._sums.get(k, [0.0, 0]) for k in self.keys], dtype=torch.float64)
        if loop.processes > 1:  # every process logs at the same steps (the loop gathers the loss there too)
            totals = loop.accelerator.gather(totals.to(loop.accelerator.device).unsqueeze(0)).sum(0).cpu()
        self._sums = {}
        return {k: s / n for k, (s, n) in zip(self.keys, totals.tolist(), strict=True) if n}

    def log(self, loop, row: dict) -> None:
        """A training row: the step's sampled answers go to the run's completions file."""
        if "loss" in row and self.on_samples is not None and self._latest:
            self.on_samples(self._latest)

    def _add(self, key: str, value: float) -> None:
        if not math.isnan(value):
            total = self._sums.setdefault(key, [0.0, 0])
            total[0] += value
            total[1] += 1

    def _said(self, line: str) -> None:
        if self.on_recovery is not None:
            self.on_recovery(line)

    def on_train_begin(self, loop) -> None:
        if self._resumed_rows is not None:  # the loop's geometry holds it since; older checkpoints kept it here
            loop.set_geometry(completion_rows=self._resumed_rows)
            self._resumed_rows = None

    def state_dict(self) -> dict:
        return {"generation_rows": self.generation_rows}

    def load_state_dict(self, state: dict) -> None:
        self.generation_rows = state["generation_rows"]
        if "micro_batch" in state:
            self._resumed_rows = int(state["micro_batch"])


def _now() -> float:
    """Seconds, after the GPU's queued work (one sync per step: generation synced already)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def grpo_objective(config: RunConfig, context: MethodContext) -> GRPO:
    """GRPO's objective (and loop policy) with the recipe's rewards; rank 0 writes the sampled completions and
    recoveries to the run directory."""
    run_dir = context.run_dir if distributed.is_main() else None

    def recovered(line: str) -> None:
        console.print(line, style="yellow", markup=False)
        if run_dir is not None:
            run_dir.log_line(line)

    return GRPO(config.recipe.grpo, build_rewards(config.recipe.grpo), context.tokenizer,
                on_samples=run_dir.append_completions if run_dir is not None else None,
                on_recovery=recovered if distributed.is_main() else None,
                generation_rows=config.settings.generation_batch_size)
