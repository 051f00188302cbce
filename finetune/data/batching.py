"""How an epoch's examples become steps and micro-batches: `data.batching` (docs/training.md, "Batching").

Padded micro-batches cost their longest row times their rows. Drawn at random, micro-batches of 8 from
alpaca_en_demo are ~45% real tokens; grouped by length, ~99% (benchmarks/results/batching.txt). The kinds:

- random: the epoch's permutation cut into micro-batches in order (the order before this setting existed).
- length_grouped: the permutation is cut into chunks of GROUP_STEPS steps; each chunk is sorted by length and
  cut into steps (micro_batch x accumulation x processes examples, micro-batches of micro_batch rows), and the
  chunk's steps are shuffled. Which examples share a step depends on their length, but the order of the
  steps stays random (the chunks are random samples, each step's place in its chunk is shuffled), so the
  training still sees a shuffled stream of batches (LengthGroupedSampler's mega-batches in transformers).
- token_budget: the steps of length_grouped (the effective batch stays in examples), each cut into
  micro-batches of at most `token_budget` padded tokens (rows x the longest row) instead of micro_batch rows:
  a step of short examples runs in fewer, fuller forward/backwards. The budget is micro_batch x the longest
  example, the tokens of the largest micro-batch the plan prices, so no micro-batch needs more memory than
  the planned one; the rows of a micro-batch are capped by its step's examples.

With `training.effective_batch_tokens` (`step_tokens` here) a step is a number of real tokens instead: examples
join the step until their tokens reach the target (so a step holds at most one example more than it needs),
in the permutation's order (random) or, grouped, in each chunk's order by length (chunks of about GROUP_STEPS
steps' tokens; a chunk's last step short of the target is carried into the next chunk, so only the epoch's last
step falls short), the chunk's steps shuffled; then each step is cut into micro-batches as its kind cuts them.
The steps do not depend on the micro-batch, so a recovery's smaller micro-batch keeps them.

Everything follows from (the permutation, the lengths, the seed and epoch), so a step's examples follow from
its number: resuming needs no sampler state, and an out-of-memory recovery that trades micro-batch for
accumulation (the same examples per step) keeps the same steps. The permutation is `epoch_order`, the one the
loop draws, so the planner prices the very micro-batches the run forms (`run_micro_batches`); torch is imported
only to draw it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from finetune.recipe.schema import BATCHINGS

GROUP_STEPS = 64  # steps per chunk sorted by length: a larger chunk pads less but correlates the steps more


@dataclass(frozen=True)
class Batching:
    """How one epoch is cut: the kind and the batch shape (one process's micro-batch and accumulation)."""

    kind: str = "random"  # one of BATCHINGS
    micro_batch: int = 1
    accumulation: int = 1
    processes: int = 1
    token_budget: int | None = None  # token_budget: padded tokens per micro-batch
    step_tokens: int | None = None  # the effective batch in real tokens (None: micro_batch x accumulation examples)

    def __post_init__(self) -> None:
        if self.kind not in BATCHINGS:
            raise ValueError(f"unknown batching {self.kind!r}: one of {', '.join(BATCHINGS)}")

    @property
    def step_examples(self) -> int:
        """Examples of one step over every process (the effective batch in examples)."""
        return self.micro_batch * self.accumulation * self.processes


def example_length(row: Mapping[str, Any]) -> int | None:
    """Tokens of an example as its collated row is padded: input_ids, or the longer of a preference pair's
    sequences (padded together); None where rows carry no tokens (a prompt to generate from)."""
    if "input_ids" in row:
        return len(row["input_ids"])
    pair = [len(row[k]) for k in ("chosen_input_ids", "rejected_input_ids") if k in row]
    return max(pair) if pair else None


def epoch_order(examples: int, seed: int, epoch: int) -> list[int]:
    """The permutation of an epoch's examples: a function of (seed, epoch) alone, so resuming needs no sampler
    state and the planner draws the run's own (torch.randperm on a CPU generator: the same on every machine)."""
    import torch

    return torch.randperm(examples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def run_micro_batches(lengths: Sequence[int], batching: Batching, seed: int, epochs: float,
                      max_steps: int | None, most_epochs: int) -> list[list[int]] | None:
    """Every micro-batch (example indices) the run forms, over every process: its first `max_steps` steps, or
    (None) `epochs` epochs (a part of the last as `finetune.train.setup.total_steps` counts it); what the plan
    must hold (finetune.plan.batches prices the largest). None where that takes more than `most_epochs` epochs."""
    out: list[list[int]] = []
    done = 0
    for epoch in range(most_epochs):
        ranks = [epoch_steps(epoch_order(len(lengths), seed, epoch), lengths, batching, seed, epoch, rank)
                 for rank in range(batching.processes)]
        count = len(ranks[0])
        take = min(count, max_steps - done) if max_steps is not None else \
            count if epoch + 1 <= epochs else max(1, math.ceil((epochs - epoch) * count))
        out += [mb for steps in ranks for step in steps[:take] for mb in step]
        done += take
        if done >= max_steps if max_steps is not None else epoch + 1 >= epochs:
            return out
    return None


def epoch_steps(order: Sequence[int], lengths: Sequence[int], batching: Batching, seed: int, epoch: int,
                rank: int = 0) -> list[list[list[int]]]:
    """Process `rank`'s steps of one epoch, each a list of micro-batches (example indices); `order` is the
    epoch's permutation, `lengths` every example's tokens. Random micro-batches are dealt round-robin to the
    processes (the last round padded from the start, as accelerate's even batches do)."""
    b = batching
    if b.step_tokens is not None:
        if b.processes != 1 or (b.kind == "token_budget" and b.token_budget is None):
            raise ValueError("steps of a token target need one process (token_budget: and a budget)")
        rng = random.Random(f"batching:{seed}:{epoch}")
        return [_micro_batches(u, lengths, b) for u in _token_steps(order, lengths, b.step_tokens, b.kind != "random", rng)]
    if b.kind == "random":
        batches = [list(order[i:i + b.micro_batch]) for i in range(0, len(order), b.micro_batch)]
    else:
        units = _grouped_steps(order, lengths, b.step_examples, random.Random(f"batching:{seed}:{epoch}"))
        if b.kind == "token_budget":
            if b.processes != 1 or b.token_budget is None:
                raise ValueError("token_budget batches need one process and a token budget")
            return [cut(u, lengths, rows=len(u), tokens=b.token_budget) for u in units]
        batches = [u[i:i + b.micro_batch] for u in units for i in range(0, len(u), b.micro_batch)]
    if b.processes > 1:
        rounds = -(-len(batches) // b.processes)
        batches = (batches * b.processes)[:rounds * b.processes][rank::b.processes]
    return [batches[i:i + b.accumulation] for i in range(0, len(batches), b.accumulation)]


def _micro_batches(step: Sequence[int], lengths: Sequence[int], b: Batching) -> list[list[int]]:
    """One step's examples as its kind cuts them: micro_batch rows, or (token_budget) under the budget."""
    if b.kind == "token_budget":
        return cut(step, lengths, rows=len(step), tokens=b.token_budget)
    return [list(step[i:i + b.micro_batch]) for i in range(0, len(step), b.micro_batch)]


def _fill(indices: Sequence[int], lengths: Sequence[int], target: int) -> list[list[int]]:
    """`indices` in order as runs that each close as soon as their tokens reach `target` (the last may not)."""
    runs: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in indices:
        current.append(i)
        tokens += lengths[i]
        if tokens >= target:
            runs.append(current)
            current, tokens = [], 0
    return runs + ([current] if current else [])


def _token_steps(order: Sequence[int], lengths: Sequence[int], target: int, grouped: bool,
                 rng: random.Random) -> list[list[int]]:
    """`order` as steps of at least `target` tokens (module docstring); only the last may fall short."""
    if not grouped:
        return _fill(order, lengths, target)
    steps: list[list[int]] = []
    carry: list[int] = []
    for chunk in _fill(order, lengths, target * GROUP_STEPS):
        group = _fill(sorted(carry + chunk, key=lambda i: lengths[i]), lengths, target)  # stable: ties keep order
        carry = group.pop() if sum(lengths[i] for i in group[-1]) < target else []
        rng.shuffle(group)
        steps += group
    return steps + ([carry] if carry else [])


def _grouped_steps(order: Sequence[int], lengths: Sequence[int], size: int, rng: random.Random) -> list[list[int]]:
    """`order` as steps of `size` examples of similar length, in shuffled order (module docstring); a
    shorter last step stays last, so every other step is whole."""
    chunk = size * GROUP_STEPS
    steps = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start:start + chunk], key=lambda i: lengths[i])  # stable: ties keep the random order
        steps += [part[i:i + size] for i in range(0, len(part), size)]
    short = [steps.pop()] if steps and len(steps[-1]) < size else []
    shuffled = []
    for start in range(0, len(steps), GROUP_STEPS):  # shuffled within each chunk: no chunk order leaks
        group = steps[start:start + GROUP_STEPS]
        rng.shuffle(group)
        shuffled += group
    return shuffled + short


def cut(indices: Sequence[Any], lengths: Sequence[int] | Mapping[Any, int], rows: int,
        tokens: int | None = None) -> list[list[Any]]:
    """`indices` in order as consecutive micro-batches of at most `rows` rows and, with `tokens`, at most that
    many padded tokens (rows x the longest); a row longer than the budget alone is a micro-batch of its own."""
    out: list[list[Any]] = []
    current: list[Any] = []
    longest = 0
    for i in indices:
        n = lengths[i]
        if current and (len(current) >= rows or (tokens is not None and (len(current) + 1) * max(longest, n) > tokens)):
            out.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        out.append(current)
    return out


@dataclass(frozen=True)
class EpochShape:
    """What one epoch's micro-batches cost: real and padded tokens, forward/backwards."""

    real_tokens: int
    padded_tokens: int
    passes: int
    largest_rows: int
    largest_tokens: int

    @property
    def real_share(self) -> float:
        return self.real_tokens / max(self.padded_tokens, 1)

    def cost(self, pass_tokens: float) -> float:
        """Predicted time, in tokens: the padded tokens plus `pass_tokens` per forward/backward (a pass of n
        tokens runs at n / (n + pass_tokens) of the device's peak: finetune.plan.cost_model's half_tokens)."""
        return self.padded_tokens + self.passes * pass_tokens


def epoch_shape(lengths: Sequence[int], batching: Batching, seed: int = 0, epoch: int = 0) -> EpochShape:
    """The micro-batches `batching` forms from `lengths` in one epoch (one process's share, as trained),
    counted (the planner's price of a batching, the benchmark's real-token share)."""
    order = epoch_order(len(lengths), seed, epoch)
    real = padded = passes = rows = tokens = 0
    for step in epoch_steps(order, lengths, batching, seed, epoch):
        for mb in step:
            longest = max(lengths[i] for i in mb)
            real += sum(lengths[i] for i in mb)
            padded += longest * len(mb)
            passes += 1
            rows, tokens = max(rows, len(mb)), max(tokens, longest * len(mb))
    return EpochShape(real, padded, passes, rows, tokens)
