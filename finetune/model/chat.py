"""Chat with trained runs: multi-turn prompts, streamed sampling, and a process that keeps models loaded.

`main` is the chat worker the UI starts (python -m ui.chat_serve, through finetune.api.chat_worker, which passes
the models their streamed loads): it reads one JSON request per line on stdin
and answers with JSON lines on stdout, so the model lives in its own process (never the UI's), is loaded once
and reused for every message, and is freed by ending the process (stdin closed) when training needs the GPU.

Requests: {"op": "chat", "id", "run", "adapter", "messages", "system", "temperature", "top_p",
"max_new_tokens", "keep"}, {"op": "cancel", "id"} (ends that reply early), {"op": "stats"} (model and adapter
loads so far). "keep" lists the {"run", "adapter"} the client shows now (the UI: the turn's columns; absent: this
request's alone): the models the others used are let go before this one is answered (`ChatModels.keep`). A chat
answers with events {"id", "event": "loading" | "text" | "done" | "error", ...}; "done" carries the whole reply
and the number of model loads so far.
"""

from __future__ import annotations

import contextlib
import gc
import json
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import torch

from finetune.console import quiet_libraries
from finetune.data.chat import drops_text_content, text_parts
from finetune.errors import FinetuneError
from finetune.model.load import load_tokenizer
from finetune.model.trained import Streaming, base_model_key, load_run, load_trained, loaded, vision_of

# A turn's content is a str, or (a turn with images) a list of parts, in order: {"type": "text", "text": ...} and
# {"type": "image", "path": "/absolute/path.png"}, the canonical record's shape (finetune.data.formats).
Message = dict[str, Any]


def has_images(messages: list[Message]) -> bool:
    """Whether any turn carries an image part."""
    return any(isinstance(m["content"], list) and any(p.get("type") == "image" for p in m["content"])
               for m in messages)


def user_turn(prompt: str, image: str | Path | None = None) -> Message:
    """One user message: the prompt alone, or the image (an absolute path) followed by the prompt."""
    if image is None:
        return {"role": "user", "content": prompt}
    return {"role": "user", "content": [{"type": "image", "path": str(Path(image).resolve())},
                                        {"type": "text", "text": prompt}]}


def prompt_inputs(tokenizer, messages: list[Message], system: str | None = None, vision: Any = None
                  ) -> dict[str, Any]:
    """The model's inputs for the assistant's next turn: input_ids and attention_mask, and for a conversation
    with images (`vision`: the run's finetune.data.vision.VisionData) each image's token expanded to its
    features and the image processor's outputs (pixel_values, image_grid_thw, ...), as the run trained."""
    images = has_images(messages)
    if images and vision is None:
        raise FinetuneError("this model reads no images: it is a text-only model",
                            hint="give an image only to a run of a vision-language model")
    ids = tokenizer(build_prompt(tokenizer, messages, system), add_special_tokens=False)["input_ids"]
    if not images:
        return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    paths = [p["path"] for m in messages if isinstance(m["content"], list) for p in m["content"]
             if p.get("type") == "image"]
    ids, _ = vision.expand((ids, ids), paths)

    def text_part(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"input_ids": torch.tensor([r["input_ids"] for r in rows]),
                "attention_mask": torch.ones(len(rows), len(ids), dtype=torch.long)}

    return vision.collator(text_part)([{"input_ids": ids, "images": paths}])


def build_prompt(tokenizer, messages: list[Message], system: str | None = None) -> str:
    """The text the model continues: the whole history (and the system prompt) through the chat template,
    ending where the assistant's next turn starts. Without a template (a base model): a lone prompt is
    continued as it is, a conversation as a plain transcript."""
    turns = ([{"role": "system", "content": system}] if system else []) + list(messages)
    if tokenizer.chat_template:
        if drops_text_content(tokenizer, tokenizer.chat_template):  # SmolVLM's template reads content parts only
            turns = text_parts(turns)
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    if len(turns) == 1:
        return turns[0]["content"]
    return "".join(f"{m['role']}: {m['content']}\n" for m in turns) + "assistant: "


def sampling_kwargs(temperature: float, top_p: float) -> dict[str, Any]:
    """generate() arguments: temperature 0 is greedy (deterministic), above 0 samples with top-p."""
    if not 0 <= temperature <= 5:
        raise FinetuneError(f"temperature {temperature} is out of range", hint="use 0 (greedy) to 5")
    if not 0 < top_p <= 1:
        raise FinetuneError(f"top_p {top_p} is out of range", hint="use a value in (0, 1]")
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": float(temperature), "top_p": float(top_p)}


class _TextStreamer:
    """A generate() streamer that hands on the new text after every token (held back while a multi-byte
    character is incomplete) and stops generation when `cancel` is set."""

    def __init__(self, tokenizer, on_text: Callable[[str], None], cancel: threading.Event):
        self.tokenizer, self.on_text, self.cancel = tokenizer, on_text, cancel
        self.ids: list[int] = []
        self.sent = 0
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first passes the prompt
            self._prompt_seen = True
            return
        self.ids.extend(value.reshape(-1).tolist())
        self._flush(final=False)

    def end(self) -> None:
        self._flush(final=True)

    def _flush(self, final: bool) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if (final or not text.endswith("\ufffd")) and len(text) > self.sent:
            self.on_text(text[self.sent:])
            self.sent = len(text)

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:  # a StoppingCriteria
        return torch.full((input_ids.shape[0],), self.cancel.is_set(), dtype=torch.bool, device=input_ids.device)


def stop_ids(model, tokenizer) -> list[int]:
    """The tokens that end an answer: the tokenizer's and the model's generation config's end-of-sequence, and
    the chat template's end of turn (the special token its template writes right after an assistant turn's
    text, e.g. <|im_end|>, <|eot_id|>, <end_of_turn>), which an instruct model emits where its answer ends."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(configured) if isinstance(configured, list | tuple) else {configured}
    if tokenizer.chat_template:
        marker = "\x00answer\x00"
        with contextlib.suppress(Exception):  # a template that wants other turns: the eos ids above
            text = tokenizer.apply_chat_template([{"role": "user", "content": "q"},
                                                  {"role": "assistant", "content": marker}], tokenize=False)
            after = tokenizer(text.split(marker, 1)[1], add_special_tokens=False)["input_ids"]
            special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
            ids |= {after[0]} if after and after[0] in special else set()
    return sorted(i for i in ids if isinstance(i, int))


def stream_reply(model, tokenizer, messages: list[Message], *, system: str | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, max_new_tokens: int = 256, on_text: Callable[[str], None] = lambda t: None,
                 cancel: threading.Event | None = None, vision: Any = None) -> str:
    """The assistant's next turn after `messages`, passed to `on_text` piece by piece as it is generated;
    returns the whole reply. Setting `cancel` ends it early (what was generated so far is kept). Turns with
    images need `vision`, the run's image processor (finetune.model.trained.vision_of)."""
    return reply(model, tokenizer, messages, system=system, temperature=temperature, top_p=top_p,
                 max_new_tokens=max_new_tokens, on_text=on_text, cancel=cancel, vision=vision).text


class Reply(NamedTuple):
    """An answer and whether it was cut at max_new_tokens (no end of turn within it)."""

    text: str
    capped: bool


def reply(model, tokenizer, messages: list[Message], *, system: str | None = None, temperature: float = 0.0,
          top_p: float = 1.0, max_new_tokens: int = 256, on_text: Callable[[str], None] = lambda t: None,
          cancel: threading.Event | None = None, vision: Any = None) -> Reply:
    """`stream_reply`'s answer, with whether the length limit cut it. The answer ends at the end of
    sequence or the chat template's end of turn (`stop_ids`)."""
    from transformers import StoppingCriteriaList

    if not messages or messages[-1].get("role") != "user":
        raise FinetuneError("the chat history must end with a user message")
    kwargs = sampling_kwargs(temperature, top_p)
    inputs = {k: v.to(model.device) for k, v in prompt_inputs(tokenizer, messages, system, vision).items()}
    streamer = _TextStreamer(tokenizer, on_text, cancel or threading.Event())
    stops = stop_ids(model, tokenizer)
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=int(max_new_tokens), streamer=streamer, use_cache=True,
                       stopping_criteria=StoppingCriteriaList([streamer]), pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=stops or None, **kwargs)
    capped = len(streamer.ids) >= int(max_new_tokens) and not (streamer.ids and streamer.ids[-1] in stops)
    return Reply(tokenizer.decode(streamer.ids, skip_special_tokens=True).strip(), capped)


def generate(model, tokenizer, prompt: str, *, image: str | Path | None = None, vision=None,
             max_new_tokens: int = 128, system: str | None = None) -> str:
    """Greedy answer to one user prompt, about `image` where one is given (with `vision`, the run's
    `finetune.model.trained.vision_of`): a one-turn chat (`finetune generate`, `compare`, `compare_runs`)."""
    return stream_reply(model, tokenizer, [user_turn(prompt, image)], system=system, max_new_tokens=max_new_tokens,
                        vision=vision)


class ChatModels:
    """Models kept loaded for chat. LoRA runs on the same base model (`base_model_key`) share one
    copy of it, each run's adapter loaded beside the others under its own name, and a run's base model is
    those weights with the adapters switched off: base, fine-tuned and a second run side by side cost one
    load. A full fine-tune is its own model. `loads` counts model loads, `adapter_loads` added adapters.

    A base loads as `streaming` says (finetune.api.chat_models: through the weight store where the run streamed
    it; runs sharing a base share it as the first of them streamed it). The models stay until `keep` lets go of
    those no run shown uses any more (a run's adapter leaves a base other runs shown share) or `close()` drops
    them all; either closes their stores (their files removed) and frees their memory."""

    def __init__(self, loader: Callable = load_trained, streaming: Streaming | None = None):
        self._loader = loader
        self._streaming = streaming
        self._stores: dict[int, contextlib.ExitStack] = {}  # id(model) -> its store, open while the model is kept
        self._runs: dict[tuple[str, bool], tuple[Any, Any, str | None]] = {}  # -> (model, tokenizer, adapter)
        self._shared: dict[tuple, Any] = {}  # base_model_key -> the PeftModel holding its runs' adapters
        self.loads = 0
        self.adapter_loads = 0

    def _key(self, run: str | Path, adapter: bool) -> tuple[tuple[str, bool], bool]:
        """(which entry answers: (run, loaded with its adapter), whether to switch the adapters off)."""
        path = str(Path(run).resolve())
        if adapter or (path, False) in self._runs:
            return (path, adapter), False
        recipe, _ = load_run(path)
        return ((path, False), False) if recipe.adapter.type == "full" else ((path, True), True)

    def needs_load(self, run: str | Path, adapter: bool = True) -> bool:
        return self._key(run, adapter)[0] not in self._runs

    def _open(self, key: tuple[str, bool]) -> tuple[Any, Any]:
        """(model, tokenizer) of `key` loaded, its store (where it streams) kept open until `close`."""
        def load(arriving: AbstractContextManager | None) -> tuple[Any, Any]:
            return self._loader(key[0], use_adapter=key[1], arriving=arriving)

        with contextlib.ExitStack() as stores:
            model, tokenizer = stores.enter_context(loaded(key[0], self._streaming, load))
            self._stores[id(model)] = stores.pop_all()
        self.loads += 1
        return model, tokenizer

    def _load(self, key: tuple[str, bool]) -> tuple[Any, Any, str | None]:
        recipe, run = load_run(key[0])
        if recipe.adapter.type == "full" or not key[1]:
            return (*self._open(key), None)
        base = base_model_key(recipe)
        model = self._shared.get(base)
        if model is None:
            model, tokenizer = self._open(key)
            self._shared[base] = model
            return model, tokenizer, model.active_adapter
        name = f"run{self.adapter_loads + 1}"
        model.load_adapter(str(run.adapter), adapter_name=name, is_trainable=False)
        self.adapter_loads += 1
        return model, load_tokenizer(run.adapter, recipe.model), name

    @contextlib.contextmanager
    def use(self, run: str | Path, adapter: bool = True) -> Iterator[tuple[Any, Any]]:
        """(model, tokenizer) for the run, or for its base model with adapter=False; loaded on first use."""
        key, switch_off = self._key(run, adapter)
        if key not in self._runs:
            self._runs[key] = self._load(key)
        model, tokenizer, name = self._runs[key]
        if name is not None:
            model.set_adapter(name)
        with model.disable_adapter() if switch_off else contextlib.nullcontext():
            yield model, tokenizer

    def keep(self, runs: list[tuple[str | Path, bool]]) -> None:
        """Let go of every model none of `runs` ((run, adapter) pairs: what the client shows now) uses: a run's
        adapter leaves a base a run shown goes on (loaded or not yet), a model no run shown uses goes whole, its
        store closed (a streamed base's files removed) and its memory freed, so clicking through runs keeps only
        what is shown. A run that cannot load is no reason to keep anything (its request answers the error)."""
        wanted, bases = set(), set()  # the entries shown; the shared bases their adapters go on
        for run, adapter in runs:
            with contextlib.suppress(FinetuneError):
                key = self._key(run, adapter)[0]
                wanted.add(key)
                recipe, _ = load_run(key[0])
                if recipe.adapter.type != "full" and key[1]:
                    bases.add(base_model_key(recipe))
        kept = {id(model) for base, model in self._shared.items() if base in bases}
        for key in [key for key in self._runs if key not in wanted]:
            model, _, name = self._runs.pop(key)
            if name is not None and (id(model) in kept or any(other is model for other, _, _ in self._runs.values())):
                model.delete_adapter(name)  # the base stays for the runs shown
        self._release(kept | {id(model) for model, _, _ in self._runs.values()})

    def _release(self, kept: set[int]) -> None:
        """Close the stores of the models not in `kept` (ids), drop them, and free their memory."""
        gone = [ident for ident in self._stores if ident not in kept]
        if not gone:
            return
        self._shared = {base: model for base, model in self._shared.items() if id(model) in kept}
        for ident in gone:
            self._stores.pop(ident).close()
        gc.collect()  # models hold reference cycles (modules, hooks): their tensors go now, not some time later
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Drop every model and close their weight stores (a streamed base's files removed); the next `use`
        loads again."""
        self._runs.clear()
        self._release(set())


def serve(requests: TextIO, replies: TextIO, models: ChatModels | None = None) -> None:
    """The worker loop: answer chat requests one at a time until `requests` ends, then close the models."""
    models = models or ChatModels()
    pending: queue.Queue[dict | None] = queue.Queue()
    lock = threading.Lock()
    current: dict[Any, threading.Event] = {}  # the request being answered -> its cancel flag
    cancelled: set[Any] = set()  # cancels that arrived before their request started

    def send(**event: Any) -> None:
        with lock:
            replies.write(json.dumps(event) + "\n")
            replies.flush()

    def read() -> None:  # a thread, so a cancel arrives while a reply is being generated
        for line in requests:
            try:
                request = json.loads(line)
            except ValueError:
                send(event="error", message=f"not a JSON request: {line[:80]!r}")
                continue
            if request.get("op") != "cancel":
                pending.put(request)
                continue
            with lock:
                if request.get("id") in current:
                    current[request.get("id")].set()
                else:
                    cancelled.add(request.get("id"))
        pending.put(None)

    threading.Thread(target=read, name="chat-requests", daemon=True).start()
    try:
        while (request := pending.get()) is not None:
            op, rid = request.get("op"), request.get("id")
            if op == "stats":
                send(id=rid, event="stats", loads=models.loads, adapter_loads=models.adapter_loads)
            elif op != "chat":
                send(id=rid, event="error", message=f"unknown request {op!r}")
            else:
                with lock:
                    cancel = current.setdefault(rid, threading.Event())
                    if rid in cancelled:
                        cancel.set()
                try:
                    _answer(request, models, send, cancel)
                finally:
                    with lock:
                        current.pop(rid, None)
                        cancelled.discard(rid)
    finally:
        models.close()


def _answer(request: dict, models: ChatModels, send: Callable[..., None], cancel: threading.Event) -> None:
    rid, adapter = request.get("id"), bool(request.get("adapter", True))
    try:
        if cancel.is_set():
            send(id=rid, event="done", text="", loads=models.loads, cancelled=True)
            return
        load_run(request["run"])  # a folder that is not a finished run: an error before any loading
        shown = request.get("keep") or [{"run": request["run"], "adapter": adapter}]
        models.keep([(item["run"], bool(item.get("adapter", True))) for item in shown])
        if models.needs_load(request["run"], adapter):
            send(id=rid, event="loading")
        with models.use(request["run"], adapter) as (model, tokenizer):
            vision = vision_of(request["run"], model, tokenizer) if has_images(request["messages"]) else None
            reply = stream_reply(model, tokenizer, request["messages"], system=request.get("system") or None,
                                 vision=vision,
                                 temperature=float(request.get("temperature", 0.0)),
                                 top_p=float(request.get("top_p", 1.0)),
                                 max_new_tokens=int(request.get("max_new_tokens", 256)),
                                 on_text=lambda piece: send(id=rid, event="text", text=piece), cancel=cancel)
        send(id=rid, event="done", text=reply, loads=models.loads, cancelled=cancel.is_set())
    except FinetuneError as exc:
        send(id=rid, event="error", message=exc.message, hint=exc.hint)
    except torch.OutOfMemoryError:
        send(id=rid, event="error", message="the GPU ran out of memory",
             hint="ask fewer columns at once, lower max new tokens, or stop what else uses the GPU")
    except Exception as exc:  # noqa: BLE001 - the worker must answer, not die, on one bad request
        send(id=rid, event="error", message=f"{type(exc).__name__}: {exc}")


def main(models: ChatModels) -> int:
    """The worker process (finetune.api.chat_worker): stdout carries only the protocol; anything libraries print
    goes to stderr."""
    replies = sys.stdout
    sys.stdout = sys.stderr
    quiet_libraries()  # the UI server's worker: its log carries no more library noise than the server's
    serve(sys.stdin, replies, models)
    return 0
