"""Which cheap statistic tracks the critical batch? B_simple vs the Hessian noise scale vs a measured one.

    nice -n 10 python benchmarks/critical_batch_estimators.py      # ~12 min on the shared 2-core machine

The `effective_batch_size: auto` rule prices a batch in tokens by McCandlish et al.'s E = E_min (1 + B / B_noise)
with B_noise taken as the measured B_simple = tr(Sigma) / |G|^2. batch_size.txt found B_simple 4-40x above the
critical batch fitted to fixed-batch curves. This script asks, on the same tiny Llama and data
(benchmarks/batch_size.py) along the batch-1 run, at a few checkpoints:
- B_simple = tr(Sigma) / |G|^2 (what the run measures), from 256 per-sequence gradients;
- B_noise = tr(H Sigma) / G^T H G, McCandlish's full noise scale (exact Hessian-vector products, double
  backward; equal to B_simple only for a well-conditioned Hessian), from 24 deviations;
- both with Adam's preconditioner P = 1 / (sqrt(v) + eps) from the run's optimizer state (tr(P Sigma) / G^T P G
  and tr(P H P Sigma) / G^T P H P G: Adam as preconditioned SGD);
- the local critical batch, measured: branches of 256 sequences at batches 1, 4 and 16 from the checkpoint
  (learning rate by the square-root rule, beta2 by the rule), the tokens the batch-1 branch needs to reach each
  branch's held-out loss (interpolated along its curve) give E(B) / E(1) = (1 + B / B_crit) / (1 + 1 / B_crit).
All in labelled tokens. Writes benchmarks/results/critical_batch_estimators.txt.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import batch_size as bs  # noqa: E402  (the same data, model, loss and schedule)

CHECKPOINTS = (100, 300, 800, 1600)  # sequences of the batch-1 run seen
BRANCH = 256  # sequences per branch
EVERY = 32  # the batch-1 branch's held-out loss every EVERY sequences
TOKENS = bs.SEQ - 1


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]).double()


class Study:
    def __init__(self) -> None:
        self.train, evals = bs.build_data()
        self.evals = evals[:256]
        self.pool = self.train[2560:]  # sequences the run never trains on
        self.model = bs.build_model()
        self.model.set_attn_implementation("eager")  # double backward (SDPA on CPU has no second derivative)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.rule = bs.scale_for_batch(bs.REF_LR, (0.9, bs.REF_BETA2), "adamw", bs.REF_BATCH, 1)
        self.opt = torch.optim.AdamW(self.params, lr=self.rule.new_learning_rate, betas=self.rule.new_betas)
        self.gen = torch.Generator().manual_seed(3)
        self.seen = 0

    def train_to(self, seqs: int) -> None:
        total = 2560 * TOKENS
        while self.seen < seqs:
            s, n = bs.loss_sum(self.model, self.train[self.seen:self.seen + 1])
            (s / n).backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.seen += 1
            for group in self.opt.param_groups:
                group["lr"] = bs.lr_at(self.seen * TOKENS, total, self.rule.new_learning_rate)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def _hvp(self, vec: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        s, n = bs.loss_sum(self.model, batch)
        grads = torch.autograd.grad(s / n, self.params, create_graph=True)
        return flat(torch.autograd.grad(flat(grads).float() @ vec.float(), self.params))

    def estimates(self) -> dict[str, float]:
        rows = []
        for i in torch.randint(len(self.pool), (256,), generator=self.gen):
            s, n = bs.loss_sum(self.model, self.pool[i:i + 1])
            rows.append(flat(torch.autograd.grad(s / n, self.params)))
        g = torch.stack(rows)
        k, mean = len(g), g.mean(0)
        dev = g - mean
        p = flat(1 / (self.opt.state[q]["exp_avg_sq"].sqrt() + 1e-8) for q in self.params)
        tr_s = dev.square().sum(1).mean() * k / (k - 1)  # per sequence
        tr_ps = (dev.square() * p).sum(1).mean() * k / (k - 1)
        batch = self.pool[torch.randint(len(self.pool), (64,), generator=self.gen)]  # the Hessian's batch
        q_h = torch.stack([d @ self._hvp(d, batch) for d in dev[:24]]).mean() * k / (k - 1)
        q_php = torch.stack([(p * d) @ self._hvp(p * d, batch) for d in dev[:24]]).mean() * k / (k - 1)
        pm = p * mean
        out = {"B_simple": tr_s / (mean.square().sum() - tr_s / k),
               "B_simple, Adam-preconditioned": tr_ps / ((mean.square() * p).sum() - tr_ps / k),
               "B_noise (Hessian)": q_h / (mean @ self._hvp(mean, batch) - q_h / k),
               "B_noise, Adam-preconditioned": q_php / (pm @ self._hvp(pm, batch) - q_php / k)}
        return {name: float(v) * TOKENS for name, v in out.items()}

    def branch(self, batch: int) -> list[tuple[int, float]]:
        """(sequences, held-out loss) along a branch of BRANCH sequences at `batch` from the checkpoint."""
        model = copy.deepcopy(self.model)
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=1.0)
        opt.load_state_dict(copy.deepcopy(self.opt.state_dict()))  # load_state_dict shares same-dtype tensors
        rule = bs.scale_for_batch(self.opt.param_groups[0]["lr"], (0.9, self.rule.new_betas[1]), "adamw", 1, batch)
        for group in opt.param_groups:
            group["lr"], group["betas"] = rule.new_learning_rate, rule.new_betas
        order = torch.randint(len(self.pool), (BRANCH,), generator=torch.Generator().manual_seed(7))
        curve = [(0, bs.held_out(model, self.evals))]
        for j in range(0, BRANCH, batch):
            s, n = bs.loss_sum(model, self.pool[order[j:j + batch]])
            (s / n).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if batch == 1 and (j + 1) % EVERY == 0:
                curve.append((j + 1, bs.held_out(model, self.evals)))
        if batch > 1:
            curve.append((BRANCH, bs.held_out(model, self.evals)))
        return curve


def measured_critical(one: list[tuple[int, float]], end: float, batch: int) -> float | None:
    """B_crit (sequences) from the sequences the batch-1 curve `one` needs to reach `end`, which `batch` reached
    with BRANCH; None where batch 1 never reached it or needed as many (no measurable price)."""
    for (s0, l0), (s1, l1) in zip(one, one[1:], strict=False):
        if l1 <= end:
            needed = s0 + (s1 - s0) * (l0 - end) / (l0 - l1) if l0 > end else s0
            ratio = BRANCH / max(needed, 1e-9)  # E(B) / E(1)
            return (batch - ratio) / (ratio - 1) if ratio > 1 else None
    return None


def main() -> None:
    torch.set_num_threads(1)
    start = time.time()
    study = Study()
    lines = [f"benchmarks/critical_batch_estimators.py: the batch_size.py model and data along its batch-1 run "
             f"(lr(ref) {bs.REF_LR}); branches of {BRANCH} sequences; all in labelled tokens ({TOKENS} per sequence)",
             ""]
    header = None
    for checkpoint in CHECKPOINTS:
        study.train_to(checkpoint)
        est = study.estimates()
        curves = {b: study.branch(b) for b in (1, 4, 16)}
        crit = {b: measured_critical(curves[1], curves[b][-1][1], b) for b in (4, 16)}
        row = {"tokens seen": checkpoint * TOKENS, "held-out": curves[1][0][1], **est,
               **{f"measured B_crit (batch {b} branch)": (c * TOKENS if c is not None else None) for b, c in crit.items()}}
        if header is None:
            header = list(row)
            lines.append(" | ".join(header))
        lines.append(" | ".join("-" if v is None else f"{v:.4g}" for v in row.values()))
        print(lines[-1], flush=True)
    lines += ["", f"({time.time() - start:.0f} s, CPU, 1 thread)"]
    text = "\n".join(lines) + "\n"
    print(text)
    (bs.RESULTS / "critical_batch_estimators.txt").write_text(text)


if __name__ == "__main__":
    main()
