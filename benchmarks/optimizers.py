"""Full fine-tuning of one fixed small Llama with each optimizer, side by side, as ratios to AdamW.

    python benchmarks/optimizers.py [--steps 30] [--threads 1]

Model: Llama, hidden 256, 4 layers, MLP 688, 8 heads (4 KV), vocab of the offline test tokenizer; fp32 on
CPU. Data: 4 fixed random sequences of 64 tokens, one per micro-batch. Measured per optimizer:
  state      bytes of the optimizer state after training (distinct storages), checked == the prediction
  grad peak  largest resident gradient bytes (.grad + layer-wise accumulators), sampled at every gradient
             hook and after backward
  peak mem   largest live tensor bytes during two training steps (parameters + everything allocated,
             counted by a TorchDispatchMode over tensor storages: CPU has no allocator statistics)
  step ms    median wall time of an optimizer step (forward, backward, update) after the first
  loss       training loss of the last step
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.optim import build_optimizer, gradient_bytes, measured_state_bytes, optimizer_state_bytes  # noqa: E402
from finetune.optim.build import trained_specs  # noqa: E402
from finetune.recipe.schema import OptimizerConfig  # noqa: E402
from finetune.units import format_bytes  # noqa: E402

# (label, config, learning rate, micro-batches per optimizer step)
RUNS = [
    ("adamw", OptimizerConfig(name="adamw"), 1e-3, 1),
    ("adamw_8bit", OptimizerConfig(name="adamw_8bit"), 1e-3, 1),
    ("paged_adamw_8bit", OptimizerConfig(name="paged_adamw_8bit"), 1e-3, 1),
    ("apollo (rank 1/8)", OptimizerConfig(name="apollo"), 1e-3, 1),
    ("apollo_mini", OptimizerConfig(name="apollo_mini"), 1e-3, 1),
    ("galore (rank 1/4)", OptimizerConfig(name="galore"), 1e-3, 1),
    ("adafactor", OptimizerConfig(name="adafactor"), 1e-2, 1),
    ("sgd (momentum 0.9)", OptimizerConfig(name="sgd", momentum=0.9), 3e-2, 1),
    ("adamw layerwise", OptimizerConfig(name="adamw", layerwise=True), 1e-3, 1),
    ("apollo_mini layerwise", OptimizerConfig(name="apollo_mini", layerwise=True), 1e-3, 1),
    ("adamw accum 4", OptimizerConfig(name="adamw"), 1e-3, 4),
    ("adamw layerwise accum 4", OptimizerConfig(name="adamw", layerwise=True), 1e-3, 4),
    ("galore accum 4", OptimizerConfig(name="galore"), 1e-3, 4),
    ("galore layerwise accum 4", OptimizerConfig(name="galore", layerwise=True), 1e-3, 4),
]


class LiveBytes(TorchDispatchMode):
    """Counts bytes of tensor storages created inside the mode and still alive; keeps the peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out


def make_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def train(model, optimizer, batches, micro: int, steps: int, on_grad=None):
    """Returns (losses, step times). `on_grad` runs after each backward (normal mode's resident grads)."""
    losses, times = [], []
    for step in range(steps):
        start = time.perf_counter()
        total = 0.0
        for k in range(micro):
            ids = batches[(step * micro + k) % len(batches)]
            loss = model(input_ids=ids, labels=ids).loss / micro
            loss.backward()
            total += loss.item()
            if on_grad:
                on_grad()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(total)
    return losses, times


def measure(model_dir: Path, cfg: OptimizerConfig, lr: float, micro: int, steps: int, batches) -> dict:
    model = make_model(model_dir)
    trained = [p for p in model.parameters() if p.requires_grad]
    peak_grad = 0

    def resident(*_):
        nonlocal peak_grad
        total = sum(p.grad.nbytes for p in trained if p.grad is not None)
        inner = getattr(optimizer, "inner", {})
        total += sum(s["grad_acc"].nbytes for o in inner.values() for s in o.state.values() if "grad_acc" in s)
        peak_grad = max(peak_grad, total)

    optimizer = None
    for p in trained:  # before the optimizer's hooks, so .grad is still there
        p.register_post_accumulate_grad_hook(resident)
    optimizer = build_optimizer(model, cfg, lr, steps_per_update=micro)
    losses, times = train(model, optimizer, batches, micro, steps, on_grad=resident)
    specs, _ = trained_specs(model)
    state = measured_state_bytes(optimizer)
    predicted = optimizer_state_bytes(cfg.name, specs, cfg)
    assert state == predicted, f"{cfg.name}: measured {state} != predicted {predicted}"
    assert peak_grad == gradient_bytes(specs, cfg, micro), f"{cfg.name}: gradient peak {peak_grad}"

    model = make_model(model_dir)
    optimizer = build_optimizer(model, cfg, lr, steps_per_update=micro)
    params = sum(p.nbytes for p in model.parameters())
    with LiveBytes() as live:
        train(model, optimizer, batches, micro, 2)
    return {"state": state, "grad": peak_grad, "peak": params + live.peak,
            "ms": 1000 * statistics.median(times[1:]), "loss": losses[-1],
            "largest": max(p.nbytes for p in trained)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from finetune.testing import make_tiny_model_dir

    model_dir = make_tiny_model_dir(Path(tempfile.mkdtemp()) / "llama-256x4", hidden_size=256,
                                    intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                                    num_key_value_heads=4)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(4, 400, (1, 64), generator=gen) for _ in range(4)]
    n_params = sum(p.numel() for p in make_model(model_dir).parameters())
    print(f"model: Llama hidden 256, 4 layers, {n_params / 1e6:.2f}M parameters, fp32, full fine-tuning; "
          f"{args.steps} steps; torch threads {args.threads}")
    results = {label: measure(model_dir, cfg, lr, micro, args.steps, batches) for label, cfg, lr, micro in RUNS}
    base = results["adamw"]
    header = f"{'optimizer':<26}{'lr':>7} {'state':>22} {'grad peak':>22} {'peak mem':>22} {'step ms':>14} {'loss':>14}"
    print(header)
    print("-" * len(header))
    for label, _, lr, _ in RUNS:
        r = results[label]
        cells = [f"{format_bytes(r[k]):>12} {r[k] / base[k]:>8.2%}" for k in ("state", "grad", "peak")]
        print(f"{label:<26}{lr:>7g} {cells[0]:>22} {cells[1]:>22} {cells[2]:>22} "
              f"{r['ms']:>6.1f} {r['ms'] / base['ms']:>6.2f}x {r['loss']:>6.3f} {r['loss'] / base['loss']:>6.2f}x")
    checks = [
        ("APOLLO-Mini state <= 1% of AdamW's", results["apollo_mini"]["state"] <= 0.01 * base["state"]),
        ("APOLLO (rank 1/8) state <= 15% of AdamW's", results["apollo (rank 1/8)"]["state"] <= 0.15 * base["state"]),
        ("layer-wise peak gradient bytes <= largest single weight's gradient",
         all(results[k]["grad"] <= results[k]["largest"] for k in ("adamw layerwise", "apollo_mini layerwise"))),
    ]
    print("state bytes equal optimizer_state_bytes() and grad peaks equal gradient_bytes() in every row (asserted).")
    print("accum 4 rows see 4 sequences per step, so their loss after the same number of steps is lower; galore "
          "layer-wise accum 4 differs from galore accum 4 because its projection (refreshed at step 0) comes "
          "from the first micro-batch, not the sum of four (see finetune/optim/layerwise.py).")
    print(f"largest single weight gradient: {format_bytes(base['largest'])}")
    for text, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
