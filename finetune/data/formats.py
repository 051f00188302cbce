"""Record formats: detect them and normalise every record to chat messages or plain text.

Why one module of ~550 lines: one normaliser per record format over shared helpers (roles, tools, images);
the detection that picks a format reads them all.

More in docs/training.md, "Record formats (finetune/data/formats.py)".
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import json
import os
import re
import secrets
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from finetune.data.read import UnparsableJSON, loads_json

FORMATS = ("alpaca", "messages", "sharegpt", "text", "preference", "sharegpt_preference", "kto")
PAIR_FORMATS = ("preference", "sharegpt_preference")  # chosen and rejected answers
PREFERENCE_FORMATS = (*PAIR_FORMATS, "kto")
DETECT_WINDOW = 10  # auto-detection looks at this many records from the start of the file

_EXPECT = {
    "alpaca": '{"instruction": str, "input": str (optional), "output": str}',
    "messages": '{"messages": [{"role": "user" | "assistant" | "system" | "tool", "content": str or [parts]}, ...], '
                '"images": [paths] (optional)}',
    "sharegpt": '{"conversations": [{"from": "human" | "gpt" | "system" | "function_call" | "observation", '
                '"value": str}, ...], "tools": JSON string or list (optional)}',
    "text": '{"text": str}',
    "preference": '{"prompt": str or messages, "chosen": str or messages, "rejected": str or messages}',
    "sharegpt_preference": '{"conversations": [{"from": "human", "value": str}, ...], '
                           '"chosen": {"from": "gpt", "value": str}, "rejected": {"from": "gpt", "value": str}}',
    "kto": '{"prompt": str or messages, "completion": str or messages, "label": true | false}',
}
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
    "function_call": "function_call", "observation": "tool", "tool": "tool",
}


CALL = "_function_call"  # marks sharegpt function_call turns; removed before the chat template sees them
IMAGE_MARKER = "<image>"  # LLaMA-Factory's: stands for the next image of the record's `images`
IMAGE_SOURCES = ("path", "image", "url")  # where an image part names its file (first present wins)
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class RecordError(ValueError):
    """A record does not match its format; the message says what is wrong and what was expected."""


@dataclass
class Chat:
    """A normalised conversation. Assistant messages that are tool calls carry `CALL: True`."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass
class Preference:
    """A prompt and its answer(s): chosen and rejected (pairs), or one `chosen` answer with a good/bad `label`
    (kto). Only the answers' assistant turns carry loss."""

    prompt: list[dict[str, Any]]
    chosen: list[dict[str, Any]]
    rejected: list[dict[str, Any]] | None = None
    label: bool | None = None
    tools: list[dict[str, Any]] | None = None

    def chats(self) -> list[tuple[Chat, int]]:
        """Each answer as a whole conversation, with the index of its first answer turn."""
        answers = [self.chosen] if self.rejected is None else [self.chosen, self.rejected]
        return [(Chat(self.prompt + answer, self.tools), len(self.prompt)) for answer in answers]


Example = Chat | str | Preference


def _signature(record: Any) -> str | None:
    """The format one record looks like, or None."""
    if not isinstance(record, dict):
        return None
    if "chosen" in record and "rejected" in record:
        return "preference" if "prompt" in record else "sharegpt_preference"
    if "completion" in record and "label" in record:
        return "kto"
    for key in ("messages", "conversations"):
        turns = _maybe_json(record.get(key))
        if isinstance(turns, list) and turns and isinstance(turns[0], dict):
            return "sharegpt" if "from" in turns[0] or "value" in turns[0] else "messages"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "text" in record:
        return "text"
    return None


def _safe_signature(record: Any) -> str | None:
    try:
        return _signature(record)
    except RecordError:  # unreadable JSON text in a field: the record shows no format
        return None


def detect_format(records: Sequence[Any]) -> str:
    """Return the format most of the first records match: alpaca, messages, sharegpt or text.

    Raises RecordError when none of them matches any format.
    """
    votes = Counter(s for s in map(_safe_signature, records[:DETECT_WINDOW]) if s)
    if not votes:
        first = records[0] if records else None
        keys = sorted(first) if isinstance(first, dict) else type(first).__name__
        raise RecordError(
            f"cannot detect the record format: the first record has {keys}; expected one of "
            + "; ".join(f"{name} {shape}" for name, shape in _EXPECT.items()))
    return votes.most_common(1)[0][0]


def normalize(record: Any, fmt: str, system_prompt: str | None = None, folder: str | Path | None = None) -> Example:
    """Turn one raw record of format `fmt` into a Chat or a text string; RecordError if malformed. `folder`:
    where relative image paths are read from (the data file's folder; None: the working directory)."""
    if not isinstance(record, dict):
        raise RecordError(f"is a {type(record).__name__}, not an object; expected {_EXPECT[fmt]}")
    try:
        example = _NORMALIZERS[fmt](record)
    except RecordError as exc:
        raise RecordError(f"{exc}; expected {fmt} {_EXPECT[fmt]}") from None
    messages = example.prompt if isinstance(example, Preference) else example.messages \
        if isinstance(example, Chat) else None
    if messages is not None:
        _check_turn_order(messages)
        if system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system_prompt})
    return _with_images(example, record, Path(folder or "."))


def _check_turn_order(messages: list[dict[str, Any]]) -> None:
    """An assistant turn must answer something: a conversation may not open with one."""
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
    if first is not None and messages[first]["role"] == "assistant":
        raise RecordError(f"turn {first} is from the assistant but nothing comes before it; a conversation "
                          "starts with a user turn (after any system message)")


def unicode_problem(text: str) -> str | None:
    """Why `text` cannot be tokenized (a lone surrogate: a bad byte in the file or an unpaired \\u escape)."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        char = text[exc.start]
        what = (f"byte 0x{ord(char) - 0xDC00:02X} that is not UTF-8" if 0xDC80 <= ord(char) <= 0xDCFF
                else f"an unpaired surrogate \\u{ord(char):04x} escape")
        return f"contains {what}; fix the text or save the file as UTF-8"


def _maybe_json(value: Any) -> Any:
    """Parse JSON-looking strings (lists and tools stored as text in CSV/Parquet); leave the rest alone."""
    if isinstance(value, str) and value.lstrip().startswith(("[", "{")):
        try:
            return _json_text(value)
        except json.JSONDecodeError:
            return value
    return value


def _json_text(text: str) -> Any:
    """loads_json, JSON that Python cannot hold reported as this record's problem."""
    try:
        return loads_json(text)
    except UnparsableJSON as exc:
        raise RecordError(f"holds JSON text that cannot be read: {exc}") from None


def _string(record: dict, key: str, optional: bool = False, where: str = "") -> str:
    value = record.get(key)
    if value is None and optional:
        return ""
    if key not in record:
        raise RecordError(f"{where}missing {key!r}")
    if not isinstance(value, str):
        raise RecordError(f"{where}{key!r} is a {type(value).__name__}, not a string")
    return value


def _tools(record: dict) -> list[dict] | None:
    raw = record.get("tools")
    if raw is None or raw == "" or raw == []:
        return None
    tools = raw
    if isinstance(raw, str):
        try:
            tools = _json_text(raw)
        except json.JSONDecodeError as exc:
            raise RecordError(f"'tools' is a string but not valid JSON ({exc.msg})") from None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RecordError("'tools' must be a list of tool schemas (objects) or a JSON string holding one")
    return tools or None


def _with_system(record: dict, messages: list[dict]) -> list[dict]:
    system = _string(record, "system", optional=True)
    return ([{"role": "system", "content": system}] if system else []) + messages


def _alpaca(record: dict) -> Chat:
    instruction = _string(record, "instruction")
    output = _string(record, "output")
    extra = _string(record, "input", optional=True)
    if not output.strip():
        raise RecordError("'output' is empty")
    if not (instruction.strip() or extra.strip()):
        raise RecordError("'instruction' and 'input' are both empty")
    messages = []
    history = record.get("history") or []
    if not isinstance(history, list):
        raise RecordError(f"'history' is a {type(history).__name__}, not a list of [question, answer] pairs")
    for i, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise RecordError(f"history[{i}] is not a [question, answer] pair of strings")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    prompt = f"{instruction}\n{extra}" if instruction and extra else instruction or extra
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    return Chat(_with_system(record, messages))


def _turns(record: dict) -> tuple[str, list]:
    for key in ("messages", "conversations"):
        if key in record:
            turns = _maybe_json(record[key])
            if not isinstance(turns, list):
                raise RecordError(f"{key!r} is a {type(turns).__name__}, not a list of turns")
            if not turns:
                raise RecordError(f"{key!r} is empty")
            return key, turns
    raise RecordError("missing 'messages' (or 'conversations')")


def _turn_role(key: str, i: int, turn: Any, field: str, roles) -> tuple[str, str]:
    """Check that turn i is an object whose `field` names a known role; returns (error prefix, role)."""
    where = f"{key}[{i}]: "
    if not isinstance(turn, dict):
        raise RecordError(f"{where}is a {type(turn).__name__}, not an object")
    role = _string(turn, field, where=where)
    if role not in roles:
        raise RecordError(f"{where}unknown role {role!r} (roles: {', '.join(roles)})")
    return where, role


def _messages(record: dict) -> Chat:
    key, turns = _turns(record)
    return Chat(_with_system(record, _message_turns(key, turns)), _tools(record))


def _message_turns(key: str, turns: list) -> list[dict]:
    messages = []
    for i, turn in enumerate(turns):
        where, role = _turn_role(key, i, turn, "role", MESSAGE_ROLES)
        if turn.get("content") is None and role == "assistant" and turn.get("tool_calls"):
            turn = {**turn, "content": ""}
        content = _content(turn, where)
        if role == "assistant" and not content_text(content).strip() and not turn.get("tool_calls"):
            raise RecordError(f"{where}the assistant's 'content' is empty")
        messages.append({**turn, "content": content})
    return messages


def _content(turn: dict, where: str) -> str | list[dict]:
    """A message's content: a string, or a list of text and image parts (a list of text parts only is its
    text joined, as chat templates render it). Image parts keep their raw source for `_with_images`."""
    value = turn.get("content")
    if not isinstance(value, list):
        return _string(turn, "content", where=where)
    parts = []
    for j, part in enumerate(value):
        at = f"{where}content[{j}]: "
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _string(part, "text", where=at)})
        elif kind in ("image", "image_url"):
            parts.append({"type": "image", "source": _image_source(part)})
        else:
            raise RecordError(f"{at}is not a text or image part ({{\"type\": \"text\", \"text\": ...}} or "
                              f"{{\"type\": \"image\", \"path\": ...}}); got {json.dumps(part, default=str)[:80]}")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _image_source(part: dict) -> Any:
    """What an image part names: its path / image / url, image_url's url, or None (the next of `images`)."""
    if part["type"] == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return next((part[k] for k in IMAGE_SOURCES if part.get(k) is not None), None)


def content_text(content: str | list[dict]) -> str:
    """A message's text: the string, or its text parts joined."""
    return content if isinstance(content, str) else "".join(p["text"] for p in content if p["type"] == "text")


def images_of(example: Example) -> list[str]:
    """The absolute paths of an example's images, in order (a preference example: the prompt's, then the
    chosen and rejected answers'); [] for a text-only example."""
    if isinstance(example, str):
        return []
    turns = example.messages if isinstance(example, Chat) else \
        example.prompt + example.chosen + (example.rejected or [])
    return [p["path"] for m in turns if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]


def _with_images(example: Example, record: dict, folder: Path) -> Example:
    """The example with its images placed (see the module docstring): markers and source-less parts take the
    record's `images` in order, every source becomes an absolute local path and every turn of an image record
    a list of parts. A text-only example is returned as it is."""
    images = _images_field(record)
    if isinstance(example, str):
        if images:
            raise RecordError("has 'images' but is plain text: images need a chat record with <image> markers")
        return example
    turns = [example.messages] if isinstance(example, Chat) else \
        [example.prompt, example.chosen] + ([example.rejected] if example.rejected is not None else [])
    parts = any(isinstance(m["content"], list) for t in turns for m in t)  # text-only lists are strings by now
    if images is None and not parts:
        return example
    markers, images = images is not None, images or []
    placed, used = _place(turns[0], images, 0, folder, markers)
    answers = [_place(t, images, used, folder, markers) for t in turns[1:]]
    ends = [(f"the prompt and {name} answer", end) for name, (_, end) in zip(("chosen", "rejected"), answers, strict=False)] \
        if answers else [("the turns", used)]
    for what, end in ends:
        if end != len(images):
            raise RecordError(f"{what} have {end} {IMAGE_MARKER} marker(s) or image parts without a path but "
                              f"'images' lists {len(images)}: each {IMAGE_MARKER} stands for the next image, so "
                              "the counts must match")
    if not images and not parts:  # `images: []` beside text turns (LLaMA-Factory's text records in a mix)
        return example
    if isinstance(example, Chat):
        return Chat(placed, example.tools)
    return Preference(placed, answers[0][0], answers[1][0] if len(answers) > 1 else None, example.label,
                      example.tools)


def _images_field(record: dict) -> list | None:
    """The record's `images` list (a JSON string in CSV/Parquet; one path as a string), or None without one."""
    value = _maybe_json(record.get("images"))
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise RecordError(f"'images' is a {type(value).__name__}, not a list of image paths")
    return value


def _place(turns: list[dict], images: list, start: int, folder: Path, markers: bool) -> tuple[list[dict], int]:
    """`turns` with every content a list of parts and each image an absolute path (`markers`: each <image> in
    the text takes the next of `images`); the index after the last image taken from `images` (past its end
    when markers outnumber the images)."""
    n = start

    def image(source: Any) -> list[dict]:
        nonlocal n
        if source is None:  # a marker, or a part without a source: the next image
            if n < len(images) and images[n] is None:
                raise RecordError(f"'images'[{n}] is null, not an image path: give the image, or remove it and "
                                  f"its {IMAGE_MARKER} marker")
            source = images[n] if n < len(images) else None
            n += 1
        return [] if source is None else [{"type": "image", "path": _local_path(source, folder)}]

    out = []
    for turn in turns:
        content = turn["content"]
        placed: list[dict] = []
        for part in [{"type": "text", "text": content}] if isinstance(content, str) else content:
            if part["type"] == "image":
                placed += image(part["source"])
                continue
            for k, piece in enumerate(part["text"].split(IMAGE_MARKER) if markers else [part["text"]]):
                placed += image(None) if k else []
                placed += [{"type": "text", "text": piece}] if piece else []
        out.append({**turn, "content": placed})
    return out, n


def _local_path(source: Any, folder: Path) -> str:
    """An image source as an absolute local path: relative paths from `folder`, `file://` URLs as their path,
    images held in the data (datasets' `{"bytes", "path"}`, a base64 `data:` URL) as a file of the cache
    (`inline_image`); RecordError for other URLs (images must be local: nothing is downloaded at run time)."""
    if isinstance(source, dict) and isinstance(source.get("bytes"), bytes) and source["bytes"]:
        return inline_image(source["bytes"])
    if isinstance(source, dict) and source.get("path"):
        source = source["path"]
    if not isinstance(source, str) or not source.strip():
        raise RecordError(f"an image is {'empty' if isinstance(source, (dict, str)) else f'a {type(source).__name__}'}"
                          ", not a file path or image bytes")
    if source.startswith("data:"):
        head, _, body = source.partition(",")
        try:
            data = base64.b64decode(body, validate=True) if head.endswith(";base64") else None
        except binascii.Error:
            data = None
        if data is None:
            raise RecordError(f"image {source[:40]}... is a data: URL without readable base64 image bytes")
        return inline_image(data)
    if source.startswith("file://"):
        source = unquote(urlparse(source).path)
    elif _URL.match(source):
        raise RecordError(f"image {source} is a URL; images must be local files (nothing is downloaded at run "
                          "time): download it and give its path")
    return os.path.abspath(folder / os.path.expanduser(source))


def inline_image(data: bytes) -> str:
    """The path of a file holding `data` (an image stored in the dataset itself) in the cache folder, named by
    its content so each image is written once, atomically (a rename) and shared by every run. Bytes that are no
    image (by their header) are a bad record and never written."""
    from PIL import Image, UnidentifiedImageError

    from finetune.units import cache_dir

    if not data:
        raise RecordError("an image held in the data is empty (no bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # sized when the file is checked
            Image.open(io.BytesIO(data)).close()
    except UnidentifiedImageError:
        raise RecordError(f"an image held in the data is not an image Pillow can read (it starts with bytes "
                          f"{data[:8]!r})") from None
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError):
        pass  # an image, whose fault the image check names with its file
    digest = hashlib.sha256(data).hexdigest()
    path = cache_dir() / "images" / digest[:2] / digest
    if not path.exists():
        tmp = path.with_name(f".{digest}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):  # FINETUNE_CACHE a file: no temporary to remove either
                tmp.unlink(missing_ok=True)
            raise RecordError(f"cannot store an image held in the data in {path.parent} ({exc.strerror or exc}); "
                              "set FINETUNE_CACHE to a writable folder with room") from None
    return str(path)


def _sharegpt(record: dict) -> Chat:
    key, turns = _turns(record)
    return Chat(_with_system(record, _sharegpt_turns(key, turns)), _tools(record))


def _sharegpt_turns(key: str, turns: list) -> list[dict]:
    messages = []
    for i, turn in enumerate(turns):
        where, source = _turn_role(key, i, turn, "from", SHAREGPT_ROLES)
        message = {"role": SHAREGPT_ROLES[source], "content": _string(turn, "value", where=where)}
        if message["role"] in ("assistant", "function_call") and not message["content"].strip():
            raise RecordError(f"{where}the {source!r} turn's 'value' is empty")
        if message["role"] == "function_call":
            message.update(role="assistant", **{CALL: True})
        messages.append(message)
    return messages


def _prompt(record: dict) -> list[dict]:
    """`prompt`: a string (one user turn) or a message list."""
    value = _maybe_json(record.get("prompt"))
    if isinstance(value, list) and value:
        return _with_system(record, _message_turns("prompt", value))
    text = _string(record, "prompt")
    if not text.strip():
        raise RecordError("'prompt' is empty")
    return _with_system(record, [{"role": "user", "content": text}])


def _answer(record: dict, key: str, sharegpt: bool = False) -> list[dict]:
    """An answer: a string (one assistant turn), a message list, or (sharegpt) one turn or a list of turns."""
    value = _maybe_json(record.get(key))
    if sharegpt and isinstance(value, dict):
        value = [value]
    if isinstance(value, list) and value:
        answer = _sharegpt_turns(key, value) if sharegpt else _message_turns(key, value)
    else:
        if key in record and not isinstance(value, str):
            raise RecordError(f"{key!r} is a {type(value).__name__}, not " + (
                "a turn or a list of turns" if sharegpt else "a string or a list of messages"))
        answer = [{"role": "assistant", "content": _string(record, key)}]
    if not any(m["role"] == "assistant" and (content_text(m["content"]).strip() or m.get("tool_calls")) for m in answer):
        raise RecordError(f"{key!r} has no assistant answer with text")
    return answer


def _preference(record: dict) -> Preference:
    return Preference(_prompt(record), _answer(record, "chosen"), _answer(record, "rejected"), tools=_tools(record))


def _sharegpt_preference(record: dict) -> Preference:
    chat = _sharegpt(record)
    return Preference(chat.messages, _answer(record, "chosen", sharegpt=True),
                      _answer(record, "rejected", sharegpt=True), tools=chat.tools)


def _kto(record: dict) -> Preference:
    label = record.get("label")
    if isinstance(label, str) and label.strip().lower() in ("true", "false"):  # CSV cells are text
        label = label.strip().lower() == "true"
    if not isinstance(label, bool):
        raise RecordError(f"'label' is {label!r}, not true or false" if "label" in record else "missing 'label'")
    return Preference(_prompt(record), _answer(record, "completion"), label=label, tools=_tools(record))


def _text(record: dict) -> str:
    text = _string(record, "text")
    if not text.strip():
        raise RecordError("'text' is empty")
    return text


_NORMALIZERS: dict[str, Callable[[dict], Example]] = {
    "alpaca": _alpaca, "messages": _messages, "sharegpt": _sharegpt, "text": _text,
    "preference": _preference, "sharegpt_preference": _sharegpt_preference, "kto": _kto,
}
