"""Helpers shared by the UI's API tests and browser tests: a tiny dataset and recipe, a launched app."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml


def write_dataset(path: Path, n: int = 12) -> Path:
    """A small chat dataset (messages format) the tiny model can overfit."""
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}) + "\n")
    return path


def tiny_recipe(model_dir: Path, data: Path, out: Path, max_steps: int = 20, **training: Any) -> dict[str, Any]:
    """A recipe that trains the tiny model in seconds on a CPU (no quantization, no checkpointing)."""
    return {
        "model": {"path": str(model_dir)},
        "quantization": {"bits": None},
        "adapter": {"type": "lora", "r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 64},
        "training": {"max_steps": max_steps, "learning_rate": 1e-2, "logging_steps": 1, "warmup_ratio": 0.0,
                     **training},
        "memory": {"activation_checkpointing": False},
        "output": {"dir": str(out), "save_steps": 1000},
    }


def write_recipe(path: Path, recipe: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_app(workdir: Path, allow_dirs: list[Path]) -> Iterator[Any]:
    """The UI served on a free loopback port; on exit its runs are stopped and the server closed."""
    from ui.app import launch

    demo = launch(port=free_port(), allow_dirs=allow_dirs, runs_dir=workdir / "runs", block=False)
    try:
        yield demo
    finally:
        demo.run_manager.close(stop_runs=True)
        demo.chat_worker.stop()
        demo.close()


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.5) -> Any:
    """Poll until `predicate()` is truthy; fail with `what` after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def status_of(html: str) -> tuple[str, int]:
    """(state, step) from the Train tab's status block."""
    state = re.search(r"data-state='([^']*)'", html)
    step = re.search(r"data-step='(\d+)'", html)
    return (state.group(1) if state else ""), int(step.group(1)) if step else 0


def form_values(recipe: dict[str, Any]) -> list[Any]:
    """The form's widget values for `recipe`, as the page would send them (no upload round trip)."""
    from finetune.recipe.load import validate_recipe
    from ui import form

    return form.dict_to_values(form.form_specs(), validate_recipe(recipe).model_dump(mode="python"))


def set_value(values: list[Any], key: str, value: Any) -> list[Any]:
    """`values` with the widget of recipe key `key` set to `value`."""
    from ui import form

    out = list(values)
    out[[s.key for s in form.form_specs()].index(key)] = value
    return out


def call_raw(url: str, api_name: str, data: list[Any], timeout: float = 30) -> str:
    """POST an API call the way any HTTP client could (gradio_client would upload local files itself),
    and return the event stream's text."""
    import httpx

    event = httpx.post(f"{url}gradio_api/call/{api_name}", json={"data": data}, timeout=timeout).json()["event_id"]
    return httpx.get(f"{url}gradio_api/call/{api_name}/{event}", timeout=timeout).text
