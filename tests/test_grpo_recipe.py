"""training.method grpo and the grpo section: validation naming the key, refusal elsewhere, `finetune run` refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.data.build import build_datasets, check_records
from finetune.errors import UsageError
from finetune.recipe.load import load_recipe_text, recipe_to_yaml
from finetune.recipe.schema import DataConfig, max_prompt_tokens

ROOT = Path(__file__).resolve().parents[1]
ARITHMETIC = str(ROOT / "recipes" / "data" / "arithmetic.jsonl")
BASE = f"""model:
  path: some/model
data:
  path: {ARITHMETIC}
  max_seq_len: 512
training:
  method: grpo
"""
REWARDS = """grpo:
  rewards:
    - kind: answer
      compare: numeric
"""


def _problems(text: str) -> list[str]:
    with pytest.raises(UsageError) as err:
        load_recipe_text(text, "r.yaml")
    return [str(p) for p in err.value.problems]


def test_grpo_section_defaults_are_trls_and_the_prompt_gets_the_rest_of_the_sequence():
    recipe = load_recipe_text(BASE + REWARDS + "  max_completion_length: 128\n", "r.yaml")
    g = recipe.grpo
    assert (g.loss_type, g.epsilon, g.epsilon_high, g.beta, g.num_generations, g.num_iterations, g.temperature,
            g.top_p, g.scale_rewards) == ("dapo", 0.2, None, 0.0, 8, 1, 1.0, 1.0, "group")
    assert g.rewards[0].kind == "answer"
    assert max_prompt_tokens(recipe) == 512 - 128
    # the resolved recipe (every grpo key written out) validates again, and so does an sft one's
    assert load_recipe_text(recipe_to_yaml(recipe), "again.yaml").grpo == g
    sft = load_recipe_text(BASE.replace("method: grpo", "method: sft"), "sft.yaml")
    assert load_recipe_text(recipe_to_yaml(sft), "again.yaml").training.method == "sft"


def test_bad_values_name_the_key_and_line():
    text = BASE + """grpo:
  num_generations: 1
  rewards:
    - kind: answer
    - kind: format
      pattern: "(("
"""
    problems = _problems(text)
    assert any(p.startswith("r.yaml:9: grpo.num_generations: ") and "greater than or equal to 2" in p
               for p in problems), problems
    assert any(p.startswith("r.yaml:13: grpo.rewards[1].pattern: is not a valid regular expression")
               for p in problems), problems


@pytest.mark.parametrize(("extra", "expected"), [
    ("  epsilon: 0.3\n  epsilon_high: 0.2\n", "grpo.epsilon_high 0.2 is below grpo.epsilon 0.3"),
    ("  max_completion_length: 512\n", "grpo.max_completion_length=512 leaves no room for a prompt"),
    ("  beta: 0.04\nadapter:\n  type: full\nquantization:\n  bits: null\n", "grpo.beta=0.04 with adapter.type=full"),
    ("", "training.effective_batch_size: auto follows the measured gradient noise scale, which a grpo run does not"),
])
def test_contradictions_name_both_keys(extra, expected):
    base = BASE if extra else BASE.replace("method: grpo", "method: grpo\n  effective_batch_size: auto")
    assert any(expected in p for p in _problems(base + REWARDS + extra))


def test_method_grpo_needs_rewards_and_user_code_needs_trust():
    assert any("grpo.rewards: training.method grpo needs at least one reward" in p for p in _problems(BASE))
    problems = _problems(BASE + "grpo:\n  rewards:\n    - kind: python\n      function: my.py:score\n")
    assert any("grpo.rewards[0]: kind python runs code from your files; set grpo.trust_python_code: true" in p
               for p in problems), problems
    trusted = BASE + "grpo:\n  trust_python_code: true\n  rewards:\n    - kind: python\n      function: my.py:score\n"
    assert load_recipe_text(trusted, "r.yaml").grpo.rewards[0].function == "my.py:score"


def test_grpo_keys_are_refused_for_other_methods_and_other_methods_keys_for_grpo():
    sft = BASE.replace("method: grpo", "method: sft") + REWARDS + "  beta: 0.1\n"
    assert any("grpo.rewards, grpo.beta: apply only to training.method grpo, not sft; remove them or set "
               "training.method: grpo" in p for p in _problems(sft))
    dpo_key = BASE.replace("method: grpo", "method: grpo\n  loss_type: ipo") + REWARDS
    assert any("training.loss_type: applies only to dpo, not grpo" in p for p in _problems(dpo_key))
    packed = BASE.replace("max_seq_len: 512", "max_seq_len: 512\n  packing: true") + REWARDS
    assert any("data.packing cannot be used with training.method=grpo" in p for p in _problems(packed))


def test_prompt_records_checked_before_a_model_loads_then_built_as_prompts(tiny_tokenizer):
    cfg = DataConfig(path=ARITHMETIC, validation_split=0.2)
    assert check_records(cfg, "grpo") == {"format": "prompt", "records": 250, "bad_records": 0}
    data = build_datasets(cfg, tiny_tokenizer, seed=0, method="grpo", max_prompt_tokens=96)
    assert (len(data.train), len(data.eval)) == (200, 50) and data.stats["train_prompts"] == 200
    assert all(len(p.input_ids) <= 96 and "answer" in p.fields for p in data.train)
    batch = data.collator(data.train[:3])  # left-padded: the prompts end where generation starts
    assert batch["attention_mask"][:, -1].tolist() == [1, 1, 1]
    assert data.fingerprint["format"] == "prompt" and data.fingerprint["settings"]["training.method"] == "grpo"


def test_grpo_quickstart_validates_with_the_arithmetic_rewards():
    import yaml

    from finetune.recipe.load import load_recipe
    from finetune.recipe.rewards import validate_rewards

    recipe = load_recipe(ROOT / "recipes" / "grpo-quickstart.yaml")
    shipped = validate_rewards(yaml.safe_load((ROOT / "recipes" / "data" / "arithmetic_rewards.yaml").read_text()))
    assert recipe.training.method == "grpo" and recipe.grpo.rewards == shipped.rewards
    assert check_records(recipe.data, "grpo")["bad_records"] == 0


def test_an_answer_reward_with_a_pattern_survives_the_resolved_recipe_round_trip():
    """recipe.yaml and the planner's chosen settings write every key out and validate again: an answer reward
    with a pattern must not come back with a default tag beside it ("give either tag or pattern")."""
    text = BASE + 'grpo:\n  rewards:\n    - kind: answer\n      pattern: "-?\\\\d+"\n'
    recipe = load_recipe_text(text, "r.yaml")
    again = load_recipe_text(recipe_to_yaml(recipe), "again.yaml")
    assert again.grpo.rewards[0].pattern == "-?\\d+" and again.grpo.rewards[0].tag is None
    tagged = load_recipe_text(BASE + REWARDS, "r.yaml")
    assert load_recipe_text(recipe_to_yaml(tagged), "again.yaml").grpo.rewards == tagged.grpo.rewards
