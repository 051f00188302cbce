"""Fit a chat record to data.max_seq_len by cutting its prompt, so that its answer keeps its tokens.

`data.overlong: truncate`. Cutting the end of a sequence whose prompt alone fills max_seq_len leaves no answer
token: the record trains on nothing. So the prompt is cut instead, as LLaMA-Factory (which splits the budget
between prompt and answer) and TRL (which truncates the DPO prompt) do.

More in docs/training.md, "Fitting records to max_seq_len (finetune/data/fit.py)".
"""

from __future__ import annotations

from typing import Any

from finetune.data.chat import PREFIX_CHARS_PER_TOKEN, PREFIX_MARGIN, ChatEncoder, Encoded
from finetune.data.formats import Chat, RecordError

Source = list[tuple[Chat, int]]  # a record's conversations (one, or chosen and rejected) with their first loss turn
CONTENT_CUTS = 4  # tries at cutting the user message: tokens next to the cut may merge differently


def cut_prompt(source: Source, encoder: ChatEncoder, max_len: int) -> list[Encoded] | None:
    """The record's sequences with the prompt cut to its share of max_len (their ends may still run past
    max_len), or None when the prompt needs no cut (a long answer within its share) or no cut lets the answer
    start within max_len (no answer; or the chat template alone, tools included, takes more than max_len)."""
    prompt, answers, tools, sft = _split(source)
    users = [i for i, m in enumerate(prompt or []) if m["role"] == "user"]
    if prompt is None or not users:
        return None
    keep = _chars_for(max_len)
    prompt = [{**m, "content": m["content"][-keep:]} if isinstance(m["content"], str) else m for m in prompt]

    def excess(candidate: list[dict], kept_tools: Any) -> int | None:
        return _excess(encoder, candidate, answers, kept_tools, max_len)

    over = excess(prompt, tools)
    if over is None or over <= 0:
        return None
    system = [m for m in prompt[: users[0]] if m["role"] == "system"]

    # 1. Leave out the oldest exchanges: the fewest that make the prompt fit (binary search over user turns).
    lo, hi = 0, len(users) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        over = excess(system + prompt[users[mid]:], tools)
        if over is not None and over <= 0:
            hi = mid
        else:
            lo = mid + 1
    last = system + prompt[users[lo]:]
    over = excess(last, tools)
    if over is not None and over <= 0:
        return _encode(encoder, last, answers, tools, sft, max_len)
    # 2. Cut the start of the last user message, with the system message, then without it.
    for head, kept_tools in [(system, tools)] + ([([], None)] if system or tools else []):
        candidate = head + prompt[users[-1]:]
        for _ in range(CONTENT_CUTS):
            over = excess(candidate, kept_tools)
            if over is None:
                break
            if over <= 0:
                return _encode(encoder, candidate, answers, kept_tools, sft, max_len)
            candidate = _cut_user(encoder, candidate, over, max_len)
            if candidate is None:
                break
    return None


def _split(source: Source) -> tuple[list[dict] | None, list[list[dict]], Any, bool]:
    """Prompt (shared by all conversations), answers, tools and whether it is SFT (prompt turns carry loss)."""
    first, turn = source[0]
    if turn:  # preference: the answer starts at `turn` in every conversation
        return first.messages[:turn], [c.messages[turn:] for c, _ in source], first.tools, False
    users = [i for i, m in enumerate(first.messages) if m["role"] == "user"]
    if not users:
        return None, [], first.tools, True
    end = users[-1] + 1
    return first.messages[:end], [first.messages[end:]], first.tools, True


def _excess(encoder: ChatEncoder, prompt: list[dict], answers: list[list[dict]], tools: Any,
            max_len: int) -> int | None:
    """How many prompt tokens too many for the largest answer, or None if an answer has no span."""
    worst = None
    for answer in answers:
        try:
            text, spans = encoder.render(Chat(prompt + answer, tools), len(prompt))
        except RecordError:
            return None
        if not spans:
            return None
        start = spans[0][0]
        offsets = encoder.tokenizer(text[: start + _chars_for(max_len // 2)],  # enough for min(answer, half)
                                    return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
        prompt_tokens = sum(1 for s, _ in offsets if s < start)
        answer_tokens = min(len(offsets) - prompt_tokens, max_len // 2)
        over = prompt_tokens - (max_len - answer_tokens)
        worst = over if worst is None else max(worst, over)
    return worst


def _chars_for(tokens: int) -> int:
    """Characters that hold more than `tokens` tokens (as in `chat.tokenize_prefixes`): a message longer than
    this for max_len cannot be kept whole, so only its end is ever looked at (a 20 MB prompt costs nothing)."""
    return (tokens + 1) * PREFIX_CHARS_PER_TOKEN + PREFIX_MARGIN


def _cut_user(encoder: ChatEncoder, prompt: list[dict], tokens: int, max_len: int) -> list[dict] | None:
    """The prompt with the first `tokens` tokens of its last user message left out (it keeps at least one),
    or None when that message is not that long."""
    i = max(i for i, m in enumerate(prompt) if m["role"] == "user")
    content = prompt[i]["content"]
    if not isinstance(content, str):
        return None
    offsets = encoder.tokenizer(content, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    if tokens >= len(offsets):
        return None
    return [*prompt[:i], {**prompt[i], "content": content[offsets[tokens][0]:]}, *prompt[i + 1:]]


def _encode(encoder: ChatEncoder, prompt: list[dict], answers: list[list[dict]], tools: Any, sft: bool,
            max_len: int) -> list[Encoded]:
    rendered = [encoder.render(Chat(prompt + answer, tools), 0 if sft else len(prompt)) for answer in answers]
    return encoder.encode(rendered, max_len)
