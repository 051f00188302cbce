"""A user's mistake becomes a message on the page, never a traceback."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import gradio as gr

from finetune.errors import FinetuneError, RecipeError


def problems_markdown(exc: FinetuneError) -> str:
    lines = [f"**{exc.message}**", *(f"- {p}" for p in exc.problems)]
    if exc.hint:
        lines.append(f"\n{exc.hint}")
    return "\n".join(lines)


def first_steps(exc: RecipeError, text: str) -> str | None:
    """What a fresh page shows instead of an error: where every problem is a required key not given yet
    (problem code `missing`), the next step, `text` (one neutral hint per tab); None where something given is
    wrong."""
    if exc.problems and all(getattr(p, "code", None) == "missing" for p in exc.problems):
        return text
    return None


def reported(n_outputs: int, message_at: int = 0) -> Callable:
    """Wrap a handler so a FinetuneError becomes a message in output `message_at`, others left unchanged."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args: Any) -> Any:
            try:
                return fn(*args)
            except FinetuneError as exc:
                out = [gr.skip()] * n_outputs
                out[message_at] = problems_markdown(exc)
                return tuple(out) if n_outputs > 1 else out[0]
        return inner
    return wrap
