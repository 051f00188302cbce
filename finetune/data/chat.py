"""Chat templates, tokenization and loss masks.

Which template: `data.chat_template` (a Jinja string, or a path to a .jinja file), else the tokenizer's own,
else `DEFAULT_CHAT_TEMPLATE`, plain ChatML (`<|im_start|>{role}\\n{content}<|im_end|>\\n` per message,
`<|im_start|>assistant\\n` as generation prompt).

More in docs/training.md, "Chat templates and loss masks (finetune/data/chat.py)".
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from finetune.data.formats import CALL, Chat, RecordError
from finetune.errors import DataError, RecipeError

IGNORE_INDEX = -100
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_CHAT_TEMPLATE = CHATML_TEMPLATE
TOOLS_PREAMBLE = (
    "You can call the tools below. To call one, reply with only a JSON object "
    '{"name": <tool name>, "arguments": <arguments object>}; its result comes back in a tool message.\n\n'
    "Tools:\n"
)

Encoded = tuple[list[int], list[int]]  # input_ids, labels
Prefix = tuple[list[int], list[tuple[int, int]], bool]  # input_ids, character offsets, cut short
PREFIX_CHARS_PER_TOKEN = 16  # generous: real tokenizers average 3-5 characters per token
PREFIX_MARGIN = 1024  # characters before a cut within which tokens may differ from the whole text's


def template_file(chat_template: str | None) -> Path | None:
    """The file data.chat_template names (None for template text or no template); RecipeError (exit code 2) if
    it names a .jinja file that is not there (a recipe mistake, as any missing path)."""
    if not chat_template or "{" in chat_template:
        return None
    path = Path(chat_template)
    if path.suffix in (".jinja", ".j2") and not path.is_file():
        raise RecipeError(f"data.chat_template file {chat_template!r} does not exist",
                          hint="give a path to a .jinja file or the template text itself")
    return path if path.is_file() else None


def resolve_template(chat_template: str | None, tokenizer: Any) -> str:
    """The chat template to use: the recipe's (string or .jinja path), the tokenizer's, or ChatML."""
    if chat_template:
        path = template_file(chat_template)
        return path.read_text(encoding="utf-8") if path is not None else chat_template
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # named templates: take the default one
        own = own.get("default") or next(iter(own.values()), None)
    return own or DEFAULT_CHAT_TEMPLATE


class ChatEncoder:
    """Renders chats with one template and tokenizes them into input_ids and labels."""

    def __init__(self, tokenizer: Any, template: str, assistant_only_loss: bool = True):
        import jinja2

        if not getattr(tokenizer, "is_fast", False):
            raise DataError(f"the tokenizer ({type(tokenizer).__name__}) is not a fast tokenizer",
                            hint="loss masks need character offsets; load the tokenizer with use_fast=True")
        self.tokenizer = tokenizer
        self.template = template
        self.assistant_only_loss = assistant_only_loss
        self.text_parts = drops_text_content(tokenizer, template)
        self.native_tools = re.search(r"\btools\b", template) is not None
        self.native_calls = self.native_tools and re.search(r"\btool_calls\b", template) is not None
        try:
            self._render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
        except jinja2.TemplateSyntaxError as exc:
            raise DataError(f"the chat template is not valid Jinja (line {exc.lineno}: {exc.message})",
                            hint="fix data.chat_template or leave it empty to use the tokenizer's") from exc
        except Exception:  # noqa: BLE001 - the template refuses this probe; records report their own refusals
            pass

    def _render(self, messages: list[dict], tools: list[dict] | None = None, generation: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=self.template, tokenize=False, add_generation_prompt=generation)

    def _prepare(self, chat: Chat) -> tuple[list[dict], list[dict] | None]:
        messages = [_native_call(m) if self.native_calls and m.get(CALL) else
                    {k: v for k, v in m.items() if k != CALL} for m in chat.messages]
        if not chat.tools or self.native_tools:
            return (text_parts(messages) if self.text_parts else messages), chat.tools
        tools_text = TOOLS_PREAMBLE + json.dumps(chat.tools, ensure_ascii=False, indent=2)
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{tools_text}"}
        else:
            messages.insert(0, {"role": "system", "content": tools_text})
        return (text_parts(messages) if self.text_parts else messages), None

    def render(self, chat: Chat, from_turn: int = 0) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans that get loss; RecordError if the template refuses it.

        from_turn: only assistant turns from this message on get loss (a preference answer after its prompt).
        """
        import jinja2

        try:
            messages, tools = self._prepare(chat)
            text = self._render(messages, tools)
            if not self.assistant_only_loss and not from_turn:
                return text, [(0, len(text))]
            spans = []
            for i, message in enumerate(messages):
                if message["role"] != "assistant" or i < from_turn:
                    continue
                prompt = self._render(messages[:i], tools, generation=True)
                end = self._render(messages[: i + 1], tools)
                if not (text.startswith(prompt) and text.startswith(end) and len(prompt) <= len(end)):
                    raise RecordError(
                        f"the chat template renders the conversation differently when it is cut before "
                        f"turn {i} (assistant), so its loss span cannot be found; use a template that does not "
                        "rewrite earlier turns (data.chat_template)")
                spans.append((len(prompt), len(end.rstrip())))
        except RecordError:
            raise
        except jinja2.TemplateError as exc:
            raise RecordError(f"the chat template rejects this conversation: {exc}") from None
        except RecursionError:
            raise RecordError("a value is nested too deeply to render (tools or tool_calls)") from None
        except Exception as exc:  # the template is code run on the record's values: any error is this record's
            raise RecordError(f"the chat template fails on this conversation ({type(exc).__name__}: {exc})") from None
        return text, spans

    def render_prompt(self, chat: Chat) -> str:
        """The text a model continues to answer `chat` (a conversation ending with the user's turn): the template
        with its generation prompt, as GRPO's generation and SFT's prompt spans render it."""
        import jinja2

        try:
            messages, tools = self._prepare(chat)
            return self._render(messages, tools, generation=True)
        except jinja2.TemplateError as exc:
            raise RecordError(f"the chat template rejects this prompt: {exc}") from None
        except Exception as exc:  # the template is code run on the record's values: any error is this record's
            raise RecordError(f"the chat template fails on this prompt ({type(exc).__name__}: {exc})") from None

    def encode(self, rendered: Sequence[tuple[str, list[tuple[int, int]]]], max_tokens: int) -> list[Encoded]:
        """Tokenize rendered chats in one batch; labels are -100 outside the spans.

        Only the first max_tokens + 1 tokens are guaranteed (see `tokenize_prefixes`): enough to cut or drop.
        """
        out = []
        for (ids, offsets, _), (_, spans) in zip(
                tokenize_prefixes(self.tokenizer, [text for text, _ in rendered], max_tokens,
                                  add_special_tokens=False), rendered, strict=True):
            labels = [tok if _overlaps(s, e, spans) else IGNORE_INDEX for tok, (s, e) in zip(ids, offsets, strict=True)]
            out.append(_mask_first(ids, labels))
        return out


_PROBE = "finetune-probe-text"


def drops_text_content(tokenizer: Any, template: str | None) -> bool:
    """Whether `template` renders a turn whose content is a plain string as nothing: SmolVLM's published
    template reads content parts only, so a text-only turn (a text record mixed in with image ones, a
    prompt without an image) must reach them as one text part (`text_parts`)."""
    if not template:
        return False
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], chat_template=template,
                                                 tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses the probe (a system turn required ...) reads strings
        return False
    return _PROBE not in rendered


def text_parts(messages: list[dict]) -> list[dict]:
    """The messages with each string content as one text part, the shape vision-language templates read."""
    return [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
            for m in messages]


def encode_text(tokenizer: Any, texts: Sequence[str], max_tokens: int) -> list[Encoded]:
    """Tokenize raw texts (with the tokenizer's own special tokens, e.g. BOS), append EOS, loss everywhere.

    A text cut by `tokenize_prefixes` gets no EOS: it is longer than max_tokens and ends there anyway.
    """
    eos = tokenizer.eos_token_id
    out = []
    for ids, _, cut in tokenize_prefixes(tokenizer, texts, max_tokens, add_special_tokens=True):
        if eos is not None and not cut and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        out.append(_mask_first(ids, list(ids)))
    return out


def tokenize_prefixes(tokenizer: Any, texts: Sequence[str], max_tokens: int,
                      **kwargs: Any) -> list[Prefix]:
    """Token ids, character offsets and whether it was cut, for each text: its first max_tokens + 1 tokens exactly.

    A 20 MB record must not be tokenized whole when only max_seq_len tokens survive: that took gigabytes and
    tens of seconds. Each text is cut to `PREFIX_CHARS_PER_TOKEN` characters per needed token first; the cut is
    accepted when max_tokens + 1 tokens end `PREFIX_MARGIN` characters before it (tokens next to a cut can merge
    differently than in the whole text), else that text is tried again with an 8 times longer cut, up to whole.
    So the kept tokens, and whether a text is longer than max_tokens, are those of the whole text. Slow
    tokenizers (no offsets) get the whole text.
    """
    if not texts:
        return []
    need = max_tokens + 1
    cap = need * PREFIX_CHARS_PER_TOKEN + PREFIX_MARGIN if getattr(tokenizer, "is_fast", False) else None
    if cap is None:
        return [(ids, [], False) for ids in tokenizer(list(texts), **kwargs)["input_ids"]]
    out: list[Prefix | None] = [None] * len(texts)
    pending = list(range(len(texts)))
    while pending:
        batch = tokenizer([texts[i][:cap] for i in pending], return_offsets_mapping=True, **kwargs)
        retry = []
        for i, ids, offsets in zip(pending, batch["input_ids"], batch["offset_mapping"], strict=True):
            if len(texts[i]) <= cap:
                out[i] = (ids, offsets, False)
            elif _ends_before(offsets, cap - PREFIX_MARGIN) >= need:
                out[i] = (ids[:need], offsets[:need], True)
            else:
                retry.append(i)
        pending, cap = retry, cap * 8
    return out  # type: ignore[return-value]


def _ends_before(offsets: Sequence[tuple[int, int]], limit: int) -> int:
    """How many leading tokens end at or before character `limit`."""
    count = 0
    for _, end in offsets:
        if end > limit:
            break
        count += 1
    return count


def _overlaps(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    return end > start and any(start < b and end > a for a, b in spans)


def _mask_first(ids: list[int], labels: list[int]) -> Encoded:
    if labels:
        labels[0] = IGNORE_INDEX
    return ids, labels


def _native_call(message: dict) -> dict:
    """A function_call turn as an OpenAI-style tool call, when its text is a JSON call; else unchanged text."""
    try:
        call = json.loads(message["content"])
    except json.JSONDecodeError:
        call = None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        return {"role": "assistant", "content": message["content"]}
    function = {"name": call["name"], "arguments": call.get("arguments", {})}
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": function}]}
