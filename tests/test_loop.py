"""The training loop itself (finetune/train/loop.py): its hooks, its train state, and no host sync per
micro-batch on the default path."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from transformers import default_data_collator

from finetune.recipe import validate_recipe
from finetune.recipe.resolved import resolve
from finetune.train.loop import TrainLoop
from finetune.train.policy import Micro, Policy, Update
from finetune.train.setup import simple_loop
from finetune.train.train_state import load_checkpoint
from tests.test_optim import examples, load_model

PACKAGE = str(Path(__file__).resolve().parents[1] / "finetune")


def _config(model_dir: Path, accumulation: int = 1, **training):
    return resolve(validate_recipe({
        "model": {"path": str(model_dir)}, "data": {"path": "unused.jsonl", "batching": "random"}, "adapter": {"type": "full"},
        "quantization": {"bits": None},
        "training": {"max_steps": 3, "micro_batch_size": 1, "gradient_accumulation_steps": accumulation,
                     "learning_rate": 1e-2, "logging_steps": 1, "seed": 0, **training},
        "memory": {"activation_checkpointing": False, "chunked_loss": False, "tiled_mlp": False},
        "output": {"save_steps": 2}}))


def _data(n: int = 16) -> list[dict]:
    return [{"input_ids": ids[0], "labels": ids[0]} for ids in examples(n, seed=3)]


class Recorder(Policy):
    """Writes down each hook as the loop calls it."""

    def __init__(self):
        self.calls: list[str] = []

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if name in Policy.__dict__ and callable(attr) and not name.startswith("_") and name not in (
                "state_dict", "load_state_dict"):
            def recorded(*args, **kwargs):
                object.__getattribute__(self, "calls").append(name)
                return attr(*args, **kwargs)
            return recorded
        return attr


def test_a_policy_is_called_at_each_hook_in_the_loop_s_order(tiny_model_dir, tmp_path):
    recorder = Recorder()
    loop = simple_loop(_config(tiny_model_dir, accumulation=2, max_steps=2, noise_scale=False),
                       load_model(tiny_model_dir), _data(), default_data_collator, 2, checkpoints=tmp_path,
                       policies=[recorder])
    loop.fit()
    step = ["plan_updates", "on_step_begin", "around_micro_batch", "around_micro_batch", "defers",
            "before_update", "after_update", "on_step_end", "log"]
    assert recorder.calls == ["on_train_begin", *step, *step, "on_save", "on_train_end"]
    assert loop.state.step == 2 and (tmp_path / "checkpoint-2").is_dir()


class Halving(Policy):
    """A new policy, unknown to the loop: every step runs as two updates of half its rows."""

    def plan_updates(self, loop, step, updates):
        rows = step.batches[0]
        half = len(rows) // 2
        return [Update(micro_batches=[Micro(rows[:half])], num_items=None, share=0.5),
                Update(micro_batches=[Micro(rows[half:])], num_items=None, share=0.5)]


def test_a_new_policy_plugs_in_without_the_loop_knowing_it(tiny_model_dir):
    """Two updates per step of micro-batch 2 are the updates of a run at micro-batch 1 with twice the steps."""
    halves = simple_loop(_config(tiny_model_dir, micro_batch_size=2, noise_scale=False, lr_scheduler="constant",
                                 warmup_ratio=0.0), load_model(tiny_model_dir), _data(), default_data_collator, 3,
                         policies=[Halving()])
    halves.fit()
    single = simple_loop(_config(tiny_model_dir, noise_scale=False, lr_scheduler="constant", warmup_ratio=0.0),
                         load_model(tiny_model_dir), _data(), default_data_collator, 6)
    # the same examples in the same order: the epoch's permutation cut in micro-batches of 1 instead of 2
    assert [i for s in single.epoch_steps(0) for b in s for i in b] == [i for s in halves.epoch_steps(0) for b in s for i in b]
    single.fit()
    for a, b in zip(halves.model.parameters(), single.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_train_state_is_one_weights_only_file_that_resumes_exactly(tiny_model_dir, tmp_path):
    straight = simple_loop(_config(tiny_model_dir, max_steps=4), load_model(tiny_model_dir), _data(),
                           default_data_collator, 4, checkpoints=tmp_path / "a")
    straight.fit()
    state = torch.load(tmp_path / "a" / "checkpoint-2" / "train_state.pt", weights_only=True)
    assert {"format", "weights", "optimizer", "scheduler", "loop", "geometry", "policies"} <= state.keys()
    assert state["loop"]["step"] == 2 and "noise_scale" in state["policies"]
    resumed = simple_loop(_config(tiny_model_dir, max_steps=4), load_model(tiny_model_dir), _data(),
                          default_data_collator, 4, checkpoints=tmp_path / "b")
    load_checkpoint(resumed, tmp_path / "a" / "checkpoint-2")
    resumed.fit()
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [r["loss"] for r in resumed.state.log_history if "loss" in r] == \
        [r["loss"] for r in straight.state.log_history if "loss" in r]


class Counter(Policy):
    """A policy with state: the updates it saw."""

    key = "counter"

    def __init__(self):
        self.updates = 0

    def after_update(self, loop, update, grad_norm):
        self.updates += 1

    def state_dict(self) -> dict:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.updates = state["updates"]


class RenamedCounter(Counter):
    """The same policy after its class was renamed: its declared key is unchanged."""


def _counting_loop(model_dir, policy: Policy, out):
    return simple_loop(_config(model_dir, max_steps=4, noise_scale=False), load_model(model_dir), _data(),
                       default_data_collator, 4, checkpoints=out, policies=[policy])


def test_policy_state_is_saved_under_its_declared_key_so_a_renamed_class_resumes(tiny_model_dir, tmp_path):
    _counting_loop(tiny_model_dir, Counter(), tmp_path / "a").fit()
    checkpoint = tmp_path / "a" / "checkpoint-2"
    assert torch.load(checkpoint / "train_state.pt", weights_only=True)["policies"]["counter"] == {"updates": 2}
    renamed = RenamedCounter()
    load_checkpoint(_counting_loop(tiny_model_dir, renamed, tmp_path / "b"), checkpoint)
    assert renamed.updates == 2
    # a checkpoint of an earlier version kept the state under the class name: still found
    state = torch.load(checkpoint / "train_state.pt", weights_only=True)
    state["policies"] = {"Counter": state["policies"].pop("counter"), **state["policies"]}
    loop = _counting_loop(tiny_model_dir, Counter(), tmp_path / "c")
    loop.load_state_dict(state)
    assert loop.policies[-1].updates == 2


def test_grpo_s_completions_per_pass_from_an_earlier_checkpoint_go_to_the_geometry(tiny_model_dir):
    """Earlier versions kept GRPO's micro-batch in its own state, under the class name; a resume puts it in the
    loop's geometry, the one record GRPO reads."""
    from finetune.recipe.schema import GRPOConfig
    from finetune.train.grpo import GRPO

    grpo = GRPO(GRPOConfig(), [], tokenizer=None)
    loop = simple_loop(_config(tiny_model_dir, noise_scale=False), load_model(tiny_model_dir), _data(),
                       default_data_collator, 1, policies=[grpo])
    state = loop.state_dict()
    state["policies"] = {"GRPO": {"micro_batch": 3, "generation_rows": 16}}
    loop.load_state_dict(state)
    grpo.on_train_begin(loop)
    assert loop.geometry.completion_rows == 3 and grpo.generation_rows == 16
    assert loop.state_dict()["policies"]["grpo"] == {"generation_rows": 16}


def test_a_policy_with_state_must_declare_its_key(tiny_model_dir, tmp_path):
    class Unnamed(Counter):
        key = None

    with pytest.raises(ValueError, match="Unnamed keeps state .* declares no checkpoint `key`"):
        _counting_loop(tiny_model_dir, Unnamed(), tmp_path)


def test_after_a_recovery_every_reader_takes_the_micro_batch_from_the_geometry(tiny_model_dir, tmp_path,
                                                                              monkeypatch):
    """One record of the batch shape: an out-of-memory error at step 2 halves the micro-batch; the loop's
    geometry, the recovery's recipe (what recipe.yaml and --resume get) and the checkpoint all say so."""
    from finetune.train.recovery import FAULT_ENV, OOMRecovery

    monkeypatch.setenv(FAULT_ENV, "2")
    told = []
    config = _config(tiny_model_dir, micro_batch_size=2, max_steps=3, noise_scale=False)
    recovery = OOMRecovery(config.recipe, tmp_path, lambda event, recipe: told.append(recipe))
    loop = simple_loop(config, load_model(tiny_model_dir), _data(), default_data_collator, 3,
                       checkpoints=tmp_path / "c", policies=[recovery])
    loop.fit()
    assert (loop.geometry.splits, loop.geometry.part_rows) == (2, 1)
    for recipe in (recovery.recipe, told[0]):
        assert (recipe.training.micro_batch_size, recipe.training.gradient_accumulation_steps) == (1, 2)
    state = torch.load(tmp_path / "c" / "checkpoint-2" / "train_state.pt", weights_only=True)
    assert state["geometry"]["splits"] == 2 and state["loop"]["step"] == 2


def test_a_batch_is_typed_and_its_extra_inputs_reach_the_model_s_forward(tiny_model_dir):
    """A collator's keys beyond the named fields (a vision-language batch's pixel_values) land in Batch.extra
    and are passed to the model's forward as keyword arguments, on the device."""
    from finetune.data.batch import Batch

    def collator(rows):
        return {**default_data_collator(rows), "pixel_values": torch.full((len(rows), 3), 7.0)}

    batch = Batch.of(collator(_data(2)))
    assert batch.labels is not None and batch.position_ids is None and set(batch.extra) == {"pixel_values"}
    assert set(batch) == {"input_ids", "labels", "pixel_values"} and "position_ids" not in batch
    seen = []

    def take(module, args, kwargs):  # the tiny model has no vision tower: note the input and drop it
        seen.append(kwargs.pop("pixel_values"))
        return args, kwargs

    model = load_model(tiny_model_dir)
    model.register_forward_pre_hook(take, with_kwargs=True)
    simple_loop(_config(tiny_model_dir, micro_batch_size=2, max_steps=1, noise_scale=False), model, _data(),
                collator, 1).fit()
    assert len(seen) == 1 and seen[0].shape == (2, 3) and bool((seen[0] == 7).all())


class _Syncs:
    """Counts the host reads of a tensor's value (bool, float, int, item, tolist) made by finetune's own code
    inside a step: each is a device sync on a GPU."""

    NAMES = ("__bool__", "__float__", "__int__", "item", "tolist")

    def __init__(self, monkeypatch):
        self.count, self.active = 0, False
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(original))

    def _counted(self, original):
        def read(tensor, *args):
            caller = inspect.currentframe().f_back
            if self.active and caller is not None and caller.f_code.co_filename.startswith(PACKAGE):
                self.count += 1
            return original(tensor, *args)
        return read


@pytest.mark.parametrize("noise_scale", [True, False])
def test_no_host_sync_per_micro_batch_on_the_default_path(tiny_model_dir, monkeypatch, noise_scale):
    """The reads of a step (the divergence check, the norm, the noise-scale observation) happen once per
    update: a step of 4 micro-batches reads as often as a step of 2 (the fewest the probe measures)."""
    syncs = _Syncs(monkeypatch)
    run_step = TrainLoop.run_step

    def counted(self, step):
        syncs.active = True
        try:
            return run_step(self, step)
        finally:
            syncs.active = False

    monkeypatch.setattr(TrainLoop, "run_step", counted)
    per_step = {}
    for accumulation in (2, 4):
        syncs.count = 0
        loop = simple_loop(_config(tiny_model_dir, accumulation, noise_scale=noise_scale, max_steps=6),
                           load_model(tiny_model_dir), _data(32), default_data_collator, 6)
        loop.fit()
        per_step[accumulation] = syncs.count / 6
    assert per_step[4] == per_step[2] and per_step[2] <= 3, per_step
