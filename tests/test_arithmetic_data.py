"""The GRPO quickstart's prompt set and rewards: current with its script, 200 + 50 prompts, and the rewards pay
a reply whose last number is right, more when it is short, and nothing but brevity for a wrong one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from finetune.data.prompts import build_prompts
from finetune.recipe.load import load_yaml
from finetune.recipe.rewards import validate_rewards
from finetune.recipe.schema import DataConfig
from finetune.rl.rewards import build_rewards, score

DATA = Path(__file__).resolve().parents[1] / "recipes" / "data"


def _script():
    spec = importlib.util.spec_from_file_location("make_arithmetic", DATA / "make_arithmetic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_file_is_what_the_script_writes():
    assert (DATA / "arithmetic.jsonl").read_text() == _script().text()


def test_two_hundred_train_and_fifty_held_out_prompts(tiny_tokenizer):
    bundle = build_prompts(DataConfig(path=str(DATA / "arithmetic.jsonl"), validation_split=0.2), tiny_tokenizer,
                           seed=0)
    assert (len(bundle.train), len(bundle.eval)) == (200, 50)
    assert bundle.stats["fields"] == ["answer"] and bundle.stats["bad_records_skipped"] == 0
    prompts = {p.text for p in bundle.train + bundle.eval}
    assert len(prompts) == 250  # distinct questions


def test_rewards_pay_the_right_last_number_and_a_short_reply():
    path = DATA / "arithmetic_rewards.yaml"
    data, _ = load_yaml(path.read_text(), str(path))
    rewards = build_rewards(validate_rewards(data, str(path)), DATA)
    record = _script().records()[0]  # 5 + 18
    assert record["answer"] == "23"
    completions = ["23", "5 + 18 = 23", "The sum of 5 and 18 is 23.", "22", "The answer is 23, or maybe 24."]
    totals, _ = score(rewards, [record["prompt"]] * 5, completions, [record] * 5, ["arithmetic.jsonl:1"] * 5)
    assert totals == [1.2, 1.2, 1.0, 0.2, 0.0]
