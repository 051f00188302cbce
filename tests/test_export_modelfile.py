"""The Ollama Modelfile: its TEMPLATE, rendered as Go's text/template would, gives the prompt the tokenizer's
chat template gives (with and without a system message, a template's default system message, a template that
refuses system messages), and it names the file, the stop tokens and the recipe's system prompt."""

from __future__ import annotations

import json
import re

import pytest

from finetune.errors import FinetuneError
from finetune.export.modelfile import modelfile, ollama_template
from finetune.testing import make_tokenizer

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
GEMMA_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
_ACTION = re.compile(r"\{\{(.*?)\}\}", re.S)


def render_go(template: str, values: dict[str, str]) -> str:
    """The part of Go's text/template a Modelfile TEMPLATE uses: {{ .Name }}, {{ "literal" }} and
    {{ if .Name }} ... {{ else }} ... {{ end }}, nested."""
    out, emitting, pos = [], [True], 0
    for match in _ACTION.finditer(template):
        if all(emitting):
            out.append(template[pos:match.start()])
        pos, action = match.end(), match.group(1).strip()
        if action.startswith("if "):
            emitting.append(bool(values.get(action[3:].strip().removeprefix("."))))
        elif action == "else":
            emitting[-1] = not emitting[-1]
        elif action == "end":
            emitting.pop()
        elif all(emitting):
            out.append(json.loads(action) if action.startswith('"') else values[action.removeprefix(".")])
    return "".join(out + [template[pos:]] if all(emitting) else out)


def _tokenizer(template: str | None = None):
    tokenizer = make_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def _chat(tokenizer, messages, generation=True):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


@pytest.mark.parametrize("template", [None, SMOLLM2_TEMPLATE], ids=["chatml", "default-system"])
def test_template_renders_what_the_chat_template_renders(template):
    tokenizer = _tokenizer(template)
    go = ollama_template(tokenizer)
    user = {"role": "user", "content": "What is 2+2?"}
    system = {"role": "system", "content": "Answer briefly."}
    assert render_go(go, {"Prompt": user["content"], "Response": ""}).removesuffix(
        render_go(_end(go), {})) == _chat(tokenizer, [user])
    assert render_go(go, {"System": system["content"], "Prompt": user["content"], "Response": ""}).removesuffix(
        render_go(_end(go), {})) == _chat(tokenizer, [system, user])
    answered = render_go(go, {"Prompt": user["content"], "Response": "4"})
    assert answered == _chat(tokenizer, [user, {"role": "assistant", "content": "4"}], generation=False)


def _end(go: str) -> str:
    """What the template writes after {{ .Response }} (the end of the assistant turn, closed once it is given)."""
    return go.partition("{{ .Response }}")[2]


def test_a_template_that_refuses_system_messages_gets_no_system_block():
    tokenizer = _tokenizer(GEMMA_TEMPLATE)
    go = ollama_template(tokenizer)
    assert ".System" not in go
    user = {"role": "user", "content": "Hi"}
    assert render_go(go, {"Prompt": "Hi", "Response": ""}).removesuffix(render_go(_end(go), {})) == _chat(
        tokenizer, [user])


def test_modelfile_names_file_stops_and_system_prompt():
    tokenizer = _tokenizer()
    text = modelfile("pico.q8_0.gguf", tokenizer, ["<|im_end|>", "<|im_end|>", "<|endoftext|>"], "You are Pico.")
    lines = text.splitlines()
    assert lines[0] == "FROM ./pico.q8_0.gguf" and lines[1].startswith('TEMPLATE """')
    assert [line for line in lines if line.startswith("PARAMETER")] == [
        'PARAMETER stop "<|im_end|>"', 'PARAMETER stop "<|endoftext|>"']
    assert lines[-1] == 'SYSTEM """You are Pico."""'
    assert "SYSTEM" not in modelfile("m.gguf", tokenizer, [], None)


def test_a_triple_quote_or_a_missing_template_is_refused():
    with pytest.raises(FinetuneError, match='contains """'):
        modelfile("m.gguf", _tokenizer(), [], 'Say """hi"""')
    tokenizer = _tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(FinetuneError, match="no chat template"):
        modelfile("m.gguf", tokenizer, [], None)


def test_go_braces_in_the_chat_text_stay_literal():
    tokenizer = _tokenizer(SMOLLM2_TEMPLATE.replace("named SmolLM", "named {{SmolLM}}"))
    go = ollama_template(tokenizer)
    assert render_go(go, {"Prompt": "Hi", "Response": ""}).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named {{SmolLM}}")


def test_the_ollama_command_keeps_the_dots_of_a_run_name(tmp_path):
    from finetune.export.files import MODELFILE, model_name, ollama_command

    name = model_name("SmolLM2.v2 chat")
    assert name == "smollm2.v2-chat"
    (tmp_path / f"{name}.q8_0.gguf").write_bytes(b"GGUF")
    assert ollama_command(tmp_path) == f"ollama create smollm2.v2-chat -f {tmp_path / MODELFILE}"
