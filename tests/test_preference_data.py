"""Preference data (training.method dpo, orpo, kto): every format parses, masks only the answers, and every
malformed variant names its file and line."""

from __future__ import annotations

import json

import pytest

from finetune.data import build_datasets, preview
from finetune.data.chat import IGNORE_INDEX
from finetune.errors import DataError
from finetune.recipe.schema import DataConfig

MESSAGES_PAIR = {"prompt": [{"role": "user", "content": "Name a colour."}],
                 "chosen": [{"role": "assistant", "content": "Blue."}],
                 "rejected": [{"role": "assistant", "content": "Seven."}]}
STRING_PAIR = {"prompt": "Name a fruit.", "chosen": "An apple.", "rejected": "A chair."}
SHAREGPT_PAIR = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
                                   {"from": "human", "value": "Say yes."}],
                 "chosen": {"from": "gpt", "value": "Yes."}, "rejected": {"from": "gpt", "value": "No."}}
KTO = [{"prompt": "2+2?", "completion": "4", "label": True}, {"prompt": "2+2?", "completion": "5", "label": False}]


def _jsonl(tmp_path, records, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def _answer_text(tokenizer, ids, labels):
    return tokenizer.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])


@pytest.mark.parametrize(("record", "fmt", "chosen", "rejected"), [
    (STRING_PAIR, "preference", "An apple.", "A chair."),
    (MESSAGES_PAIR, "preference", "Blue.", "Seven."),
    (SHAREGPT_PAIR, "sharegpt_preference", "Yes.", "No."),
])
def test_pair_formats_parse_and_mask_the_prompt(tmp_path, tiny_tokenizer, record, fmt, chosen, rejected):
    path = _jsonl(tmp_path, [record] * 3)
    bundle = build_datasets(DataConfig(path=str(path)), tiny_tokenizer, seed=0, method="dpo")
    assert bundle.stats["format"] == fmt and len(bundle.train) == 3
    row = bundle.train[0]
    # Only the last answer carries loss (not the earlier assistant turn of the sharegpt conversation).
    assert _answer_text(tiny_tokenizer, row["chosen_input_ids"], row["chosen_labels"]).startswith(chosen)
    assert _answer_text(tiny_tokenizer, row["rejected_input_ids"], row["rejected_labels"]).startswith(rejected)
    batch = bundle.collator([bundle.train[0], bundle.train[1]])
    assert batch["input_ids"].shape[0] == 4  # chosen rows, then rejected rows, in one batch
    assert batch["input_ids"][0].tolist()[:len(row["chosen_input_ids"])] == row["chosen_input_ids"]
    assert batch["input_ids"][2].tolist()[:len(row["rejected_input_ids"])] == row["rejected_input_ids"]


def test_kto_format_and_pairs_split_for_kto(tmp_path, tiny_tokenizer):
    bundle = build_datasets(DataConfig(path=str(_jsonl(tmp_path, KTO))), tiny_tokenizer, seed=0, method="kto")
    assert bundle.stats["format"] == "kto" and bundle.train["kto_label"] == [True, False]
    batch = bundle.collator([bundle.train[0], bundle.train[1]])
    assert batch["kto_label"].tolist() == [True, False] and batch["input_ids"].shape[0] == 2
    pairs = build_datasets(DataConfig(path=str(_jsonl(tmp_path, [STRING_PAIR], "p.jsonl"))), tiny_tokenizer, 0,
                           method="kto")
    assert pairs.train["kto_label"] == [True, False]


def test_shared_sharegpt_sample_parses(shared_datasets, tiny_tokenizer):
    from finetune.data.read import read_records

    path = str(shared_datasets / "dpo_en_demo.json")
    records = [r.value for r in read_records(path).records]
    assert len(records) == 300
    bundle = build_datasets(DataConfig(path=path, max_seq_len=256, on_bad_record="skip"), tiny_tokenizer, seed=0,
                            method="dpo")
    assert bundle.stats["format"] == "sharegpt_preference"
    # Long prompts are cut so that both answers keep their tokens; nothing is left without loss.
    assert bundle.stats["truncated"] > 0 and bundle.stats["prompts_cut"] > 0 and bundle.stats["dropped_no_loss"] == 0
    assert len(bundle.train) + bundle.stats["dropped_overlong"] == len(records)
    assert bundle.stats["dropped_overlong"] <= 3


@pytest.mark.parametrize(("record", "message"), [
    ({"prompt": "q", "chosen": "a"}, "missing 'rejected'"),  # detected by a good first record
    ({"prompt": "q", "chosen": "", "rejected": "b"}, "'chosen' has no assistant answer"),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, "'chosen' is a int"),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, "'prompt' is empty"),
    ({"prompt": [{"role": "wizard", "content": "x"}], "chosen": "a", "rejected": "b"}, "unknown role 'wizard'"),
])
def test_malformed_pairs_name_file_and_line(tmp_path, tiny_tokenizer, record, message):
    path = _jsonl(tmp_path, [STRING_PAIR, record])
    with pytest.raises(DataError) as info:
        build_datasets(DataConfig(path=str(path)), tiny_tokenizer, seed=0, method="dpo")
    text = str(info.value) + "\n".join(info.value.problems)
    assert f"{path}:2: " in text and message in text


@pytest.mark.parametrize(("record", "message"), [
    ({**SHAREGPT_PAIR, "chosen": {"from": "gpt", "value": " "}}, "chosen[0]: the 'gpt' turn's 'value' is empty"),
    ({**SHAREGPT_PAIR, "rejected": {"from": "robot", "value": "x"}}, "unknown role 'robot'"),
    ({**SHAREGPT_PAIR, "rejected": 5}, "'rejected' is a int, not a turn or a list of turns"),
    ({k: v for k, v in SHAREGPT_PAIR.items() if k != "rejected"}, "missing 'rejected'"),
])
def test_malformed_sharegpt_pairs_name_file_and_line(tmp_path, tiny_tokenizer, record, message):
    path = _jsonl(tmp_path, [SHAREGPT_PAIR, record])
    with pytest.raises(DataError) as info:
        build_datasets(DataConfig(path=str(path)), tiny_tokenizer, seed=0, method="dpo")
    assert any(p.startswith(f"{path}:2: ") and message in p for p in info.value.problems), info.value.problems


@pytest.mark.parametrize(("record", "message"), [
    ({"prompt": "q", "completion": "a", "label": "maybe"}, "'label' is 'maybe', not true or false"),
    ({"prompt": "q", "completion": "", "label": True}, "'completion' has no assistant answer"),
])
def test_malformed_kto_names_file_and_line(tmp_path, tiny_tokenizer, record, message):
    path = _jsonl(tmp_path, [KTO[0], record])
    with pytest.raises(DataError) as info:
        build_datasets(DataConfig(path=str(path)), tiny_tokenizer, seed=0, method="kto")
    assert any(p.startswith(f"{path}:2: ") and message in p for p in info.value.problems), info.value.problems


def test_overlong_pairs_are_dropped_or_cut_and_counted(tmp_path, tiny_tokenizer):
    long = {"prompt": "q", "chosen": "short", "rejected": "word " * 200}
    path = _jsonl(tmp_path, [STRING_PAIR, long])
    dropped = build_datasets(DataConfig(path=str(path), max_seq_len=64, overlong="drop"), tiny_tokenizer, 0, "dpo")
    assert dropped.stats["dropped_overlong"] == 1 and len(dropped.train) == 1
    cut = build_datasets(DataConfig(path=str(path), max_seq_len=64), tiny_tokenizer, 0, "dpo")
    assert cut.stats["truncated"] == 1 and len(cut.train) == 2
    assert max(len(ids) for ids in cut.train["rejected_input_ids"]) == 64


def test_a_pair_with_a_long_prompt_keeps_both_answers_after_one_shared_prompt(tmp_path, tiny_tokenizer):
    question = "The quick brown fox jumps over the lazy dog. " * 30 + "Is that a pangram?"
    pair = {"prompt": question, "chosen": "Yes, every letter is in it.", "rejected": "No."}
    path = _jsonl(tmp_path, [STRING_PAIR, pair])
    full = build_datasets(DataConfig(path=str(path), max_seq_len=4096), tiny_tokenizer, 0, "dpo").train
    cut = build_datasets(DataConfig(path=str(path), max_seq_len=64), tiny_tokenizer, 0, "dpo")
    assert cut.stats["prompts_cut"] == 1 and len(cut.train) == 2
    row, whole = cut.train[1], full[1]
    for side in ("chosen", "rejected"):
        ids, labels = row[f"{side}_input_ids"], row[f"{side}_labels"]
        first = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
        n = len(ids) - first  # the answer and its end token, with their labels, as in the uncut pair
        assert len(ids) <= 64 and ids[-n:] == whole[f"{side}_input_ids"][-n:]
        assert labels[-n:] == whole[f"{side}_labels"][-n:]
        assert tiny_tokenizer.decode(ids[:first]).endswith("lazy dog. Is that a pangram?<|im_end|>\n"
                                                           "<|im_start|>assistant\n")
    chosen, rejected = row["chosen_labels"], row["rejected_labels"]
    prompt_len = next(i for i, label in enumerate(chosen) if label != IGNORE_INDEX)
    assert prompt_len == next(i for i, label in enumerate(rejected) if label != IGNORE_INDEX)
    assert row["chosen_input_ids"][:prompt_len] == row["rejected_input_ids"][:prompt_len]  # one prompt for both
    kto = build_datasets(DataConfig(path=str(path), max_seq_len=64), tiny_tokenizer, 0, "kto")
    assert len(kto.train) == 4 and kto.stats["prompts_cut"] == 2


def test_method_and_format_must_agree(tmp_path, tiny_tokenizer):
    pairs, sft = _jsonl(tmp_path, [STRING_PAIR]), _jsonl(tmp_path, [{"text": "hello"}], "t.jsonl")
    with pytest.raises(DataError, match="preference data .*training.method is sft"):
        build_datasets(DataConfig(path=str(pairs)), tiny_tokenizer, 0)
    with pytest.raises(DataError, match="needs preference data"):
        build_datasets(DataConfig(path=str(sft)), tiny_tokenizer, 0, "orpo")
    with pytest.raises(DataError, match="needs chosen/rejected pairs"):
        build_datasets(DataConfig(path=str(_jsonl(tmp_path, KTO, "k.jsonl"))), tiny_tokenizer, 0, "dpo")


def test_preview_shows_chosen_and_rejected_loss_tokens(tmp_path, tiny_tokenizer):
    shown, = preview(DataConfig(path=str(_jsonl(tmp_path, [STRING_PAIR]))), tiny_tokenizer, n=1)
    assert "".join(t for t, loss in shown["tokens"] if loss).startswith("An apple.")
    assert "".join(t for t, loss in shown["rejected_tokens"] if loss).startswith("A chair.")
    assert not any(loss for t, loss in shown["tokens"] if "fruit" in t)


def test_ui_preview_colours_chosen_and_rejected_loss_tokens(tmp_path, tiny_tokenizer):
    from ui.tabs.data import CHOSEN, GOOD, REJECTED, highlighted

    pair, = preview(DataConfig(path=str(_jsonl(tmp_path, [STRING_PAIR]))), tiny_tokenizer, n=1)
    shown = highlighted(pair)
    assert "".join(t for t, c in shown if c == CHOSEN).startswith("An apple.")
    assert "".join(t for t, c in shown if c == REJECTED).startswith("A chair.")
    assert [c for _, c in shown].index(REJECTED) > [t for t, _ in shown].index("\n\n── rejected ──\n\n")
    good, = preview(DataConfig(path=str(_jsonl(tmp_path, KTO[:1], "k.jsonl"))), tiny_tokenizer, n=1)
    assert "".join(t for t, c in highlighted(good) if c == GOOD).startswith("4")


def test_ui_preview_legend_names_only_the_categories_of_the_data(tmp_path, tiny_tokenizer):
    """SFT data used to show the chosen/rejected/good/bad legend of preference data beside its loss tokens."""
    from ui.tabs.data import BAD, CHOSEN, GOOD, REJECTED, example_update

    sft = {"messages": [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "An apple."}]}
    cases = {"sft.jsonl": ([sft], {"loss"}), "pair.jsonl": ([STRING_PAIR], {CHOSEN, REJECTED}),
             "kto.jsonl": (KTO, {GOOD, BAD})}
    for name, (records, legend) in cases.items():
        examples = preview(DataConfig(path=str(_jsonl(tmp_path, records, name))), tiny_tokenizer, n=len(records))
        shown = set().union(*(example_update(ex)["color_map"] for ex in examples))
        assert shown == legend, name
    assert example_update(None)["color_map"] == {} and example_update(None)["value"] == []
