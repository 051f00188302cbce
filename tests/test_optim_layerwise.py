"""Layer-wise updates: same weights as the normal optimizer with accumulation, real grad norm, clipping, memory."""

from __future__ import annotations

import pytest
import torch

from finetune.optim import LayerwiseOptimizer, build_optimizer, gradient_bytes
from finetune.optim.build import trained_specs
from tests.test_optim import _one_thread, backward, config, examples, load_model, train  # noqa: F401

ACCUMULATION = 4


def _trained(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _reference_norm(model, micro: list[torch.Tensor]) -> float:
    for ids in micro:
        backward(model, ids, 1 / len(micro))
    norm = float(torch.nn.utils.clip_grad_norm_(_trained(model), float("inf")))
    model.zero_grad()
    return norm


def _layerwise_step(model, optimizer: LayerwiseOptimizer, micro: list[torch.Tensor]) -> float:
    for ids in micro:
        backward(model, ids, 1 / len(micro))
    norm = optimizer.grad_norm()
    optimizer.step()
    assert optimizer.grad_norm() == norm  # still readable after the step, for logging
    return norm


def _assert_same_weights(a, b, atol=1e-6):
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=atol, msg=name)


@pytest.mark.parametrize(("name", "lora"), [
    ("adamw", False), ("adamw", True), ("apollo", False), ("apollo_mini", False), ("apollo", True),
    ("galore", False), ("galore", True), ("adamw_8bit", False), ("adafactor", False), ("sgd", False),
    ("muon", False), ("muon", True)])
def test_layerwise_with_accumulation_equals_normal_accumulation(tiny_model_dir, name, lora):
    """One step of 4 micro-batches (after a 1-micro-batch step, so GaLore's projection is set alike)."""
    micro = examples(ACCUMULATION, seed=1)
    steps = [examples(1, seed=2), micro]
    normal_model, lw_model = load_model(tiny_model_dir, lora), load_model(tiny_model_dir, lora)
    normal = build_optimizer(normal_model, config(name), 1e-2)
    layerwise = build_optimizer(lw_model, config(name, layerwise=True), 1e-2, steps_per_update=ACCUMULATION)
    assert isinstance(layerwise, LayerwiseOptimizer)

    train(normal_model, normal, steps[:1])
    _layerwise_step(lw_model, layerwise, steps[0])
    _assert_same_weights(normal_model, lw_model)

    reference = _reference_norm(normal_model, micro)
    train(normal_model, normal, [micro])
    norm = _layerwise_step(lw_model, layerwise, micro)
    assert all(p.grad is None for p in _trained(lw_model))
    _assert_same_weights(normal_model, lw_model)
    if name != "galore":
        assert norm == pytest.approx(reference, rel=1e-6)
    else:  # projected weights contribute the norm of their projected gradient (what GaLore uses)
        assert 0 < norm < reference


def test_galore_norm_counts_projected_gradients_exactly(tiny_model_dir):
    micro = examples(ACCUMULATION, seed=1)
    normal_model, lw_model = load_model(tiny_model_dir), load_model(tiny_model_dir)
    normal = build_optimizer(normal_model, config("galore"), 1e-2)
    layerwise = build_optimizer(lw_model, config("galore", layerwise=True), 1e-2, steps_per_update=ACCUMULATION)
    train(normal_model, normal, [examples(1, seed=2)])
    _layerwise_step(lw_model, layerwise, examples(1, seed=2))
    for ids in micro:
        backward(normal_model, ids, 1 / ACCUMULATION)
    squares = 0.0
    for p in _trained(normal_model):
        projector = normal.state[p].get("projector")
        grad = projector.project(p.grad, 1) if projector else p.grad  # step 1 of gap 200: no refresh
        squares += float(grad.double().pow(2).sum())
    assert _layerwise_step(lw_model, layerwise, micro) == pytest.approx(squares ** 0.5, rel=1e-6)


def test_galore_refresh_under_accumulation_uses_the_first_micro_batch(tiny_model_dir):
    from galore_torch.galore_projector import GaLoreProjector

    micro = examples(ACCUMULATION, seed=1)
    first_model, lw_model = load_model(tiny_model_dir), load_model(tiny_model_dir)
    layerwise = build_optimizer(lw_model, config("galore", layerwise=True), 1e-2, steps_per_update=ACCUMULATION)
    backward(first_model, micro[0], 1 / ACCUMULATION)
    for ids in micro:
        backward(lw_model, ids, 1 / ACCUMULATION)
    checked = 0
    for p, q in zip(_trained(lw_model), _trained(first_model), strict=True):
        inner = layerwise.inner[p]
        if "method" in inner.param_groups[0]:
            group = inner.param_groups[0]
            expected = GaLoreProjector(group["rank"], proj_type=group["proj_type"])
            expected.project(q.grad, 0)
            torch.testing.assert_close(inner.state[p]["projector"].ortho_matrix, expected.ortho_matrix)
            checked += 1
    assert checked == 7 * lw_model.config.num_hidden_layers + 2  # + embeddings and lm_head


def test_clipping_with_accumulation_uses_the_exact_global_norm(tiny_model_dir):
    """SGD makes the update proportional to the clipped gradient, so a wrong coefficient shows."""
    micro = examples(ACCUMULATION, seed=1)
    normal_model, lw_model = load_model(tiny_model_dir), load_model(tiny_model_dir)
    normal = build_optimizer(normal_model, config("sgd"), 0.1)
    layerwise = build_optimizer(lw_model, config("sgd", layerwise=True), 0.1, steps_per_update=ACCUMULATION,
                                max_grad_norm=0.05)
    reference = _reference_norm(normal_model, micro)
    assert reference > 0.5  # clipping is active
    train(normal_model, normal, [micro], clip=0.05)
    assert _layerwise_step(lw_model, layerwise, micro) == pytest.approx(reference, rel=1e-6)
    _assert_same_weights(normal_model, lw_model, atol=1e-7)


def test_clipping_without_accumulation_uses_the_previous_steps_norm(tiny_model_dir):
    """Documented rule: step t is clipped by min(1, max / (norm_{t-1} + 1e-6)); step 1 is not clipped."""
    steps = [examples(1, seed=s) for s in (3, 4)]
    normal_model, lw_model = load_model(tiny_model_dir), load_model(tiny_model_dir)
    normal = build_optimizer(normal_model, config("sgd"), 0.1)
    layerwise = build_optimizer(lw_model, config("sgd", layerwise=True), 0.1, max_grad_norm=0.05)
    norms = []
    for micro in steps:
        norms.append(_reference_norm(normal_model, micro))
        backward(normal_model, micro[0])
        if len(norms) > 1:
            for p in _trained(normal_model):
                p.grad.mul_(min(1.0, 0.05 / (norms[-2] + 1e-6)))
        normal.step()
        normal.zero_grad()
        assert _layerwise_step(lw_model, layerwise, micro) == pytest.approx(norms[-1], rel=1e-6)
        _assert_same_weights(normal_model, lw_model, atol=1e-7)
    assert norms[0] > 0.5  # so step 2 really was clipped


@pytest.mark.parametrize(("name", "steps_per_update"), [("adamw", 1), ("apollo_mini", 1), ("galore", 4), ("apollo", 4)])
def test_layerwise_peak_gradient_bytes_match_the_prediction(tiny_model_dir, name, steps_per_update):
    """Resident .grad + accumulator bytes, sampled at every gradient hook before the optimizer frees .grad."""
    model = load_model(tiny_model_dir)
    opt = config(name, layerwise=True)
    specs, _ = trained_specs(model)
    peak, optimizer = 0, None

    def resident(_):
        nonlocal peak
        total = sum(p.grad.nbytes for p in _trained(model) if p.grad is not None)
        total += sum(s["grad_acc"].nbytes for o in optimizer.inner.values() for s in o.state.values()
                     if "grad_acc" in s)
        peak = max(peak, total)

    for p in _trained(model):  # registered first, so it runs before the optimizer's hook
        p.register_post_accumulate_grad_hook(resident)
    optimizer = build_optimizer(model, opt, 1e-3, steps_per_update=steps_per_update)
    for ids in examples(steps_per_update, seed=5):
        backward(model, ids, 1 / steps_per_update)
    optimizer.step()
    assert peak == gradient_bytes(specs, opt, steps_per_update)
    full = gradient_bytes(specs, config(name), steps_per_update)
    if steps_per_update == 1:
        assert peak == max(torch.Size(s).numel() * 4 for _, s, _ in specs) < full / 2
    elif name == "galore":
        assert peak < full  # projected accumulators instead of full gradients
    else:
        assert peak == full  # APOLLO needs the full summed gradient: same as normal accumulation


def test_lr_scheduler_drives_the_per_parameter_optimizers(tiny_model_dir):
    model = load_model(tiny_model_dir)
    optimizer = build_optimizer(model, config("apollo", layerwise=True), 1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    optimizer.step()
    scheduler.step()
    assert {g["lr"] for o in optimizer.inner.values() for g in o.param_groups} == {5e-3}


def test_layerwise_overfits_with_accumulation(tiny_model_dir):
    model = load_model(tiny_model_dir)
    optimizer = build_optimizer(model, config("apollo_mini", layerwise=True), 1e-2, steps_per_update=2)
    (ids,) = examples()
    losses = train(model, optimizer, [[ids, ids]] * 40)
    assert losses[-1] < 0.5 < 5.5 < losses[0]


@pytest.mark.parametrize("steps_per_update", [1, ACCUMULATION])
def test_layerwise_works_under_activation_checkpointing(tiny_model_dir, steps_per_update):
    """Non-reentrant checkpointing (what the Trainer uses) fires each gradient hook once per backward."""
    micro = examples(steps_per_update, seed=6)
    normal_model, lw_model = load_model(tiny_model_dir), load_model(tiny_model_dir)
    for model in (normal_model, lw_model):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    normal = build_optimizer(normal_model, config("apollo"), 1e-2)
    layerwise = build_optimizer(lw_model, config("apollo", layerwise=True), 1e-2, steps_per_update=steps_per_update)
    train(normal_model, normal, [micro])
    _layerwise_step(lw_model, layerwise, micro)
    _assert_same_weights(normal_model, lw_model)


def test_no_live_model_after_a_layerwise_run(tiny_model_dir, tmp_path, monkeypatch):
    """The gradient hooks sit on the parameters, where the garbage collector cannot see what they hold: a
    hook holding the optimizer kept the model and the Trainer alive after each run (~3 GB per run on CUDA)."""
    import gc
    import weakref

    import finetune.model.load
    from finetune.recipe.schema import Recipe
    from finetune.train.run import run
    from tests.run_support import sums_data, tiny_lora_recipe

    loaded: list[weakref.ref] = []
    real_load = finetune.model.load.load_model

    def load_and_watch(*args, **kwargs):
        model, *rest = real_load(*args, **kwargs)
        loaded.append(weakref.ref(model))
        return (model, *rest)

    monkeypatch.setattr(finetune.model.load, "load_model", load_and_watch)
    recipe = tiny_lora_recipe(tiny_model_dir, sums_data(tmp_path / "sums.jsonl", 8), tmp_path / "run",
                              {"adapter": {"type": "full"}, "optimizer": {"name": "adamw", "layerwise": True},
                               "training": {"max_steps": 2, "micro_batch_size": 2}})
    assert run(Recipe.model_validate(recipe), overwrite=True).state == "completed"
    gc.collect()
    assert len(loaded) == 1 and loaded[0]() is None, "the layer-wise run's model is still alive"

