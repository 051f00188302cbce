"""Weight streaming (memory.offload_weights): the frozen layer weights resident, in host RAM or in files give
the same losses and gradients bit for bit (QLoRA and LoRA, checkpointing on and off, a dense and a MoE model);
the device never holds more than the read-ahead window of layers; the planner prices it (a 70B QLoRA fits a
24 GiB card) and says what bounds the step; careless input is one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from finetune.cli import main
from finetune.memory.weight_store import frozen_storages, offload_weights
from finetune.model.adapter import apply_adapter
from finetune.model.family import decoder_layers
from finetune.model.load import load_model
from finetune.recipe.schema import AdapterConfig, ModelConfig, QuantizationConfig
from finetune.rundir import read_jsonl
from finetune.step.training_step import enable_checkpointing
from tests.run_support import three_step_recipe

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
RECIPE = Path(__file__).parents[1] / "recipes" / "qlora-8b-24gb.yaml"


def _model(path: Path, bits: int | None, checkpointing: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model, _, _ = load_model(ModelConfig(path=str(path)), QuantizationConfig(bits=bits))
    model = apply_adapter(model, AdapterConfig(r=8, dropout=0.0), checkpointing=checkpointing)
    enable_checkpointing(model, checkpointing, 1)
    for name, param in model.named_parameters():  # lora_B non-zero, so lora_A gets gradients too
        if "lora_B" in name:
            param.data.normal_(0, 0.02)
    return model.train()


def _steps(model: torch.nn.Module) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Two SGD steps: each step's loss and LoRA gradients (the second step runs on updated adapters)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trained, lr=0.5)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    out = []
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
        optimizer.step()
    return out


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("bits", [4, None])
def test_streamed_weights_train_bit_equal(tiny_model_dir, tmp_path, bits, checkpointing):
    """Resident, in host RAM and in files: the same losses and gradients, bit for bit, two layers (the one
    computing and the one read ahead) materialised at most, and no file left once the store is closed."""
    reference = _steps(_model(tiny_model_dir, bits, checkpointing))
    for tier in ("cpu", "disk"):
        model = _model(tiny_model_dir, bits, checkpointing)
        store = offload_weights(model, tier, 1, None, tmp_path / "weights")
        streamed = _steps(model)
        for (loss, grads), (ref_loss, ref_grads) in zip(streamed, reference, strict=True):
            assert loss == ref_loss, tier
            assert grads.keys() == ref_grads.keys()
            assert all(torch.equal(grads[k], ref_grads[k]) for k in grads), tier
        assert store.materialised_peak == 2
        store.close()
        assert not (tmp_path / "weights").exists()  # the files, and the folder the store made


def test_window_of_layers_on_the_device(tmp_path):
    """With two layers read ahead, no more than three layers' frozen weights have bytes when any layer runs
    (counted from the storages themselves, not the store's bookkeeping): forward reads ahead up the layers
    and turns back at the top; backward (each checkpointed layer's recompute) reads ahead down them."""
    from finetune.testing import make_tiny_model_dir

    model = _model(make_tiny_model_dir(tmp_path / "model", num_hidden_layers=4), 4, True)
    layers = decoder_layers(model)
    frozen = [[t for _, t in frozen_storages(layer)] for layer in layers]
    total = sum(t.untyped_storage().nbytes() for tensors in frozen for t in tensors)
    store = offload_weights(model, "cpu", 2, None)
    assert store.host_bytes == total
    seen: list[list[int]] = []
    for layer in layers:  # inside the layer's forward: runs in the checkpointed layers' recompute too
        layer.input_layernorm.register_forward_pre_hook(lambda m, a: seen.append(
            [p for p, tensors in enumerate(frozen) if any(t.untyped_storage().nbytes() for t in tensors)]))
    _steps(model)
    forward, recompute = [[0, 1, 2], [1, 2, 3], [1, 2, 3], [1, 2, 3]], [[1, 2, 3], [0, 1, 2], [0, 1, 2], [0, 1, 2]]
    assert seen[:8] == forward + recompute
    assert max(len(materialised) for materialised in seen) == 3 == store.materialised_peak


def test_moe_experts_stream_with_the_layers(tmp_path, capsys):
    """A MoE model's 4-bit experts stream with the rest of each layer through `finetune run`: the same losses
    and router aux losses as resident, and no file left in offload_dir."""
    losses = {}
    for tier in ("none", "cpu", "disk"):
        folder = tmp_path / tier
        path = three_step_recipe(folder, "qwen3_moe", {"quantization": {"bits": 4}},
                                 {"memory": {"offload_weights": tier, "activation_checkpointing": True,
                                             "offload_dir": str(folder / "weights")}}, num_hidden_layers=4)
        assert main(["run", str(path)]) == 0, capsys.readouterr().err
        losses[tier] = [(r["loss"], r["aux_loss"]) for r in read_jsonl(folder / "run" / "metrics.jsonl") if "loss" in r]
        assert not (folder / "weights").exists()
    assert len(losses["none"]) == 3 and losses["none"] == losses["cpu"] == losses["disk"]


def _refused(tmp_path: Path, capsys, argv: list[str], *words: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if line.startswith("error:")]) == 1 and "Traceback" not in "\n".join(err)
    assert any(all(w in line for w in words) for line in err), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("memory", "words"), [
    ({"offload_weights": "cpu", "offload_cpu_limit": "1KiB"}, ("memory.offload_weights", "host RAM", "1.00 KiB")),
    ({"offload_weights": "cpu", "offload_experts": "cpu"}, ("memory.offload_weights", "offload_experts: none")),
])
def test_careless_streaming_refused(tmp_path, capsys, memory, words):
    path = three_step_recipe(tmp_path, "llama", {"memory": memory})
    _refused(tmp_path, capsys, ["run", str(path)], *words)


def test_streaming_offload_dir_not_writable(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    path = three_step_recipe(tmp_path, "llama", {"memory": {"offload_weights": "disk",
                                                            "offload_dir": str(tmp_path / "file" / "weights")}})
    _refused(tmp_path, capsys, ["run", str(path)], "memory.offload_dir", "not writable")


def test_streaming_offload_dir_too_small(tmp_path, capsys, monkeypatch):
    """A disk without room for the weights: the run's own check says so (the plan is off here)."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 1 << 40, 4096))
    path = three_step_recipe(tmp_path, "llama", {"memory": {"offload_weights": "disk", "plan": False,
                                                            "offload_dir": str(tmp_path / "weights")}})
    _refused(tmp_path, capsys, ["run", str(path)], "memory.offload_dir", "4.00 KiB free", "of frozen weights")


def test_streaming_with_several_gpus_refused(tmp_path, capsys):
    path = three_step_recipe(tmp_path, "llama", {"memory": {"offload_weights": "disk"}, "distributed": {"gpus": 2}})
    _refused(tmp_path, capsys, ["validate", str(path)], "memory.offload_weights", "distributed.gpus")


def test_70b_qlora_planned_on_a_24gb_card(tmp_path):
    """Llama-3.1-70B QLoRA: its 4-bit weights alone (~37 GiB) exceed a 24 GiB card; the search streams them
    (every layer but the window of two off the device) and the plan says what bounds the step; without
    streaming nothing fits."""
    from finetune.plan import predict
    from finetune.recipe import load_recipe

    base = [f"model.path={CONFIGS / 'llama-3.1-70b.json'}", f"memory.offload_dir={tmp_path}",
            "memory.offload_weights_resident=0"]  # none kept (a slow disk here would keep some: a later test)
    on = predict(load_recipe(RECIPE, base), device="cuda")
    off = predict(load_recipe(RECIPE, [*base, "memory.offload_weights=none"]), device="cuda")
    assert on.fits and on.settings["offload_weights"] in ("cpu", "disk") and on.peak_bytes <= 24 * 2**30
    assert on.breakdown["weights"] < 6 * 2**30  # embeddings, LM head, two layers
    assert any("bound by" in note and "frozen weights" in note for note in on.notes)
    assert not off.fits and off.min_budget_bytes > 40 * 2**30


def test_link_time_against_compute():
    """The time model: each micro-batch streams every layer twice (forward; backward with the recompute), and
    only the link time above the compute costs: a slow link bounds the step, a fast one is hidden."""
    from finetune.plan.memory_model import streamed_weight_bytes
    from finetune.plan.search import model_spec
    from finetune.plan.trace import planned_config
    from finetune.plan.weight_stream import bound_note, link_seconds
    from finetune.recipe import load_recipe
    from finetune.recipe.settings import Settings

    recipe = load_recipe(RECIPE, [f"model.path={CONFIGS / 'llama-3.1-70b.json'}"])
    spec = model_spec(recipe, planned_config(recipe.model.path), "cuda")
    settings = Settings(micro_batch_size=1, gradient_accumulation_steps=1, activation_checkpointing=True,
                        checkpoint_every_n_layers=1, offload="none", chunked_loss=True, bits=4, optimizer="adamw",
                        offload_weights="cpu")
    streamed, per_layer = streamed_weight_bytes(spec, settings)
    assert streamed == pytest.approx(80 * per_layer) and 30 * 2**30 < streamed < 40 * 2**30  # 4-bit layers
    assert link_seconds(spec, settings, (1e9,)) == pytest.approx(2 * streamed / 1e9)
    tokens = spec.seq_len  # one micro-batch of one sequence
    slow = bound_note(spec, settings, 10.0, tokens / (link_seconds(spec, settings, (1e9,)) / 2), (1e9,))
    fast = bound_note(spec, settings, 10.0, tokens / (link_seconds(spec, settings, (1e9,)) * 2), (1e9,))
    assert "bound by the link" in slow and "bound by the compute" in fast


def test_planned_weights_match_what_the_store_moves(tmp_path):
    """On a CPU run the disk tier frees the layers' frozen weights but for the window of two: the plan's
    weights with streaming are its resident weights less what the store really moves, less two layers'."""
    from finetune.plan import predict
    from finetune.recipe import load_recipe

    path = three_step_recipe(tmp_path, "llama", {"memory": {"offload_dir": str(tmp_path / "weights")}},
                             num_hidden_layers=4)
    recipe = load_recipe(path)
    planned = {tier: predict(load_recipe(path, [f"memory.offload_weights={tier}", "memory.offload_weights_ahead=1",
                                                "memory.offload_weights_resident=0"]), device="cpu").breakdown["weights"]
               for tier in ("none", "disk")}
    torch.manual_seed(0)
    model, _, _ = load_model(recipe.model, recipe.quantization)
    model = apply_adapter(model, recipe.adapter, checkpointing=True)
    store = offload_weights(model, "disk", recipe.memory.offload_weights_ahead, None, tmp_path / "weights")
    moved = store.host_bytes - 2 * max(sum(sizes) for sizes in store.sizes)
    store.close()
    assert planned["none"] - planned["disk"] == pytest.approx(moved, rel=0.05)


def test_read_ahead_depth_is_searched_and_priced(tmp_path):
    """memory.offload_weights_ahead: auto. The disk tier on a GPU carries each layer over the SSD, then PCIe:
    with one layer ahead the two add up, with two the SSD reads one layer while the last crosses PCIe, so where
    the link bounds the step the planner reads two ahead and its window holds one layer more. Over one link
    (the cpu tier) a deeper read-ahead buys no time, so the search keeps one."""
    from finetune.plan import predict
    from finetune.plan.memory_model import streamed_weight_bytes
    from finetune.plan.search import model_spec
    from finetune.plan.trace import planned_config
    from finetune.plan.weight_stream import link_seconds
    from finetune.recipe import load_recipe
    from finetune.recipe.settings import Settings
    from finetune.testing import stated_machine

    base = [f"model.path={CONFIGS / 'llama-3.1-70b.json'}", f"memory.offload_dir={tmp_path}"]
    recipe = load_recipe(RECIPE, base)
    spec = model_spec(recipe, planned_config(recipe.model.path), "cuda")
    one = Settings(micro_batch_size=1, gradient_accumulation_steps=1, activation_checkpointing=True,
                   checkpoint_every_n_layers=1, offload="none", chunked_loss=True, bits=4, optimizer="adamw",
                   offload_weights="disk", offload_weights_ahead=1)
    two = Settings(**{**one.__dict__, "offload_weights_ahead": 2})
    streamed, per_layer = streamed_weight_bytes(spec, one)
    assert link_seconds(spec, one, (3e9, 20e9)) == pytest.approx(2 * streamed * (1 / 3e9 + 1 / 20e9))
    assert link_seconds(spec, two, (3e9, 20e9)) == pytest.approx(2 * streamed / 3e9)

    with stated_machine(host_ram=16 * 10**9, disk_free=400 * 10**9, disk_bytes_per_s=1e9):  # RAM too small: disk
        fixed_batch = [*base, "training.micro_batch_size=2", "memory.offload_weights_resident=0"]
        auto = predict(load_recipe(RECIPE, fixed_batch), device="cuda")
        fixed = predict(load_recipe(RECIPE, [*fixed_batch, "memory.offload_weights_ahead=1"]), device="cuda")
    assert auto.fits and auto.settings["offload_weights"] == "disk" and auto.settings["offload_weights_ahead"] == 2
    assert fixed.settings["offload_weights"] == "disk" and fixed.settings["offload_weights_ahead"] == 1
    assert auto.tokens_per_s > fixed.tokens_per_s
    assert auto.breakdown["weights"] - fixed.breakdown["weights"] == pytest.approx(per_layer, rel=0.01)
    assert any("2 layers read ahead" in note and "overlapped" in note for note in auto.notes)
    with stated_machine(host_ram=128 * 10**9):
        in_ram = predict(load_recipe(RECIPE, base), device="cuda")
    assert in_ram.settings["offload_weights"] == "cpu" and in_ram.settings["offload_weights_ahead"] == 1


def test_streaming_from_a_slow_disk_refused(tmp_path, capsys):
    """memory.offload_weights: disk on a disk measured below 100 MB/s: `finetune plan` and `finetune run` refuse
    it in one line naming memory.offload_dir and the measured speed, nothing written; `auto` never streams from
    it (its disk candidates rejected as slow), where the same disk at 3 GB/s streams."""
    from finetune.plan import predict
    from finetune.recipe import load_recipe
    from finetune.testing import stated_machine

    path = three_step_recipe(tmp_path, "llama", {"memory": {"offload_weights": "disk",
                                                            "offload_dir": str(tmp_path / "weights")}})
    with stated_machine(disk_bytes_per_s=40e6):
        for command in ("plan", "run"):
            _refused(tmp_path, capsys, [command, str(path)], "memory.offload_dir", "40 MB/s", "below the 100 MB/s")
        assert not (tmp_path / "weights").exists()
    base = [f"model.path={CONFIGS / 'llama-3.1-70b.json'}", f"memory.offload_dir={tmp_path}"]
    plans = {}
    for speed in (40e6, 3e9):
        with stated_machine(host_ram=16 * 10**9, disk_free=400 * 10**9, disk_bytes_per_s=speed):  # RAM too small
            plans[speed] = predict(load_recipe(RECIPE, base), device="cuda")
    assert plans[3e9].fits and plans[3e9].settings["offload_weights"] == "disk"
    assert not plans[40e6].fits
    assert any(c.kind == "slow_disk" and "40 MB/s" in c.reason for c in plans[40e6].rejected)


def test_planned_weights_match_what_the_store_leaves_on_the_device(tmp_path):
    """QLoRA streamed from disk on a CPU run: the plan's weights are what stays on the device (the frozen weights
    outside the layers, every 4-bit weight's quant state codes, which the store leaves there) plus the window of
    two layers' streamed bytes, within 1%; the codes are a third of this tiny model's 4-bit weights, so a plan
    without them would be off by far more."""
    from finetune.plan import predict
    from finetune.recipe import load_recipe

    path = three_step_recipe(tmp_path, "llama", {"quantization": {"bits": 4},
                                                 "memory": {"offload_dir": str(tmp_path / "weights")}},
                             num_hidden_layers=4)
    recipe = load_recipe(path)
    planned = predict(load_recipe(path, ["memory.offload_weights=disk", "memory.offload_weights_ahead=1",
                                         "memory.offload_weights_resident=0"]), device="cpu").breakdown["weights"]
    torch.manual_seed(0)
    model, _, _ = load_model(recipe.model, recipe.quantization)
    model = apply_adapter(model, recipe.adapter, checkpointing=True)
    store = offload_weights(model, "disk", 1, None, tmp_path / "weights")
    left, codes = {}, {}
    for param in model.parameters():
        if param.requires_grad:
            continue
        left[param.untyped_storage().data_ptr()] = param.untyped_storage().nbytes()
        state = getattr(param, "quant_state", None)
        while state is not None:
            for t in (state.code, state.offset, state.absmax):
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                    left[t.untyped_storage().data_ptr()] = codes[t.untyped_storage().data_ptr()] = \
                        t.untyped_storage().nbytes()
            state = state.state2
    window = 2 * max(sum(sizes) for sizes in store.sizes)
    store.close()
    on_device = sum(left.values()) + window
    assert planned == pytest.approx(on_device, rel=0.01)
    assert abs(planned - (on_device - sum(codes.values()))) > 0.05 * on_device


def test_resident_layers_stay_and_train_bit_equal(tmp_path):
    """memory.offload_weights_resident 2 of 4 layers: the first two layers' frozen weights never leave the device
    (their bytes there throughout), the other two stream with one read ahead, and the losses and gradients are
    the resident run's, bit for bit."""
    from finetune.testing import make_tiny_model_dir

    folder = make_tiny_model_dir(tmp_path / "model", num_hidden_layers=4)
    reference = _steps(_model(folder, 4, True))
    model = _model(folder, 4, True)
    layers = decoder_layers(model)
    frozen = [[t for _, t in frozen_storages(layer)] for layer in layers]
    streamed_bytes = sum(t.untyped_storage().nbytes() for tensors in frozen[2:] for t in tensors)
    store = offload_weights(model, "disk", 1, None, tmp_path / "weights", resident=2)
    assert store.host_bytes == streamed_bytes > 0
    seen: list[list[int]] = []
    for layer in layers:
        layer.input_layernorm.register_forward_pre_hook(lambda m, a: seen.append(
            [p for p, tensors in enumerate(frozen) if all(t.untyped_storage().nbytes() for t in tensors)]))
    streamed = _steps(model)
    store.close()
    for (loss, grads), (ref_loss, ref_grads) in zip(streamed, reference, strict=True):
        assert loss == ref_loss and all(torch.equal(grads[k], ref_grads[k]) for k in grads)
    assert all(p in materialised for materialised in seen for p in (0, 1))
    assert max(len(materialised) for materialised in seen) == 4 and store.materialised_peak == 2


def test_resident_layers_planned_where_the_link_bounds_the_step(tmp_path):
    """memory.offload_weights_resident: auto keeps as many first layers on the device as the budget has room
    for where the link bounds the step (each carries no bytes over it: faster), each priced as one layer's
    weights; where the link is hidden it keeps none."""
    from finetune.plan import predict
    from finetune.plan.memory_model import streamed_weight_bytes
    from finetune.plan.search import model_spec
    from finetune.plan.trace import planned_config
    from finetune.recipe import load_recipe
    from finetune.recipe.settings import Settings
    from finetune.testing import stated_machine

    base = [f"model.path={CONFIGS / 'llama-3.1-70b.json'}", f"memory.offload_dir={tmp_path}",
            "training.micro_batch_size=2", "memory.offload_weights_ahead=2"]
    with stated_machine(host_ram=16 * 10**9, disk_free=400 * 10**9, disk_bytes_per_s=1e9):  # disk, link-bound
        auto = predict(load_recipe(RECIPE, base), device="cuda")
        none = predict(load_recipe(RECIPE, [*base, "memory.offload_weights_resident=0"]), device="cuda")
    kept = auto.settings["offload_weights_resident"]
    assert auto.fits and auto.settings["offload_weights"] == "disk" and kept > 0
    assert none.settings["offload_weights_resident"] == 0 and auto.tokens_per_s > none.tokens_per_s
    assert none.peak_bytes < auto.peak_bytes <= auto.budget_bytes
    recipe = load_recipe(RECIPE, base)
    per_layer = streamed_weight_bytes(model_spec(recipe, planned_config(recipe.model.path), "cuda"),
                                      Settings(**{**none.settings, "offload_weights_resident": 0}))[1]
    assert auto.breakdown["weights"] - none.breakdown["weights"] == pytest.approx(kept * per_layer, rel=0.01)
    with stated_machine(host_ram=128 * 10**9):  # the cpu tier: the link hidden
        hidden = predict(load_recipe(RECIPE, base[:2]), device="cuda")
    assert hidden.settings["offload_weights"] == "cpu" and hidden.settings["offload_weights_resident"] == 0


def test_resident_layers_are_filled_only_for_a_plan_that_streams_weights(tmp_path, monkeypatch):
    """memory.offload_weights_resident auto: resident layers are looked for only where the chosen plan streams
    its weights. A plan that does not (offload_weights auto choosing none, or none) is not searched and is the
    plan with none kept; a plan streaming from a link-bound disk still keeps layers, faster than with none."""
    from finetune.plan import predict, search
    from finetune.recipe import load_recipe
    from finetune.testing import stated_machine

    filled = []
    fill = search._fill_resident
    monkeypatch.setattr(search, "_fill_resident", lambda spec, shapes, chosen, *rest: (
        filled.append(chosen.settings["offload_weights"]) or fill(spec, shapes, chosen, *rest)))
    base = [f"model.path={CONFIGS / 'llama-3.2-1b.json'}", f"memory.offload_dir={tmp_path}",
            "training.micro_batch_size=2"]
    disk = [*base, "memory.offload_weights=disk", "memory.offload_weights_ahead=2"]
    with stated_machine(host_ram=16 * 10**9, disk_free=400 * 10**9, disk_bytes_per_s=1e9):
        plans = {name: predict(load_recipe(RECIPE, overrides), device="cuda") for name, overrides in (
            ("auto", base), ("auto, none kept", [*base, "memory.offload_weights_resident=0"]),
            ("none", [*base, "memory.offload_weights=none"]), ("disk", disk),
            ("disk, none kept", [*disk, "memory.offload_weights_resident=0"]))}
    assert filled == ["disk"]  # the streaming plan's only; "disk, none kept" fixes the layers kept
    auto, fixed = plans["auto"], plans["auto, none kept"]
    assert auto.settings["offload_weights"] == "none" and auto.settings["offload_weights_resident"] == 0
    assert (auto.settings, auto.peak_bytes, auto.tokens_per_s) == (fixed.settings, fixed.peak_bytes,
                                                                   fixed.tokens_per_s)
    assert plans["none"].settings["offload_weights"] == "none"
    streaming, none_kept = plans["disk"], plans["disk, none kept"]
    assert streaming.fits and streaming.settings["offload_weights_resident"] > 0
    assert streaming.tokens_per_s > none_kept.tokens_per_s and streaming.peak_bytes <= streaming.budget_bytes
