"""adapter.init_from: SFT -> DPO. The trained adapter starts as the SFT adapter, the DPO reference is the SFT
model (a frozen second adapter), a bad start adapter is refused naming the key, resume is exact, the plan
counts the extra adapter and `finetune generate --compare` shows base, SFT and DPO."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from finetune.errors import FinetuneError
from finetune.recipe.init_from import resolve_init_from
from finetune.rundir import RunDir, read_jsonl
from finetune.step.preference import PreferenceLoss, preference_loss, reference_logps, sequence_logps
from finetune.train.run import run
from tests.run_support import assert_same_steps
from tests.test_preference_train import COLOURS, _recipe


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_model_dir):
    """A short SFT run (r=4, alpha=8, q/v only: not the recipe defaults, so the shape must come from it)."""
    tmp = tmp_path_factory.mktemp("sft")
    data = tmp / "sft.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Say {c}."},
                                                       {"role": "assistant", "content": f"{c} {c}."}]})
                              for c in COLOURS) + "\n")
    recipe = _recipe(tmp, tiny_model_dir, "sft", training={"method": "sft", "max_steps": 4, "learning_rate": 5e-2},
                     adapter={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                     data={"path": str(data), "validation_split": 0.0})
    return run(recipe).run_dir


def _dpo(tmp_path, model_dir, sft_dir, name="dpo", **sections):
    recipe = _recipe(tmp_path, model_dir, name, **sections)
    adapter = {k: v for k, v in recipe.adapter.model_dump().items() if k in recipe.adapter.model_fields_set}
    adapter.pop("r"), adapter.pop("alpha")  # the adapter section as a user writes it: shape from init_from
    data = recipe.model_dump()
    data["adapter"] = {**adapter, "init_from": str(sft_dir)}
    return type(recipe).model_validate(data)


def _batch():
    ids = torch.randint(4, 400, (4, 20), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :6] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("bits, reference", [pytest.param(None, True, id="dpo"), pytest.param(4, True, id="qlora-dpo"),
                                             pytest.param(None, False, id="sft-continued")])
def test_start_adapter_weights_and_reference_are_the_sft_model(tmp_path, tiny_model_dir, sft_run, bits, reference):
    """Before any step the trained adapter and the reference equal base + SFT adapter loaded by peft (on the
    same, possibly 4-bit, base); a DPO step changes the trained adapter only, and the reference stays frozen."""
    from peft import PeftModel

    from finetune.model.adapter import REFERENCE_ADAPTER, apply_adapter
    from finetune.model.load import load_model
    from finetune.recipe.schema import ModelConfig, QuantizationConfig

    def base():
        return load_model(ModelConfig(path=str(tiny_model_dir)), QuantizationConfig(bits=bits))[0]

    recipe = resolve_init_from(_dpo(tmp_path, tiny_model_dir, sft_run, adapter={"dropout": 0.1}))
    assert (recipe.adapter.r, recipe.adapter.alpha, recipe.adapter.target_modules) == (4, 8, ["q_proj", "v_proj"])
    assert recipe.adapter.dropout == 0.1  # a training knob: the recipe's
    model = apply_adapter(base(), recipe.adapter, checkpointing=False, reference=reference)
    sft = PeftModel.from_pretrained(base(), sft_run / "adapter").eval()
    batch = _batch()
    expected = sequence_logps(sft, batch)[0]
    assert (expected - sequence_logps(base().eval(), batch)[0]).abs().max() > 1e-3  # the SFT adapter matters
    torch.testing.assert_close(sequence_logps(model.eval(), batch)[0], expected)  # trained adapter = SFT at start
    if not reference:  # sft (or orpo): training goes on from the adapter, no reference copy
        assert list(model.peft_config) == ["default"]
        return
    model.train()
    torch.testing.assert_close(reference_logps(model, batch), expected)  # reference = base + SFT adapter
    assert model.training and model.active_adapter == "default"

    saved = load_file(sft_run / "adapter" / "adapter_model.safetensors")
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(REFERENCE_ADAPTER not in n for n, p in model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.SGD(trained, lr=0.5)
    for _ in range(2):
        preference_loss(model, batch, PreferenceLoss("dpo"), chunked=True).backward()
        optimizer.step()
        optimizer.zero_grad()
    weights = {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    for key, value in saved.items():  # base_model.model...q_proj.lora_A.weight
        ref = weights[key.replace(".weight", f".{REFERENCE_ADAPTER}.weight")]
        torch.testing.assert_close(ref, value)  # the reference did not move
    moved = [k for k, v in saved.items() if not torch.equal(weights[k.replace(".weight", ".default.weight")], v)]
    assert moved  # the trained adapter did
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [n for n, p in model.named_parameters()
                                                                          if ".default." in n]
    torch.testing.assert_close(reference_logps(model, batch), expected)


def test_dpo_after_sft_run_and_generate_compare_shows_base_sft_dpo(tmp_path, tiny_model_dir, sft_run, capsys):
    """A DPO run from the SFT run: held-out margins start at 0 (policy = reference = SFT; with the bare base as
    reference they would not), the run records its start, saves only its own adapter, and `generate
    --compare` on it alone shows base, SFT and DPO."""
    from finetune import api
    from finetune.cli import main
    from finetune.recipe.load import load_recipe

    result = run(_dpo(tmp_path, tiny_model_dir, sft_run, training={"max_steps": 6}))
    results = json.loads((result.run_dir / "results.json").read_text())
    assert results["eval_before"]["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert results["eval_after"]["eval_rewards/margins"] > 0
    assert results["init_from"]["run"] == str(sft_run.resolve())
    assert results["init_from"]["adapter"] == str((sft_run / "adapter").resolve())
    assert len(results["init_from"]["sha256"]) == 64
    saved = load_recipe(result.run_dir / "recipe.yaml").adapter
    assert (saved.init_from, saved.r, saved.target_modules) == (str(sft_run.resolve()), 4, ["q_proj", "v_proj"])
    assert sorted(p.name for p in (result.run_dir / "adapter").iterdir() if p.is_dir()) == []  # no reference/
    config = json.loads((result.run_dir / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]

    answers = api.compare_runs([result.run_dir], "Say red.", max_new_tokens=6)
    assert [label for label, _ in answers] == ["base model", "sft (start of dpo)", "dpo"]
    assert answers[1][1] == api.generate(sft_run, "Say red.", max_new_tokens=6)
    assert answers[2][1] == api.generate(result.run_dir, "Say red.", max_new_tokens=6)
    capsys.readouterr()
    assert main(["generate", str(result.run_dir), "--compare", "--prompt", "Say red.", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "base model" in out and "sft (start of dpo)" in out and "dpo" in out

    from ui.tabs.chat import start_of  # the UI chat fills its second column with the start run

    assert start_of(str(result.run_dir)) == str(sft_run.resolve()) and start_of(str(sft_run)) is None
    from ui.backend import Backend, UISettings
    from ui.runs import RunManager
    from ui.tabs.chat import start_column

    def column(*roots):
        return start_column(Backend(UISettings(list(roots), tmp_path / "runs"), RunManager(tmp_path / "runs")),
                            str(result.run_dir), None)

    assert column(tmp_path, sft_run.parent) == str(sft_run.resolve())
    assert not isinstance(column(tmp_path), str)  # the start run is outside the allowed folders: not shown


def test_resume_with_init_from_is_exact(tmp_path, tiny_model_dir, sft_run):
    """3 steps, then --resume to 5, equal to 5 straight steps (the reference comes back from init_from)."""
    common = dict(adapter={"dropout": 0.1}, data={"validation_split": 0.0})
    straight = run(_dpo(tmp_path, tiny_model_dir, sft_run, "straight", training={"max_steps": 5,
                                                                                  "lr_scheduler": "constant"},
                        **common))
    expected = {r["step"]: r for r in read_jsonl(straight.run_dir / "metrics.jsonl") if "loss" in r}
    first = _dpo(tmp_path, tiny_model_dir, sft_run, "resumed", training={"max_steps": 3, "lr_scheduler": "constant"},
                 output={"save_steps": 3}, **common)
    run(first)
    assert not (tmp_path / "resumed" / "checkpoints" / "checkpoint-3" / "reference").exists()  # only the trained
    resumed = run(first.model_copy(update={"training": first.training.model_copy(update={"max_steps": 5})}),
                  resume=True)
    rows = {r["step"]: r for r in read_jsonl(resumed.run_dir / "metrics.jsonl") if "loss" in r}
    assert sorted(rows) == list(range(1, 6))
    for step in (4, 5):
        for key in ("loss", "rewards/margins"):
            assert rows[step][key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-7), (step, key)


def _peft_folder(path, model_dir, **config):
    """An adapter folder saved by peft for the model in `model_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **config}
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(**config))
    model.save_pretrained(path, safe_serialization=True)
    return path


def test_bad_init_from_is_refused_naming_the_key(tmp_path, tiny_model_dir, sft_run, capsys):
    from finetune.cli import main
    from finetune.errors import RecipeError
    from finetune.testing import make_tiny_model_dir

    def refused(adapter_section, match, error=RecipeError, **sections):
        recipe = _recipe(tmp_path, tiny_model_dir, "bad", adapter=adapter_section, **sections)
        with pytest.raises(error, match=match):
            run(recipe)
        if error is RecipeError:  # refused before the run directory is made
            assert not (tmp_path / "bad").exists()

    refused({"init_from": str(tmp_path / "nowhere")}, r"adapter.init_from: .*nowhere does not exist")
    refused({"init_from": str(tiny_model_dir)}, r"adapter.init_from: .* is a full fine-tune")
    refused({"init_from": str(sft_run), "r": 8}, r"(?s)adapter.init_from: .* does not fit the recipe's adapter "
            r"section.*adapter.r: the recipe sets 8, the adapter has 4")
    refused({"init_from": str(sft_run), "type": "dora"}, r"(?s)adapter.type: the recipe sets 'dora'")
    other = make_tiny_model_dir(tmp_path / "other-model", hidden_size=48)
    refused({"init_from": str(sft_run)}, r"adapter.init_from: .* trained on model.path .* this recipe trains",
            model={"path": str(other)})
    pickled = _peft_folder(tmp_path / "pickled", tiny_model_dir)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    refused({"init_from": str(pickled)}, r"adapter.init_from: .* has no adapter_model.safetensors; only safetensors")
    wrong_size = _peft_folder(tmp_path / "wrong-size", other)  # a plain folder: caught when the weights load
    refused({"init_from": str(wrong_size)}, r"adapter.init_from: .*wrong-size does not fit this base model: "
            r".*size mismatch", error=FinetuneError)
    (wrong_size / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    refused({"init_from": str(wrong_size)}, r"adapter.init_from: cannot read .*wrong-size", error=FinetuneError,
            output={"dir": str(tmp_path / "bad2")})

    recipe_file = tmp_path / "bad.yaml"
    recipe_file.write_text(json.dumps(_recipe(tmp_path, tiny_model_dir, "bad", adapter={
        "init_from": str(tmp_path / "nowhere")}).model_dump(mode="json")))
    capsys.readouterr()
    assert main(["plan", str(recipe_file)]) == 2
    err = capsys.readouterr()
    assert "adapter.init_from" in err.err + err.out and "Traceback" not in err.err


def test_plan_counts_the_frozen_reference_adapter(tmp_path, tiny_model_dir, sft_run):
    """The frozen copy is priced when each step runs the reference forward; with a precomputed reference
    there is none, neither in the step nor in the pass before training (it runs the trained adapter)."""
    from finetune.plan import predict

    def training(recipe, **update):
        return recipe.model_copy(update={"training": recipe.training.model_copy(update=update)})

    dpo = resolve_init_from(_dpo(tmp_path, tiny_model_dir, sft_run))
    plain = dpo.model_copy(update={"adapter": dpo.adapter.model_copy(update={"init_from": None})})
    sft = training(dpo, method="sft")
    with_ref, without, continued = (predict(r, device="cpu").breakdown for r in (dpo, plain, sft))
    assert with_ref["trainable_weights"] == without["trainable_weights"] > 0
    assert with_ref["weights"] - without["weights"] == without["trainable_weights"]  # one more adapter
    assert continued["weights"] == without["weights"]  # sft from an adapter: no reference copy
    precomputed, precomputed_plain = (predict(training(r, precompute_reference=True), device="cpu")
                                      for r in (dpo, plain))
    assert precomputed.breakdown["weights"] == without["weights"]  # the training step holds no copy
    assert precomputed.breakdown == precomputed_plain.breakdown
    assert precomputed.reference_pass_bytes == precomputed_plain.reference_pass_bytes > 0  # nor does the pass


def _build_spies(monkeypatch, start_weights):
    """Counters of what a build does with the start adapter's file: opens (a read of its bytes, or hashing
    it) and safetensors loads (from bytes, or from the file itself)."""
    import pathlib

    import safetensors.torch

    counts = {"open": 0, "load": 0}
    real_open, real_load, real_load_file = pathlib.Path.open, safetensors.torch.load, safetensors.torch.load_file

    def open_(path, *args, **kwargs):
        counts["open"] += path == start_weights
        return real_open(path, *args, **kwargs)

    def load(data, *args, **kwargs):
        counts["load"] += 1
        return real_load(data, *args, **kwargs)

    def load_file(path, *args, **kwargs):
        counts["load"] += pathlib.Path(path) == start_weights
        return real_load_file(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", open_)
    monkeypatch.setattr(safetensors.torch, "load", load)
    monkeypatch.setattr(safetensors.torch, "load_file", load_file)
    return counts


def test_precompute_from_an_adapter_keeps_no_reference_copy_and_trains_like_the_in_step_reference(
        tmp_path, tiny_model_dir, sft_run, monkeypatch):
    """DPO from the SFT run with a precomputed reference: the pass runs the trained adapter (the SFT weights
    before the first step), no frozen copy exists during the pass or training, the losses equal those of the
    in-step reference (the frozen copy), and --resume with the stored values loads no reference either; with
    the file deleted, --resume computes the same values again (from the start weights, not the checkpoint).
    Every build reads the start adapter's safetensors once and results.json hashes those very bytes."""
    import hashlib

    from finetune.step import preference
    from finetune.train import reference_pass

    start_weights = (sft_run / "adapter" / "adapter_model.safetensors").resolve()
    sha = hashlib.sha256(start_weights.read_bytes()).hexdigest()
    counts = _build_spies(monkeypatch, start_weights)
    adapters: dict[str, set] = {"pass": set(), "step": set()}  # the model's adapters at each forward
    phase = ["step"]
    real_compute, real_logps = reference_pass.compute_reference, preference.sequence_logps

    def compute(*args, **kwargs):
        phase[0] = "pass"
        try:
            return real_compute(*args, **kwargs)
        finally:
            phase[0] = "step"

    def logps(model, inputs, *args, **kwargs):
        if not inputs["input_ids"].is_meta:  # not the planner's trace
            adapters[phase[0]].add(tuple(model.peft_config))
        return real_logps(model, inputs, *args, **kwargs)

    monkeypatch.setattr(reference_pass, "compute_reference", compute)
    monkeypatch.setattr(preference, "sequence_logps", logps)

    def build(name, resume=False, **training):
        recipe = _dpo(tmp_path, tiny_model_dir, sft_run, name, output={"save_steps": 2},
                      training={"lr_scheduler": "constant", **training})
        counts.update(open=0, load=0)
        adapters["pass"].clear(), adapters["step"].clear()
        result = run(recipe, resume=resume)
        assert counts == {"open": 1, "load": 1}, (name, counts)  # one read, hashed from the bytes read
        assert json.loads((result.run_dir / "results.json").read_text())["init_from"]["sha256"] == sha
        return result

    in_step = build("in-step", max_steps=4)
    assert adapters == {"pass": set(), "step": {("default", "reference")}}
    first = build("pre", max_steps=2, precompute_reference=True)
    assert adapters == {"pass": {("default",)}, "step": {("default",)}}
    stored = json.loads(RunDir(first.run_dir).reference_logps.read_text())
    build("pre", resume=True, max_steps=3, precompute_reference=True)
    assert adapters == {"pass": set(), "step": {("default",)}}  # the stored values: no pass, no reference
    # the file lost: the resumed run computes it again from the start adapter, not from its trained checkpoint
    RunDir(first.run_dir).reference_logps.unlink()
    resumed = build("pre", resume=True, max_steps=4, precompute_reference=True)
    assert adapters == {"pass": {("default",)}, "step": {("default",)}}
    again = json.loads(RunDir(resumed.run_dir).reference_logps.read_text())
    for split in ("train", "eval"):
        assert sum(again[split], []) == pytest.approx(sum(stored[split], []), rel=1e-5, abs=1e-5), split
    assert_same_steps(resumed.run_dir, in_step.run_dir, ("loss", "rewards/margins", "rewards/chosen"), [1, 2, 3, 4])


def test_init_from_files_are_read_again_only_when_they_change(tmp_path, tiny_model_dir, sft_run, monkeypatch):
    """Planning twice reads the parent's adapter_config.json and recipe.yaml once; an edited file is read
    again (a changed adapter shape is planned, a changed parent model refused)."""
    import os
    import pathlib
    import shutil

    from finetune.errors import RecipeError
    from finetune.plan import predict

    parent = tmp_path / "parent"
    shutil.copytree(sft_run, parent, ignore=shutil.ignore_patterns("checkpoints"))  # a new path: not cached
    opened: list[str] = []
    real_open = pathlib.Path.open

    def open_(path, *args, **kwargs):
        if path.name in ("adapter_config.json", "recipe.yaml") and parent in path.parents:
            opened.append(path.name)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", open_)
    recipe = _dpo(tmp_path, tiny_model_dir, parent)
    plans = [predict(recipe, device="cpu") for _ in range(2)]
    assert sorted(opened) == ["adapter_config.json", "recipe.yaml"]  # once each for both plans
    assert plans[0].breakdown == plans[1].breakdown

    config_file = parent / "adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "r": 6}))
    stat = config_file.stat()
    os.utime(config_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a coarse file-system clock
    assert resolve_init_from(recipe).adapter.r == 6
    assert predict(recipe, device="cpu").breakdown["trainable_weights"] > plans[0].breakdown["trainable_weights"]
    recipe_file = parent / "recipe.yaml"
    recipe_file.write_text(recipe_file.read_text().replace(str(tiny_model_dir), str(tmp_path / "other-model")))
    with pytest.raises(RecipeError, match=r"trained on model.path .*other-model"):
        resolve_init_from(recipe)


@pytest.mark.parametrize("precompute", [False, True], ids=["in-step", "precomputed"])
def test_planned_peak_with_reference_adapter_matches_the_tracker(tmp_path, precompute):
    """DPO from a large adapter (r=64 on every linear layer: its frozen copy is several % of the peak): the
    plan, which adds that copy to the weights, within 5% of `finetune measure`'s tracked step; with a
    precomputed reference neither has the copy (the pass and the steps run the trained adapter), and the
    planned pass, with that adapter on, matches the tracked one."""
    from finetune.plan import predict
    from finetune.recipe.schema import Recipe
    from finetune.testing import make_tiny_model_dir
    from finetune.train.measure import measure
    from tests.test_preference_plan import DIMS

    model_dir = make_tiny_model_dir(tmp_path / "model", **DIMS)
    start = _peft_folder(tmp_path / "start", model_dir, r=64, lora_alpha=64, target_modules="all-linear")
    recipe = Recipe.model_validate({
        "model": {"path": str(model_dir)}, "data": {"path": "unused.jsonl", "max_seq_len": 256},
        "adapter": {"init_from": str(start)}, "quantization": {"bits": None},
        "training": {"method": "dpo", "micro_batch_size": 1, "precompute_reference": precompute},
        "memory": {"activation_checkpointing": True, "chunked_loss": False, "tiled_mlp": False}})
    result = measure(recipe, steps=2)
    measured = result["peak_bytes"]
    plan = predict(recipe, device="cpu")
    assert plan.breakdown["trainable_weights"] > 0.05 * measured  # leaving the frozen copy out would show
    assert abs(plan.peak_bytes / measured - 1) <= 0.05, (plan.peak_bytes, measured, plan.breakdown)
    if precompute:  # the pass runs the trained adapter (the start weights), traced with it on (7% more here)
        assert abs(plan.reference_pass_bytes / result["reference_pass_bytes"] - 1) <= 0.02, \
            (plan.reference_pass_bytes, result["reference_pass_bytes"])


def test_a_retrained_start_adapter_changes_the_reference_fingerprint(tmp_path, tiny_model_dir):
    """The stored reference values depend on the start weights: a parent trained again (same folder, other
    weights) changes the fingerprint, so the values are computed again instead of read back."""
    from datasets import Dataset

    from finetune.data.build import DataBundle
    from finetune.train.reference_pass import fingerprint

    folder = _peft_folder(tmp_path / "start", tiny_model_dir)
    recipe = _dpo(tmp_path, tiny_model_dir, folder)
    data = DataBundle(Dataset.from_dict({"input_ids": [[1, 2, 3]], "labels": [[-100, 2, 3]]}), None, {}, list)
    before = fingerprint(recipe, data)
    assert fingerprint(recipe, data) == before
    torch.manual_seed(1)
    _peft_folder(folder, tiny_model_dir)  # trained again: the same folder and shape, other weights
    assert fingerprint(recipe, data) != before


def test_a_same_size_atomic_rewrite_of_the_adapter_config_is_read_again(tmp_path, tiny_model_dir, sft_run):
    """A file renamed over the config (an atomic save) with the same size and modification time (a coarse
    file-system clock) is read again: the cache keys on the inode and change time too."""
    import os
    import shutil

    parent = tmp_path / "parent"
    shutil.copytree(sft_run, parent, ignore=shutil.ignore_patterns("checkpoints"))  # a new path: not cached
    config_file = parent / "adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(config))
    recipe = _dpo(tmp_path, tiny_model_dir, parent)
    assert resolve_init_from(recipe).adapter.r == 4
    before = config_file.stat()
    new = config_file.with_name("adapter_config.json.tmp")
    new.write_text(json.dumps({**config, "r": 6}))  # r 4 -> r 6: the same size
    os.utime(new, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(new, config_file)
    after = config_file.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert resolve_init_from(recipe).adapter.r == 6
