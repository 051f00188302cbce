"""Liger Kernel's fused preference losses (`liger_kernel.chunked_loss`) for the preference methods whose formula
is ours, under `memory.kernels: liger`.

Why a table: each fused loss takes the decoder's hidden states and the LM head's weight and computes the
answers' log-probabilities one example's rows at a time (no full logits), then its formula. It is used only
where that formula is exactly ours (finetune/step/preference.py: the same beta, label smoothing, reference,
length normalisation, NLL term); every other case runs our own loss over chunked log-probabilities, for the
reason `fused_problem` gives. A new method is one entry in LIGER_LOSSES.

More in docs/preference.md, "Liger's fused preference losses".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from finetune.memory.chunked_loss import IGNORE_INDEX

# The vocabulary-wide bytes a token of Liger's chunk holds, to those of our chunked log-probabilities' (which
# the planner traces): four fp32 tensors (logits, log-softmax and their gradients inside its torch.func grad) to
# our three (tests/test_liger_preference.py measures both on the CPU, eager; Liger's compiled chunk on CUDA may
# fuse some: an over-estimate there).
FUSED_CHUNK_BYTES = 4 / 3

_NO_SMOOTHING = ("its sigmoid loss takes no label smoothing (its `robust` loss with label_smoothing is the "
                 "debiased formula, divided by 1 - 2 x label_smoothing, not ours)")


@dataclass(frozen=True)
class LigerLoss:
    """One method's fused loss: the class in liger_kernel.chunked_loss, its keywords from our knobs (`loss`: a
    finetune.step.preference.PreferenceLoss), whether its log-probabilities are per-token means (ours are
    sums), and why these knobs' formula differs from ours (None: it is ours)."""

    name: str
    arguments: Callable[[Any], dict[str, Any]]
    average: bool = False
    differs: Callable[[Any], str | None] = lambda loss: None


def _dpo_differs(loss: Any) -> str | None:
    if loss.loss_type == "ipo":
        return "its DPO has no ipo loss (it raises NotImplementedError: ipo needs the answers' token counts)"
    if loss.loss_type == "sigmoid" and loss.label_smoothing:
        return _NO_SMOOTHING
    if loss.reference_precomputed:
        return ("it computes the reference's log-probabilities from the reference's hidden states and takes no "
                "precomputed ones (training.precompute_reference)")
    return None


# training.method -> its fused loss, or why none matches ours.
LIGER_LOSSES: dict[str, LigerLoss | str] = {
    "dpo": LigerLoss("LigerFusedLinearDPOLoss", lambda loss: {
        "beta": loss.beta, "loss_type": loss.loss_type, "use_ref_model": loss.uses_reference,
        "average_log_prob": False, "compute_nll_loss": False}, differs=_dpo_differs),
    "orpo": LigerLoss("LigerFusedLinearORPOLoss", lambda loss: {"beta": loss.beta, "compute_nll_loss": True},
                      average=True),
    "simpo": LigerLoss("LigerFusedLinearSimPOLoss", lambda loss: {
        "beta": loss.beta, "gamma": loss.simpo_gamma, "label_smoothing": loss.label_smoothing,
        "compute_nll_loss": False}, average=True),
    "cpo": LigerLoss("LigerFusedLinearCPOLoss", lambda loss: {
        "beta": loss.beta, "alpha": loss.cpo_alpha, "label_smoothing": loss.label_smoothing,
        "compute_nll_loss": True, "average_log_prob": False}),
    "kto": ("its KTO takes the KL reference point as an input computed before the loss (ours is the batch's own "
            "mean log-ratio, which needs the policy's log-probabilities first: a second pass through the head) "
            "and has no desirable_weight or undesirable_weight"),
}


def fused_problem(loss: Any) -> str | None:
    """Why `loss` (a PreferenceLoss) runs our own loss and not a Liger fused one (None: Liger's matches)."""
    entry = LIGER_LOSSES.get(loss.method, "Liger has no fused loss for it")
    return entry if isinstance(entry, str) else entry.differs(loss)


def head_problem(head: torch.nn.Module, softcap: float | None) -> str | None:
    """Why the model's LM head cannot go into a fused loss (which multiplies by a plain weight and bias)."""
    if softcap is not None:
        return "the model soft-caps its logits (final_logit_softcapping), which the fused losses do not"
    if type(head) is not torch.nn.Linear:
        return f"the LM head is a {type(head).__name__}, not a plain Linear (an adapter on it would be skipped)"
    return None


def kernels_line(loss: Any, head: str | None = None) -> str:
    """The plan note and run line saying which loss a preference method runs under memory.kernels: liger;
    `head`: the model's `head_problem` where it has one (known once the model is loaded)."""
    problem = fused_problem(loss) or head
    if problem is None:
        return f"memory.kernels: liger: the {loss.method} loss is Liger's fused {LIGER_LOSSES[loss.method].name}"
    return (f"memory.kernels: liger: the {loss.method} loss is ours over chunked log-probabilities (no logits), "
            f"not Liger's fused one: {problem}")


def fused_loss(loss: Any, hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor,
               ref_hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Liger's fused loss of `loss`'s method over the decoder's `hidden` states ([rows, seq, hidden]: the pairs'
    chosen rows, then their rejected rows) and their shifted `labels`; `ref_hidden`: the reference's hidden
    states (None: reference-free). Returns the loss, each row's summed log-probability (detached: for the
    metrics) and, with a reference, each row's reference log-probability. Compiled (Liger's torch.compile of
    each chunk) on CUDA only: on the CPU inductor would build C++ for minutes."""
    import liger_kernel.chunked_loss as chunked

    entry = LIGER_LOSSES[loss.method]
    assert isinstance(entry, LigerLoss)
    module = getattr(chunked, entry.name)(ignore_index=IGNORE_INDEX, compiled=hidden.is_cuda, **entry.arguments(loss))
    extra = {"ref_input": ref_hidden, "ref_weight": head.weight, "ref_bias": head.bias} \
        if ref_hidden is not None else {}
    value, (chosen, rejected, _, _, _, *aux) = module(head.weight, hidden, labels, head.bias, **extra)
    counts = (labels != IGNORE_INDEX).sum(-1)
    logps = torch.cat([chosen, rejected]).detach()
    logps = logps * counts if entry.average else logps
    ref = None
    if ref_hidden is not None:  # its rewards are beta x (log-probability - the reference's)
        ref = logps - torch.cat([aux[0], aux[1]]).detach() / loss.beta
    return value, logps, ref
