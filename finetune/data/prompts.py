"""Prompt-only data for reinforcement learning (GRPO): each record is a prompt the model answers, plus the fields
its rewards read (an `answer`, test cases, ...).

A record is `{"prompt": str or messages, ...}` (TRL's prompt-only format; `system` adds a system message) or
`{"messages": [...]}` ending with the user's turn. Every other key is a field handed to the reward functions.
The chat template is applied as for SFT (`data.chat_template`, else the tokenizer's, else ChatML;
`data.system_prompt` when the record has no system message), with the generation prompt added, and tokenized
without adding special tokens (the template has them). `max_samples`, the seeded validation split and
`on_bad_record` work as in `build_datasets`; a prompt longer than `max_prompt_tokens` is dropped and counted
(cutting it would change the question; TRL cuts from the left instead).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from finetune.data.build import DataBundle, _listed, _refuse_bad, _sample, _split, checked
from finetune.data.chat import ChatEncoder, resolve_template
from finetune.data.fingerprint import data_fingerprint
from finetune.data.formats import (
    Chat,
    RecordError,
    _check_turn_order,
    _message_turns,
    _prompt,
    _tools,
    _turns,
    _with_system,
    unicode_problem,
)
from finetune.data.mix import file_stats, is_mix, mixed_records, read_files, repeated
from finetune.errors import DataError
from finetune.recipe.schema import DataConfig

PROMPT_KEYS = ("prompt", "messages", "conversations", "system", "tools")  # what makes the prompt, not a field
EXPECTED = '{"prompt": str or messages, <fields the rewards read>} or {"messages": [..., user turn], <fields>}'


@dataclass
class PromptExample:
    """One prompt ready to generate from: where it is, its rendered text and tokens, and the reward fields."""

    where: str
    text: str
    input_ids: list[int]
    fields: dict[str, Any] = field(default_factory=dict)
    file: int = 0  # its file's index in data.path (a list)


def prompt_chat(record: Any, system_prompt: str | None = None) -> Chat:
    """A prompt-only record as the conversation to answer; RecordError if it is not one."""
    if not isinstance(record, dict):
        raise RecordError(f"is a {type(record).__name__}, not an object; expected {EXPECTED}")
    try:
        if "prompt" in record:
            messages = _prompt(record)
        elif "messages" in record or "conversations" in record:
            key, turns = _turns(record)
            messages = _with_system(record, _message_turns(key, turns))
        else:
            raise RecordError(f"has no 'prompt' or 'messages' (keys: {', '.join(sorted(record)) or 'none'})")
        _check_turn_order(messages)
        if any(isinstance(m["content"], list) for m in messages):
            raise RecordError("has image parts: prompts for generated answers are text only")
        if messages[-1]["role"] != "user":
            raise RecordError(f"its last turn is from the {messages[-1]['role']}; a prompt ends with the user's "
                              "turn (the model writes the answer)")
        chat = Chat(messages, _tools(record))
    except RecordError as exc:
        raise RecordError(f"{exc}; expected {EXPECTED}") from None
    if system_prompt and not any(m["role"] == "system" for m in chat.messages):
        chat.messages.insert(0, {"role": "system", "content": system_prompt})
    return chat


def _chats(cfg: DataConfig, records: list[Any]) -> tuple[list[tuple[Any, Chat]], list[str]]:
    """Each record with its conversation, and one problem line per record that is not a prompt."""
    chats, problems = [], []
    for record in records:
        try:
            chats.append((record, prompt_chat(record.value, cfg.system_prompt)))
        except RecordError as exc:
            problems.append(f"{record.where}: {exc}")
    return chats, problems


def check_prompt_records(cfg: DataConfig) -> dict[str, Any]:
    """`check_records` for prompt-only data: every record read and checked as a prompt, no tokenizer (the
    seconds-long check before a model loads); raises the DataError `build_prompts` would."""
    files = read_files(cfg)
    bad = [f.read.problems + _chats(cfg, f.read.records)[1] for f in files]
    return checked(cfg, files, ["prompt"] * len(files), "prompt", bad)


def build_prompts(cfg: DataConfig, tokenizer: Any, seed: int, max_prompt_tokens: int | None = None) -> DataBundle:
    """Read, check, render and tokenize prompt-only records, split as `build_datasets` splits (see the module):
    train and held-out PromptExamples, a collator of left-padded prompts, counts and the fingerprint."""
    limit = max_prompt_tokens or cfg.max_seq_len
    files = read_files(cfg)
    records = _sample(mixed_records(cfg, files, seed), cfg.max_samples, seed)
    encoder = ChatEncoder(tokenizer, resolve_template(cfg.chat_template, tokenizer))
    chats, problems = _chats(cfg, records)
    problems = [p for f in files for p in f.read.problems] + problems
    prepared = []
    for record, chat in chats:
        text = encoder.render_prompt(chat)
        if problem := unicode_problem(text):
            problems.append(f"{record.where}: {problem}")
            continue
        fields = {k: v for k, v in record.value.items() if k not in PROMPT_KEYS}
        prepared.append(PromptExample(record.where, text, [], fields, record.file))
    _refuse_bad(cfg, "prompt", problems, len(prepared))
    ids = tokenizer([p.text for p in prepared], add_special_tokens=False)["input_ids"]
    overlong = []
    for example, tokens in zip(prepared, ids, strict=True):
        example.input_ids = tokens
        if len(tokens) > limit:
            overlong.append(f"{example.where}: prompt of {len(tokens)} tokens, longer than {limit}")
    kept = [p for p in prepared if len(p.input_ids) <= limit]
    if not kept:
        raise DataError(f"{cfg.label()}: every prompt is longer than {limit} tokens", problems=_listed(overlong),
                        hint="raise the prompt length limit or shorten the prompts")
    train, held_out = _split(cfg.label(), kept, cfg.validation_split, seed)
    stats = {"format": "prompt", "records": sum(f.read.total for f in files),
             "bad_records_skipped": len(problems), "dropped_overlong": len(overlong), "train_prompts": len(train),
             "eval_prompts": len(held_out), "max_prompt_tokens": max(len(p.input_ids) for p in kept),
             "fields": sorted({k for p in kept for k in p.fields})}
    if is_mix(cfg):
        made = [p.file for p in kept]
        stats["files"] = file_stats(files, ["prompt"] * len(files), records, made,
                                    Counter(r.file for r in records) - Counter(made))
    warnings = repeated(files) + ([f"{len(problems)} malformed record(s) skipped (data.on_bad_record: skip)"] if problems else []) + \
        ([f"{len(overlong)} prompt(s) dropped: longer than {limit} tokens (data.max_seq_len less "
          f"grpo.max_completion_length; first: {overlong[0]})"] if overlong else [])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return DataBundle(train, held_out or None, stats, PromptCollator(pad),
                      data_fingerprint(cfg, [f.read for f in files], "prompt", tokenizer, encoder.template, seed, "grpo"),
                      warnings)


@dataclass(frozen=True)
class PromptCollator:
    """A loader batch of prompts as the model would see them, left-padded (the loop counts their tokens; the
    GRPO policy generates from the PromptExamples themselves)."""

    pad_token_id: int

    def __call__(self, prompts: list[PromptExample]) -> dict[str, torch.Tensor]:
        ids, mask = left_padded(prompts, 1, self.pad_token_id)
        return {"input_ids": ids, "attention_mask": mask}


def left_padded(prompts: list[PromptExample], copies: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of the prompts, each `copies` times in a row, padded on the left (where
    generation continues them)."""
    width = max(len(p.input_ids) for p in prompts)
    ids = torch.full((len(prompts) * copies, width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        n = len(p.input_ids)
        ids[i * copies:(i + 1) * copies, width - n:] = torch.tensor(p.input_ids, dtype=torch.long)
        mask[i * copies:(i + 1) * copies, width - n:] = 1
    return ids, mask
