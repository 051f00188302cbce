"""The gradient noise scale, measured in every run: how large a batch is still worth its tokens.

B_simple = tr(Sigma) / |G|^2 (McCandlish et al., "An Empirical Model of Large-Batch Training", 2018): Sigma is
the covariance of one token's gradient, G the true gradient. Batches much smaller than B_simple waste steps
(each update is mostly noise), much larger ones waste tokens. The unit here is LABELLED TOKENS (labels !=
-100), so packed and unpacked data, and sequences of different lengths, are counted alike; divide by the
labelled tokens per sequence for a batch in sequences.

More in docs/training.md, "How the noise scale is measured (finetune/train/noise_scale.py)".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from finetune.compat import foreach_norm
from finetune.data.batch import Batch
from finetune.memory.chunked_loss import IGNORE_INDEX
from finetune.optim import layerwise_of
from finetune.train.policy import Micro, Part, Policy, Step, Update

DEFAULT_DECAY = 0.95  # EMA of |G|^2 and tr(Sigma): about 20 steps of memory
SLICE = 1 << 24  # elements per fp32 slice of a gradient norm
MIN_STEPS = 5  # fewer observations than this: no estimate is reported (the EMA is still mostly one step)
KEYS = ("gns", "grad_sq", "trace_sigma")  # what NoiseScaleEMA.values() reports, as metrics.jsonl names them


@dataclass(frozen=True)
class Observation:
    """One optimizer step's unbiased estimates (each may be negative: they are noisy)."""

    grad_sq: float  # |G|^2
    trace_sigma: float  # tr(Sigma), per labelled token


def two_batch(small_sq: float, inv_small: float, big_sq: float, inv_big: float) -> Observation:
    """Solve E|G_b|^2 = |G|^2 + tr(Sigma) / b for the two batches; inv_*: 1/b of each (in tokens)."""
    if not inv_small > inv_big:
        raise ValueError(f"the small batch must be smaller: 1/b_small {inv_small} <= 1/b_big {inv_big}")
    trace = (small_sq - big_sq) / (inv_small - inv_big)
    return Observation(grad_sq=big_sq - trace * inv_big, trace_sigma=trace)


def part_sums(parts: list[tuple[float, float, float]]) -> list[float]:
    """What step_observation needs of the micro-batches, as sums (so several processes can add theirs):
    [sum |c_i / w_i|^2, count, sum 1/b_i, sum w_i^2 / b_i, sum w_i] over the non-empty parts."""
    parts = [p for p in parts if p[1] > 0 and p[2] > 0]
    return [sum(sq / w**2 for sq, _, w in parts), float(len(parts)), sum(1 / b for _, b, _ in parts),
            sum(w**2 / b for _, b, w in parts), sum(w for _, _, w in parts)]


def observation_of_sums(sums: list[float], big_sq: float) -> Observation | None:
    """step_observation from part_sums (added over processes); None with fewer than two micro-batches."""
    small_sum, count, inv_small_sum, inv_big_sum, total = sums
    if count < 2:
        return None
    return two_batch(small_sum / count, inv_small_sum / count, big_sq / total**2, inv_big_sum / total**2)


def step_observation(parts: list[tuple[float, float, float]], big_sq: float) -> Observation | None:
    """The step's observation from its micro-batches: parts are (|c_i|^2, tokens b_i, weight w_i) where c_i
    is micro-batch i's contribution to the accumulated gradient, c_i = w_i * (mean gradient of its tokens);
    big_sq is |sum c_i|^2. None when the step has fewer than two non-empty micro-batches."""
    return observation_of_sums(part_sums(parts), big_sq)


class NoiseScaleEMA:
    """Bias-corrected EMAs of |G|^2 and tr(Sigma) (smoothed separately, divided only when read)."""

    def __init__(self, decay: float = DEFAULT_DECAY):
        self.decay = decay
        self.grad_sq = 0.0
        self.trace_sigma = 0.0
        self.weight = 0.0  # 1 - decay**steps: the bias correction
        self.steps = 0

    def update(self, obs: Observation) -> None:
        d = self.decay
        self.grad_sq = d * self.grad_sq + (1 - d) * obs.grad_sq
        self.trace_sigma = d * self.trace_sigma + (1 - d) * obs.trace_sigma
        self.weight = d * self.weight + (1 - d)
        self.steps += 1

    def values(self) -> dict[str, float] | None:
        """{"gns", "grad_sq", "trace_sigma"}; gns in labelled tokens. None until MIN_STEPS observations, or
        while the smoothed |G|^2 is not positive (the gradient is all noise: no finite noise scale)."""
        if self.steps < MIN_STEPS:
            return None
        g2, trace = self.grad_sq / self.weight, self.trace_sigma / self.weight
        gns, grad_sq, trace_sigma = KEYS
        out = {grad_sq: g2, trace_sigma: trace}
        if g2 > 0 and trace > 0:
            out[gns] = trace / g2
        return out

    def state_dict(self) -> dict[str, float]:
        return {"decay": self.decay, "grad_sq": self.grad_sq, "trace_sigma": self.trace_sigma,
                "weight": self.weight, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.decay = float(state["decay"])
        self.grad_sq, self.trace_sigma = float(state["grad_sq"]), float(state["trace_sigma"])
        self.weight, self.steps = float(state["weight"]), int(state["steps"])


def labelled_tokens(inputs: dict) -> torch.Tensor:
    """Tokens of a micro-batch that carry a loss, counted as transformers counts num_items_in_batch
    (labels shifted by one for a causal LM): a 0-d tensor on the labels' device, so counting waits for nothing."""
    labels = inputs.get("shift_labels")
    if labels is None:
        labels = inputs["labels"][..., 1:]
    return labels.ne(IGNORE_INDEX).sum()


class GradNormProbe:
    """Per-micro-batch gradient norms from hooks, and the accumulated one (see the module docstring).

    Call `micro_batch(tokens, weight)` before each micro-batch's backward, then `finish()` after the step's
    last backward and before anything scales the gradients (clipping, an accumulation mean): it returns the
    step's Observation (or None) and rearms for the next step. `discard()` forgets a step in progress (an
    out-of-memory retry redoes it). world > 1: DDP over `world` processes (.grad is the average of their
    hooked sums); every process must then call finish() at the same steps (it runs one collective).
    """

    def __init__(self, params: Iterable[torch.Tensor], world: int = 1):
        self.params = [p for p in params if p.requires_grad]
        self.world = world
        self._parts: list[tuple[torch.Tensor, float, float]] = []  # (per-parameter norms, tokens, weight)
        self._current: list[torch.Tensor] = []  # this micro-batch's per-parameter |contribution|
        self._touched: dict[int, torch.Tensor] = {}  # parameters that received a gradient this step
        self._meta: tuple[float, float] | None = None  # the micro-batch the hooks measure now
        self._first: tuple[float, float] | None = None  # the step's first micro-batch, read from .grad later
        self._armed = False  # micro_batch() was called since the last finish()/discard(): on every process
        self._handles = [p.register_hook(functools.partial(self._contribution, p)) for p in self.params]

    @staticmethod
    def _whole(t: torch.Tensor) -> bool:
        """|t| in fp32 needs no fp32 copy of t: it is fp32, or on CUDA (its reductions read 16-bit inputs
        directly), or a copy is at most one slice."""
        return t.dtype == torch.float32 or t.is_cuda or t.numel() <= SLICE

    @classmethod
    def _norm(cls, t: torch.Tensor) -> torch.Tensor:
        """|t| in fp32; a 16-bit gradient on CPU (an embedding's) in slices of 16M elements, no full copy."""
        if cls._whole(t):
            return torch.linalg.vector_norm(t, dtype=torch.float32)
        parts = t.reshape(-1).split(SLICE)
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x, dtype=torch.float32)
                                                     for x in parts]))

    @classmethod
    def _norms(cls, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The norms of `tensors` in one fused foreach call (per device and dtype) where that makes no
        full-size copy, the rest one by one; a 1-d tensor."""
        whole = [t for t in tensors if cls._whole(t)]
        norms = foreach_norm(whole) if whole else []
        norms += [cls._norm(t) for t in tensors if not cls._whole(t)]
        return torch.stack(norms)

    @torch.no_grad()
    def _contribution(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        if self._meta is not None:
            self._current.append(self._norm(grad))
            self._touched[id(p)] = p

    def micro_batch(self, tokens: float | torch.Tensor, weight: float | torch.Tensor) -> None:
        """The next backward is one micro-batch of `tokens` labelled tokens whose loss is scaled so that its
        gradient enters the sum with `weight` (tokens / step tokens, or 1 / micro-batches for mean losses;
        with several processes, as this process's hooks see it, before DDP averages). Numbers or device
        scalars: they are read in `finish`'s one host sync."""
        self._close_part()
        meta = (tokens, weight)
        if self.world == 1 and not self._armed:  # the step's first: .grad will hold it alone (see above)
            self._first, self._armed = meta, True
            return
        if self._first is not None:  # the second: the first one's contribution is what .grad holds now
            with torch.no_grad():
                held = [p for p in self.params if p.grad is not None]
                if held:
                    self._parts.append((self._norms([p.grad for p in held]), *self._first))
                    self._touched.update((id(p), p) for p in held)
            self._first = None
        self._meta, self._armed = meta, True

    def _close_part(self) -> None:
        if self._meta is not None and self._current:
            self._parts.append((torch.stack(self._current), *self._meta))
        self._current, self._meta = [], None

    def finish(self) -> Observation | None:
        """The step's observation (one host sync), then reset for the next step. None with fewer than two
        micro-batches (over all processes), or when a gradient was freed before the step's end (GaLore's
        layer-wise accumulation projects and frees each micro-batch's): an unknown accumulated norm gives no
        estimate, not a wrong one."""
        if not self._armed:  # nothing measured since the last finish (the step's second call)
            return None
        self._close_part()
        parts, touched = self._parts, list(self._touched.values())
        self.discard()
        usable = bool(touched) and all(p.grad is not None for p in touched) \
            and (self.world > 1 or len(parts) > 1)
        measured, big_sq = [], 0.0
        if usable:
            big = self._norms([p.grad for p in touched]).square().sum()
            flat = [x for norms, b, w in parts for x in (norms.square().sum(), b, w)] + [big]
            values = torch.stack([torch.as_tensor(x, device=big.device).double() for x in flat]).tolist()
            usable = all(math.isfinite(v) for v in values)
            measured, big_sq = [tuple(values[i:i + 3]) for i in range(0, len(values) - 1, 3)], values[-1]
        if self.world == 1:
            return step_observation(measured, big_sq) if usable else None
        # .grad is the average of the processes' hooked sums: their sum's norm is world x its norm.
        local = part_sums(measured) if usable else [0.0] * 5
        device = self.params[0].device if self.params else torch.device("cpu")
        reduced = torch.tensor([*local, float(not usable)], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(reduced)
        *sums, unusable = reduced.tolist()
        if unusable:  # one process could not measure: no estimate on any (they stay the same)
            return None
        return observation_of_sums(sums, big_sq * self.world**2)

    def discard(self) -> None:
        self._parts, self._current, self._touched, self._meta, self._first = [], [], {}, None, None
        self._armed = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class NoiseScale(Policy):
    """The noise-scale measurement as a loop policy: the probe sees each micro-batch, observes each update's
    gradients before anything scales them, and its smoothed values join the training log rows; every
    `split_every` steps an update of a single loader batch runs as two halves (the same gradient), so a
    run without accumulation measures too (module docstring)."""

    key = "noise_scale"

    def __init__(self, probe: GradNormProbe | None, split_every: int):
        self.probe, self.split_every = probe, split_every
        self.ema = NoiseScaleEMA()

    def plan_updates(self, loop, step: Step, updates: list[Update]) -> list[Update]:
        if self.probe is None or len(updates) != 1 or loop.steps_waiting or loop.geometry.splits > 1:
            return updates
        (update,) = updates
        rows = update.micro_batches[0].rows if len(update.micro_batches) == 1 else []
        layerwise = layerwise_of(loop.optimizer)
        if len(rows) < 2 or (layerwise is not None and layerwise.steps_per_update == 1) \
                or step.number % self.split_every:
            return updates
        half = -(-len(rows) // 2)
        return [dataclasses.replace(update, micro_batches=[Micro(rows[:half]), Micro(rows[half:])])]

    def around_micro_batch(self, loop, part: Part, run) -> torch.Tensor:
        if self.probe is not None and isinstance(part.batch, Batch) and part.batch.labels is not None:
            tokens = labelled_tokens(part.batch)
            self.probe.micro_batch(tokens, part.weight(tokens))  # device scalars: read at the update
        return run()

    def before_update(self, loop, update: Update) -> None:
        if self.probe is not None and (observation := self.probe.finish()) is not None:
            self.ema.update(observation)

    def on_oom(self, loop, step: Step, failure: str, phase: str) -> bool:
        if self.probe is not None:
            self.probe.discard()
        return False

    def log(self, loop, row: dict) -> None:
        if "loss" in row and (values := self.ema.values()) is not None:
            row.update({k: float(f"{v:.6g}") for k, v in values.items()})

    def on_train_end(self, loop) -> None:
        if self.probe is not None:
            self.probe.remove()

    def state_dict(self) -> dict:
        return self.ema.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.ema.load_state_dict(state)
