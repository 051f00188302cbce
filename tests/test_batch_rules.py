"""Learning rate and beta2 when the batch differs from the one they were tuned for (finetune/recipe/batch_rules.py)."""

from __future__ import annotations

import math

import pytest
from run_support import SAMPLE_DATA

from finetune.recipe import validate_recipe
from finetune.recipe.batch_rules import (
    MAX_LR_FACTOR,
    MIN_GAIN,
    TIMING_SKIP,
    TOKEN_SLACK,
    StepTimes,
    advise,
    apply_batch_rules,
    auto_schedule,
    best_accumulation,
    reference_batch,
    scale_for_batch,
    token_cap,
    token_overhead,
    update_batch,
    wall_time,
)
from finetune.recipe.optimizers import SPECS


def test_adam_family_scales_the_learning_rate_with_the_square_root_and_keeps_beta2_half_life_in_tokens():
    rule = scale_for_batch(1e-4, (0.9, 0.999), "adamw", reference=4, batch=16)
    assert rule.new_learning_rate == pytest.approx(2e-4) and rule.rule == "sqrt" and not rule.capped
    assert rule.new_betas == (0.9, pytest.approx(0.999 ** 4))
    # half-life in steps x sequences per step is the same at both batches
    half_life = lambda beta2, batch: math.log(0.5) / math.log(beta2) * batch  # noqa: E731
    assert half_life(rule.new_betas[1], 16) == pytest.approx(half_life(0.999, 4))
    down = scale_for_batch(1e-4, (0.9, 0.99), "apollo_mini", reference=16, batch=4)
    assert down.new_learning_rate == pytest.approx(5e-5) and down.new_betas[1] == pytest.approx(0.99 ** 0.25)


def test_sgd_scales_linearly_and_has_no_beta2_and_the_factor_is_capped():
    rule = scale_for_batch(0.01, (0.9, 0.999), "sgd", reference=2, batch=6)
    assert rule.new_learning_rate == pytest.approx(0.03) and rule.rule == "linear" and rule.new_betas is None
    capped = scale_for_batch(1e-4, (0.9, 0.999), "adamw", reference=1, batch=64)  # sqrt(64) = 8 > the cap
    assert capped.capped and capped.new_learning_rate == pytest.approx(MAX_LR_FACTOR * 1e-4)
    assert "capped at 4x" in capped.describe() and "beta2 0.999 ->" in capped.describe()


def test_every_registered_optimizer_names_its_rule():
    assert {s.lr_batch_scaling for s in SPECS} <= {"sqrt", "linear"}
    assert [s.name for s in SPECS if s.lr_batch_scaling == "linear"] == ["sgd"]
    assert not any(s.uses_beta2 for s in SPECS if s.name in ("sgd", "adafactor"))


def _recipe(**training) -> object:
    return validate_recipe({"model": {"path": "m"}, "data": {"path": SAMPLE_DATA},
                            "training": {"learning_rate": 1e-4, **training}})


def test_the_recipe_rescales_only_when_its_batch_differs_from_the_reference_and_only_once():
    plain = _recipe(micro_batch_size=2, gradient_accumulation_steps=4)
    assert reference_batch(plain) == 8 and apply_batch_rules(plain, 8) == (plain, None)  # the default: no change
    given = _recipe(micro_batch_size=2, gradient_accumulation_steps=8, reference_batch_size=4)
    scaled, rule = apply_batch_rules(given, reference_batch(given))
    assert rule.batch == 16 and scaled.training.learning_rate == pytest.approx(2e-4)
    assert scaled.optimizer.betas[1] == pytest.approx(0.999 ** 4)
    assert scaled.training.reference_batch_size == 16  # its recipe.yaml is not rescaled again
    assert apply_batch_rules(scaled, reference_batch(scaled)) == (scaled, None)
    # micro-batch left to the planner with a target batch: the target is the reference
    auto = _recipe(micro_batch_size="auto", gradient_accumulation_steps="auto", effective_batch_size=16)
    assert reference_batch(auto) == 16
    assert reference_batch(_recipe(micro_batch_size="auto")) is None  # nothing to compare against


def test_effective_batch_size_accepts_auto_and_rejects_zero():
    assert _recipe(effective_batch_size="auto").training.effective_batch_size == "auto"
    with pytest.raises(Exception, match="effective_batch_size"):
        _recipe(effective_batch_size=0)


def test_auto_batch_with_several_processes_is_refused_naming_the_key():
    with pytest.raises(Exception, match="training.effective_batch_size=auto with 2 processes"):
        validate_recipe({**_recipe(effective_batch_size="auto").model_dump(mode="python"),
                         "distributed": {"gpus": 2}}, "test")


def test_finetune_plan_shows_the_rescaling(tiny_model_dir, tmp_path, capsys):
    from finetune.cli import main
    from finetune.recipe.load import recipe_to_yaml

    recipe = validate_recipe({"model": {"path": str(tiny_model_dir)}, "data": {"path": SAMPLE_DATA, "max_seq_len": 64},
                              "quantization": {"bits": None},
                              "training": {"learning_rate": 1e-4, "micro_batch_size": 2,
                                           "gradient_accumulation_steps": 8, "reference_batch_size": 4}})
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_to_yaml(recipe))
    assert main(["plan", str(path), "--gpu-memory", "2GiB", "--device", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "batch rules: batch 16 vs reference 4 sequences: learning rate 0.0001 -> 0.0002 (sqrt rule)" in out


def test_a_cheap_optimizer_step_never_accumulates_whatever_the_noise_scale():
    """LoRA / small models: the update costs little next to a micro-batch, so a larger batch only costs tokens."""
    assert best_accumulation(1e6, 500.0, t_micro=0.2, t_opt=0.001) == 1  # k* = sqrt(0.001 x 1e6 / 100) = 1.4
    assert best_accumulation(1e5, 500.0, t_micro=0.2, t_opt=0.0) == 1
    assert best_accumulation(None, 500.0, t_micro=0.2, t_opt=5.0) == 1  # nothing measured yet
    assert best_accumulation(1e6, 500.0, t_micro=None, t_opt=None) == 1


def test_an_expensive_optimizer_step_accumulates_more_as_the_noise_scale_grows():
    """Full fine-tuning with an expensive step: k* = sqrt(t_opt x gns / (t_micro x b)) grows with the noise scale,
    and the chosen integer is the better of floor(k*) and ceil(k*) under the wall-time model where the token cap
    does not bind (a noise scale far above the batch)."""
    b, t_micro, t_opt = 1000.0, 0.1, 0.4
    ks = [best_accumulation(gns, b, t_micro, t_opt, limit=1024) for gns in (500.0, 4e4, 4e5, 4e6, 1.6e7)]
    assert ks == sorted(ks) and ks[0] == 1 and ks[-1] > 200
    for gns in (1.6e7, 3.3e7):
        k_star = math.sqrt(t_opt * gns / (t_micro * b))
        assert k_star < token_cap(gns, b)
        k = best_accumulation(gns, b, t_micro, t_opt, limit=1024)
        assert k in (math.floor(k_star), math.ceil(k_star)), (gns, k_star, k)
        for other in (k - 1, k + 1):  # an integer minimum of the convex wall time
            assert wall_time(k, b, gns, t_micro, t_opt) <= wall_time(other, b, gns, t_micro, t_opt)
    assert best_accumulation(1.6e7, b, t_micro, t_opt) == 64  # the limit
    assert best_accumulation(1.6e7, b, t_micro, t_opt, limit=10**4) == 253  # k* = sqrt(0.4 x 1.6e7 / 100) = 253


def test_accumulation_never_costs_more_than_the_token_slack():
    """The run's length is fixed in tokens: where the wall-time optimum k* would buy speed with more than
    TOKEN_SLACK extra tokens (McCandlish's E = E_min (1 + B / B_noise)), the batch stops at the cap."""
    b, t_micro, t_opt = 1000.0, 0.1, 0.4
    for gns in (4e4, 4e5, 4e6):
        k_star = math.sqrt(t_opt * gns / (t_micro * b))
        k = best_accumulation(gns, b, t_micro, t_opt, limit=1024)
        cap = token_cap(gns, b)
        assert k_star > cap and k == cap > 1 or cap == 1 and k == 1, (gns, k_star, cap, k)
        overhead = (1 + k * b / gns) / (1 + b / gns) - 1
        assert overhead <= TOKEN_SLACK < (1 + (k + 1) * b / gns) / (1 + b / gns) - 1
    assert best_accumulation(1.6e4, b, t_micro, t_opt) == 1  # k* = 8, but batch 2 would cost 6% more tokens


def test_the_warmup_update_batch_is_the_largest_power_of_two_within_the_token_slack_of_one_sequence():
    """Below the micro-batch the update batch grows with the noise scale: the largest power of two dividing the
    micro-batch (or the micro-batch) within TOKEN_SLACK extra tokens next to one sequence; never down."""
    per_sequence = 100.0
    assert update_batch(None, per_sequence, current=1, micro=32) == 1  # nothing measured yet
    assert update_batch(10 * per_sequence, per_sequence, current=1, micro=32) == 1  # 2 sequences cost 9% more
    for gns_sequences in (50, 200, 400, 1600, 1e6):
        u = update_batch(gns_sequences * per_sequence, per_sequence, current=1, micro=32)
        assert u & (u - 1) == 0 and u <= 32
        assert token_overhead(u, gns_sequences) <= TOKEN_SLACK + 1e-12
        assert u == 32 or token_overhead(2 * u, gns_sequences) > TOKEN_SLACK
    assert update_batch(1e6 * per_sequence, per_sequence, current=1, micro=32) == 32
    assert update_batch(200 * per_sequence, per_sequence, current=4, micro=32) == 4  # cap 5: only up, by 2^k
    assert update_batch(200 * per_sequence, per_sequence, current=1, micro=6) == 2  # cap 5; 4 does not divide 6
    assert update_batch(1e6 * per_sequence, per_sequence, current=1, micro=6) == 6
    # the plan says what the warmup does, and why a layer-wise optimizer has none
    assert "updates of 1 sequence first, each micro-batch of 8 run as 8 updates" in auto_schedule(8, "adamw", False, 64, 10)
    assert "no warmup below the micro-batch: a layer-wise optimizer updates inside backward" in \
        auto_schedule(8, "adamw", True, 64, 10)
    assert "warmup" not in auto_schedule(1, "adamw", False, 64, 10)
    assert "no warmup below the micro-batch: kto's reference point" in auto_schedule(8, "adamw", False, 64, 10, "kto")


def test_the_accumulation_only_ramps_up_and_only_for_a_real_saving():
    b, t_micro, t_opt = 1000.0, 0.1, 0.4
    assert best_accumulation(500.0, b, t_micro, t_opt, current=8) == 8  # k* = 1.4 now: never down
    # k* = 8.9 from 8: ceil(8.9) = 9 saves far less than MIN_GAIN of the time, so no change
    assert best_accumulation(2e4, b, t_micro, t_opt, current=8) == 8
    assert 1 - wall_time(9, b, 2e4, t_micro, t_opt) / wall_time(8, b, 2e4, t_micro, t_opt) < MIN_GAIN


def test_step_times_split_a_step_into_forward_backward_and_the_update():
    times = StepTimes()
    for _ in range(TIMING_SKIP):  # warm-up steps (allocation) are not counted
        times.add(100.0, 100.0, updated=True)
    assert times.estimate() is None
    for i in range(6):  # an ordinary optimizer: the update follows the last backward
        times.add(0.2, 0.05 if i % 2 else 0.0, updated=i % 2 == 1)
    assert times.estimate() == pytest.approx((0.2, 0.05))
    layerwise = StepTimes(update_in_backward=True)  # t_opt: what an updating step costs beyond a deferred one
    for i in range(TIMING_SKIP + 12):
        layerwise.add(0.2 if i % 2 else 0.5, 0.0, updated=i % 2 == 0)
    assert layerwise.estimate() == pytest.approx((0.2, 0.3))
    again = StepTimes(update_in_backward=True)
    again.load_state_dict(layerwise.state_dict())
    assert again.estimate() == layerwise.estimate()


def test_advice_is_the_micro_batch_times_the_accumulation_that_minimises_the_time_to_a_loss():
    # 20 labelled tokens per sequence, micro-batch 2 = 40 tokens; k* = sqrt(0.01 x 144000 / (0.01 x 40)) = 60,
    # below the token cap (145 sequences = 72 micro-batches)
    advice = advise(1.44e5, 20.0, 2, batch_used=2, learning_rate=1e-3, betas=(0.9, 0.999), optimizer="adamw",
                    times=(0.01, 0.01))
    assert advice["settings"]["training.effective_batch_size"] == 120  # 2 x 60
    assert advice["settings"]["training.learning_rate"] == pytest.approx(1e-3 * MAX_LR_FACTOR)  # sqrt(60), capped
    assert advice["settings"]["optimizer.betas"][1] == pytest.approx(0.999 ** 60, rel=1e-6)
    assert "7.2e+03 sequences" in advice["reason"] and "60 micro-batch(es) per update" in advice["reason"]
    assert "training.micro_batch_size" not in advice["settings"]
    capped = advise(3200.0, 20.0, 2, batch_used=2, learning_rate=1e-3, betas=(0.9, 0.999), optimizer="adamw",
                    times=(0.01, 0.02))  # k* = 12.6, but at most 4 sequences stay within the token slack
    assert capped["settings"]["training.effective_batch_size"] == 4
    cheap = advise(3200.0, 20.0, 2, batch_used=8, learning_rate=1e-3, betas=(0.9, 0.999), optimizer="adamw",
                   times=(0.01, 0.0001))
    assert cheap["settings"]["training.effective_batch_size"] == 2  # below the batch used: no accumulation
    assert "settings" not in advise(None, 20.0, 2, 2, 1e-3, (0.9, 0.999), "adamw", (0.01, 0.02))
    assert "settings" not in advise(3200.0, 20.0, 2, 2, 1e-3, (0.9, 0.999), "adamw", None)
    # a run that ended in the warmup (no step times) still learns that its micro-batch is too large a batch
    warm = advise(2000.0, 20.0, 32, batch_used=1, learning_rate=1e-3, betas=(0.9, 0.999), optimizer="adamw", times=None)
    assert warm["settings"]["training.effective_batch_size"] == 2 and "step" not in warm["reason"].split(":")[0]


def test_a_micro_batch_past_the_noise_scale_is_advised_down_and_left_to_the_planner():
    """At a noise scale of 160 sequences a micro-batch of 8 costs 4.4% more tokens than one sequence: the advice
    is the largest power of two within the slack (4: 1.9%), and the micro-batch becomes the planner's again."""
    advice = advise(3200.0, 20.0, 8, batch_used=8, learning_rate=1e-3, betas=(0.9, 0.999), optimizer="adamw",
                    times=(0.01, 0.02))
    assert advice["settings"]["training.effective_batch_size"] == 4
    assert advice["settings"]["training.micro_batch_size"] == "auto"
    assert advice["settings"]["training.learning_rate"] == pytest.approx(1e-3 * math.sqrt(0.5), rel=1e-3)
    assert "micro-batch 8 costs 4.35% more tokens" in advice["reason"]


def test_finetune_plan_takes_the_advice_of_a_finished_run(tiny_model_dir, tmp_path, capsys):
    from finetune.cli import main
    from finetune.recipe.load import recipe_to_yaml
    from finetune.rundir import RunDir, atomic_write_json

    previous = RunDir(tmp_path / "previous")
    previous.root.mkdir()
    atomic_write_json(previous.results, {"state": "completed", "advice": advise(
        16000.0, 20.0, 4, batch_used=4, learning_rate=1e-3, betas=(0.9, 0.999), optimizer="adamw",
        times=(0.01, 0.0008))})  # k* = sqrt(0.0008 x 16000 / (0.01 x 80)) = 4: 16 sequences (cap 17)
    recipe = validate_recipe({"model": {"path": str(tiny_model_dir)}, "data": {"path": SAMPLE_DATA, "max_seq_len": 64},
                              "quantization": {"bits": None}, "training": {"micro_batch_size": 4}})
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_to_yaml(recipe))
    assert main(["plan", str(path), "--gpu-memory", "2GiB", "--device", "cpu", "--advice", str(previous.root)]) == 0
    out = capsys.readouterr().out
    assert "advice from" in out and "--set training.effective_batch_size=16" in out
    assert "mb=4 ga=4" in out  # 16 sequences at the recipe's micro-batch
    assert main(["plan", str(path), "--device", "cpu", "--advice", str(tmp_path)]) == 2  # no results.json there
    assert "no batch advice" in capsys.readouterr().err


def test_finetune_plan_shows_what_auto_will_do(tiny_model_dir, tmp_path, capsys):
    from finetune.cli import main
    from finetune.recipe.load import recipe_to_yaml

    recipe = validate_recipe({"model": {"path": str(tiny_model_dir)}, "data": {"path": SAMPLE_DATA, "max_seq_len": 64},
                              "quantization": {"bits": None},
                              "training": {"micro_batch_size": 4, "effective_batch_size": "auto"}})
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_to_yaml(recipe))
    assert main(["plan", str(path), "--gpu-memory", "2GiB", "--device", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "effective batch auto: a batch-size warmup (the critical batch starts near 0 and grows): updates of 1 " \
        "sequence first, each micro-batch of 4 run as 4 updates in a row" in out
    assert "until it is the micro-batch (smaller updates run slower per token); then, without accumulation at " \
        "first, the run times" in out
    assert "at most 256 sequences; learning rate x sqrt of the batch ratio (capped at 4x), beta2 ** ratio" in out
