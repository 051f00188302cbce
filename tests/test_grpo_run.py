"""`finetune run` with training.method grpo: the loop generates, scores and trains (finetune/train/grpo.py), on
the tiny model with a user reward (the share of the letter "e" in the answer: learnable by a random model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune import api
from finetune.rundir import RunDir

REWARD_FILE = '''
def share_e(prompts, completions, **fields):
    return [c.count("e") / max(len(c), 1) for c in completions]
'''


def _recipe(tmp_path: Path, model: Path, out: str = "run", **training) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    if not prompts.exists():
        prompts.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "answer": a + b}) + "\n"
                                   for a in range(1, 7) for b in range(1, 7)))
        (tmp_path / "rewards.py").write_text(REWARD_FILE)
    keys = {"max_steps": 4, "micro_batch_size": 4, "gradient_accumulation_steps": 2, "learning_rate": 0.02,
            "lr_scheduler": "constant", "warmup_ratio": 0.0, "logging_steps": 1, **training}
    path = tmp_path / f"{out}.yaml"
    path.write_text(f"""model:
  path: {model}
adapter:
  r: 8
  alpha: 16
  dropout: 0.0
data:
  path: {prompts}
  max_seq_len: 64
  validation_split: 0.2
training:
  method: grpo
{"".join(f"  {k}: {v}" + chr(10) for k, v in keys.items())}output:
  dir: {tmp_path / out}
  save_steps: 2
grpo:
  num_generations: 4
  max_completion_length: 8
  trust_python_code: true
  rewards:
    - kind: python
      function: rewards.py:share_e
""")
    return path


def _run(path: Path, resume: bool = False, **overrides) -> api.RunResult:
    recipe = api.load_recipe(path, [f"{k}={v}" for k, v in overrides.items()])
    return api.run(recipe, resume=resume)


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "adapter" / "adapter_model.safetensors")


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_a_grpo_run_logs_rewards_samples_and_the_held_out_reward_before_and_after(tmp_path, tiny_model_dir):
    result = _run(_recipe(tmp_path, tiny_model_dir))
    run = RunDir(result.run_dir)
    assert result.state == "completed" and result.steps == 4
    rows = [r for r in run.read_metrics() if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert 0 <= row["reward"] <= 1 and row["rewards/rewards.py:share_e/mean"] == pytest.approx(row["reward"])
        assert 0 < row["completion_length"] <= 8 and row["clip_ratio"] == 0.0  # one pass: the ratio is 1
        assert row["generation_tokens_per_second"] > 0 and row["training_tokens_per_second"] > 0
        assert "kl" not in row  # beta 0: no reference
    # tokens per step: the prompts and their completions (2 prompts x 4 answers of at most 8 tokens each)
    assert rows[1]["tokens_seen"] - rows[0]["tokens_seen"] > 8 * 4
    samples = run.read_completions()
    assert {s["step"] for s in samples} == {1, 2, 3, 4}
    assert all(s["where"].startswith(str(tmp_path / "prompts.jsonl") + ":") and s["prompt"].endswith("assistant\n")
               and isinstance(s["completion"], str) for s in samples)
    results = json.loads(run.results.read_text())
    for when in ("eval_before", "eval_after"):
        assert 0 <= results[when]["eval_reward"] <= 1 and results[when]["eval_completion_length"] > 0
    assert result.eval_after["eval_reward"] == results["eval_after"]["eval_reward"]
    assert isinstance(api.generate(result.run_dir, "What is 2 + 2?", max_new_tokens=4), str)


def test_the_mean_reward_rises_over_a_run(tmp_path, tiny_model_dir):
    result = _run(_recipe(tmp_path, tiny_model_dir, max_steps=24, learning_rate=0.1), **{"grpo.num_generations": 8})
    rewards = [r["reward"] for r in RunDir(result.run_dir).read_metrics() if "loss" in r]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > 2 * first and last > first + 0.05, rewards
    assert result.eval_after["eval_reward"] > result.eval_before["eval_reward"] + 0.05


def test_an_interrupted_run_resumes_exactly(tmp_path, tiny_model_dir):
    whole = _run(_recipe(tmp_path, tiny_model_dir, "whole"))
    first = _recipe(tmp_path, tiny_model_dir, "parts")
    _run(first, **{"training.max_steps": 2})
    resumed = _run(first, resume=True)
    assert resumed.steps == 4
    a, b = _adapter(whole.run_dir), _adapter(resumed.run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rewards = [[r["reward"] for r in RunDir(run).read_metrics() if "loss" in r] for run in (whole.run_dir,
                                                                                           resumed.run_dir)]
    assert rewards[0] == rewards[1]


def test_out_of_memory_in_training_halves_the_micro_batch_and_keeps_the_step(tmp_path, tiny_model_dir,
                                                                           monkeypatch):
    """One forward/backward of 4 completions runs out of memory at step 2: the step is redone in micro-batches of
    2 over the same completions, which trains as a run at micro-batch 2 does (same completions per step)."""
    import finetune.train.grpo as grpo

    reference = _run(_recipe(tmp_path, tiny_model_dir, "reference", micro_batch_size=2,
                             gradient_accumulation_steps=4))
    real, calls = grpo.grpo_forward_backward, []

    def failing(model, micro, config, **kw):
        calls.append(len(micro.advantages))
        if len(calls) == 3:  # step 2's first micro-batch (step 1 ran two of 4 rows)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(model, micro, config, **kw)

    monkeypatch.setattr(grpo, "grpo_forward_backward", failing)
    result = _run(_recipe(tmp_path, tiny_model_dir, "recovered"))
    # step 1: its 8 answers in 2 forward/backwards of 4; step 2: the first fails, then 4 of 2; steps 3-4: 4 of 2
    assert calls == [4, 4, 4] + [2] * 12
    assert "training micro-batch 2 completions" in RunDir(result.run_dir).log.read_text()
    rows = [[r for r in RunDir(run).read_metrics() if "loss" in r] for run in (reference.run_dir, result.run_dir)]
    for want, got in zip(*rows, strict=True):  # the same answers and gradients but for float summation order
        assert got["reward"] == want["reward"] and got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    a, b = _adapter(reference.run_dir), _adapter(result.run_dir)
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)


def test_out_of_memory_in_generation_generates_in_halves(tmp_path, tiny_model_dir, monkeypatch):
    """The first sampling generate (step 1's: 2 prompts x 4 answers) runs out of memory: the step generates 4
    completions at a time from then on, and the run completes."""
    from transformers import GenerationMixin

    original, calls = GenerationMixin.generate, []

    def generate(self, *args, **kwargs):
        if kwargs.get("logits_processor"):  # sampling (RowSampler), not the held-out evaluation's greedy answers
            calls.append(kwargs["input_ids"].shape[0])
            if len(calls) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", generate)
    result = _run(_recipe(tmp_path, tiny_model_dir, max_steps=2))
    assert result.state == "completed" and result.steps == 2
    assert calls == [8, 4, 4, 4, 4], calls
    assert "generating 4 completions at a time" in RunDir(result.run_dir).log.read_text()


def test_a_planned_generation_batch_generates_in_parts_and_samples_what_one_batch_does(tmp_path, tiny_model_dir,
                                                                                       monkeypatch):
    """grpo.generation_batch_size 4 (the planner's pick where the step's 8 completions at once would not fit):
    each step generates twice 4, and every completion is sampled from its own seed, so the rewards are those of
    generating all 8 at once."""
    from transformers import GenerationMixin

    original, calls = GenerationMixin.generate, []

    def generate(self, *args, **kwargs):
        if kwargs.get("logits_processor"):  # sampling, not the held-out evaluation's greedy answers
            calls.append(kwargs["input_ids"].shape[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", generate)
    parts = _run(_recipe(tmp_path, tiny_model_dir, "parts", max_steps=2), **{"grpo.generation_batch_size": 4})
    assert calls == [4, 4, 4, 4], calls
    calls.clear()
    whole = _run(_recipe(tmp_path, tiny_model_dir, "whole", max_steps=2), **{"grpo.generation_batch_size": "null"})
    assert calls == [8, 8], calls

    def rewards(result: api.RunResult) -> list[float]:
        return [row["reward"] for row in RunDir(result.run_dir).read_metrics() if "reward" in row]

    assert rewards(parts) == rewards(whole) and len(rewards(parts)) == 2


def test_generation_that_runs_out_of_memory_one_group_at_a_time_is_a_clear_error(tmp_path, tiny_model_dir,
                                                                               monkeypatch):
    from transformers import GenerationMixin

    from finetune.errors import FinetuneError

    original = GenerationMixin.generate

    def generate(self, *args, **kwargs):
        if kwargs.get("logits_processor"):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", generate)
    with pytest.raises(FinetuneError) as failed:
        _run(_recipe(tmp_path, tiny_model_dir, max_steps=2))
    assert "out of memory generating step 1's answers even one prompt's 4 at a time" in failed.value.message
    assert "grpo.num_generations" in failed.value.hint


def test_two_processes_sample_train_and_log_as_one(tmp_path, tiny_model_dir):
    """torchrun, 2 processes x 2 prompts per step (micro-batch 4 x accumulation 2, 4 answers each) against 1
    process x 4 prompts (accumulation 4): the same prompts per step, each answer sampled from its own seeded
    generator (so the same answers), dapo's normaliser over both processes, DDP's mean gradient: the same
    losses, gradient norms and rewards (float summation order aside)."""
    from tests.run_support import torchrun

    two = _recipe(tmp_path, tiny_model_dir, "two")
    done = torchrun("run", str(two), "--set", "distributed.gpus=2", "--set", "distributed.strategy=ddp")
    assert done.returncode == 0, done.stderr[-3000:]
    one = _run(_recipe(tmp_path, tiny_model_dir, "one", gradient_accumulation_steps=4))
    rows = [[r for r in RunDir(run).read_metrics() if "loss" in r] for run in (tmp_path / "two", one.run_dir)]
    assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]] == [1, 2, 3, 4]
    for got, want in zip(*rows, strict=True):
        for key in ("loss", "grad_norm", "reward", "completion_length", "rewards/rewards.py:share_e/mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)
    assert [r["eval_reward"] for r in RunDir(tmp_path / "two").read_metrics() if "eval_reward" in r] == \
        pytest.approx([r["eval_reward"] for r in RunDir(one.run_dir).read_metrics() if "eval_reward" in r])


def test_a_missing_reward_file_is_named_before_anything_loads(tmp_path, tiny_model_dir, capsys):
    """A typo in a kind python reward's file: `finetune run` stops in its preflight, naming the key and the file,
    exit code 2, and leaves no run directory."""
    from finetune.cli import main

    path = _recipe(tmp_path, tiny_model_dir)
    path.write_text(path.read_text().replace("function: rewards.py:share_e", "function: reward.py:share_e"))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"grpo.rewards[0].function: {tmp_path / 'reward.py'} does not exist" in err
    assert "Loading weights" not in err and not (tmp_path / "run").exists()
