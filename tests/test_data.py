"""The data pipeline on the tiny tokenizer: exact ids and loss masks per format, readers, errors, counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.data import build_datasets, detect_format, preview
from finetune.data.chat import TOOLS_PREAMBLE
from finetune.errors import DataError, RecipeError
from finetune.recipe.schema import DataConfig
from finetune.testing import CHATML_TEMPLATE

IGNORE = -100
ALPACA = [
    {"instruction": "What is the capital of France?", "input": "", "output": "The capital is Paris."},
    {"instruction": "Answer the question.", "input": "What is 2+2?", "output": "4"},
    {"instruction": "Say hi.", "output": "hi", "system": "Be brief."},
]


def write_json(tmp_path: Path, records, name: str = "data.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(records))
    return path


def write_jsonl(tmp_path: Path, lines: list, name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def build(path: Path, tokenizer, seed: int = 0, **kwargs):
    return build_datasets(DataConfig(path=str(path), **kwargs), tokenizer, seed)


class Expected:
    """Builds expected ChatML token ids and labels piece by piece, independently of the pipeline."""

    def __init__(self, tok):
        self.tok, self.ids, self.labels = tok, [], []

    def add(self, text: str, loss: bool = False, special: bool = False) -> Expected:
        ids = [self.tok.convert_tokens_to_ids(text)] if special else self.tok.encode(text, add_special_tokens=False)
        self.ids += ids
        self.labels += ids if loss else [IGNORE] * len(ids)
        return self

    def turn(self, role: str, content: str) -> Expected:
        loss = role == "assistant"
        self.add("<|im_start|>", special=True).add(role + "\n")
        return self.add(content, loss).add("<|im_end|>", loss, special=True).add("\n")

    def result(self) -> tuple[list[int], list[int]]:
        return self.ids, [IGNORE, *self.labels[1:]]


def rows(dataset) -> list[tuple[list[int], list[int]]]:
    return list(zip(dataset["input_ids"], dataset["labels"], strict=True))


def test_alpaca_becomes_exact_chatml_ids_with_loss_on_the_answer_only(tmp_path, tiny_tokenizer):
    bundle = build(write_json(tmp_path, ALPACA), tiny_tokenizer)
    expected = [
        Expected(tiny_tokenizer).turn("user", "What is the capital of France?").turn("assistant", "The capital is Paris.").result(),
        Expected(tiny_tokenizer).turn("user", "Answer the question.\nWhat is 2+2?").turn("assistant", "4").result(),
        Expected(tiny_tokenizer).turn("system", "Be brief.").turn("user", "Say hi.").turn("assistant", "hi").result(),
    ]
    assert rows(bundle.train) == expected
    assert bundle.eval is None
    assert bundle.stats["format"] == "alpaca" and bundle.stats["train_examples"] == 3
    assert bundle.stats["loss_tokens"] == sum(sum(x != IGNORE for x in labels) for _, labels in expected)


def test_messages_multi_turn_and_system_prompt(tmp_path, tiny_tokenizer):
    record = {"messages": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And the dog?"},
        {"role": "assistant", "content": "The lazy dog."},
    ]}
    bundle = build(write_jsonl(tmp_path, [record]), tiny_tokenizer, system_prompt="Be brief.")
    expected = (Expected(tiny_tokenizer).turn("system", "Be brief.").turn("user", "What is the capital of France?")
                .turn("assistant", "Paris.").turn("user", "And the dog?").turn("assistant", "The lazy dog.").result())
    assert rows(bundle.train) == [expected]
    assert bundle.stats["format"] == "messages"


def test_sharegpt_function_call_trained_observation_not_tools_in_system(tmp_path, tiny_tokenizer):
    tools = [{"name": "capital", "description": "Capital of a country", "parameters": {"type": "object"}}]
    call = '{"name": "capital", "arguments": {"country": "France"}}'
    record = {"conversations": [
        {"from": "human", "value": "What is the capital of France?"},
        {"from": "function_call", "value": call},
        {"from": "observation", "value": '{"capital": "Paris"}'},
        {"from": "gpt", "value": "The capital is Paris."},
    ], "tools": json.dumps(tools)}
    bundle = build(write_json(tmp_path, [record]), tiny_tokenizer)
    expected = (Expected(tiny_tokenizer).turn("system", TOOLS_PREAMBLE + json.dumps(tools, indent=2))
                .turn("user", "What is the capital of France?").turn("assistant", call)
                .turn("tool", '{"capital": "Paris"}').turn("assistant", "The capital is Paris.").result())
    assert rows(bundle.train) == [expected]
    assert bundle.stats["format"] == "sharegpt"


def test_text_gets_eos_and_loss_on_every_predicted_token(tmp_path, tiny_tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    bundle = build(write_jsonl(tmp_path, [{"text": text}]), tiny_tokenizer)
    ids = tiny_tokenizer.encode(text) + [tiny_tokenizer.eos_token_id]
    assert rows(bundle.train) == [(ids, [IGNORE, *ids[1:]])]
    assert bundle.stats["format"] == "text" and bundle.stats["loss_tokens"] == len(ids) - 1


def test_assistant_only_loss_off_trains_on_the_whole_conversation(tmp_path, tiny_tokenizer):
    bundle = build(write_json(tmp_path, ALPACA[:1]), tiny_tokenizer, assistant_only_loss=False)
    (ids, labels), = rows(bundle.train)
    assert labels == [IGNORE, *ids[1:]]


def test_masks_match_transformers_generation_markers(tmp_path, tiny_tokenizer):
    """On a template with {% generation %} blocks, transformers' own assistant mask equals ours."""
    marked = CHATML_TEMPLATE.replace(
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}",
        "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
        "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
        "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}")
    template_file = tmp_path / "marked.jinja"
    template_file.write_text(marked)
    record = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"},
                           {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Sure?"},
                           {"role": "assistant", "content": "The capital of France is Paris."}]}
    bundle = build(write_json(tmp_path, [record]), tiny_tokenizer, chat_template=str(template_file))
    reference = tiny_tokenizer.apply_chat_template(record["messages"], chat_template=marked, tokenize=True,
                                                   return_dict=True, return_assistant_tokens_mask=True)
    (ids, labels), = rows(bundle.train)
    assert ids == reference["input_ids"]
    assert [label != IGNORE for label in labels] == [bool(m) for m in reference["assistant_masks"]]
    assert sum(reference["assistant_masks"]) > 0


def test_template_with_native_tools_gets_tools_and_structured_calls(tmp_path, tiny_tokenizer):
    template = (
        "{% if tools %}<|im_start|>system\n{% for t in tools %}TOOL {{ t['name'] }}\n{% endfor %}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "CALL {{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}{% endfor %}"
        "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    record = {"conversations": [{"from": "human", "value": "Capital?"},
                                {"from": "function_call", "value": '{"name": "capital", "arguments": {"c": "FR"}}'},
                                {"from": "observation", "value": "Paris"}, {"from": "gpt", "value": "Paris."}],
              "tools": [{"name": "capital"}]}
    bundle = build(write_json(tmp_path, [record]), tiny_tokenizer, chat_template=template)
    expected = (Expected(tiny_tokenizer).add("<|im_start|>", special=True).add("system\nTOOL capital\n")
                .add("<|im_end|>", special=True).add("\n").turn("user", "Capital?")
                .turn("assistant", 'CALL capital {"c": "FR"}').turn("tool", "Paris").turn("assistant", "Paris.").result())
    assert rows(bundle.train) == [expected]


def test_jsonl_csv_parquet_save_to_disk_and_json_object_load_the_same(tmp_path, tiny_tokenizer):
    import datasets
    import pandas as pd

    records = [{"instruction": r["instruction"], "input": r.get("input", ""), "output": r["output"]} for r in ALPACA]
    paths = [write_json(tmp_path, records), write_jsonl(tmp_path, records),
             write_json(tmp_path, {f"id{i}": r for i, r in enumerate(records)}, "object.json"),
             write_json(tmp_path, {"data": records}, "wrapped.json")]
    pd.DataFrame(records).to_csv(tmp_path / "data.csv", index=False)
    pd.DataFrame(records).to_parquet(tmp_path / "data.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    jsonl_named_json = tmp_path / "lines.json"
    jsonl_named_json.write_text(paths[1].read_text())
    paths += [tmp_path / "data.csv", tmp_path / "data.parquet", tmp_path / "saved", jsonl_named_json]
    reference = rows(build(paths[0], tiny_tokenizer).train)
    assert len(reference) == 3
    for path in paths[1:]:
        assert rows(build(path, tiny_tokenizer).train) == reference, path


def test_nested_messages_from_parquet_and_csv(tmp_path, tiny_tokenizer):
    import pandas as pd

    records = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    pd.DataFrame(records).to_parquet(tmp_path / "m.parquet")
    pd.DataFrame([{"messages": json.dumps(r["messages"])} for r in records]).to_csv(tmp_path / "m.csv", index=False)
    reference = rows(build(write_jsonl(tmp_path, records), tiny_tokenizer).train)
    assert rows(build(tmp_path / "m.parquet", tiny_tokenizer).train) == reference
    assert rows(build(tmp_path / "m.csv", tiny_tokenizer).train) == reference


def test_detect_format():
    assert detect_format([{"instruction": "a", "input": "", "output": "b"}]) == "alpaca"
    assert detect_format([{"messages": [{"role": "user", "content": "a"}]}]) == "messages"
    assert detect_format([{"conversations": [{"from": "human", "value": "a"}]}]) == "sharegpt"
    assert detect_format([{"text": "a"}]) == "text"
    assert detect_format([{"other": 1}, {"text": "a"}, {"text": "b"}]) == "text"
    with pytest.raises(ValueError, match="cannot detect.*'prompt'"):
        detect_format([{"prompt": "a"}])


def test_bad_records_name_file_and_line_and_skip_mode_counts(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path, [
        ALPACA[0], "{not json", {"instruction": "x"}, ALPACA[1], {"instruction": "x", "output": 3}, ALPACA[2]])
    with pytest.raises(DataError) as info:
        build(path, tiny_tokenizer)
    message = str(info.value)
    assert "3 malformed" in message
    assert f"{path}:2: not valid JSON" in message
    assert f"{path}:3: missing 'output'; expected alpaca" in message
    assert f"{path}:5: 'output' is a int, not a string" in message
    assert "on_bad_record: skip" in message
    bundle = build(path, tiny_tokenizer, on_bad_record="skip")
    assert bundle.stats["bad_records_skipped"] == 3 and bundle.stats["train_examples"] == 3
    assert bundle.stats["records"] == 6


ALPACA_AS_MESSAGES = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
SHAREGPT_GOOD = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}


@pytest.mark.parametrize(("record", "problem"), [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
     "messages[1]: unknown role 'bot'"),
    ({"messages": []}, "'messages' is empty"),
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt"}]}, "conversations[1]: missing 'value'"),
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "robot", "value": "b"}]}, "conversations[1]: unknown role 'robot'"),
    ({"conversations": [{"from": "human", "value": "a"}], "tools": "[oops"}, "'tools' is a string but not valid JSON"),
    ({"messages": "hello"}, "'messages' is a str, not a list"),
])
def test_malformed_chat_records_are_named(tmp_path, tiny_tokenizer, record, problem):
    good = ALPACA_AS_MESSAGES if "messages" in record else SHAREGPT_GOOD
    path = write_json(tmp_path, [good, good, record])
    with pytest.raises(DataError) as info:
        build(path, tiny_tokenizer)
    assert f"{path} record 2: {problem}" in str(info.value)



@pytest.mark.parametrize(("content", "problem"), [
    (b"\x89PNG\r\n\x1a\n" + bytes(range(256)), "not a UTF-8 text file"),
    (b"", "is empty"),
    (b"42", "top-level JSON value is a int"),
    (b"{\"a\": ", "not valid JSON"),
    (b"[]", "contains no records"),
    (b'[{"prompt": "a"}]', "cannot detect the record format"),
])
def test_files_that_are_not_datasets(tmp_path, tiny_tokenizer, content, problem):
    path = tmp_path / "data.json"
    path.write_bytes(content)
    with pytest.raises(DataError, match=problem):
        build(path, tiny_tokenizer)


@pytest.mark.parametrize(("suffix", "problem"), [
    (".jsonl", "not a UTF-8 text file"), (".csv", "not a UTF-8 text file"), (".parquet", "not a readable Parquet file"),
])
def test_binary_file_with_a_dataset_suffix(tmp_path, tiny_tokenizer, suffix, problem):
    path = tmp_path / f"image{suffix}"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe" * 4)
    with pytest.raises(DataError, match=problem):
        build(path, tiny_tokenizer)


def test_missing_path_and_unknown_suffix(tmp_path, tiny_tokenizer):
    with pytest.raises(RecipeError, match="data.path '.*nope.json' does not exist"):  # exit 2: the recipe's
        build(tmp_path / "nope.json", tiny_tokenizer)
    (tmp_path / "data.txt").write_text("hello")
    with pytest.raises(DataError, match="unsupported file type '.txt'"):
        build(tmp_path / "data.txt", tiny_tokenizer)
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="not one written by datasets' save_to_disk"):
        build(tmp_path / "folder", tiny_tokenizer)
    (tmp_path / "bad.jsonl").write_text("{oops\nnot json\n")
    with pytest.raises(DataError, match=r"has no readable record\n  - .*bad.jsonl:1: not valid JSON"):
        build(tmp_path / "bad.jsonl", tiny_tokenizer)


def test_bad_chat_template(tmp_path, tiny_tokenizer):
    path = write_json(tmp_path, ALPACA)
    with pytest.raises(DataError, match="not valid Jinja"):
        build(path, tiny_tokenizer, chat_template="{% for m in messages %}")
    with pytest.raises(RecipeError, match="data.chat_template file .* does not exist"):
        build(path, tiny_tokenizer, chat_template=str(tmp_path / "missing.jinja"))
    rejecting = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(DataError, match="record 0: the chat template rejects this conversation: roles must alternate"):
        build(path, tiny_tokenizer, chat_template=rejecting)


def answer_tail(ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """The tokens from the first one with loss to the end: the answer and what follows it."""
    first = next(i for i, label in enumerate(labels) if label != IGNORE)
    return ids[first:], labels[first:]


FOX = "The quick brown fox jumps over the lazy dog. "


def test_overlong_prompts_are_cut_so_the_answer_keeps_its_labels(tmp_path, tiny_tokenizer):
    long_answer = {"instruction": "Say it.", "output": FOX * 20}
    long_prompt = {"instruction": FOX * 20 + "Is that a pangram?", "output": "Yes, it is.", "system": "Be brief."}
    path = write_json(tmp_path, [ALPACA[0], long_answer, long_prompt])
    full = rows(build(path, tiny_tokenizer, max_seq_len=4096).train)
    bundle = build(path, tiny_tokenizer, max_seq_len=64)  # trains with the defaults: nothing refused
    kept = rows(bundle.train)
    assert kept[:2] == [full[0], (full[1][0][:64], full[1][1][:64])]  # a long answer: cut at its end
    ids, labels = kept[2]
    assert len(ids) <= 64 and answer_tail(ids, labels) == answer_tail(*full[2])  # the whole answer, its labels
    text = tiny_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")  # the system message fits: kept
    assert "lazy dog. Is that a pangram?<|im_end|>" in text and text.count("fox") < 20  # the end of the question
    counts = {k: bundle.stats[k] for k in ("truncated", "prompts_cut", "dropped_no_loss", "dropped_overlong")}
    assert counts == {"truncated": 2, "prompts_cut": 1, "dropped_no_loss": 0, "dropped_overlong": 0}
    assert bundle.warnings == []
    dropped = build(path, tiny_tokenizer, max_seq_len=64, overlong="drop")
    assert rows(dropped.train) == [full[0]]
    assert dropped.stats["dropped_overlong"] == 2 and dropped.stats["truncated"] == 0
    assert dropped.warnings == [f"2 record(s) dropped: longer than data.max_seq_len=64 (data.overlong: drop; raise "
                                f"data.max_seq_len to keep them) (first: {path} record 1, {path} record 2)"]
    with pytest.raises(DataError, match=rf"2 record\(s\) are longer than data.max_seq_len=64 tokens\n  - {path} "
                                         r"record 1: .*\n  - .* record 2: .*\nraise data.max_seq_len"):
        build(path, tiny_tokenizer, max_seq_len=64, overlong="error")
    with pytest.raises(DataError, match="no training examples left"):
        build(write_json(tmp_path, [long_answer], "long.json"), tiny_tokenizer, max_seq_len=16, overlong="drop")


def last_answer(ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """The last run of tokens with loss and what follows it."""
    end = max(i for i, label in enumerate(labels) if label != IGNORE)
    start = end
    while start > 0 and labels[start - 1] != IGNORE:
        start -= 1
    return ids[start:], labels[start:]


def test_oldest_turns_go_first_and_a_system_message_that_does_not_fit_goes(tmp_path, tiny_tokenizer):
    exchanges = [m for i in range(6) for m in ({"role": "user", "content": f"Question {i}? {FOX}"},
                                               {"role": "assistant", "content": f"Answer {i}."})]
    record = {"messages": [{"role": "system", "content": "Be brief."}, *exchanges]}
    huge_system = {"messages": [{"role": "system", "content": FOX * 10}, *exchanges[-2:]]}
    path = write_jsonl(tmp_path, [record, huge_system])
    full = rows(build(path, tiny_tokenizer, max_seq_len=4096).train)
    (ids, labels), (ids2, labels2) = rows(build(path, tiny_tokenizer, max_seq_len=96).train)
    text = tiny_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQuestion ")
    assert "Question 0" not in text and text.endswith(f"Question 5? {FOX}<|im_end|>\n<|im_start|>assistant\n"
                                                      "Answer 5.<|im_end|>\n")
    assert last_answer(ids, labels) == last_answer(*full[0])
    assert not tiny_tokenizer.decode(ids2).startswith("<|im_start|>system")  # 450 characters: no room
    assert answer_tail(ids2, labels2) == answer_tail(*full[1])


NAMED = CHATML_TEMPLATE.replace("message['role'] + '\n'", "message['role'] + (' ' + message.name if message.name else '') + '\n'")


def test_records_whose_answer_cannot_fit_are_dropped_counted_and_named(tmp_path, tiny_tokenizer):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    # The template writes the user's name, which no prompt cut shortens: the answer cannot start within 64.
    named = {"messages": [{"role": "user", "content": "Hi", "name": "word " * 60},
                          {"role": "assistant", "content": "Hello."}]}
    path = write_jsonl(tmp_path, [good, named, good, named, named, named, good])
    bundle = build(path, tiny_tokenizer, max_seq_len=64, chat_template=NAMED)
    assert bundle.stats["train_examples"] == 3 and bundle.stats["dropped_overlong"] == 4
    assert bundle.stats["overlong_at"] == [f"{path}:2", f"{path}:4", f"{path}:5"]
    assert bundle.warnings == [f"4 record(s) dropped: no answer token fits in data.max_seq_len=64 even with the "
                               f"prompt cut (raise data.max_seq_len to keep them) (first: {path}:2, {path}:4, {path}:5)"]
    with pytest.raises(DataError, match=r"no training examples left: 4 longer than data.max_seq_len=64"):
        build(write_jsonl(tmp_path, [named] * 4, "named.jsonl"), tiny_tokenizer, max_seq_len=64, chat_template=NAMED)


def test_shared_datasets_build_at_max_seq_len_128(shared_datasets, tiny_tokenizer):
    """The brief's newcomer: the sample datasets at a short max_seq_len train, every answer starting inside."""
    for name, method in (("alpaca_en_demo.json", "sft"), ("identity.json", "sft"),
                         ("glaive_toolcall_en_demo.json", "sft"), ("dpo_en_demo.json", "dpo")):
        bundle = build_datasets(DataConfig(path=str(shared_datasets / name), max_seq_len=128), tiny_tokenizer, 0, method)
        stats = bundle.stats
        assert stats["train_examples"] + stats["dropped_overlong"] == stats["records"], name
        assert stats["dropped_overlong"] <= stats["records"] // 20 and stats["prompts_cut"] > 0, (name, stats)


def test_validation_split_and_max_samples_are_seeded_record_splits(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path, [{"text": f"record {i}"} for i in range(50)])
    bundle = build(path, tiny_tokenizer, seed=1, validation_split=0.2)
    assert (len(bundle.train), len(bundle.eval)) == (40, 10)
    assert (bundle.stats["train_examples"], bundle.stats["eval_examples"]) == (40, 10)
    train, evaluation = {tuple(x) for x in bundle.train["input_ids"]}, {tuple(x) for x in bundle.eval["input_ids"]}
    assert not train & evaluation and len(train | evaluation) == 50
    again = build(path, tiny_tokenizer, seed=1, validation_split=0.2)
    other = build(path, tiny_tokenizer, seed=2, validation_split=0.2)
    assert again.eval["input_ids"] == bundle.eval["input_ids"] != other.eval["input_ids"]
    assert len(build(path, tiny_tokenizer, validation_split=0.001).eval) == 1
    sampled = build(path, tiny_tokenizer, seed=1, max_samples=7)
    assert sampled.stats["records_used"] == 7 and len(sampled.train) == 7
    assert sampled.train["input_ids"] != build(path, tiny_tokenizer, seed=3, max_samples=7).train["input_ids"]
    with pytest.raises(DataError, match="leaves no training records"):
        build(write_jsonl(tmp_path, [{"text": "a"}], "one.jsonl"), tiny_tokenizer, validation_split=0.5)


def test_collator_pads_inputs_and_labels(tmp_path, tiny_tokenizer):
    bundle = build(write_json(tmp_path, ALPACA), tiny_tokenizer)
    short, long = sorted(rows(bundle.train), key=lambda r: len(r[0]))[::2]
    batch = bundle.collator([{"input_ids": ids, "labels": labels} for ids, labels in (short, long)])
    pad = len(long[0]) - len(short[0])
    assert batch["input_ids"][0].tolist() == short[0] + [tiny_tokenizer.pad_token_id] * pad
    assert batch["labels"][0].tolist() == short[1] + [IGNORE] * pad
    assert batch["attention_mask"].tolist() == [[1] * len(short[0]) + [0] * pad, [1] * len(long[0])]


def test_preview_marks_loss_tokens(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path, ["{broken", *ALPACA])
    shown = preview(DataConfig(path=str(path)), tiny_tokenizer, n=2)
    assert [s["where"] for s in shown] == [f"{path}:2", f"{path}:3"]
    first = shown[0]["tokens"]
    assert "".join(t for t, loss in first if loss) == "The capital is Paris.<|im_end|>"
    assert "".join(t for t, _ in first).startswith("<|im_start|>user\nWhat is the capital of France?")
