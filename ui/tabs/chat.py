"""Chat tab: one prompt answered by a run's fine-tuned model and by its base model, side by side."""

from __future__ import annotations

import gradio as gr

from finetune.errors import FinetuneError
from ui.backend import Backend
from ui.tabs.messages import reported


def build(backend: Backend) -> gr.Dropdown:
    """The Chat tab; returns its run picker (the page fills it with the list of runs)."""
    with gr.Tab("Chat", id="chat"):
        with gr.Row():
            chat_run = gr.Dropdown(label="Run (adapter)", allow_custom_value=True, elem_id="chat-run", scale=3)
            max_new = gr.Slider(8, 1024, value=128, step=8, label="max new tokens", scale=1)
        with gr.Row():
            tuned_bot = gr.Chatbot(label="fine-tuned (base + adapter)", height=320, elem_id="chat-tuned")
            base_bot = gr.Chatbot(label="base model", height=320, elem_id="chat-base")
        with gr.Row():
            prompt = gr.Textbox(label="Prompt", scale=4, elem_id="chat-prompt")
            send_btn = gr.Button("Send to both", variant="primary", scale=1, elem_id="chat-send")
        chat_msg = gr.Markdown(elem_id="chat-message")

    @reported(4, message_at=3)
    def chat(run_dir, text, tokens, tuned_hist, base_hist):
        if not text or not text.strip():
            raise FinetuneError("type a prompt first")
        tuned, base = backend.chat(run_dir, text, int(tokens))
        user = {"role": "user", "content": text}
        return ("", [*tuned_hist, user, {"role": "assistant", "content": tuned}],
                [*base_hist, user, {"role": "assistant", "content": base}], "")

    chat_inputs = [chat_run, prompt, max_new, tuned_bot, base_bot]
    send_btn.click(chat, chat_inputs, [prompt, tuned_bot, base_bot, chat_msg], api_name="chat")
    prompt.submit(chat, chat_inputs, [prompt, tuned_bot, base_bot, chat_msg], api_visibility="private")
    return chat_run
