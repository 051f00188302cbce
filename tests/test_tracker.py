"""The tensor tracker counts live storages exactly and splits them into categories."""

from __future__ import annotations

import torch

from finetune.memory.tracker import MemoryTracker, measure_step


def test_peak_counts_live_storages_and_frees():
    def fn(_tracker):
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B
        b = a.view(10, 100)  # a view: no new storage
        c = torch.empty(500, dtype=torch.float64)  # 4000 B -> peak 8000
        del a, b, c
        d = torch.empty(100, dtype=torch.float32)  # 400 B, after the frees
        del d

    result = measure_step(fn)
    assert result["peak_bytes"] == 8000
    assert result["breakdown"]["activations"] == 8000


def test_training_step_categories():
    torch.manual_seed(0)
    vocab = 37
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, vocab))
    model[0].weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(0, vocab, (4, 8))
    tracker = MemoryTracker(vocab_size=vocab)
    tracker.register_model(model)
    tracker.register_optimizer(opt)
    with tracker:
        for _ in range(2):
            logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab), ids.view(-1))
            loss.backward()
            with tracker.optimizer_step():
                opt.step()
            opt.zero_grad(set_to_none=True)
    tracker.remove_hooks()
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert tracker._totals["weights"] == vocab * 16 * 4
    assert tracker._totals["trainable_weights"] == trainable
    # AdamW keeps exp_avg and exp_avg_sq (fp32) plus a scalar step per parameter
    assert tracker._totals["optimizer_state"] == 2 * trainable + 4 * 4
    assert tracker._totals["gradients"] == 0  # freed by zero_grad(set_to_none=True)
    assert tracker.peak_breakdown["logits_and_loss"] >= 4 * 8 * vocab * 4
    assert sum(tracker.peak_breakdown.values()) == tracker.peak
