"""An Ollama Modelfile beside a GGUF file: FROM, a TEMPLATE that renders the prompt the tokenizer's chat
template renders, the stop tokens, and the recipe's system prompt.

Ollama templates are Go templates, not Jinja, so the chat template is not translated: it is rendered with
placeholder messages, and the text around the placeholders becomes the Go template's fixed text
({{ .System }}, {{ .Prompt }}, {{ .Response }}). The template's own default system message (SmolLM2 and
Qwen2 add one when the conversation has none) becomes the {{ else }} branch.
"""

from __future__ import annotations

from typing import Any

from finetune.errors import FinetuneError

_S, _U, _R = "\x00SYSTEM\x00", "\x00PROMPT\x00", "\x00RESPONSE\x00"


def ollama_template(tokenizer: Any) -> str:
    """The Go template equivalent of the tokenizer's chat template for one system / user / assistant exchange."""
    if not isinstance(tokenizer.chat_template, str):
        raise FinetuneError("export --ollama: the tokenizer has no chat template to build the TEMPLATE from",
                            hint="set data.chat_template in the recipe, or export without --ollama")

    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    plain = render([{"role": "user", "content": _U}])
    before_user, _, after_user = plain.partition(_U)
    answered = tokenizer.apply_chat_template([{"role": "user", "content": _U}, {"role": "assistant", "content": _R}],
                                             tokenize=False)
    if not answered.startswith(plain.partition(_U)[0]) or _R not in answered:
        raise FinetuneError("export --ollama: the chat template does not render a user turn followed by the "
                            "assistant's answer", hint="export without --ollama and write the TEMPLATE yourself")
    end = answered.partition(_R)[2]
    head = _go(before_user)
    try:
        with_system = render([{"role": "system", "content": _S}, {"role": "user", "content": _U}])
    except Exception:  # a template that refuses a system role (Gemma's) has no system block
        with_system = None
    if with_system and _S in with_system:
        sys_open, _, rest = with_system.partition(_S)
        rest = rest.partition(_U)[0]
        shared = _common_suffix(rest, before_user)  # the user turn's opening, after the system block
        default = before_user[:len(before_user) - len(shared)]  # the template's own system block, if any
        head = ("{{ if .System }}" + _go(sys_open) + "{{ .System }}" + _go(rest[:len(rest) - len(shared)])
                + ("{{ else }}" + _go(default) if default else "") + "{{ end }}" + _go(shared))
    return head + "{{ .Prompt }}" + _go(after_user) + "{{ .Response }}" + _go(end)


def modelfile(gguf_name: str, tokenizer: Any, stops: list[str], system: str | None) -> str:
    """The Modelfile text: `ollama create NAME -f Modelfile` in its folder makes the model."""
    template = ollama_template(tokenizer)
    if '"""' in template + (system or ""):
        raise FinetuneError('export --ollama: the chat template or data.system_prompt contains """, which ends '
                            "a Modelfile value early", hint="remove the triple quote, or export without --ollama")
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{template}"""']
    lines += [f"PARAMETER stop {_quoted(s)}" for s in dict.fromkeys(stops)]
    if system:
        lines.append(f'SYSTEM """{system}"""')
    return "\n".join(lines) + "\n"


def _go(text: str) -> str:
    """Literal text inside a Go template (a "{{" in it would open an action)."""
    return text.replace("{{", '{{ "{{" }}')


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _common_suffix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return a[len(a) - n:]
