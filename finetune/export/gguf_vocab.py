"""The tokenizer as GGUF metadata: vocabulary, merges, token types, special ids, pre-tokenizer, chat template.

llama.cpp and transformers (`gguf_file=`) rebuild the tokenizer from these keys, so what is written here is
what every GGUF user tokenizes with. Two kinds are written, llama.cpp's two BPE tokenizer models:
- byte-level BPE ("gpt2": SmolLM, Qwen2, Llama 3). llama.cpp names the pre-tokenizer (the regex that splits
  text before the merges), so the tokenizer's own is matched against the ones it knows; another is refused.
- sentencepiece-style BPE with byte fallback ("llama": Llama 2, Mistral, Gemma, Phi-3): llama.cpp merges by
  token score, so each token scores minus the rank of the merge that makes it (the merges are written too).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from finetune.errors import FinetuneError

# The regex splits of tokenizer.json's Split pre-tokenizer that llama.cpp knows, by its name for them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}
_BYTE = re.compile(r"<0x[0-9A-F]{2}>")  # a sentencepiece byte-fallback token
CONVERT_HINT = "export --format safetensors and convert with llama.cpp's convert_hf_to_gguf.py"


@dataclass
class Vocab:
    """What GGUF stores about a tokenizer (llama.cpp's key names in the comments)."""

    model: str                   # tokenizer.ggml.model: gpt2 (byte-level) or llama (sentencepiece-style)
    tokens: list[str]            # tokenizer.ggml.tokens, by id, padded to the model's vocabulary
    token_types: list[int]       # tokenizer.ggml.token_type (gguf.TokenType)
    merges: list[str]            # tokenizer.ggml.merges, "a b", best first
    scores: list[float] | None   # tokenizer.ggml.scores (llama: the merge order as scores)
    pre: str | None              # tokenizer.ggml.pre (gpt2)
    add_space_prefix: bool | None  # tokenizer.ggml.add_space_prefix (llama: "▁" before the text)
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
    if model.get("type") != "BPE":
        raise FinetuneError(f"export --format gguf: the tokenizer is {model.get('type')}; only BPE tokenizers "
                            "(byte-level or sentencepiece-style) are written to GGUF", hint=CONVERT_HINT)
    spm = bool(model.get("byte_fallback"))
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
        types.append(gguf.TokenType.UNKNOWN if i == tokenizer.unk_token_id
                     else gguf.TokenType.CONTROL if i in added and added[i].special
                     else gguf.TokenType.USER_DEFINED if i in added
                     else gguf.TokenType.BYTE if spm and _BYTE.fullmatch(by_id[i]) else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    special = {name: getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "unk", "pad")}
    probe = tokenizer("a")["input_ids"]
    return Vocab(
        model="llama" if spm else "gpt2", tokens=tokens, token_types=[int(t) for t in types], merges=merges,
        scores=_merge_scores(tokens, merges) if spm else None,
        pre=None if spm else _pre_tokenizer(state.get("pre_tokenizer")),
        add_space_prefix=_space_prefix(state) if spm else None,
        special={k: v for k, v in special.items() if v is not None},
        add_bos=special["bos"] is not None and probe[:1] == [special["bos"]],
        add_eos=special["eos"] is not None and probe[-1:] == [special["eos"]],
        chat_template=tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
        end_of_turn=end_of_turn(tokenizer),
    )


def _merge_scores(tokens: list[str], merges: list[str]) -> list[float]:
    """llama.cpp's sentencepiece tokenizer merges the pair whose joined token scores highest: minus the rank of
    the merge that makes a token gives the order the merges list has (0 for tokens no merge makes)."""
    rank: dict[str, int] = {}
    for r, merge in enumerate(merges):
        rank.setdefault(merge.replace(" ", "", 1), r)
    return [-float(rank[t]) if t in rank else 0.0 for t in tokens]


def _space_prefix(state: dict) -> bool:
    """Whether a sentencepiece-style tokenizer puts "▁" before the text: a Metaspace pre-tokenizer that
    prepends, or a normalizer that prepends it (Llama 2's and Phi-3's tokenizer.json); anything else refused."""
    pre, norm = state.get("pre_tokenizer") or {}, state.get("normalizer") or {}
    steps = norm.get("normalizers", [norm]) if norm else []
    if pre.get("type") == "Metaspace" and not steps:
        return pre.get("prepend_scheme", "always") != "never"
    if not pre and any(s.get("type") == "Replace" and s.get("content") == "\u2581" for s in steps):
        return any(s.get("type") == "Prepend" for s in steps)
    raise FinetuneError(f"export --format gguf: a sentencepiece-style tokenizer with pre-tokenizer "
                        f"{json.dumps(pre)[:200]} and normalizer {json.dumps(norm)[:200]} is not one llama.cpp "
                        "reproduces (it splits only on spaces, written as ▁)", hint=CONVERT_HINT)


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
                        "llama.cpp knows by name (gpt-2, smollm, llama-bpe, qwen2)", hint=CONVERT_HINT)


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
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    for name, token_id in vocab.special.items():
        getattr(writer, f"add_{name}_token_id")(token_id)
    if vocab.end_of_turn is not None and vocab.end_of_turn != vocab.special.get("eos"):
        writer.add_eot_token_id(vocab.end_of_turn)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)
