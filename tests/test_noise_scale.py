"""The gradient noise scale estimator (finetune/train/noise_scale.py) against problems whose answer is known."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from finetune.recipe import validate_recipe
from finetune.rundir import read_jsonl
from finetune.train import noise_scale
from finetune.train.noise_scale import GradNormProbe, NoiseScaleEMA, step_observation, two_batch
from finetune.train.run import run
from tests.run_support import sums_data, tiny_lora_recipe

DIM, DELTA_SQ, NOISE_VAR = 10, 1.0, 4.0


def _linear_regression_truth() -> float:
    """Per-example gradient of 0.5 (w.x - y)^2 with x ~ N(0, I), y = w*.x + N(0, s^2), at w = w* + delta:
    g = (delta.x - eps) x, so G = delta and Sigma = (|delta|^2 + s^2) I + delta delta^T."""
    trace = DIM * (DELTA_SQ + NOISE_VAR) + DELTA_SQ
    return trace / DELTA_SQ


def _regression_steps(steps: int, sizes: list[int], token_weighted: bool, seed: int = 0) -> NoiseScaleEMA:
    """Frozen weights, `steps` accumulated steps of micro-batches of `sizes` examples, through the hooks."""
    gen = torch.Generator().manual_seed(seed)
    w_star = torch.randn(DIM, generator=gen)
    delta = torch.randn(DIM, generator=gen)
    delta *= (DELTA_SQ / delta.square().sum()).sqrt()
    w = torch.nn.Parameter(w_star + delta)
    probe = GradNormProbe([w])
    ema = NoiseScaleEMA(decay=0.9999)
    total = sum(sizes)
    for _ in range(steps):
        for b in sizes:
            x = torch.randn(b, DIM, generator=gen)
            y = x @ w_star + NOISE_VAR ** 0.5 * torch.randn(b, generator=gen)
            per_example = 0.5 * (x @ w - y).square()
            weight = b / total if token_weighted else 1 / len(sizes)
            probe.micro_batch(b, weight)
            (per_example.sum() / total if token_weighted else per_example.mean() / len(sizes)).backward()
        ema.update(probe.finish())
        w.grad = None
    probe.remove()
    return ema


def test_recovers_known_noise_scale_of_linear_regression():
    """Unequal micro-batches weighted by their tokens, through the hooks; 1200 steps (seeds 0-4 land within
    8%; the mean-loss weighting is checked exactly below and through the Trainer in the run tests)."""
    values = _regression_steps(1200, [2, 6, 3, 5], token_weighted=True).values()
    truth = _linear_regression_truth()
    assert values["gns"] == pytest.approx(truth, rel=0.10)
    assert values["grad_sq"] == pytest.approx(DELTA_SQ, rel=0.10)
    assert values["trace_sigma"] == pytest.approx(truth * DELTA_SQ, rel=0.10)


def test_two_batch_solves_the_expected_norms_exactly():
    g2, trace = 2.0, 300.0
    obs = two_batch(g2 + trace / 8, 1 / 8, g2 + trace / 64, 1 / 64)
    assert obs.grad_sq == pytest.approx(g2) and obs.trace_sigma == pytest.approx(trace)
    # Unequal micro-batches weighted by tokens: 1/b averaged as the loss weights them.
    parts = [(w**2 * (g2 + trace / b), b, w) for b, w in [(10, 0.25), (30, 0.75)]]
    obs = step_observation(parts, g2 + trace / 40)
    assert obs.grad_sq == pytest.approx(g2) and obs.trace_sigma == pytest.approx(trace)
    # The same micro-batches as per-micro-batch means (weight 1/2 each, as without num_items_in_batch).
    means = [(0.25 * (g2 + trace / b), b, 0.5) for b in (10, 30)]
    obs = step_observation(means, g2 + trace * 0.25 * (1 / 10 + 1 / 30))
    assert obs.grad_sq == pytest.approx(g2) and obs.trace_sigma == pytest.approx(trace)
    assert step_observation(parts[:1], 1.0) is None  # one micro-batch: no small norm to compare


def test_probe_measures_each_contribution_and_refuses_a_sum_it_cannot_see():
    """Each micro-batch's own gradient comes from a hook before autograd adds it to .grad; the accumulated
    one from .grad at the step's end. A gradient freed before then (GaLore's layer-wise accumulation frees
    each micro-batch's) gives no observation rather than a wrong one."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    probe = GradNormProbe([w])
    free = False
    w.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None) if free else None)
    for freed in (False, True):
        free = freed
        probe.micro_batch(1, 0.5)
        (0.5 * (w * torch.tensor([1.0, 0.0])).sum()).backward()  # contribution [0.5, 0]
        probe.micro_batch(1, 0.5)
        (0.5 * (w * torch.tensor([0.0, 1.0])).sum()).backward()  # contribution [0, 0.5]
        obs = probe.finish()
        w.grad = None
        if freed:
            assert obs is None
        else:  # small: mean of |c_i / w_i|^2 = 1 over b = 1; big: |[0.5, 0.5]|^2 = 0.5 over b = 2
            expected = two_batch(1.0, 1.0, 0.5, 0.5)
            assert (obs.grad_sq, obs.trace_sigma) == pytest.approx((expected.grad_sq, expected.trace_sigma), abs=1e-6)
    assert probe.finish() is None  # rearmed: nothing measured since


def _full_fine_tune_step(slice_elements: int, monkeypatch) -> tuple:
    """One step of 2 micro-batches, every weight of a bf16 toy Llama trained, with gradient norms in slices
    of `slice_elements`; the probe's allocations read from the profiler (benchmarks/noise_probe_overhead.py).
    Returns (observation, bytes its hooks hold, its largest single allocation, parameters)."""
    from benchmarks.noise_probe_overhead import CountedProbe, probe_memory
    from finetune.testing import tiny_config

    monkeypatch.setattr(noise_scale, "SLICE", slice_elements)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config()).to(torch.bfloat16)
    params = list(model.parameters())
    probe = CountedProbe(params)
    observed = []

    def step():
        for _ in range(2):
            ids = torch.randint(0, 512, (2, 16))
            probe.micro_batch(2 * 15, 0.5)
            (0.5 * model(input_ids=ids, labels=ids).loss).backward()
        observed.append(probe.finish())

    held, largest = probe_memory(step)
    probe.remove()
    return observed[0], held, largest, params


def test_a_full_fine_tune_gets_no_full_size_buffer_from_the_probe(monkeypatch):
    """Issue #14's memory bound: the probe copies no gradient; it holds one fp32 scalar per parameter and
    micro-batch, and a 16-bit gradient on CPU (where a norm in fp32 copies its input) is read in slices."""
    full, _, full_largest, params = _full_fine_tune_step(1 << 30, monkeypatch)  # no slicing
    sliced, held, largest, _ = _full_fine_tune_step(1024, monkeypatch)
    biggest = max(p.numel() for p in params)  # the embedding's 32768 elements
    assert full_largest >= 4 * biggest  # the profiler sees a full-size fp32 copy where there is one
    assert largest <= 4 * 1024 and held <= 2 * 64 * len(params)  # a slice; a scalar (64-byte block) each
    # the same estimate (a difference of two norms: summation order shows at 1e-5)
    assert (sliced.grad_sq, sliced.trace_sigma) == pytest.approx((full.grad_sq, full.trace_sigma), rel=1e-3)


def test_ema_reports_nothing_until_enough_steps_and_round_trips():
    ema = NoiseScaleEMA()
    for _ in range(4):
        ema.update(two_batch(3.0, 1.0, 2.0, 0.5))
    assert ema.values() is None
    ema.update(two_batch(3.0, 1.0, 2.0, 0.5))
    assert ema.values() == {"grad_sq": pytest.approx(1.0), "trace_sigma": pytest.approx(2.0), "gns": pytest.approx(2.0)}
    copy = NoiseScaleEMA()
    copy.load_state_dict(ema.state_dict())
    assert copy.values() == ema.values()


def _run_recipe(tmp_path, model_dir, name: str, **training) -> dict:
    return tiny_lora_recipe(model_dir, sums_data(tmp_path / "gns-data.jsonl", 24), tmp_path / name,
                            {"training": {"max_steps": 8, "learning_rate": 1e-3, **training}})


@pytest.mark.parametrize("training", [{"micro_batch_size": 2, "gradient_accumulation_steps": 2},
                                      {"micro_batch_size": 4, "gradient_accumulation_steps": 1,
                                       "noise_scale_split_every": 1}], ids=["accumulated", "split"])
def test_a_run_logs_the_noise_scale_and_plots_it(tmp_path, tiny_model_dir, training):
    result = run(validate_recipe(_run_recipe(tmp_path, tiny_model_dir, "gns", **training)))
    rows = [r for r in read_jsonl(result.run_dir / "metrics.jsonl") if "loss" in r]
    measured = [r for r in rows if "grad_sq" in r]
    assert [r["step"] for r in measured] == list(range(5, 9))  # from MIN_STEPS observations on
    assert all(r["trace_sigma"] > 0 and r["gns"] == pytest.approx(r["trace_sigma"] / r["grad_sq"], rel=1e-4)
               for r in measured if "gns" in r)
    assert (result.run_dir / "loss.png").is_file()
    results = json.loads((result.run_dir / "results.json").read_text())  # the batch used, gns over time, advice
    used = training["micro_batch_size"] * training["gradient_accumulation_steps"]
    assert results["batch"]["effective_batch_size"] == used and results["batch"]["changes"] == []
    assert [s for s, _ in results["noise_scale"]["series"]] == [r["step"] for r in measured if "gns" in r]
    assert "settings" in results["advice"] or "no noise scale" in results["advice"]["reason"]


def test_the_ui_loss_chart_shows_the_noise_scale_on_its_own_axis():
    from ui.charts import loss_figure

    rows = [{"step": s, "loss": 2.0 / s, **({"gns": 100.0 * s} if s > 2 else {})} for s in range(1, 6)]
    fig = loss_figure({"run": rows})
    loss_ax, gns_ax = fig.axes
    assert gns_ax.get_yscale() == "log" and list(gns_ax.lines[0].get_xdata()) == [3, 4, 5]
    assert "noise scale (right axis)" in [t.get_text() for t in loss_ax.get_legend().get_texts()]
    assert len(loss_figure({"run": [{"step": 1, "loss": 1.0}]}).axes) == 1  # nothing measured: no extra axis
