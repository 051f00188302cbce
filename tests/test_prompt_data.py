"""Prompt-only records for GRPO: rendered with the chat template and its generation prompt, as SFT renders
chats, with every other key kept as a field for the rewards."""

from __future__ import annotations

import json

import pytest

from finetune.data.formats import RecordError
from finetune.data.prompts import build_prompts, prompt_chat
from finetune.errors import DataError
from finetune.recipe.schema import DataConfig


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_prompt_string_rendered_with_generation_prompt_and_fields_kept(tmp_path, tiny_tokenizer):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "What is 2 + 3?", "answer": "5", "level": 1},
                                         {"prompt": [{"role": "user", "content": "And 4 + 4?"}], "answer": 8}])
    bundle = build_prompts(DataConfig(path=path, system_prompt="Be brief."), tiny_tokenizer, seed=0)
    first, second = bundle.train
    assert first.text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                          "<|im_start|>assistant\n")
    assert first.fields == {"answer": "5", "level": 1} and second.fields == {"answer": 8}
    assert tiny_tokenizer.decode(first.input_ids) == first.text
    assert first.input_ids == tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert first.where == f"{path}:1" and bundle.stats["fields"] == ["answer", "level"]


def test_messages_must_end_with_the_user_turn(tmp_path, tiny_tokenizer):
    path = _write(tmp_path / "p.jsonl", [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                      {"role": "user", "content": "what is 1 + 1?"}], "answer": "2"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"question": "no prompt here"}])
    with pytest.raises(DataError) as err:
        build_prompts(DataConfig(path=path), tiny_tokenizer, seed=0)
    assert err.value.problems[0].startswith(f"{path}:2: its last turn is from the assistant; a prompt ends with "
                                            "the user's turn")
    assert err.value.problems[1].startswith(f"{path}:3: has no 'prompt' or 'messages' (keys: question)")
    bundle = build_prompts(DataConfig(path=path, on_bad_record="skip"), tiny_tokenizer, seed=0)
    assert [p.where for p in bundle.train] == [f"{path}:1"] and bundle.stats["bad_records_skipped"] == 2
    assert bundle.train[0].text.endswith("<|im_start|>user\nwhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n")


def test_split_sampling_and_overlong_prompts(tmp_path, tiny_tokenizer):
    records = [{"prompt": f"What is {i} + {i}?", "answer": 2 * i} for i in range(40)]
    records.append({"prompt": "word " * 400, "answer": 0})
    path = _write(tmp_path / "p.jsonl", records)
    bundle = build_prompts(DataConfig(path=path, validation_split=0.25), tiny_tokenizer, seed=0,
                           max_prompt_tokens=64)
    assert bundle.stats["dropped_overlong"] == 1
    assert (len(bundle.train), len(bundle.eval)) == (30, 10)
    again = build_prompts(DataConfig(path=path, validation_split=0.25), tiny_tokenizer, seed=0, max_prompt_tokens=64)
    assert [p.where for p in again.eval] == [p.where for p in bundle.eval]  # seeded
    assert {p.fields["answer"] for p in bundle.train + bundle.eval} == {2 * i for i in range(40)}


def test_prompt_chat_refuses_a_conversation_opened_by_the_assistant():
    with pytest.raises(RecordError, match="turn 0 is from the assistant"):
        prompt_chat({"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "q"}]})
