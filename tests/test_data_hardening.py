"""Hostile and careless data: every bad record is named with its file and line, or skipped and counted;
huge records are tokenized only as far as max_seq_len; records without loss are named."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from finetune.data import build_datasets
from finetune.data import chat as chat_module
from finetune.errors import DataError
from finetune.recipe.schema import DataConfig

GOOD = {"instruction": "What is the capital of France?", "output": "The capital is Paris."}
USER, ASSISTANT = {"role": "user", "content": "a question"}, {"role": "assistant", "content": "an answer"}


def build(path: Path, tokenizer, **kwargs):
    return build_datasets(DataConfig(path=str(path), **kwargs), tokenizer, 0)


def jsonl_with_bad_line_3(tmp_path: Path, bad: bytes, good=GOOD) -> Path:
    """Five lines, the third one `bad` (raw bytes, written as they are)."""
    line = json.dumps(good).encode()
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join([line, line, bad, line, line]) + b"\n")
    return path


def test_a_bad_byte_on_line_3_names_line_3_and_skip_keeps_the_other_lines(tmp_path, tiny_tokenizer):
    path = jsonl_with_bad_line_3(tmp_path, b'{"instruction": "caf\xe9", "output": "ok"}')
    with pytest.raises(DataError) as info:
        build(path, tiny_tokenizer)
    assert f"{path}:3: contains byte 0xE9 that is not UTF-8" in str(info.value)
    bundle = build(path, tiny_tokenizer, on_bad_record="skip")
    assert bundle.stats["bad_records_skipped"] == 1 and bundle.stats["bad_records_at"] == [f"{path}:3"]
    assert bundle.stats["train_examples"] == 4


MESSAGES_GOOD = {"messages": [USER, ASSISTANT]}


@pytest.mark.parametrize(("bad", "good", "problem"), [
    (b'{"instruction": "a\\ud800", "output": "b"}', GOOD, r"contains an unpaired surrogate \\ud800 escape"),
    (b'{"instruction": "a", "output": "\\udcff"}', GOOD, "contains byte 0xFF that is not UTF-8"),
    (b'{"instruction": "a\x00", "output": "b"}', GOOD, "not valid JSON \\(Invalid control character"),
    (b'{"instruction": "a", "output": "b", "n": ' + b"7" * 5000 + b"}", GOOD, "a number too long to read"),
    (b'{"instruction": "a", "output": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", GOOD, "nested too deeply"),
    (b'{"instruction": ["a"], "output": "b"}', GOOD, "'instruction' is a list, not a string"),
    (b'{"instruction": "a", "output": "b", "system": 5}', GOOD, "'system' is a int, not a string"),
    (b'{"instruction": "a", "output": "b", "history": [[1, 2]]}', GOOD, r"history\[0\] is not a \[question, answer\]"),
    (b"[1, 2]", GOOD, "is a list, not an object"),
    (b'{"instruction": "a", "output": "b"', GOOD, "not valid JSON"),
    (json.dumps({"messages": [ASSISTANT, USER]}).encode(), MESSAGES_GOOD, "turn 0 is from the assistant"),
    (json.dumps({"messages": [{"role": "system", "content": "s"}, ASSISTANT]}).encode(), MESSAGES_GOOD,
     "turn 1 is from the assistant"),
    (json.dumps({"messages": [USER, {"role": "assistant", "content": " "}]}).encode(), MESSAGES_GOOD,
     r"messages\[1\]: the assistant's 'content' is empty"),
    (json.dumps({"messages": [USER, {"role": "assistant", "content": None}]}).encode(), MESSAGES_GOOD,
     r"messages\[1\]: 'content' is a NoneType"),
    (json.dumps({"messages": [USER, {"role": 7, "content": "x"}]}).encode(), MESSAGES_GOOD,
     r"messages\[1\]: 'role' is a int"),
    (json.dumps({"messages": [USER, ASSISTANT], "tools": 5}).encode(), MESSAGES_GOOD, "'tools' must be a list"),
    (json.dumps({"messages": [USER, {**ASSISTANT, "tool_calls": 5}]}).encode(), MESSAGES_GOOD, None),
    (json.dumps({"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "x"}]}).encode(),
     {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}, "turn 0 is from the assistant"),
    (json.dumps({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": ""}]}).encode(),
     {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
     r"conversations\[1\]: the 'gpt' turn's 'value' is empty"),
    (b'{"text": {"nested": true}}', {"text": "some text"}, "'text' is a dict, not a string"),
    (b'{"text": "\\ud83d"}', {"text": "some text"}, r"contains an unpaired surrogate \\ud83d"),
])
def test_each_malformed_record_is_named_by_line_or_skipped_and_counted(tmp_path, tiny_tokenizer, bad, good, problem):
    path = jsonl_with_bad_line_3(tmp_path, bad, good)
    if problem is None:  # a value the template ignores: the record is fine
        assert build(path, tiny_tokenizer).stats["train_examples"] == 5
        return
    with pytest.raises(DataError, match=rf"  - {path}:3: {problem}"):
        build(path, tiny_tokenizer)
    bundle = build(path, tiny_tokenizer, on_bad_record="skip")
    assert bundle.stats["bad_records_skipped"] == 1 and bundle.stats["train_examples"] == 4


def test_a_conversation_without_an_answer_is_named_and_counted(tmp_path, tiny_tokenizer):
    path = jsonl_with_bad_line_3(tmp_path, json.dumps({"messages": [USER]}).encode(), MESSAGES_GOOD)
    with pytest.raises(DataError, match=rf"1 record\(s\) have no tokens to train on\n  - {path}:3: nothing to train on"):
        build(path, tiny_tokenizer)
    bundle = build(path, tiny_tokenizer, on_bad_record="skip")
    assert bundle.stats["dropped_no_loss"] == 1 and bundle.stats["no_loss_at"] == [f"{path}:3"]
    assert bundle.stats["train_examples"] == 4


@pytest.mark.parametrize(("value", "problem"), [
    ("7" * 5000, "a number too long to read"), ("[" * 50_000 + "]" * 50_000, "nested too deeply to read"),
])
def test_unreadable_values_in_a_json_array_name_their_line(tmp_path, tiny_tokenizer, value, problem):
    path = tmp_path / "data.json"
    good = json.dumps(GOOD)
    path.write_text(f'[\n{good},\n{good},\n{{"instruction": "a", "output": "b", "n": {value}}}\n]')
    with pytest.raises(DataError, match=rf"^{path}:4: {problem}"):
        build(path, tiny_tokenizer)


def test_bom_and_crlf_are_read(tmp_path, tiny_tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(json.dumps(GOOD).encode() for _ in range(3)) + b"\r\n")
    assert build(path, tiny_tokenizer).stats["train_examples"] == 3


def save_to_disk(tmp_path: Path) -> Path:
    import datasets

    path = tmp_path / "saved"
    datasets.Dataset.from_list([GOOD] * 20).save_to_disk(str(path))
    return path


@pytest.mark.parametrize(("damage", "problem"), [
    (lambda p: next(p.glob("*.arrow")).unlink(), "with files missing"),
    (lambda p: next(p.glob("*.arrow")).write_bytes(next(p.glob("*.arrow")).read_bytes()[:300]), "damaged"),
    (lambda p: next(p.glob("*.arrow")).write_bytes(b""), "damaged"),
    (lambda p: (p / "state.json").write_text("{oops"), "damaged"),
    (lambda p: (p / "state.json").write_text("[]"), "damaged"),
    (lambda p: (p / "dataset_info.json").write_text("{oops"), "damaged"),
    (lambda p: (p / "state.json").write_text(json.dumps(
        {**json.loads((p / "state.json").read_text()), "_data_files": []})), "damaged"),
])
def test_a_damaged_save_to_disk_folder_is_named(tmp_path, tiny_tokenizer, damage, problem):
    path = save_to_disk(tmp_path)
    assert build(path, tiny_tokenizer).stats["train_examples"] == 20
    damage(path)
    with pytest.raises(DataError, match=problem) as info:
        build(path, tiny_tokenizer, on_bad_record="skip")
    assert str(path) in str(info.value)


class _Recording:
    """Wraps a tokenizer's class so that every call records the longest text it was given."""

    @staticmethod
    def install(tokenizer) -> list[int]:
        longest: list[int] = []
        base = type(tokenizer)

        class Recording(base):
            def __call__(self, text, *args, **kwargs):
                longest.append(max(map(len, text)) if isinstance(text, list) else len(text))
                return super().__call__(text, *args, **kwargs)

        tokenizer.__class__ = Recording
        return longest


@pytest.mark.parametrize("fmt", ["alpaca", "text"])
def test_a_20_mb_record_is_tokenized_only_as_far_as_max_seq_len(tmp_path, fmt):
    from finetune.testing import make_tokenizer

    tokenizer = make_tokenizer()
    longest = _Recording.install(tokenizer)
    huge = "The quick brown fox jumps over the lazy dog. " * 450_000  # 20 MB
    record = {"instruction": "Say it.", "output": huge} if fmt == "alpaca" else {"text": huge}
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD if fmt == "alpaca" else {"text": "short"}) + "\n" + json.dumps(record) + "\n")
    tracemalloc.start()
    try:
        bundle = build(path, tokenizer, max_seq_len=64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert bundle.stats["truncated"] == 1 and bundle.stats["max_example_tokens"] == 64
    assert max(longest) < 64 * 100  # characters given to the tokenizer at once, not 20 million
    assert peak < 250 * 2**20, f"peak Python allocation {peak / 2**20:.0f} MiB"
    dropped = build(path, tokenizer, max_seq_len=64, overlong="drop")
    assert dropped.stats["dropped_overlong"] == 1 and dropped.stats["train_examples"] == 1


@pytest.mark.parametrize("fmt", ["alpaca", "text"])
def test_cut_tokenization_equals_whole_tokenization(tmp_path, tiny_tokenizer, fmt, monkeypatch):
    """Same ids and labels as tokenizing whole and cutting, even when the first cut is far too short."""
    long = "".join(f"The quick brown fox {i} jumps over the lazy dog. " for i in range(3000))
    record = {"instruction": long[:200], "output": long} if fmt == "alpaca" else {"text": long}  # a prompt not cut
    path = tmp_path / "data.json"
    path.write_text(json.dumps([record, GOOD if fmt == "alpaca" else {"text": "short"}]))
    whole = build(path, tiny_tokenizer, max_seq_len=100_000)
    assert whole.stats["truncated"] == 0
    for chars_per_token in (16, 1):  # 1: the first cut holds too few tokens and must be retried longer
        monkeypatch.setattr(chat_module, "PREFIX_CHARS_PER_TOKEN", chars_per_token)
        monkeypatch.setattr(chat_module, "PREFIX_MARGIN", 8)
        for max_seq_len in (1500, 2000):
            cut = build(path, tiny_tokenizer, max_seq_len=max_seq_len, on_bad_record="skip")
            assert cut.stats["truncated"] == 1
            assert cut.train["input_ids"] == [ids[:max_seq_len] for ids in whole.train["input_ids"]]
            assert cut.train["labels"] == [labels[:max_seq_len] for labels in whole.train["labels"]]


def test_cli_reports_a_bad_record_with_its_line_and_exit_code_3(tmp_path, tiny_model_dir, capsys):
    import yaml

    from finetune.cli import main

    bad = json.dumps({"messages": [USER, {"role": "[/red]", "content": "x"}]}).encode()
    path = jsonl_with_bad_line_3(tmp_path, bad, MESSAGES_GOOD)
    recipe = {"model": {"path": str(tiny_model_dir)}, "quantization": {"bits": None},
              "data": {"path": str(path), "max_seq_len": 64}, "training": {"max_steps": 1},
              "output": {"dir": str(tmp_path / "run")}}
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe))
    assert main(["run", str(recipe_path)]) == 3
    err = capsys.readouterr().err
    assert f"{path}:3: messages[1]: unknown role '[/red]'" in err.replace("\n", "")
    assert "Traceback" not in err


def test_a_template_that_rewrites_earlier_turns_or_fails_names_the_record(tmp_path, tiny_tokenizer):
    path = jsonl_with_bad_line_3(tmp_path, json.dumps(MESSAGES_GOOD).encode(), MESSAGES_GOOD)
    rewriting = "{% for m in messages %}{{ m['content'] }}{{ messages | length }}{% endfor %}"
    with pytest.raises(DataError, match=rf"{path}:1: the chat template renders the conversation differently"):
        build(path, tiny_tokenizer, chat_template=rewriting)
    failing = "{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}"
    with pytest.raises(DataError, match=rf"{path}:1: the chat template fails on this conversation \(TypeError"):
        build(path, tiny_tokenizer, chat_template=failing)
