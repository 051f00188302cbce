"""Preference losses (DPO, ORPO, KTO, SimPO, CPO) as part of the one training step (`finetune.step.training_step`).

Why our own and not TRL's trainers: TRL's DPOTrainer (and ORPO/KTO, which trl 1.x moved to
`trl.experimental`) own the training step, the data pipeline and the reference model, so they would bypass
the step that `finetune run`, `finetune measure` and the planner's meta trace share (layer-wise optimizers,
offload, chunked loss, OOM recovery). The formulas below follow TRL's (`DPOTrainer.dpo_loss`,
`ORPOTrainer.odds_ratio_loss`, `KTOTrainer.kto_loss`, `CPOTrainer.cpo_loss` for SimPO and CPO). Under
`memory.kernels: liger` Liger's fused loss runs where its formula is ours (finetune/step/liger_losses.py).

More in docs/preference.md, "In the code: finetune/step/preference.py".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from finetune.errors import FinetuneError
from finetune.memory.chunked_loss import IGNORE_INDEX, default_chunk_size, head_logits, head_of, shift
from finetune.model.adapter import REFERENCE_ADAPTER
from finetune.recipe.methods import method_keys, method_spec, uses_reference
from finetune.recipe.reference import resolve
from finetune.recipe.schema import Recipe, TrainingConfig
from finetune.rundir import REWARD_ACCURACY, REWARD_CHOSEN, REWARD_KEYS, REWARD_MARGIN, REWARD_REJECTED
from finetune.step.liger_losses import fused_loss, fused_problem, head_problem

Metrics = dict[str, list[float]]  # name -> [sum, count], added over micro-batches
METRIC_PREFIXES = (*REWARD_KEYS, "logps/", "nll_loss", "log_odds_ratio", "kl")  # logged keys (metrics.jsonl)


@dataclass(frozen=True, init=False)
class PreferenceLoss:
    """A preference method and its knobs: the recipe's training.method and the training.* keys the method
    registry's entries name or declare (finetune/recipe/methods.py), read as attributes (`loss.beta`,
    `loss.simpo_gamma`); a knob not given takes the schema's default."""

    method: str  # a training.method whose registry entry is a preference method (finetune/recipe/methods.py)
    knobs: tuple[tuple[str, Any], ...]  # (training.* key, value) for every key of `method_keys()`
    reference_current: bool = False  # the precomputed pass runs the model as it is (`reference_is_current`)
    fused: bool = False  # memory.kernels: liger: Liger's fused loss where it is ours (finetune.step.liger_losses)

    def __init__(self, method: str, *, reference_current: bool = False, fused: bool = False, **knobs: Any) -> None:
        keys, fields = method_keys(), TrainingConfig.model_fields
        unknown = sorted(set(knobs) - set(keys))
        if unknown:
            raise TypeError(f"not a training method's knob: {', '.join(unknown)}; known: {', '.join(keys)}")
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "knobs", tuple((key, knobs.get(key, fields[key].default)) for key in keys))
        object.__setattr__(self, "reference_current", reference_current)
        object.__setattr__(self, "fused", fused)

    def __getattr__(self, name: str) -> Any:
        """A knob's value (only names that are no attribute get here)."""
        for key, value in self.__dict__.get("knobs", ()):
            if key == name:
                return value
        raise AttributeError(f"{type(self).__name__} has no knob {name!r}")

    @classmethod
    def of(cls, training: TrainingConfig, reference_current: bool = False, fused: bool = False
           ) -> PreferenceLoss | None:
        """The loss of a recipe's training section; None for sft (and grpo, whose loss is finetune.rl's).
        `reference_current`: the recipe's `reference_is_current` (what the precomputed pass runs, for the
        planner's trace); `fused`: memory.kernels resolved to liger (Liger's fused loss where it is ours, else
        ours over chunked log-probabilities: the model's own forward would return full logits)."""
        if not method_spec(training.method).preference:
            return None
        knobs = {key: getattr(training, key) for key in method_keys()}  # each a field of the section
        return cls(training.method, reference_current=reference_current, fused=fused, **knobs)

    @property
    def uses_reference(self) -> bool:
        return uses_reference(self.method, self.reference_free)

    @property
    def reference_in_step(self) -> bool:
        """Whether each step runs the reference forward (not when its values were precomputed)."""
        return self.uses_reference and not self.precompute_reference

    @property
    def reference_precomputed(self) -> bool:
        """Whether the reference values come with the batch, from the pass before training."""
        return self.uses_reference and self.precompute_reference

    @property
    def rows_per_example(self) -> int:
        """Sequences per example in a batch: chosen and rejected, or one (kto)."""
        return method_spec(self.method).rows_per_example

    @property
    def objective(self) -> str:
        """What decides the step's memory (not beta and the other numbers): `dpo`, `dpo:reference_free`,
        `dpo:precompute_reference`, `orpo`, `kto`, `kto:precompute_reference`, a precomputed pass with the
        adapter on adding `:reference_current`; the planner's trace key, turned back into a loss by
        `of_objective`."""
        flags = ["reference_free"] if self.reference_free else []
        if self.reference_precomputed:
            flags.append("precompute_reference")
            if self.reference_current:
                flags.append("reference_current")
        return ":".join([self.method, *flags])

    @classmethod
    def of_objective(cls, objective: str) -> PreferenceLoss | None:
        method, *flags = objective.split(":")
        if not method_spec(method).preference:  # sft, grpo (finetune.rl.step.trace_objective)
            return None
        return cls(method, reference_free="reference_free" in flags,
                   precompute_reference="precompute_reference" in flags,
                   reference_current="reference_current" in flags)


def loads_reference_adapter(recipe: Recipe) -> bool:
    """Whether the run loads REFERENCE_ADAPTER, a frozen copy of adapter.init_from: only when each step runs
    the reference forward (a precomputed reference's pass runs on the trained adapter, before the first
    step)."""
    loss = PreferenceLoss.of(recipe.training)
    return recipe.adapter.init_from is not None and loss is not None and loss.reference_in_step


def reference_is_current(recipe: Recipe) -> bool:
    """Whether the precomputed reference pass runs on the model as it is, adapter on (`reference_logps`'s
    `current`): a run from an adapter (adapter.init_from), whose trained adapter holds the start weights
    before the first step; else the reference is the base with the adapter off."""
    return recipe.adapter.init_from is not None


def batch_layout(rows: int, packing: bool) -> str:
    """How a run's collator (finetune.data.packing.make_collator) lays out a micro-batch of `rows` sequences, as
    `synthetic_batch` rebuilds it: `packed` (data.packing: the rows joined padding-free into one sequence with
    restarting position_ids), `padded` (rows of different lengths right-padded to the longest, with an
    attention_mask of zeros there) or `full` (one row: never padded). Both others make transformers build a
    4-D attention mask ([rows, 1, s, s] padded; block-diagonal over the joined sequence packed, quadratic in
    it) that SDPA turns into an additive mask per layer, and, for grouped-query attention under SDPA, copy K
    and V for every query head (no GQA kernel takes a mask)."""
    return "packed" if packing else "padded" if rows > 1 else "full"


def synthetic_batch(loss: PreferenceLoss | None, rows: int, seq_len: int, vocab: int, device: Any,
                    generator: torch.Generator | None = None, layout: str = "full") -> dict[str, torch.Tensor]:
    """A batch of `rows` examples at full length, laid out as the collator lays them out (what `finetune
    measure` and the planner's trace run): every token an input and a label; with a precomputed reference,
    its values (`ref_logps`, zeros) as the collator adds them. `layout` (`batch_layout`): `padded`, each row's
    last position is padding (attention_mask 0, label ignored); `packed`, the rows joined into one of
    rows x seq_len tokens, two examples per row (position_ids restart), `use_cache` off as the collator sets
    it. On `meta` the mask (a boolean one, what transformers turns it into) and the position_ids stay on the
    CPU: the forward reads their values to decide which mask to build."""
    n = rows * (loss.rows_per_example if loss is not None else 1)
    meta = device == "meta" or str(device) == "meta"
    if meta:
        ids = torch.zeros(n, seq_len, dtype=torch.long, device="meta")
    else:
        ids = torch.randint(0, vocab, (n, seq_len), generator=generator).to(device)
    batch: dict[str, Any] = {"input_ids": ids, "labels": ids}
    if layout == "padded":
        mask = torch.ones(n, seq_len, dtype=torch.bool if meta else torch.long)
        mask[:, -1] = 0
        batch["attention_mask"] = mask if meta else mask.to(ids.device)
        if not meta:
            batch["labels"] = ids.masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
    elif layout == "packed":
        half = seq_len // 2
        positions = torch.cat([torch.arange(half), torch.arange(seq_len - half)]).repeat(n)[None]
        batch = {"input_ids": ids.reshape(1, -1), "labels": ids.reshape(1, -1),
                 "position_ids": positions if meta else positions.to(ids.device), "use_cache": False}
    if loss is not None and method_spec(loss.method).data_kind == "kto":
        batch["kto_label"] = (torch.arange(n) % 2 == 0).to(ids.device)
    if loss is not None and loss.reference_precomputed:
        batch["ref_logps"] = torch.zeros(n, device=ids.device)
    return batch


def _token_logps(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                 softcap: float | None) -> torch.Tensor:
    return -F.cross_entropy(head_logits(head, hidden, softcap).float(), labels, reduction="none")


def sequence_logps(model: torch.nn.Module, inputs: Mapping[str, Any],
                   chunked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the sum of log p(label) over labelled tokens, and how many there are (both shape [rows])."""
    inputs = dict(inputs)
    labels = shift(inputs.pop("labels"))
    inputs.setdefault("use_cache", False)
    mask = labels != IGNORE_INDEX
    counts = mask.sum(-1)
    if not chunked:
        logits = model(**inputs).logits
        logps = -F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none",
                                 ignore_index=IGNORE_INDEX)
        return logps.sum(-1), counts
    decoder, head, softcap, vocab = head_of(model)
    hidden = decoder(**inputs)[0]
    if mask.is_meta:  # the planner's trace: every position of its full-length batch is an answer token
        flat = torch.arange(mask.numel(), device=mask.device)
    else:
        flat = mask.reshape(-1).nonzero().squeeze(1)  # answer tokens only: one host sync per step
    rows = flat // labels.shape[-1]
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat)
    targets = labels.reshape(-1).index_select(0, flat)
    size = default_chunk_size(vocab)
    parts = [checkpoint(_token_logps, head, hidden[i:i + size], targets[i:i + size], softcap, use_reentrant=False)
             for i in range(0, hidden.shape[0], size)]
    per_token = torch.cat(parts) if parts else hidden.sum(-1) * 0.0
    sums = torch.zeros(labels.shape[0], dtype=per_token.dtype, device=per_token.device)
    return sums.index_add(0, rows, per_token) + hidden.sum() * 0.0, counts


def reference_logps(model: torch.nn.Module, inputs: Mapping[str, Any], chunked: bool = False,
                    current: bool = False) -> torch.Tensor:
    """Sequence log-probabilities of the reference model, no graph kept (`reference_model`)."""
    with reference_model(model, current) as reference:
        return sequence_logps(reference, inputs, chunked)[0]


@contextmanager
def reference_model(model: torch.nn.Module, current: bool = False) -> Iterator[torch.nn.Module]:
    """The model switched to the reference, in eval mode (no dropout), without gradients: the frozen
    REFERENCE_ADAPTER when the run started from an adapter (adapter.init_from: the SFT model), else the base
    with the adapter off; `current`: the model as it is, adapter on (a run from an adapter before its first
    step, whose trained adapter is the start adapter). Under DDP or DeepSpeed the peft model inside the wrapper
    runs it: the wrapper has no adapter switch, and a forward without gradients needs none of its
    synchronisation."""
    from accelerate.utils import extract_model_from_parallel

    model = extract_model_from_parallel(model)
    if not current and not hasattr(model, "disable_adapter"):
        raise FinetuneError("the reference model is the base with the adapter switched off, but this model has "
                            "no adapter", hint="use adapter.type: lora, or a reference-free method")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), nullcontext() if current else reference_weights(model):
            yield model
    finally:
        model.train(was_training)


@contextmanager
def reference_weights(model: torch.nn.Module) -> Iterator[None]:
    """Switch the peft model to its reference: the frozen reference adapter if it has one (TRL's
    ref_adapter_name), else no adapter. Switching back makes the trained adapter trainable again, as before."""
    if REFERENCE_ADAPTER not in getattr(model, "peft_config", {}):
        with model.disable_adapter():
            yield
        return
    trained = model.active_adapter
    model.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
    try:
        yield
    finally:
        model.set_adapter(trained)


def batch_reference_logps(model: torch.nn.Module, batch: Mapping[str, Any], chunked: bool = False,
                          current: bool = False) -> torch.Tensor:
    """`reference_logps` of a collated batch (what the precomputed pass runs, and the planner traces)."""
    inputs = {k: v for k, v in batch.items() if k not in ("kto_label", "ref_logps")}
    return reference_logps(model, inputs, chunked, current)


def reference_values(model: torch.nn.Module, batch: Mapping[str, Any], loss: PreferenceLoss,
                     chunked: bool = False, current: bool = False) -> list[list[float]]:
    """The reference log-probabilities of a collated batch, per example in the collator's row order (pairs:
    [chosen, rejected]; kto: [answer]): what a precomputed reference pass stores as the `ref_logps` column."""
    ref = batch_reference_logps(model, batch, chunked, current).float().cpu()
    return ref.reshape(loss.rows_per_example, -1).t().tolist()


def preference_loss(model: torch.nn.Module, inputs: Mapping[str, Any], loss: PreferenceLoss, chunked: bool = False,
                    metrics: Metrics | None = None) -> torch.Tensor:
    """The micro-batch's mean preference loss; adds its rewards, margins and accuracy to `metrics`. The
    reference values are the batch's `ref_logps` when it has them (precomputed: FinetuneError without them),
    else a reference forward."""
    inputs = dict(inputs)
    kto_label = inputs.pop("kto_label", None)
    ref = inputs.pop("ref_logps", None)
    if ref is None and loss.reference_precomputed:  # a reference forward here would be the wrong reference
        raise FinetuneError("internal inconsistency: training.precompute_reference is on but the batch has "
                            "no ref_logps (the precomputed reference values); the loss will not guess a "
                            "reference",
                            hint="please report this bug; meanwhile set training.precompute_reference: false "
                                 "(the reference forward then runs in each step)")
    fused = _liger_loss(model, inputs, loss) if loss.fused else None
    if fused is not None:  # our formula below gives the metrics, from Liger's detached log-probabilities
        value, logps, ref, counts = fused
    else:  # under memory.kernels: liger the model's own forward would return full logits: chunked instead
        if ref is None and loss.uses_reference:
            ref = reference_logps(model, inputs, chunked or loss.fused)
        logps, counts = sequence_logps(model, inputs, chunked or loss.fused)
    ours = objective_of(loss, logps, ref if ref is not None else torch.zeros_like(logps), counts, kto_label, metrics)
    return fused[0] if fused is not None else ours


def objective_of(loss: PreferenceLoss, logps: torch.Tensor, ref: torch.Tensor, counts: torch.Tensor,
                 kto_label: torch.Tensor | None = None, metrics: Metrics | None = None) -> torch.Tensor:
    """The method's loss (its registry entry's formula) from the rows' sequence log-probabilities, reference
    log-probabilities and labelled-token counts (pairs: chosen rows then rejected rows); adds its rewards,
    margins and accuracy to `metrics`. What the step's loss and `finetune eval`'s held-out pairs both use."""
    spec = method_spec(loss.method)
    objective = resolve(spec.loss)
    if spec.data_kind == "kto":
        value, stats = objective(loss, logps, ref, kto_label)
    else:
        n = logps.shape[0] // 2
        value, stats = objective(loss, logps[:n], logps[n:], ref[:n], ref[n:], counts[:n], counts[n:])
    if metrics is not None:
        for name, (total, count) in stats.items():
            entry = metrics.setdefault(name, [0.0, 0.0])
            entry[0] += float(total)
            entry[1] += float(count)
    return value


def _liger_loss(model: torch.nn.Module, inputs: dict[str, Any], loss: PreferenceLoss
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """Liger's fused loss (finetune.step.liger_losses) where its formula is ours and the model's head allows:
    the loss, the rows' log-probabilities and reference log-probabilities (detached) and labelled-token
    counts; None where our own loss runs (`kernels_line` says why). The reference's hidden states come from
    the reference forward (`reference_model`), before the policy's."""
    if fused_problem(loss) is not None:
        return None
    decoder, head, softcap, _ = head_of(model)
    if head_problem(head, softcap) is not None:
        return None
    inputs = dict(inputs)
    labels = shift(inputs.pop("labels"))
    inputs.setdefault("use_cache", False)
    ref_hidden = None
    if loss.reference_in_step:
        with reference_model(model):
            ref_hidden = decoder(**inputs)[0]
    value, logps, ref = fused_loss(loss, decoder(**inputs)[0], head, labels, ref_hidden)
    return value, logps, ref, (labels != IGNORE_INDEX).sum(-1)


def pair_stats(chosen: torch.Tensor, rejected: torch.Tensor, pc: torch.Tensor, pr: torch.Tensor) -> dict:
    n = chosen.numel()
    return {REWARD_CHOSEN: (chosen.sum(), n), REWARD_REJECTED: (rejected.sum(), n),
            REWARD_MARGIN: ((chosen - rejected).sum(), n), REWARD_ACCURACY: ((chosen > rejected).sum(), n),
            "logps/chosen": (pc.detach().sum(), n), "logps/rejected": (pr.detach().sum(), n)}


def dpo_loss(loss: PreferenceLoss, pc, pr, rc, rr, cc, cr) -> tuple[torch.Tensor, dict]:
    if loss.loss_type == "ipo":  # IPO compares length-averaged log-probabilities (TRL does the same)
        logits = (pc / cc - pr / cr) - (rc / cc - rr / cr)
        losses = (logits - 1 / (2 * loss.beta)) ** 2
    else:
        logits = (pc - pr) - (rc - rr)
        if loss.loss_type == "hinge":
            losses = torch.relu(1 - loss.beta * logits)
        else:
            losses = _smoothed_sigmoid(loss, logits)
    chosen, rejected = loss.beta * (pc - rc).detach(), loss.beta * (pr - rr).detach()
    return losses.mean(), pair_stats(chosen, rejected, pc, pr)


def _log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0 (a mean log-probability), finite at x = 0."""
    return torch.log(torch.clamp(-torch.expm1(x), min=torch.finfo(x.dtype).tiny))


def orpo_loss(loss: PreferenceLoss, pc, pr, rc, rr, cc, cr) -> tuple[torch.Tensor, dict]:
    ac, ar = pc / cc.clamp(min=1), pr / cr.clamp(min=1)
    log_odds = (ac - ar) - (_log1m_exp(ac) - _log1m_exp(ar))
    ratio = F.logsigmoid(log_odds)
    nll = -pc.sum() / cc.sum().clamp(min=1)  # the SFT loss on the chosen answers
    stats = pair_stats(loss.beta * ac.detach(), loss.beta * ar.detach(), pc, pr)
    n = pc.numel()
    stats.update({"nll_loss": (nll.detach() * n, n), "log_odds_ratio": (ratio.detach().sum(), n)})
    return nll - loss.beta * ratio.mean(), stats


def _smoothed_sigmoid(loss: PreferenceLoss, logits: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(beta x logits), with label smoothing (conservative DPO; TRL's sigmoid loss)."""
    return (-F.logsigmoid(loss.beta * logits) * (1 - loss.label_smoothing)
            - F.logsigmoid(-loss.beta * logits) * loss.label_smoothing)


def simpo_loss(loss: PreferenceLoss, pc, pr, rc, rr, cc, cr) -> tuple[torch.Tensor, dict]:
    """SimPO (TRL's CPOTrainer, loss_type simpo, cpo_alpha 0): the reward is beta x the answer's mean token
    log-probability (no reference model), and the chosen answer must beat the rejected one by simpo_gamma."""
    ac, ar = pc / cc.clamp(min=1), pr / cr.clamp(min=1)
    losses = _smoothed_sigmoid(loss, ac - ar - loss.simpo_gamma / loss.beta)
    return losses.mean(), pair_stats(loss.beta * ac.detach(), loss.beta * ar.detach(), pc, pr)


def cpo_loss(loss: PreferenceLoss, pc, pr, rc, rr, cc, cr) -> tuple[torch.Tensor, dict]:
    """CPO (TRL's CPOTrainer, loss_type sigmoid): DPO's sigmoid loss without a reference model (the reward is
    beta x the answer's log-probability), plus cpo_alpha x the NLL of the chosen answers (behaviour cloning)."""
    nll = -pc.sum() / cc.sum().clamp(min=1)  # TRL's cross-entropy over the chosen answers' tokens
    stats = pair_stats(loss.beta * pc.detach(), loss.beta * pr.detach(), pc, pr)
    stats["nll_loss"] = (nll.detach() * pc.numel(), pc.numel())
    return _smoothed_sigmoid(loss, pc - pr).mean() + loss.cpo_alpha * nll, stats


def kto_loss(loss: PreferenceLoss, logps, ref, good) -> tuple[torch.Tensor, dict]:
    if good is None:
        raise FinetuneError("training.method kto needs batches with kto_label (labelled answers)")
    good = good.to(torch.bool).to(logps.device)
    ratio = logps - ref
    kl = ratio.detach().mean().clamp(min=0)
    losses = torch.where(good, loss.desirable_weight * (1 - torch.sigmoid(loss.beta * (ratio - kl))),
                         loss.undesirable_weight * (1 - torch.sigmoid(loss.beta * (kl - ratio))))
    rewards = loss.beta * ratio.detach()
    n_good, n_bad = good.sum(), (~good).sum()
    stats = {REWARD_CHOSEN: (torch.where(good, rewards, 0).sum(), n_good),
             REWARD_REJECTED: (torch.where(good, 0, rewards).sum(), n_bad),
             "kl": (kl * logps.numel(), logps.numel())}
    return losses.mean(), stats


def metric_means(metrics: Metrics, prefix: str = "") -> dict[str, float]:
    """The logged values: each metric's mean over what was added; margins of kto from the two means."""
    out = {f"{prefix}{k}": total / count for k, (total, count) in metrics.items() if count}
    chosen, rejected = out.get(prefix + REWARD_CHOSEN), out.get(prefix + REWARD_REJECTED)
    if prefix + REWARD_MARGIN not in out and chosen is not None and rejected is not None:
        out[prefix + REWARD_MARGIN] = chosen - rejected
    return out

