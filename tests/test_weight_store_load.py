"""Loading streams (memory.offload_weights cpu/disk): each decoder layer's weights go into the weight store as
transformers sets them, so the whole model is never on the device. The model loaded so trains with the same
losses and gradients, bit for bit, as one loaded whole and streamed afterwards (and as resident); the tensor
tracker's peak during the load stays within the plan's window; `finetune run` loads this way."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from finetune.cli import main
from finetune.memory.tracker import MemoryTracker
from finetune.memory.weight_store import frozen_storages, offload_weights, stream_on_arrival, weight_store_of
from finetune.model.adapter import apply_adapter
from finetune.model.family import decoder_layers
from finetune.model.load import load_model
from finetune.recipe.schema import AdapterConfig, ModelConfig, QuantizationConfig
from finetune.rundir import read_jsonl
from finetune.step.training_step import enable_checkpointing
from tests.run_support import assert_same_steps, three_step_recipe
from tests.test_weight_store import _steps


def _load(path: Path, bits: int | None, tier: str | None, folder: Path | None = None) -> torch.nn.Module:
    """The tiny model loaded whole (`tier` None) or streamed into the store as it loads."""
    arriving = stream_on_arrival(tier, 1, None, folder, (0, 0)) if tier else None
    model, _, _ = load_model(ModelConfig(path=str(path)), QuantizationConfig(bits=bits), arriving=arriving)
    return model


def _trained(model: torch.nn.Module, tier: str | None, folder: Path | None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = apply_adapter(model, AdapterConfig(r=8, dropout=0.0), checkpointing=True)
    enable_checkpointing(model, True, 1)
    for name, param in model.named_parameters():  # lora_B non-zero, so lora_A gets gradients too
        if "lora_B" in name:
            param.data.normal_(0, 0.02)
    if tier is not None:
        offload_weights(model, tier, 1, None, folder)
    return model.train()


@pytest.mark.parametrize("bits", [4, None])
def test_streamed_load_trains_bit_equal(tiny_model_dir, tmp_path, bits):
    """Loaded into host RAM or into files layer by layer: no decoder layer's weight has bytes once loaded, and
    two steps give the losses and LoRA gradients of the model loaded whole (resident, and streamed after a whole
    load), bit for bit; the files go when the store closes."""
    reference = _steps(_trained(_load(tiny_model_dir, bits, None), None, None))
    for tier in ("cpu", "disk"):
        folder = tmp_path / tier
        model = _load(tiny_model_dir, bits, tier, folder)
        layers = decoder_layers(model)
        assert all(t.untyped_storage().nbytes() == 0 for layer in layers for _, t in frozen_storages(layer))
        whole = _steps(_trained(_load(tiny_model_dir, bits, None), tier, tmp_path / f"{tier}-whole"))
        streamed = _steps(_trained(model, tier, folder))
        for (loss, grads), (ref_loss, ref_grads), (whole_loss, _) in zip(streamed, reference, whole, strict=True):
            assert loss == ref_loss == whole_loss, tier
            assert grads.keys() == ref_grads.keys()
            assert all(torch.equal(grads[k], ref_grads[k]) for k in grads), tier
        store = weight_store_of(model)
        assert store.materialised_peak == 2
        store.close()
        assert not folder.exists()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_5_vl"])
def test_streamed_load_of_moe_and_vision_models_trains_bit_equal(tmp_path, arch):
    """QLoRA on a MoE model (its 4-bit experts taken as they are stored) and a vision-language model (its vision
    tower's layers stay, the language model's stream), loaded into files layer by layer: the losses and LoRA
    gradients of the model loaded whole, bit for bit."""
    from finetune.testing import make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path / "model", arch)
    reference = _steps(_trained(_load(path, 4, None), None, None))
    model = _load(path, 4, "disk", tmp_path / "weights")
    streamed = _steps(_trained(model, "disk", tmp_path / "weights"))
    for (loss, grads), (ref_loss, ref_grads) in zip(streamed, reference, strict=True):
        assert loss == ref_loss
        assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[k], ref_grads[k]) for k in grads)
    store = weight_store_of(model)
    assert store.host_bytes > 0 and all(len(names) for names in store.names)
    store.close()


def test_streamed_load_peak_within_the_window(tmp_path):
    """QLoRA, disk tier, 8 layers: the tensor tracker's peak while the model loads is at most the plan's weights
    with streaming (what stays, two layers' 4-bit weights), the quant states' codes and the one weight arriving
    in full precision to be quantized; the model loaded whole peaks above that. (4-bit: the tracker sees the quantizing operators; a
    16-bit CPU load hands over safetensors' tensors without an operator it could see.)"""
    from finetune.plan import predict
    from finetune.recipe import load_recipe

    path = three_step_recipe(tmp_path, "llama", {"quantization": {"bits": 4}},
                             {"memory": {"offload_dir": str(tmp_path / "weights"), "offload_weights": "disk"}},
                             num_hidden_layers=8)
    recipe = load_recipe(path)
    planned = predict(recipe, device="cpu").breakdown["weights"]
    peaks = {}
    for tier in (None, "disk"):
        tracker = MemoryTracker()
        with tracker:
            model = _load(Path(recipe.model.path), 4, tier, tmp_path / "weights")
        peaks[tier] = tracker.peak
        if tier is not None:
            weight_store_of(model).close()
    layers = decoder_layers(model)
    arriving = max(p.numel() * 4 for p in layers[0].parameters())  # the largest weight, fp32 before quantizing
    assert peaks["disk"] <= planned + _codes(layers) + arriving < peaks[None]


def _codes(layers: list[torch.nn.Module]) -> int:
    """Bytes of the quant states' codes and offsets, which stay on the device (a kilobyte a 4-bit weight, which
    the plan leaves out): bitsandbytes reads them when the state dict is taken, outside any layer's forward."""
    found = {}
    for layer in layers:
        for param in layer.parameters():
            state = getattr(param, "quant_state", None)
            while state is not None:
                for t in (state.code, state.offset):
                    if isinstance(t, torch.Tensor):
                        found[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                state = state.state2
    return sum(found.values())


def test_run_loads_layer_by_layer(tmp_path, capsys):
    """`finetune run` with offload_weights disk loads through the store (its line says so) and trains the same
    losses as resident, its measured peak lower and within 5% of the plan's (as resident's is), no file left
    behind."""
    losses, peaks = {}, {}
    for tier in ("none", "disk"):
        folder = tmp_path / tier
        path = three_step_recipe(folder, "llama", {"quantization": {"bits": 4}},
                                 {"memory": {"offload_weights": tier, "offload_dir": str(folder / "weights")}},
                                 num_hidden_layers=4)
        assert main(["run", str(path)]) == 0, capsys.readouterr().err
        out = capsys.readouterr().err  # the console says what the run does on stderr
        assert ("memory.offload_weights: disk: loaded layer by layer" in out) == (tier == "disk")
        rows = [r for r in read_jsonl(folder / "run" / "metrics.jsonl") if "loss" in r]
        losses[tier] = [r["loss"] for r in rows]
        measured = max(r["peak_memory_bytes"] for r in rows)
        planned = json.loads((folder / "run" / "plan.json").read_text())["peak_bytes"]
        assert abs(planned - measured) <= 0.05 * measured, (tier, planned, measured)
        peaks[tier] = measured
        assert not (folder / "weights").exists()
    assert len(losses["none"]) == 3 and losses["none"] == losses["disk"]
    assert peaks["disk"] < peaks["none"]


def test_disk_filling_up_during_the_load_is_one_line(tmp_path, capsys, monkeypatch):
    """The disk fills up while the weights are written as they load: exit 2, one line naming offload_dir's
    folder, no weight file and no run folder left."""
    import errno

    from finetune.memory import weight_store
    from tests.test_weight_store import _refused

    written = []

    def full(path: Path, data: torch.Tensor) -> None:
        if len(written) == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(path)
        path.write_bytes(data.numpy().tobytes())

    monkeypatch.setattr(weight_store, "write_tensor_file", full)
    path = three_step_recipe(tmp_path, "llama", {"memory": {"offload_weights": "disk",
                                                            "offload_dir": str(tmp_path / "weights")}})
    _refused(tmp_path, capsys, ["run", str(path)], "memory.offload_weights", "writing the frozen weights", "No space left")
    assert len(written) == 5 and not (tmp_path / "weights").exists()


@pytest.mark.parametrize("command", ["validate", "plan", "run"])
def test_streaming_with_several_gpus_refused_by_every_command(tmp_path, capsys, command):
    from tests.test_weight_store import _refused

    path = three_step_recipe(tmp_path, "llama", {"memory": {"offload_weights": "cpu"}, "distributed": {"gpus": 2}})
    _refused(tmp_path, capsys, [command, str(path)], "memory.offload_weights", "distributed.gpus")


def test_a_streamed_run_resumes_exactly(tmp_path, capsys):
    """Weights streamed from disk: 2 steps, a checkpoint, --resume to 4 (constant schedule), the same losses
    as 4 straight steps with the weights resident; the resumed run loads layer by layer again."""
    import yaml

    def recipe(name: str, tier: str, steps: int) -> Path:
        folder = tmp_path / name
        return three_step_recipe(folder, "llama", {"quantization": {"bits": 4}},
                                 {"training": {"max_steps": steps, "lr_scheduler": "constant"},
                                  "output": {"save_steps": 2},
                                  "memory": {"offload_weights": tier, "offload_dir": str(folder / "weights")}},
                                 num_hidden_layers=4)

    straight = recipe("straight", "none", 4)
    assert main(["run", str(straight)]) == 0, capsys.readouterr().err
    streamed = recipe("streamed", "disk", 2)
    assert main(["run", str(streamed)]) == 0, capsys.readouterr().err
    data = yaml.safe_load(streamed.read_text())
    data["training"]["max_steps"] = 4
    streamed.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    assert main(["run", str(streamed), "--resume"]) == 0, capsys.readouterr().err
    assert "memory.offload_weights: disk: loaded layer by layer" in capsys.readouterr().err
    assert_same_steps(tmp_path / "streamed" / "run", tmp_path / "straight" / "run", ("loss",), [1, 2, 3, 4])
    assert not (tmp_path / "streamed" / "weights").exists()


LOADED = "memory.offload_weights: disk: loaded layer by layer"


@pytest.fixture(scope="module")
def streamed_runs(tmp_path_factory) -> dict[str, Path]:
    """{"disk": a tiny 4-bit run that streamed its frozen weights from disk (its offload folder `weights` beside
    it), "none": a copy of it whose recipe loads the base whole}; both folders are named run (the labels of
    compare_runs)."""
    import shutil

    import yaml

    from finetune.rundir import RunDir

    folder = tmp_path_factory.mktemp("streamed")
    path = three_step_recipe(folder, "llama", {"quantization": {"bits": 4}},
                             {"memory": {"offload_weights": "disk", "offload_dir": str(folder / "weights")}},
                             num_hidden_layers=4)
    assert main(["run", str(path)]) == 0
    whole = folder / "whole" / "run"
    shutil.copytree(folder / "run", whole)
    recipe = yaml.safe_load(RunDir(whole).recipe.read_text())
    recipe["memory"]["offload_weights"] = "none"
    RunDir(whole).recipe.write_text(yaml.safe_dump(recipe))
    return {"disk": folder / "run", "none": whole}


def test_generate_and_eval_load_the_base_as_the_run_streamed_it(streamed_runs, capsys):
    """A run that streamed its weights from disk is asked (`finetune generate`) and evaluated (`finetune eval`)
    with its base loaded layer by layer into the store, so a model that trained only streamed can be used on the
    same card: the same tokens and held-out loss as the base loaded whole, no weight file left behind."""
    from finetune import api

    weights = streamed_runs["disk"].parent / "weights"
    capsys.readouterr()
    answers, losses = {}, {}
    for tier, run in streamed_runs.items():
        answers[tier] = api.generate(run, "Tell me about the sea", max_new_tokens=12)
        losses[tier] = api.evaluate(run, streamed_runs["disk"].parent / "data.jsonl")["models"][0]["loss"]
        out = capsys.readouterr()
        assert (out.err + out.out).count(LOADED) == (2 if tier == "disk" else 0)
        assert not weights.exists()
    assert answers["disk"] == answers["none"] and answers["none"]
    assert losses["disk"] == losses["none"]


def test_generate_compare_loads_the_base_as_the_run_streamed_it(streamed_runs, capsys):
    """`finetune generate --compare` (base and fine-tuned answers) and `--compare RUN` (the runs' answers side
    by side) on a run that streamed its weights from disk load its base once, layer by layer into the store:
    the same texts as with the base loaded whole, the load line printed, no weight file left behind."""
    weights = streamed_runs["disk"].parent / "weights"
    capsys.readouterr()
    shown = {}
    for tier, run in streamed_runs.items():
        for others in ([], [str(run)]):
            command = ["generate", str(run), "--prompt", "Tell me about the sea", "--max-new-tokens", "12", "--compare", *others]
            assert main(command) == 0, capsys.readouterr().err
            out = capsys.readouterr()
            assert out.err.count(LOADED) == (1 if tier == "disk" else 0), out.err
            assert LOADED not in out.out, "the answers alone are the command's output"
            assert not weights.exists()
            shown[tier, bool(others)] = out.out
    assert "base model: " in shown["none", False] and "fine-tuned: " in shown["none", False]
    assert "base model" in shown["none", True] and " run " in shown["none", True]
    assert shown["disk", False] == shown["none", False]
    assert shown["disk", True] == shown["none", True]


def test_chat_loads_a_streamed_run_as_it_streamed_and_its_files_go_with_the_models(streamed_runs, capsys):
    """The chat worker's models (finetune.api.chat_models, what the UI's chat page talks to) load a run that
    streamed from disk layer by layer, fine-tuned and base sharing one load: the same replies as its base loaded
    whole; the store's files stay while the models are kept and go when they are released (`close`, and the
    worker loop's end)."""
    import io
    import json

    from finetune import api
    from finetune.model.chat import serve, stream_reply

    weights = streamed_runs["disk"].parent / "weights"
    turn = [{"role": "user", "content": "Tell me about the sea"}]
    capsys.readouterr()
    replies = {}
    for tier, run in streamed_runs.items():
        models = api.chat_models()
        for adapter in (True, False, True):
            with models.use(run, adapter) as (model, tokenizer):
                reply = stream_reply(model, tokenizer, turn, max_new_tokens=12)
            assert replies.setdefault((tier, adapter), reply) == reply
        assert capsys.readouterr().err.count(LOADED) == (1 if tier == "disk" else 0)
        assert models.loads == 1
        assert (weights.is_dir() and any(weights.iterdir())) == (tier == "disk"), "the store's files while kept"
        models.close()
        assert not weights.exists()
    assert replies["disk", True] == replies["none", True] and replies["disk", False] == replies["none", False]

    out = io.StringIO()
    request = {"op": "chat", "id": 1, "run": str(streamed_runs["disk"]), "messages": turn, "max_new_tokens": 12}
    serve(io.StringIO(json.dumps(request) + "\n"), out, api.chat_models())
    done = [e for e in map(json.loads, out.getvalue().splitlines()) if e["event"] == "done"]
    assert [e["text"] for e in done] == [replies["disk", True]]
    assert LOADED in capsys.readouterr().err and not weights.exists()


def test_the_chat_worker_stopped_by_sigterm_removes_the_store_files(streamed_runs):
    """The UI's chat worker process (`python -m ui.chat_serve`) holding a streamed run's base: SIGTERM (what the
    UI sends a worker that does not end in time) still closes the store, its files removed, before it exits."""
    import os
    import signal
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    weights = streamed_runs["disk"].parent / "weights"
    worker = subprocess.Popen([sys.executable, "-m", "ui.chat_serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=root,
                              env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    try:
        worker.stdin.write(json.dumps({"op": "chat", "id": 1, "run": str(streamed_runs["disk"]), "max_new_tokens": 4,
                                       "messages": [{"role": "user", "content": "Hello"}]}) + "\n")
        worker.stdin.flush()
        while (event := json.loads(worker.stdout.readline()))["event"] not in ("done", "error"):
            pass
        assert event["event"] == "done", event
        assert any(weights.iterdir()), "the store's files while the worker keeps the model"
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 143
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert not weights.exists(), worker.stderr.read()


def test_the_chat_worker_lets_go_of_a_streamed_run_for_another_and_a_killed_ones_files_go_later(streamed_runs,
                                                                                              capsys, tmp_path):
    """The chat worker process (`python -m ui.chat_serve`) asked about a run that streams from disk, then about
    a run on another base: the first run's model is let go, its store's files removed while the worker lives;
    shown side by side, both stay. A worker killed outright (kill -9) leaves the files: the next load of that
    run removes them first, in one line."""
    import os
    import shutil
    import signal
    import subprocess
    import sys

    import yaml

    from finetune import api
    from finetune.model.chat import serve
    from finetune.rundir import RunDir

    other = tmp_path / "run"  # the run on a 16-bit base: another base model
    shutil.copytree(streamed_runs["none"], other)
    recipe = yaml.safe_load(RunDir(other).recipe.read_text())
    recipe["quantization"]["bits"] = None
    RunDir(other).recipe.write_text(yaml.safe_dump(recipe))
    streamed, weights = streamed_runs["disk"], streamed_runs["disk"].parent / "weights"
    root = Path(__file__).resolve().parents[1]
    worker = subprocess.Popen([sys.executable, "-m", "ui.chat_serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=root,
                              env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})

    def chat(rid: int, run: Path, keep: list[Path] | None = None) -> dict:
        request = {"op": "chat", "id": rid, "run": str(run), "max_new_tokens": 4,
                   "messages": [{"role": "user", "content": "Hello"}]}
        worker.stdin.write(json.dumps({**request, "keep": [{"run": str(r)} for r in keep]} if keep else request) + "\n")
        worker.stdin.flush()
        while (event := json.loads(worker.stdout.readline()))["event"] not in ("done", "error"):
            pass
        assert event["event"] == "done", event
        return event

    try:
        assert chat(1, streamed)["loads"] == 1 and any(weights.iterdir()), "the store's files while it is kept"
        assert chat(2, other)["loads"] == 2
        assert not weights.exists(), "the streamed run's model let go for the other run's: its files removed"
        assert chat(3, streamed, [streamed, other])["loads"] == 3 and any(weights.iterdir())
        assert chat(4, other, [streamed, other])["loads"] == 3 and any(weights.iterdir()), "both shown: both kept"
        left = sorted(p.name for p in weights.iterdir())
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert sorted(p.name for p in weights.iterdir()) == left, "a kill leaves the files"
    capsys.readouterr()
    out = io.StringIO()
    serve(io.StringIO(json.dumps({"op": "chat", "id": 1, "run": str(streamed), "max_new_tokens": 4,
                                  "messages": [{"role": "user", "content": "Hello"}]}) + "\n"), out, api.chat_models())
    assert [json.loads(line)["event"] for line in out.getvalue().splitlines()][-1] == "done"
    err = capsys.readouterr().err
    assert f"offload: removed {len(left)} files" in err and f"left in {weights} by a run" in err, err
    assert f"(pid {worker.pid})" in err and not weights.exists()
