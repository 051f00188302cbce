"""The planner chooses settings that fit a budget, says when nothing fits, and is fast on real configs."""

from __future__ import annotations

from pathlib import Path

import pytest
from run_support import SAMPLE_DATA

from finetune.plan import Plan, plot_breakdown, predict
from finetune.recipe.schema import Recipe
from finetune.train.measure import measure

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
AUTO = {"training": {"micro_batch_size": "auto"},
        "memory": {"activation_checkpointing": "auto", "chunked_loss": "auto", "gpu_memory_margin": 0}}


def _recipe(path, seq=256, **sections) -> Recipe:
    data = {"model": {"path": str(path)}, "data": {"path": SAMPLE_DATA, "max_seq_len": seq},
            "quantization": {"bits": None}, **AUTO}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return Recipe.model_validate(data)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from finetune.testing import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("m"), "llama", hidden_size=128, intermediate_size=320,
                               num_hidden_layers=4)


@pytest.mark.parametrize("budget", [12 * 2**20, 20 * 2**20, 40 * 2**20])
def test_measured_peak_stays_under_budget(tiny_dir, budget):
    recipe = _recipe(tiny_dir)
    plan = predict(recipe, gpu_memory=budget, device="cpu")
    assert plan.fits and plan.peak_bytes <= budget
    chosen = plan.apply(recipe).recipe
    assert chosen.training.micro_batch_size == plan.settings["micro_batch_size"]
    measured = measure(chosen, steps=2)
    assert measured["peak_bytes"] <= budget
    # a bigger budget never buys a smaller micro-batch
    assert plan.settings["micro_batch_size"] >= 1


def test_bigger_budget_allows_bigger_micro_batch(tiny_dir, monkeypatch):
    # A processor whose speed grows with the micro-batch (as a GPU's: half its peak at 1024 tokens); the
    # planner keeps a smaller micro-batch where a larger one is not predicted faster
    monkeypatch.setattr("finetune.plan.search.cpu_compute", lambda: {
        "flops@128": 1e12 * 128 / (128 + 1024), "flops@1024": 1e12 * 1024 / (1024 + 1024), "mem_bw": 1e11})
    small = predict(_recipe(tiny_dir), gpu_memory=12 * 2**20, device="cpu")
    large = predict(_recipe(tiny_dir), gpu_memory=200 * 2**20, device="cpu")
    assert large.settings["micro_batch_size"] > small.settings["micro_batch_size"]


def test_impossible_budget_reports_smallest_budget(tiny_dir, tmp_path):
    plan = predict(_recipe(tiny_dir), gpu_memory=2 * 2**20, device="cpu")
    assert not plan.fits
    assert plan.min_budget_bytes == min(c.peak_bytes for c in plan.rejected)
    assert all("budget" in c.reason for c in plan.rejected)
    again = predict(_recipe(tiny_dir), gpu_memory=plan.min_budget_bytes, device="cpu")
    assert again.fits
    plot_breakdown(plan, tmp_path / "plan.png")
    assert (tmp_path / "plan.png").stat().st_size > 0
    assert '"fits": false' in plan.to_json()


@pytest.mark.parametrize("gpu_memory", ["0GiB", "1MiB"])
def test_a_budget_eaten_by_the_margin_is_a_clear_error(tiny_dir, capsys, gpu_memory):
    """--gpu-memory 0GiB (or less than memory.gpu_memory_margin) used to plan against a negative budget; a bad
    argument: exit 2."""
    from finetune.cli import main
    from finetune.recipe.load import recipe_to_yaml

    recipe = tiny_dir.parent / "margin.yaml"
    recipe.write_text(recipe_to_yaml(_recipe(tiny_dir)))
    assert main(["plan", str(recipe), "--gpu-memory", gpu_memory, "--set", "memory.gpu_memory_margin=2MiB"]) == 2
    err = capsys.readouterr().err
    assert "leaves no budget after memory.gpu_memory_margin" in err and "Traceback" not in err


def test_tiled_mlp_chosen_only_where_it_is_needed(tiny_dir):
    """At a long sequence a budget between the tiled and the plain MLP's peak makes the planner tile (the
    run stays under it); a roomy budget keeps the faster plain MLP."""
    sections = {"training": {"micro_batch_size": 1},
                "memory": {"activation_checkpointing": True, "chunked_loss": False, "tiled_mlp": "auto",
                           "tiled_mlp_tokens": 128}}
    # data the plan cannot read: rows of max_seq_len (the sample data's examples are ~120 tokens, one MLP chunk)
    recipe = _recipe(tiny_dir, seq=2048, data={"path": "unused.jsonl"}, **sections)
    plain = predict(recipe.model_copy(update={"memory": recipe.memory.model_copy(update={"tiled_mlp": False})}),
                    gpu_memory=1 << 40, device="cpu")
    tiled = predict(recipe.model_copy(update={"memory": recipe.memory.model_copy(update={"tiled_mlp": True})}),
                    gpu_memory=1 << 40, device="cpu")
    assert tiled.peak_bytes < plain.peak_bytes
    budget = (tiled.peak_bytes + plain.peak_bytes) // 2
    plan = predict(recipe, gpu_memory=budget, device="cpu")
    assert plan.fits and plan.settings["tiled_mlp"] is True
    assert any("budget" in (c.reason or "") and c.settings["tiled_mlp"] is False for c in plan.rejected)
    assert measure(plan.apply(recipe).recipe, steps=1)["peak_bytes"] <= budget
    assert predict(recipe, gpu_memory=1 << 40, device="cpu").settings["tiled_mlp"] is False


def test_effective_batch_kept_through_accumulation(tiny_dir):
    recipe = _recipe(tiny_dir, training={"micro_batch_size": "auto", "gradient_accumulation_steps": "auto",
                                         "effective_batch_size": 8})
    plan = predict(recipe, gpu_memory=14 * 2**20, device="cpu")
    s = plan.settings
    assert s["micro_batch_size"] * s["gradient_accumulation_steps"] >= 8
    assert s["micro_batch_size"] <= 8


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "llama-3.1-8b", "qwen2.5-7b", "mistral-7b-v0.3", "gemma-2-9b"])
def test_published_configs_plan_for_every_card(name):
    """Every key auto, four cards: a plan each, budgets in order, something fits. (Planning speed is measured
    side by side in benchmarks/plan_speed.py, not timed here.)"""
    recipe = _recipe(CONFIGS / f"{name}.json", seq=2048, quantization={"bits": "auto"},
                     memory={"offload": "auto", "gpu_memory_margin": 512 * 2**20})
    plans: list[Plan] = []
    for gib in (8, 12, 16, 24):
        plans.append(predict(recipe, gpu_memory=f"{gib}GiB"))
    assert all(p.device == "cuda" for p in plans)
    budgets = [p.budget_bytes for p in plans]
    assert budgets == sorted(budgets)
    assert any(p.fits for p in plans)


def test_70b_config_plans_from_its_config_alone():
    recipe = _recipe(CONFIGS / "llama-3.1-70b.json", seq=2048, quantization={"bits": 4},
                     training={"micro_batch_size": 1}, memory={"activation_checkpointing": True})
    plan = predict(recipe, gpu_memory="48GiB")
    assert 35 * 2**30 < plan.breakdown["weights"] < 45 * 2**30  # 70B in NF4 ~ 0.53 B/param + bf16 embeddings


def test_plan_and_measure_commands_print_json(tiny_dir, tmp_path, capsys):
    import json

    from finetune.cli import main
    from finetune.recipe.load import recipe_to_yaml

    recipe, path = _recipe(tiny_dir, seq=64), tmp_path / "recipe.yaml"
    path.write_text(recipe_to_yaml(recipe))
    assert main(["plan", str(path), "--gpu-memory", "64MiB", "--device", "cpu", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["budget_bytes"] == 64 * 2**20
    assert set(plan["breakdown"]) == {"weights", "trainable_weights", "gradients", "optimizer_state",
                                      "activations", "logits_and_loss", "other"}
    assert main(["plan", str(path), "--gpu-memory", "1MiB", "--device", "cpu"]) == 1
    assert "Smallest budget that works" in capsys.readouterr().out
    path.write_text(recipe_to_yaml(predict(recipe, gpu_memory="64MiB", device="cpu").apply(recipe).recipe))
    assert main(["measure", str(path), "--steps", "1", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["device"] == "cpu" and measured["peak_bytes"] == sum(measured["breakdown"].values())


def test_offload_speed_uses_the_measured_bandwidth_once(tmp_path, monkeypatch):
    """Disk offload is priced at this machine's measured (and cached) disk speed: a slow disk ranks it lower."""
    import finetune.memory.bandwidth as bandwidth

    calls = []

    def fake_measure(directory, nbytes=0):
        calls.append(directory)
        return {"write": speed, "read": speed}

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bandwidth, "measure_disk", fake_measure)
    recipe = _recipe(CONFIGS / "llama-3.1-8b.json", seq=16384, memory={"offload": "disk"},
                     output={"dir": str(tmp_path / "run")})
    speed = 10e9
    fast = predict(recipe, gpu_memory="24GiB").tokens_per_s
    assert predict(recipe, gpu_memory="24GiB").tokens_per_s == fast and len(calls) == 1, "measured once, cached"
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "other-cache"))
    speed = 50e6  # a slow USB disk
    assert predict(recipe, gpu_memory="24GiB").tokens_per_s < 0.5 * fast
    assert not (tmp_path / "run").exists(), "planning creates no folders"


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_muon_is_priced_from_the_registry_and_matches_a_real_step(tiny_dir, adapter):
    """optimizer.name: muon plans (Muon's momentum for hidden matrices, AdamW for the rest) and the predicted
    state equals what a real step allocates."""
    fixed = {"training": {"micro_batch_size": 1}, "memory": {"activation_checkpointing": True, "chunked_loss": False}}
    recipe = _recipe(tiny_dir, seq=64, optimizer={"name": "muon"}, adapter={"type": adapter}, **fixed)
    plan = predict(recipe, gpu_memory="64MiB", device="cpu")
    assert plan.fits and plan.settings["optimizer"] == "muon"
    measured = measure(plan.apply(recipe).recipe, steps=2)
    assert measured["breakdown"]["optimizer_state"] == plan.breakdown["optimizer_state"] > 0


def test_auto_optimizer_picks_only_what_the_optimizer_keys_fit(tiny_dir, capsys):
    """optimizer.rank with optimizer.name auto: the plan used to pick adamw, which Plan.apply then refused
    (rank applies only to the low-rank optimizers); now auto picks among the optimizers the keys fit, and a
    key none of them takes is a recipe error naming it."""
    from finetune import cli

    recipe = _recipe(tiny_dir, adapter={"type": "lora", "r": 16}, optimizer={"name": "auto", "rank": 4})
    plan = predict(recipe, gpu_memory=200 * 2**20, device="cpu")
    assert plan.settings["optimizer"] == "apollo_mini"
    assert plan.apply(recipe).recipe.optimizer.name == "apollo_mini"
    path = tiny_dir.parent / "momentum.yaml"
    path.write_text(f"model: {{path: {tiny_dir}}}\ndata: {{path: {SAMPLE_DATA}}}\n"
                    "optimizer: {name: auto, momentum: 0.5}\n")
    assert cli.main(["plan", str(path), "--gpu-memory", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "optimizer.name auto" in err and "optimizer.momentum: applies only to sgd" in err
    assert "Traceback" not in err


def test_cpu_calibration_fits_peak_and_half_tokens_through_the_measured_rates():
    """rate(t) = peak * t / (t + half): two measured row counts give back peak and half; noise that makes the
    small matmul faster than the large one gives half 0, not a negative utilisation."""
    from finetune.plan.cost_model import calibrated

    def rate(t: int, peak: float = 40e9, half: float = 96.0) -> float:
        return peak * t / (t + half)

    figures = calibrated({"flops@128": rate(128), "flops@1024": rate(1024), "mem_bw": 7e9})
    assert figures["flops"] == pytest.approx(40e9) and figures["half_tokens"] == pytest.approx(96.0)
    assert figures["mem_bw"] == 7e9
    flat = calibrated({"flops@128": 30e9, "flops@1024": 29e9, "mem_bw": 7e9})
    assert flat["half_tokens"] == 0 and flat["flops"] == pytest.approx(29e9)


def test_a_cpu_plan_is_priced_with_the_cpu_measured_once_and_prefers_small_micro_batches(tiny_dir, tmp_path,
                                                                                         monkeypatch):
    """On a CPU the speed model uses this machine's measured matmul rate (cached, measured once): half the
    FLOP/s, half the predicted tokens/s. Where a larger micro-batch is predicted less than 10% faster,
    `auto` keeps the smaller one; where it is much faster (a slow start, as on a GPU), the larger."""
    import finetune.memory.bandwidth as bandwidth
    from finetune.plan.cost_model import figures_of

    calls = []
    probe = {"flops@128": 20e9, "flops@1024": 20e9, "mem_bw": 5e9}

    def fake_measure():
        calls.append(1)
        return dict(probe)

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bandwidth, "measure_cpu", fake_measure)
    recipe = _recipe(tiny_dir, training={"micro_batch_size": "auto"},
                     memory={"activation_checkpointing": True, "chunked_loss": False})
    plan = predict(recipe, gpu_memory="1GiB", device="cpu")
    assert plan.figures_measured and plan.device_figures == figures_of("cpu", probe)
    assert plan.settings["micro_batch_size"] == 1  # flat: every micro-batch runs at the peak
    fixed = _recipe(tiny_dir, training={"micro_batch_size": 4}, memory={"activation_checkpointing": True,
                                                                        "chunked_loss": False})
    slow = predict(fixed, gpu_memory="1GiB", device="cpu").tokens_per_s
    assert len(calls) == 1, "measured once, then read from the cache"

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "faster-cache"))
    probe.update({"flops@128": 40e9, "flops@1024": 40e9})
    assert predict(fixed, gpu_memory="1GiB", device="cpu").tokens_per_s == pytest.approx(2 * slow)
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "slow-start-cache"))
    probe.update({"flops@128": 40e9 * 128 / (128 + 2048), "flops@1024": 40e9 * 1024 / (1024 + 2048)})
    assert predict(recipe, gpu_memory="1GiB", device="cpu").settings["micro_batch_size"] == 32


@pytest.fixture(scope="module")
def planned_by_micro_batch():
    """(model config, budget, optimizer) -> the plan with the micro-batch `auto` and the plan at each micro-batch
    pinned (qlora-8b-16gb's recipe: offload, chunked loss and tiled MLP left to the planner)."""
    from finetune.plan.search import MICRO_BATCHES
    from finetune.recipe.load import load_recipe

    def plans(config: str, budget: str, optimizer: str) -> tuple[Plan, dict[int, Plan]]:
        sets = [f"model.path={CONFIGS / config}", f"optimizer.name={optimizer}"]
        recipe = "recipes/qlora-8b-16gb.yaml"
        auto = predict(load_recipe(recipe, sets), gpu_memory=budget, device="cuda")
        pinned = {mb: predict(load_recipe(recipe, [*sets, f"training.micro_batch_size={mb}"]), gpu_memory=budget,
                              device="cuda") for mb in MICRO_BATCHES if mb <= 16}  # effective_batch_size 16
        return auto, pinned

    return plans


@pytest.mark.parametrize("config,optimizer", [("llama-3.1-8b.json", "adamw"), ("qwen2.5-7b.json", "adamw"),
                                              ("gemma-2-9b.json", "adamw"), ("mistral-7b-v0.3.json", "auto"),
                                              ("qwen2.5-0.5b.json", "adamw")])
@pytest.mark.parametrize("budget", ["8GiB", "12GiB", "16GiB", "24GiB"])
def test_the_plan_is_the_fastest_at_its_micro_batch_and_the_smallest_micro_batch_within_the_gain(
        planned_by_micro_batch, config, optimizer, budget):
    """The micro-batch preference applies to whole plans: at each micro-batch its fastest settings, then the
    smallest micro-batch whose fastest is within MICRO_BATCH_GAIN of the fastest of all. (Llama-3.1-8B at
    16 GiB once kept offload=cpu, chosen for micro-batch 8, at micro-batch 4, where offload=none was faster.)
    `optimizer.name: auto` ranks by tokens/s times the optimizer's preference factor."""
    from finetune.plan.search import MICRO_BATCH_GAIN
    from finetune.recipe.optimizers import auto_preferences

    def score(settings: dict, tokens_per_s: float) -> float:
        return tokens_per_s * (auto_preferences()[settings["optimizer"]] if optimizer == "auto" else 1.0)

    auto, pinned = planned_by_micro_batch(config, budget, optimizer)
    fitting = {mb: plan for mb, plan in pinned.items() if plan.fits}
    if not auto.fits:
        assert not fitting
        return
    chosen = auto.settings["micro_batch_size"]
    at_chosen = fitting[chosen]
    assert auto.settings == at_chosen.settings and auto.tokens_per_s == at_chosen.tokens_per_s
    best = score(auto.settings, auto.tokens_per_s)
    for plan in (auto, at_chosen):  # no fitting candidate at the chosen micro-batch is faster
        assert all(score(a.settings, a.tokens_per_s) <= best for a in plan.alternatives
                   if a.settings["micro_batch_size"] == chosen)
    fastest = max(score(p.settings, p.tokens_per_s) for p in fitting.values())
    assert best * (1 + MICRO_BATCH_GAIN) >= fastest
    assert all(score(p.settings, p.tokens_per_s) * (1 + MICRO_BATCH_GAIN) < fastest
               for mb, p in fitting.items() if mb < chosen)
