"""Rewards for GRPO: configs validated with one line per bad key, built-ins, and the user's functions, which run
only when trusted and allowed and whose failures name the record and the function."""

from __future__ import annotations

import math

import pytest

from finetune.errors import RecipeError
from finetune.recipe.rewards import validate_rewards
from finetune.rl.rewards import RewardError, build_rewards, score

RECORDS = [{"answer": "12", "id": 1}, {"answer": 7, "id": 2}, {"answer": "1,024", "id": 3}]
WHERE = ["math.jsonl:1", "math.jsonl:2", "math.jsonl:3"]
PROMPTS = ["3 * 4?", "14 / 2?", "2^10?"]


def _score(config: dict, completions: list, base_dir=".", allow: bool = True):
    rewards = build_rewards(validate_rewards(config, "r.yaml"), base_dir, allow_python_code=allow)
    return score(rewards, PROMPTS[:len(completions)], completions, RECORDS[:len(completions)], WHERE)


def test_answer_in_tag_exact_and_numeric():
    completions = ["so <answer>12</answer>", "<answer> 7.0 </answer>", "<answer>1024</answer>"]
    exact, _ = _score({"rewards": [{"kind": "answer"}]}, completions)
    numeric, _ = _score({"rewards": [{"kind": "answer", "compare": "numeric"}]}, completions)
    assert exact == [1.0, 0.0, 0.0]  # "7.0" is not the text "7"; "1024" is not "1,024"
    assert numeric == [1.0, 1.0, 1.0]
    last, _ = _score({"rewards": [{"kind": "answer"}]}, ["<answer>3</answer> no, <answer>12</answer>"])
    assert last == [1.0]  # the last tagged answer counts


def test_answer_by_regex_and_conversational_completion():
    config = {"rewards": [{"kind": "answer", "pattern": r"answer is (-?\d+)", "compare": "numeric"}]}
    totals, _ = _score(config, [[{"role": "assistant", "content": "The answer is 12."}], "the answer is 8"])
    assert totals == [1.0, 0.0]


def test_format_length_and_weighted_sum():
    config = {"rewards": [{"kind": "answer", "weight": 2.0},
                          {"kind": "format", "pattern": r"^<think>.*</think>"},
                          {"kind": "length", "max_chars": 30, "weight": -0.5}]}
    completions = ["<think>3*4</think><answer>12</answer>", "<answer>7</answer>"]
    totals, per = _score(config, completions)
    assert per == {"rewards[0]": [1.0, 1.0], "rewards[1]": [1.0, 0.0], "rewards[2]": [0.0, 1.0]}
    assert totals == [3.0, 2.0 - 0.5]


def test_config_problems_name_the_key():
    bad = {"rewards": [{"kind": "answer", "tag": "answer", "pattern": "x"}, {"kind": "format", "pattern": "("},
                       {"kind": "length", "min_chars": 9, "max_chars": 3}, {"kind": "bleu"},
                       {"kind": "answer", "colour": "red"}]}
    with pytest.raises(RecipeError) as err:
        validate_rewards(bad, "r.yaml")
    lines = err.value.problems
    assert lines == [
        "r.yaml: rewards[0]: give either tag or pattern, not both",
        "r.yaml: rewards[1].pattern: is not a valid regular expression (missing ), unterminated subpattern at "
        "position 0) (got '(')",
        "r.yaml: rewards[2]: min_chars 9 is above max_chars 3",
        "r.yaml: rewards[3].kind: must be one of answer, format, length, python (got 'bleu')",
        "r.yaml: rewards[4].colour: unknown key",
    ]


USER_CODE = '''
def score(prompts, completions, answer, **fields):
    return [1.0 if str(a) in c else 0.0 for c, a in zip(completions, answer)]

def picky(prompts, completions, id, **fields):
    if 2 in id:
        raise ValueError("cannot read this one")
    return [0.5] * len(completions)

def wordy(prompts, completions, **fields):
    return ["good" if "12" in c else 1.0 for c in completions]

def undefined(prompts, completions, **fields):
    return [float("nan") if "7" in c else 1.0 for c in completions]
'''


@pytest.fixture
def user_dir(tmp_path):
    (tmp_path / "my_rewards.py").write_text(USER_CODE)
    return tmp_path


def _python(name: str, trust: bool = True) -> dict:
    return {"rewards": [{"kind": "python", "function": f"my_rewards.py:{name}"}], "trust_python_code": trust}


def test_user_function_runs_when_trusted_with_record_fields(user_dir):
    totals, _ = _score(_python("score"), ["it is 12", "it is 8"], user_dir)
    assert totals == [1.0, 0.0]


def test_user_function_refused_without_the_trust_key(user_dir):
    with pytest.raises(RecipeError) as err:
        validate_rewards(_python("score", trust=False), "r.yaml")
    assert "rewards[0]: kind python runs code from your files; set trust_python_code: true" in err.value.problems[0]


def test_user_function_refused_where_the_server_does_not_allow_code(user_dir):
    with pytest.raises(RewardError, match=r"rewards\[0\]: kind python \(my_rewards.py:score\) runs code, and this "
                                          "server does not allow user code"):
        _score(_python("score"), ["12"], user_dir, allow=False)


def test_user_function_that_raises_names_the_record_and_function(user_dir):
    with pytest.raises(RewardError) as err:
        _score(_python("picky"), ["a", "b", "c"], user_dir)
    assert str(err.value) == ("math.jsonl:2: reward rewards[0] (my_rewards.py:picky) raised ValueError: "
                              "cannot read this one")


@pytest.mark.parametrize(("name", "where", "value"), [("wordy", "math.jsonl:1", "'good'"),
                                                      ("undefined", "math.jsonl:2", "nan")])
def test_user_function_returning_a_non_number_names_the_record(user_dir, name, where, value):
    with pytest.raises(RewardError) as err:
        _score(_python(name), ["12", "7"], user_dir)
    assert str(err.value).startswith(f"{where}: reward rewards[0] (my_rewards.py:{name}) returned {value} for "
                                     "completion")
    assert err.value.exit_code == 2


def test_missing_file_or_function_and_none_rewards(user_dir):
    with pytest.raises(RewardError, match="does not exist"):
        _score({"rewards": [{"kind": "python", "function": "nope.py:f"}], "trust_python_code": True}, ["x"], user_dir)
    with pytest.raises(RewardError, match="has no function 'missing'"):
        _score(_python("missing"), ["x"], user_dir)
    (user_dir / "maybe.py").write_text("def f(prompts, completions, **k):\n    return [None] * len(completions)\n")
    totals, _ = _score({"rewards": [{"kind": "python", "function": "maybe.py:f"}], "trust_python_code": True},
                       ["x"], user_dir)
    assert math.isnan(totals[0])  # no reward applies: left out of the advantages


def test_answer_field_missing_from_records_names_it():
    with pytest.raises(RewardError, match=r"math.jsonl:1: reward rewards\[0\] \(answer\) raised KeyError: .*no "
                                          "field 'solution'"):
        _score({"rewards": [{"kind": "answer", "field": "solution"}]}, ["<answer>1</answer>"])
