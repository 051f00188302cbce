"""The PeakMemory policy puts the measured peak (CPU: tracker, with breakdown) into every training log row."""

from __future__ import annotations

import torch


def test_the_loop_logs_peak_memory(tiny_model_dir, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, default_data_collator

    from finetune.recipe import validate_recipe
    from finetune.recipe.resolved import resolve
    from finetune.train.peak_memory import PeakMemory
    from finetune.train.policy import Policy
    from finetune.train.setup import simple_loop

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (4, 32)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    callback = PeakMemory(predicted_peak_bytes=1)  # any real peak is above 1 byte: must warn
    captured: list[dict] = []

    class MetricsWriter(Policy):  # stands for the metrics.jsonl writer, which runs after ours
        def log(self, loop, row):
            if "loss" in row:
                captured.append(dict(row))

    recipe = validate_recipe({"model": {"path": str(tiny_model_dir), "dtype": "fp32"}, "adapter": {"type": "full"},
                              "quantization": {"bits": None}, "data": {"path": "unused.jsonl", "batching": "random"},
                              "training": {"max_steps": 2, "micro_batch_size": 2, "gradient_accumulation_steps": 1,
                                           "logging_steps": 1, "noise_scale": False},
                              "memory": {"activation_checkpointing": False, "chunked_loss": False,
                                         "tiled_mlp": False}})
    loop = simple_loop(resolve(recipe), model, data, default_data_collator, 2, policies=[callback, MetricsWriter()])
    try:
        loop.fit()
    finally:
        callback.close()
    logs = captured
    assert len(logs) == 2
    first = logs[0]
    params = sum(p.numel() * 4 for p in model.parameters())
    assert first["peak_memory_bytes"] > params  # weights plus activations
    breakdown = first["peak_memory_breakdown"]
    assert breakdown["trainable_weights"] == params
    assert sum(breakdown.values()) == first["peak_memory_bytes"]
    assert "memory_warning" in first
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None  # tracker left after training


def _batches(*shapes: tuple[int, int]) -> list[dict]:
    return [{"input_ids": torch.zeros(shape, dtype=torch.long)} for shape in shapes]


def _step(callback, step: int, *shapes: tuple[int, int]) -> bool:
    """One step through the policy as the loop runs it; whether its micro-batch ran tracked."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    callback.step_begins(_batches(*shapes), step)
    seen = []
    loss = callback.micro_batch(lambda: seen.append(_get_current_dispatch_mode() is callback.tracker)
                                or torch.ones(()))
    norm = torch.ones(())  # the gradient norm, made after the micro-batches
    callback.keep(norm)
    assert (_get_current_dispatch_mode() is callback.tracker) == seen[0]  # the same to the step's end
    callback.on_step_end()
    assert _get_current_dispatch_mode() is callback.tracker  # on between steps
    for kept in (loss, norm):  # what the loop keeps into the next step is counted
        assert id(kept.untyped_storage()) in callback.tracker._live
    return seen[0]


def _callback():
    from finetune.memory.tracker import MemoryTracker
    from finetune.train.peak_memory import PeakMemory

    callback = PeakMemory(mode="peaks")
    callback.tracker = MemoryTracker()
    callback._enter()
    return callback


def test_only_steps_that_can_set_a_new_peak_are_tracked():
    """The first steps, a step with a longer or wider batch than any tracked one, a step of another shape
    (more micro-batches) and the steps of and after a recovery run their micro-batches tracked; the others not."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from finetune.train.peak_memory import FIRST_STEPS

    callback = _callback()
    steps = [[(2, 8)], [(2, 8)], [(2, 6)], [(2, 10)], [(2, 9)], [(1, 10)], [(2, 5), (2, 5)], [(2, 4), (1, 5)],
             [(3, 4)]]
    tracked = [_step(callback, step, *shapes) for step, shapes in enumerate(steps)]
    assert FIRST_STEPS == 2
    assert callback.tracked_steps == [0, 1, 3, 6, 8]
    assert tracked == [step in callback.tracked_steps for step in range(len(steps))]

    callback.step_begins(_batches((2, 4)), 9)  # a recovery in the middle of an untracked step
    assert not callback.track_step
    callback.micro_batch(lambda: torch.ones(()))  # its first micro-batch (then out of memory)
    assert _get_current_dispatch_mode() is None
    callback.restart(None)
    assert callback.track_step and _get_current_dispatch_mode() is callback.tracker  # the redone step is tracked
    callback.on_step_end()
    assert [_step(callback, step, (2, 4)) for step in (10, 11, 12)] == [True, True, False]
    callback.close()
    assert _get_current_dispatch_mode() is None


def test_a_padded_step_is_tracked_after_an_unpadded_one_of_the_same_shape():
    """A padded micro-batch makes transformers build a 4-D attention mask that an all-ones one does not (SDPA
    skips it), so an unpadded tracked step of the same shape does not bound it; a padded one bounds both."""
    callback = _callback()
    full, padded = torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    padded[0, -3:] = 0
    batches = [[{"input_ids": torch.zeros(2, 8, dtype=torch.long), "attention_mask": m}] for m in
               (full, full, full, padded, padded, full)]
    tracked = []
    for step, step_batches in enumerate(batches):
        callback.step_begins(step_batches, step)
        tracked.append(callback.track_step)
        callback.on_step_end()
    assert tracked == [True, True, False, True, False, False]  # the first two, then the first padded one
    callback.close()


def test_the_recorded_peak_is_the_every_step_peak_when_the_longest_batch_comes_late(tiny_model_dir, tmp_path,
                                                                                    monkeypatch):
    """`finetune run` on CPU: tracking only the steps that can set a peak records in metrics.jsonl the peak
    (and breakdown) that tracking every step records, on data whose longest batch is met late in the run."""
    import json
    import re

    from finetune.recipe import validate_recipe
    from finetune.rundir import RunDir
    from finetune.train.peak_memory import MODE_VARIABLE
    from finetune.train.run import run
    from tests.run_support import tiny_lora_recipe

    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}." + " yes" * (20 if i == 7 else i % 3)}]}
            for i in range(12)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    peaks, logs = {}, {}
    for mode in ("every_step", "peaks"):
        monkeypatch.setenv(MODE_VARIABLE, mode)
        recipe = tiny_lora_recipe(tiny_model_dir, data, tmp_path / mode,
                                  {"training": {"max_steps": 8, "micro_batch_size": 2, "seed": 5}})
        result = run(validate_recipe(recipe))
        metrics = RunDir(result.run_dir).read_metrics()
        best = max((r for r in metrics if "peak_memory_bytes" in r), key=lambda r: r["peak_memory_bytes"])
        peaks[mode] = (best["peak_memory_bytes"], best["peak_memory_breakdown"], best["step"])
        logs[mode] = RunDir(result.run_dir).log.read_text()
    tracked = re.search(r"memory tracker: tracked (\d+) of 8 steps .*: ([\d, ]+)", logs["peaks"])
    assert tracked is not None and "memory tracker" not in logs["every_step"]
    steps = [int(s) for s in tracked.group(2).split(", ")]
    # the first two steps, then untracked steps before the longest batch comes, tracked (at step 5: seed 5)
    assert steps == [1, 2, 5] and peaks["every_step"][2] == 5  # the peak's first log is that step's
    assert peaks["peaks"] == peaks["every_step"]  # bytes, breakdown and step


def test_untracked_steps_do_not_dispatch_through_the_tracker(tiny_model_dir, tmp_path, monkeypatch):
    """`finetune run` on CPU, steps of one shape: after the first steps, no operator of a step's forward,
    backward or optimizer update passes through the tracker, only the few before its first micro-batch (the
    noise probe counting its labelled tokens): a run with the tracker costs its few tracked steps."""
    import json
    from collections import Counter

    from finetune.memory.tracker import MemoryTracker
    from finetune.recipe import validate_recipe
    from finetune.train.peak_memory import MODE_VARIABLE, PeakMemory
    from finetune.train.run import run
    from tests.run_support import tiny_lora_recipe

    row = {"messages": [{"role": "user", "content": "What is one plus one?"}, {"role": "assistant", "content": "Two."}]}
    data = tmp_path / "data.jsonl"
    data.write_text((json.dumps(row) + "\n") * 12)
    phase, dispatched = ["before"], Counter()
    dispatch, begin, end = MemoryTracker.__torch_dispatch__, PeakMemory.on_step_begin, PeakMemory.on_step_end

    def counting_dispatch(self, func, types, args=(), kwargs=None):
        dispatched[phase[0]] += 1
        return dispatch(self, func, types, args, kwargs)

    def on_step_begin(self, loop, step):
        begin(self, loop, step)
        phase[0] = f"step {step.number} {'tracked' if self.track_step else 'untracked'}"

    def on_step_end(self, loop, step):
        phase[0] = "between steps"
        return end(self, loop, step)

    monkeypatch.setattr(MemoryTracker, "__torch_dispatch__", counting_dispatch)
    monkeypatch.setattr(PeakMemory, "on_step_begin", on_step_begin)
    monkeypatch.setattr(PeakMemory, "on_step_end", on_step_end)
    monkeypatch.setenv(MODE_VARIABLE, "peaks")
    recipe = tiny_lora_recipe(tiny_model_dir, data, tmp_path / "run",
                              {"training": {"max_steps": 5, "micro_batch_size": 2}})
    run(validate_recipe(recipe))
    tracked = [dispatched[f"step {s} tracked"] for s in (1, 2)]
    untracked = [dispatched[f"step {s} untracked"] for s in (3, 4, 5)]
    assert min(tracked) > 1000 and max(untracked) <= 5, dispatched
