"""The planner plans per device: what each strategy shards is divided by the world size, what it replicates
stays, its communication buffers are added, the effective batch is kept across world sizes, and a model that
fits on no single card gets a plan for several."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_support import SAMPLE_DATA

from finetune.plan import predict
from finetune.recipe.schema import Recipe
from finetune.recipe.settings import auto_keys

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
GIB = 2**30


def _recipe(name: str, gpus: int, strategy: str, **sections) -> Recipe:
    data = {"model": {"path": str(CONFIGS / f"{name}.json")}, "data": {"path": SAMPLE_DATA, "max_seq_len": 2048},
            "quantization": {"bits": None}, "adapter": {"type": "full"},
            "training": {"micro_batch_size": 1}, "memory": {"chunked_loss": False, "tiled_mlp": False, "gpu_memory_margin": 0},
            "distributed": {"gpus": gpus, "strategy": strategy}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return Recipe.model_validate(data)


@pytest.fixture(scope="module")
def full_8b():
    """Full fine-tuning of Llama-3.1-8B (bf16 weights, AdamW), planned for 1 GPU and per device for 4."""
    one = predict(_recipe("llama-3.1-8b", 1, "ddp"), gpu_memory="80GiB")
    return one, {s: predict(_recipe("llama-3.1-8b", 4, s), gpu_memory="80GiB") for s in ("ddp", "fsdp", "deepspeed")}


def test_ddp_replicates_everything_and_adds_its_gradient_buckets(full_8b):
    one, four = full_8b
    ddp = four["ddp"]
    for part in ("weights", "trainable_weights", "optimizer_state", "gradients", "activations"):
        assert ddp.breakdown[part] == pytest.approx(one.breakdown[part], rel=1e-6), part
    assert ddp.communication_bytes == pytest.approx(one.breakdown["gradients"], rel=1e-6)  # flat bucket copy
    assert ddp.breakdown["other"] - one.breakdown["other"] >= ddp.communication_bytes
    assert ddp.world_size == 4 and one.communication_bytes == 0


def test_fsdp_divides_weights_gradients_and_optimizer_state_by_the_world_size(full_8b):
    one, four = full_8b
    fsdp = four["fsdp"]
    for part in ("trainable_weights", "optimizer_state"):
        assert fsdp.breakdown[part] == pytest.approx(one.breakdown[part] / 4, rel=1e-3), part
    assert fsdp.breakdown["gradients"] <= one.breakdown["gradients"] / 4 * (1 + 1e-3)  # at most a quarter resident
    # root unit (embeddings + head: 2 x 128256 x 4096 bf16 = 1.96 GiB) + two gathered layers (2 x 0.41 GiB)
    # + one layer's gradients (0.41 GiB)
    assert 2.9 * GIB < fsdp.communication_bytes < 3.3 * GIB
    assert fsdp.peak_bytes < four["ddp"].peak_bytes / 2


def test_zero3_shards_like_fsdp_and_keeps_an_fp32_master_copy_in_the_optimizer_partition(full_8b):
    one, four = full_8b
    zero3 = four["deepspeed"]
    assert zero3.breakdown["trainable_weights"] == pytest.approx(one.breakdown["trainable_weights"] / 4, rel=1e-3)
    master = one.breakdown["trainable_weights"] * 2  # bf16 weights -> fp32 copy
    assert zero3.breakdown["optimizer_state"] == pytest.approx((one.breakdown["optimizer_state"] + master) / 4,
                                                               rel=1e-3)
    offloaded = predict(_recipe("llama-3.1-8b", 4, "deepspeed", distributed={"deepspeed_offload": "cpu"}),
                        gpu_memory="80GiB")
    assert offloaded.breakdown["optimizer_state"] == 0
    assert offloaded.tokens_per_s < zero3.tokens_per_s  # the state crosses the host link every step


def test_zero2_shards_gradients_and_optimizer_state_only():
    short = {"data": {"path": SAMPLE_DATA, "max_seq_len": 256}}  # the peak in backward, not at the logits
    one = predict(_recipe("qwen2.5-0.5b", 1, "ddp", **short), gpu_memory="80GiB")
    zero2 = predict(_recipe("qwen2.5-0.5b", 2, "deepspeed", distributed={"zero_stage": 2}, **short),
                    gpu_memory="80GiB")
    assert zero2.breakdown["trainable_weights"] == pytest.approx(one.breakdown["trainable_weights"], rel=1e-6)
    assert zero2.breakdown["gradients"] < one.breakdown["gradients"]


def test_70b_qlora_fits_no_24gb_card_alone_and_gets_a_plan_for_four(tmp_path, capsys):
    from finetune.cli import main
    from finetune.recipe.load import recipe_to_yaml

    recipe = _recipe("llama-3.1-70b", 1, "auto", quantization={"bits": 4}, adapter={"type": "lora"},
                     training={"micro_batch_size": "auto", "gradient_accumulation_steps": "auto",
                               "effective_batch_size": 16},
                     memory={"activation_checkpointing": "auto", "chunked_loss": "auto",
                             "gpu_memory_margin": 512 * 2**20})
    alone = predict(recipe, gpu_memory="24GiB")
    assert not alone.fits and alone.breakdown["weights"] > 24 * GIB
    path = tmp_path / "70b.yaml"
    path.write_text(recipe_to_yaml(recipe))
    assert main(["plan", str(path), "--gpus", "4", "--gpu-memory", "24GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["world_size"] == 4 and plan["peak_bytes"] <= plan["budget_bytes"]
    s = plan["settings"]
    assert s["strategy"] == "fsdp"  # FSDP-QLoRA: ddp would keep all 37 GiB of NF4 weights on each card
    assert s["micro_batch_size"] * s["gradient_accumulation_steps"] * 4 == 16  # the effective batch is kept


def test_auto_strategy_skips_what_would_be_refused_and_one_process_writes_none():
    galore = _recipe("qwen2.5-0.5b", 2, "auto", optimizer={"name": "galore"}, adapter={"type": "lora"})
    assert predict(galore, gpu_memory="24GiB").settings["strategy"] == "ddp"  # projected state: no shards
    single = _recipe("qwen2.5-0.5b", 1, "auto", adapter={"type": "lora"})
    assert "distributed.strategy" not in auto_keys(single)  # one process: nothing to distribute
    plan = predict(single, gpu_memory="24GiB")
    assert plan.apply(single).recipe.distributed.strategy == "auto" and plan.world_size == 1


def test_chunked_loss_is_refused_and_never_chosen_with_several_processes():
    """The chunked loss runs the decoder and LM head outside the DDP wrapper's forward, so the gradients would
    not be synchronised (a real 2-process run failed on it): refused when asked for, never chosen by auto."""
    with pytest.raises(ValueError, match=r"memory.chunked_loss: true with 2 processes"):
        _recipe("qwen2.5-0.5b", 2, "ddp", adapter={"type": "lora"}, memory={"chunked_loss": True})
    assert _recipe("qwen2.5-0.5b", 1, "ddp", memory={"chunked_loss": True}).memory.chunked_loss is True
    tight = {"adapter": {"type": "lora"}, "data": {"path": SAMPLE_DATA, "max_seq_len": 8192},
             "memory": {"chunked_loss": "auto", "gpu_memory_margin": 0}}
    assert predict(_recipe("qwen2.5-0.5b", 1, "ddp", **tight), gpu_memory="6GiB").settings["chunked_loss"] is True
    assert predict(_recipe("qwen2.5-0.5b", 2, "ddp", **tight), gpu_memory="6GiB").settings["chunked_loss"] is False


def test_layerwise_with_several_processes_is_refused_also_when_the_strategy_is_auto():
    """No strategy can run layer-wise updates with several processes: `auto` is refused at validation (the
    search used to find no combination at all and fail with an AttributeError)."""
    with pytest.raises(ValueError, match=r"optimizer.layerwise with distributed.strategy=auto with 2 processes"):
        _recipe("qwen2.5-0.5b", 2, "auto", adapter={"type": "lora"}, optimizer={"layerwise": True})


REFUSAL_CASES = {
    "everything auto, lora": {"adapter": {"type": "lora"}, "quantization": {"bits": "auto"},
                              "optimizer": {"name": "auto"},
                              "memory": {"offload": "auto", "tiled_mlp": "auto"}},
    "full, optimizer and offload auto": {"optimizer": {"name": "auto"}, "memory": {"offload": "auto"}},
    "int8 pinned": {"adapter": {"type": "lora"}, "quantization": {"bits": 8}, "optimizer": {"name": "auto"}},
    # optimizer.rank fits only the low-rank optimizers: validating (fsdp, adamw) refused it for the key, which
    # the strategy check alone would not; the search now offers `auto` only optimizers the keys fit
    "optimizer.rank with auto": {"adapter": {"type": "lora"}, "optimizer": {"name": "auto", "rank": 4},
                                 "quantization": {"bits": "auto"}},
    # a deepspeed-only key: auto offers deepspeed alone (ddp or fsdp would be refused for the key at apply)
    "zero_stage with auto": {"adapter": {"type": "lora"}, "quantization": {"bits": "auto"},
                             "distributed": {"zero_stage": 2}},
}


@pytest.mark.parametrize("sections", REFUSAL_CASES.values(), ids=REFUSAL_CASES)
def test_the_strategy_check_refuses_what_validating_the_whole_combination_refuses(sections, monkeypatch):
    """The search checks each sharded combination with the schema's strategy_problems on an unchecked copy
    instead of validating it as a recipe: the same combinations are refused, for the same reasons."""
    from types import SimpleNamespace

    from finetune.plan import search
    from finetune.recipe.schema import strategy_problems
    from finetune.recipe.settings import write_settings

    recipe = _recipe("qwen2.5-0.5b", 2, "auto", **sections)
    monkeypatch.setattr(search, "deepspeed_installed", lambda: True)
    verdicts = []

    def compared(recipe: Recipe, st: dict) -> bool:
        refused = real(recipe, st)
        values = {k: v for k, v in st.items() if v != "auto"}
        try:
            write_settings(recipe, values)
            full = ""
        except ValueError as exc:
            full = str(exc)
        assert refused == bool(full), (st, full)
        for problem in strategy_problems(write_settings(recipe, values, validate=False), st["strategy"]):
            assert problem in full
        verdicts.append((st["strategy"], refused))
        return refused

    real = search._refused
    monkeypatch.setattr(search, "_refused", compared)
    spec = SimpleNamespace(device="cuda", seq_len=2048, tiled_mlp_tokens=1024, num_layers=24)
    kept = search._choices(recipe, spec)
    assert len(kept) == sum(not refused for _, refused in verdicts)
    assert any(refused for _, refused in verdicts)
    ddp = [refused for strategy, refused in verdicts if strategy == "ddp"]
    assert not any(ddp)  # every ddp combination is accepted, where ddp is offered: not with a deepspeed key
    assert bool(ddp) != bool(recipe.distributed.deepspeed_keys())


def test_a_deepspeed_key_without_deepspeed_installed_is_a_clear_error_not_a_traceback(tmp_path, monkeypatch,
                                                                                        capsys):
    """strategy auto with zero_stage 2: only deepspeed reads the key; without deepspeed the planner used to
    pick ddp and applying the plan raised pydantic's ValidationError (a traceback in the CLI)."""
    from finetune.cli import main
    from finetune.plan import search
    from finetune.recipe.load import recipe_to_yaml

    monkeypatch.setattr(search, "deepspeed_installed", lambda: False)
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_to_yaml(_recipe("qwen2.5-0.5b", 2, "auto", adapter={"type": "lora"},
                                           distributed={"zero_stage": 2})))
    assert main(["plan", str(path), "--gpu-memory", "80GiB"]) != 0
    captured = capsys.readouterr()
    err = captured.out + captured.err
    assert "distributed.zero_stage: only strategy deepspeed reads it, and deepspeed is not installed" in err
    assert "pip install deepspeed" in err and "Traceback" not in err and "ValidationError" not in err
