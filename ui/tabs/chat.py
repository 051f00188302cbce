"""Chat tab: a multi-turn chat with a run's fine-tuned model, beside its base model and a second run.

Every column gets the same user turns and keeps its own answers; replies stream in token by token from the
chat worker process (ui.chat_worker), which keeps the models loaded between messages and waits while a
training run holds the GPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradio as gr

from finetune import api
from finetune.errors import FinetuneError
from ui.backend import Backend
from ui.tabs.messages import problems_markdown

COLUMNS = ("fine-tuned", "base model", "second run")
STREAM_EVERY_S = 0.1  # the page is updated at most this often while answers stream in
# Copy buttons only: Gradio's default "share" (to Hugging Face Spaces discussions) is an icon without a label.
CHATBOT_BUTTONS = ["copy", "copy_all"]


def text_of(content: Any) -> str:
    """A chat message's text, whether Gradio hands it over as a string or as a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return content.get("text") or ""
    return "".join(text_of(part) for part in content or [])


def _image_path(part: Any) -> str | None:
    """The file of a chat message part that is one: Gradio's {"type": "file", "file": {"path"}} or a part with a
    "path" (the canonical {"type": "image", "path"}, which the Chatbot also shows as a file)."""
    if not isinstance(part, dict):
        return None
    return (part.get("file") or {}).get("path") if part.get("type") == "file" else part.get("path")


def model_content(content: Any) -> str | list[dict[str, str]]:
    """A chat message as the model reads it: its text, or for a turn with images the parts in order,
    {"type": "image", "path"} and {"type": "text", "text"} (finetune.model.chat's turn shape)."""
    parts = content if isinstance(content, list) else [content]
    if not any(_image_path(p) for p in parts):
        return text_of(content)
    out = []
    for part in parts:
        if path := _image_path(part):
            out.append({"type": "image", "path": path})
        elif text := text_of(part):
            out.append({"type": "text", "text": text})
    return out


def plain(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A chatbot's history as the model sees it: role and content (text, or images and text) of each turn."""
    return [{"role": m["role"], "content": model_content(m["content"])} for m in history or []]


def start_of(run: str | None) -> str | None:
    """The run whose adapter `run` started from (adapter.init_from: the SFT run of a DPO run), if any."""
    try:
        runs = api.lineage([run]) if run else []
    except FinetuneError:
        return None
    return str(runs[-2][0]) if len(runs) > 1 else None


def start_column(backend: Backend, run: str | None, second: str | None) -> Any:
    """The second column for `run`: its start run when none is chosen and both are in the allowed folders."""
    if second or not run:
        return gr.skip()
    try:
        parent = start_of(str(backend.run_path(run)))
        return str(backend.run_path(parent)) if parent else gr.skip()
    except FinetuneError:  # outside the allowed folders (or gone): no lineage shown
        return gr.skip()


def respond(backend: Backend, run: str | None, second: str | None, show_base: bool, system: str,
            temperature: float, top_p: float, max_new_tokens: int, text: str | dict[str, Any],
            *histories: list[dict[str, Any]]) -> Iterator[tuple[Any, ...]]:
    """Send the message to every shown column and stream the answers in; yields (prompt box, fine-tuned
    history, base history, second-run history, status message). `text` is the message box's value: a string,
    or {"text", "files"} with the images uploaded beside it (for a vision-language run: each image goes before
    the text in the user turn)."""
    histories = [plain(h) for h in histories]
    text, images = (text.get("text") or "", list(text.get("files") or [])) if isinstance(text, dict) else (text, [])
    try:
        if not text or not text.strip():
            raise FinetuneError("type a message first")
        columns = [(0, backend.chat_run(run, "fine-tuned run"), True)]
        if show_base:
            columns.append((1, columns[0][1], False))
        if second:
            columns.append((2, backend.chat_run(second, "second run"), True))
    except FinetuneError as exc:
        yield gr.skip(), gr.skip(), gr.skip(), gr.skip(), problems_markdown(exc)
        return
    content = [*({"type": "image", "path": str(i)} for i in images), {"type": "text", "text": text}] if images \
        else text
    requests = []
    for index, path, adapter in columns:
        histories[index] = [*histories[index], {"role": "user", "content": content}]
        requests.append({"run": path, "adapter": adapter, "messages": list(histories[index]),
                         "system": system or "", "temperature": float(temperature), "top_p": float(top_p),
                         "max_new_tokens": int(max_new_tokens)})
        histories[index].append({"role": "assistant", "content": ""})
    yield "", *histories, ""
    with contextlib.closing(backend.chat(requests)) as events:  # closed early (Stop): the reply is cancelled
        yield from _stream(events, columns, histories)


def _stream(events: Iterator[dict[str, Any]], columns: list[tuple[int, str, bool]],
            histories: list[list[dict[str, str]]]) -> Iterator[tuple[Any, ...]]:
    """The chat worker's events as updates of the page: answers grow, the status says what is going on."""
    status, problems, started, shown = "", [], time.monotonic(), 0.0
    for event in events:
        kind = event["event"]
        index = columns[event["column"]][0] if "column" in event else None
        if kind == "waiting":
            status = (f"Waiting for training to finish ({Path(event['run']).name} holds the GPU): your message "
                      "is queued and goes to the model as soon as the run ends.")
        elif kind == "loading":
            status = f"Loading the {COLUMNS[index]} model (once: later messages reuse it)..."
        elif kind == "text":
            status = ""
            histories[index][-1]["content"] += event["text"]
            if time.monotonic() - shown < STREAM_EVERY_S:
                continue  # a small model writes faster than a browser redraws: send the page what is new
        elif kind == "done":
            histories[index][-1]["content"] = event["text"] or histories[index][-1]["content"]
        elif kind == "error":
            del histories[index][-2:]  # no answer: the turn is taken back in this column (send it again)
            hint = f" ({event['hint']})" if event.get("hint") else ""
            problems.append(f"{COLUMNS[index]}: {event['message']}{hint}")
            status = "**The chat worker could not answer**\n" + "\n".join(f"- {p}" for p in problems)
        shown = time.monotonic()
        yield gr.skip(), *histories, status
    if not problems:
        yield gr.skip(), *histories, f"Answered in {time.monotonic() - started:.1f} s."


def build(backend: Backend) -> gr.Dropdown:
    """The Chat tab; returns its run picker (the page fills it with the list of runs)."""
    with gr.Tab("Chat", id="chat") as tab:
        with gr.Row():
            chat_run = gr.Dropdown(label="Fine-tuned run", allow_custom_value=True, elem_id="chat-run", scale=3)
            show_base = gr.Checkbox(value=True, label="Also ask the base model", elem_id="chat-show-base",
                                    scale=1)
            second_run = gr.Dropdown(label="Second run (optional)", allow_custom_value=True,
                                     elem_id="chat-run2", scale=3)
        with gr.Accordion("Generation settings", open=False, elem_id="chat-settings"):
            system = gr.Textbox(label="System prompt", lines=2, elem_id="chat-system",
                                placeholder="e.g. You are a concise assistant.")
            with gr.Row():
                temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature (0 = greedy)",
                                        elem_id="chat-temperature")
                top_p = gr.Slider(0.05, 1, value=0.9, step=0.05, label="Top-p", elem_id="chat-top-p")
                max_new = gr.Slider(8, 1024, value=256, step=8, label="Max new tokens", elem_id="chat-max-new")
        with gr.Row():
            tuned_bot = gr.Chatbot(label="fine-tuned (base + adapter)", height=360, buttons=CHATBOT_BUTTONS,
                                   elem_id="chat-tuned")
            base_bot = gr.Chatbot(label="base model", height=360, buttons=CHATBOT_BUTTONS,
                                  elem_id="chat-base")
            second_bot = gr.Chatbot(label="second run", height=360, buttons=CHATBOT_BUTTONS,
                                    elem_id="chat-second", visible=False)
        with gr.Row():
            prompt = gr.MultimodalTextbox(label="Message", scale=5, elem_id="chat-prompt", file_types=["image"],
                                          file_count="single", sources=["upload"], submit_btn=False,
                                          placeholder="Enter sends; the conversation so far goes with it. "
                                                      "A vision-language run also takes an image (the clip).")
            send_btn = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send")
            stop_btn = gr.Button("Stop", scale=1, elem_id="chat-stop")
            clear_btn = gr.Button("New chat", scale=1, elem_id="chat-clear")
        chat_msg = gr.Markdown(elem_id="chat-message")
        unload_btn = gr.Button("Free the GPU (unload chat models)", size="sm", elem_id="chat-unload")

    def send(*args):
        yield from respond(backend, *args)

    inputs = [chat_run, second_run, show_base, system, temperature, top_p, max_new, prompt,
              tuned_bot, base_bot, second_bot]
    outputs = [prompt, tuned_bot, base_bot, second_bot, chat_msg]
    sent = send_btn.click(send, inputs, outputs, api_name="chat")
    submitted = prompt.submit(send, inputs, outputs, api_visibility="private")
    stop_btn.click(None, None, None, cancels=[sent, submitted])
    clear_btn.click(lambda: ([], [], [], ""), None, [tuned_bot, base_bot, second_bot, chat_msg],
                    api_visibility="private")

    def unload():
        backend.chat_worker.release()
        return "Chat models unloaded; the next message loads them again."

    unload_btn.click(unload, None, chat_msg, api_name="chat_unload")
    show_base.change(lambda shown: gr.update(visible=shown), show_base, base_bot, api_visibility="private")
    second_run.change(lambda run: gr.update(visible=bool(run), label=f"second run: {Path(run).name}" if run
                                            else "second run"), second_run, second_bot,
                      api_visibility="private")
    chat_run.change(lambda run: gr.update(label=f"fine-tuned: {Path(run).name}" if run
                                          else "fine-tuned (base + adapter)"), chat_run, tuned_bot,
                    api_visibility="private")
    # A run started from another run's adapter (DPO after SFT): that run becomes the second column, so the
    # page shows base, SFT and DPO side by side (unless a second run is already chosen).
    chat_run.change(lambda run, second: start_column(backend, run, second), [chat_run, second_run], second_run,
                    api_visibility="private")
    def run_lists():  # runs finish while the page is open: list them again when the tab is opened
        dirs = backend.chat_runs()
        return gr.update(choices=dirs), gr.update(choices=dirs)

    tab.select(run_lists, None, [chat_run, second_run], api_visibility="private")
    return chat_run
