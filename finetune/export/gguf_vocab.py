"""The tokenizer as GGUF metadata: vocabulary, merges, token types, special ids, pre-tokenizer, chat template.

llama.cpp and transformers (`gguf_file=`) rebuild the tokenizer from these keys, so what is written here is
what every GGUF user tokenizes with. Only byte-level BPE vocabularies (GPT-2 style: SmolLM, Qwen2, Llama 3)
are written; llama.cpp names their pre-tokenizer (the regex that splits text before the merges) by name, so
the tokenizer's own pre-tokenizer is matched against the ones it knows and anything else is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from finetune.errors import FinetuneError

# The regex splits of tokenizer.json's Split pre-tokenizer that llama.cpp knows, by its name for them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}


@dataclass
class Vocab:
    """What GGUF stores about a tokenizer (llama.cpp's key names in the comments)."""

    tokens: list[str]            # tokenizer.ggml.tokens, by id, padded to the model's vocabulary
    token_types: list[int]       # tokenizer.ggml.token_type (gguf.TokenType)
    merges: list[str]            # tokenizer.ggml.merges, "a b", best first
    pre: str                     # tokenizer.ggml.pre
    special: dict[str, int]      # bos / eos / unk / pad ids that exist
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    end_of_turn: int | None      # the special token a chat template closes an assistant turn with


def read_vocab(tokenizer: Any, vocab_size: int) -> Vocab:
    """The GGUF view of a Hugging Face fast tokenizer, padded with unused tokens to `vocab_size` (the model's
    embedding rows); a clear refusal for a tokenizer this writer does not express."""
    import gguf

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state["model"]
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = "sentencepiece-style BPE (byte_fallback)" if model.get("byte_fallback") else model.get("type")
        raise FinetuneError(f"export --format gguf: the tokenizer is {kind}; only byte-level BPE tokenizers "
                            "(GPT-2 style, as in SmolLM, Qwen2, Llama 3) are written to GGUF so far",
                            hint="export --format safetensors and convert with llama.cpp's convert_hf_to_gguf.py")
    if len(tokenizer) > vocab_size:
        raise FinetuneError(f"export --format gguf: the tokenizer has {len(tokenizer)} tokens but the model only "
                            f"{vocab_size} embedding rows")
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = {i: tok for i, tok in tokenizer.added_tokens_decoder.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(by_id[i])
        types.append(gguf.TokenType.NORMAL if i not in added
                     else gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
    special = {name: getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "unk", "pad")}
    probe = tokenizer("a")["input_ids"]
    return Vocab(
        tokens=tokens, token_types=[int(t) for t in types],
        merges=[m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])],
        pre=_pre_tokenizer(state.get("pre_tokenizer")),
        special={k: v for k, v in special.items() if v is not None},
        add_bos=special["bos"] is not None and probe[:1] == [special["bos"]],
        add_eos=special["eos"] is not None and probe[-1:] == [special["eos"]],
        chat_template=tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
        end_of_turn=end_of_turn(tokenizer),
    )


def _pre_tokenizer(pre: dict | None) -> str:
    """llama.cpp's name for a byte-level pre-tokenizer: plain GPT-2 ("gpt-2"), digits split one by one before it
    ("smollm"), or a known regex split (Llama 3, Qwen2)."""
    steps = (pre or {}).get("pretokenizers") if (pre or {}).get("type") == "Sequence" else [pre] if pre else []
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and (name := _SPLITS.get(steps[0].get("pattern", {}).get("Regex"))):
        return name
    raise FinetuneError(f"export --format gguf: the tokenizer's pre-tokenizer {json.dumps(pre)[:300]} is not one "
                        "llama.cpp knows by name (gpt-2, smollm, llama-bpe, qwen2)",
                        hint="export --format safetensors and convert with llama.cpp's convert_hf_to_gguf.py")


def end_of_turn(tokenizer: Any) -> int | None:
    """The special token the chat template writes right after an assistant's reply (ChatML's <|im_end|>, Llama
    3's <|eot_id|>): generation must stop there, even where it is not the tokenizer's EOS."""
    if not isinstance(tokenizer.chat_template, str):
        return None
    marker = "\x00REPLY\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                                         tokenize=False)
    after = text.partition(marker)[2]
    specials = [t for t in tokenizer.added_tokens_decoder.values() if t.special and t.content in after]
    if not specials:
        return None
    first = min(specials, key=lambda t: after.index(t.content))
    return tokenizer.convert_tokens_to_ids(first.content)


def add_vocab(writer: Any, vocab: Vocab) -> None:
    """Write `vocab` through a gguf.GGUFWriter."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    for name, token_id in vocab.special.items():
        getattr(writer, f"add_{name}_token_id")(token_id)
    if vocab.end_of_turn is not None and vocab.end_of_turn != vocab.special.get("eos"):
        writer.add_eot_token_id(vocab.end_of_turn)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)
