"""The UI's chat: one worker process keeps the model loaded across messages, chat waits while a training run
holds the GPU (and a run starting frees it), the worker never outlives the UI, and the Chat tab's handler
streams a multi-turn, side-by-side conversation. (The export's progress is shown in test_ui_api.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from tests.chat_support import fake_run
from tests.ui_support import wait_for
from ui.backend import Backend, UISettings
from ui.runs import Job, RunManager
from ui.tabs.chat import plain, respond

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ui(tmp_path_factory, tiny_model_dir):
    """A backend (its run manager not polling in the background) over two finished runs."""
    work = tmp_path_factory.mktemp("ui-chat")
    runs = [fake_run(work / "runs" / name, tiny_model_dir, seed) for seed, name in enumerate(("one", "two"))]
    backend = Backend(UISettings([work, tiny_model_dir], work / "runs"), RunManager(work / "runs", cwd=ROOT))
    yield backend, runs, work
    backend.chat_worker.stop()


def _chat(backend: Backend, requests: list[dict]) -> list[dict]:
    return list(backend.chat(requests))


def _request(run: Path, messages: list[dict], adapter: bool = True) -> dict:
    return {"run": str(run), "adapter": adapter, "messages": messages, "max_new_tokens": 12}


def test_the_worker_loads_the_model_once_for_several_messages(ui):
    backend, (run, _), _ = ui
    history = []
    for turn in ("Hello there.", "What is 2 plus 2?", "And what did I say first?"):
        history.append({"role": "user", "content": turn})
        events = _chat(backend, [_request(run, history), _request(run, history, adapter=False)])
        done = [e for e in events if e["event"] == "done"]
        assert [e["column"] for e in done] == [0, 1], events
        assert all(e["loads"] == 1 for e in done), "base and fine-tuned share one load, kept between messages"
        assert sum(e["event"] == "text" and e["column"] == 0 for e in events) > 1, "the reply streams in"
        history.append({"role": "assistant", "content": done[0]["text"]})
    assert [e["event"] for e in events].count("loading") == 0
    pid = backend.chat_worker.pid
    assert pid and pid != os.getpid(), "the model lives in the worker process, not the UI's"
    assert backend.chat_worker.stats()["loads"] == 1

    long = backend.chat([{**_request(run, history[:-1]), "max_new_tokens": 1000}])  # Stop pressed mid-answer:
    while next(long)["event"] != "text":
        pass
    long.close()  # the answer is cancelled and its remaining events are drained, so the next is clean
    after = _chat(backend, [_request(run, history[:-1])])
    assert [e["event"] for e in after].count("done") == 1 and after[-1]["text"] == done[0]["text"]


def test_an_uploaded_image_goes_before_the_text_and_a_text_only_run_says_it_reads_none(ui, tmp_path):
    from finetune.testing import shape_image

    backend, (run, _), _ = ui
    image = tmp_path / "red.png"
    shape_image("red", "circle", (4, 4, 30, 30)).save(image)
    page = respond(backend, str(run), None, False, "", 0.0, 1.0, 8,
                   {"text": "What colour is the shape?", "files": [str(image)]}, [], [], [])
    sent = next(page)[1][0]["content"]  # the turn as shown and sent, before any answer
    assert sent == [{"type": "image", "path": str(image)}, {"type": "text", "text": "What colour is the shape?"}]
    _, tuned, _, _, status = list(page)[-1]
    assert "could not answer" in status and "reads no images" in status and tuned == []
    # The Chatbot hands a shown image back as a file part: the model reads it as the image it was.
    shown = [{"role": "user", "content": [{"type": "file", "file": {"path": str(image)}, "alt_text": None},
                                          {"type": "text", "text": "What colour?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
    assert plain(shown) == [{"role": "user", "content": [{"type": "image", "path": str(image)},
                                                         {"type": "text", "text": "What colour?"}]},
                            {"role": "assistant", "content": "red"}]


def test_chat_tab_three_turns_side_by_side_and_clear_mistakes(ui):
    backend, (run, second), work = ui
    settings = (0.0, 1.0, 12)  # greedy: the same history gives the same answer
    tuned, base, other = [], [], []
    for turn in ("My name is Ada.", "I like foxes.", "What is my name?"):
        updates = list(respond(backend, str(run), str(second), True, "Be brief.", *settings, turn,
                               tuned, base, other))
        assert updates[0][0] == "", "the message box is emptied at once"
        _, tuned, base, other, status = updates[-1]
        assert status.startswith("Answered in") and len(updates) > 3, "answers stream in over several updates"
    for history in (tuned, base, other):
        assert [m["role"] for m in history] == ["user", "assistant"] * 3
        assert [m["content"] for m in history[::2]] == ["My name is Ada.", "I like foxes.", "What is my name?"]
    assert tuned[1::2] != base[1::2] and tuned[1::2] != other[1::2], "each column answers with its own model"
    stats = backend.chat_worker.stats()
    assert (stats["loads"], stats["adapter_loads"]) == (1, 1), "nine answers, one model, the second run's adapter"

    def message(run_dir, text="hi", show_base=False, second_run=None):
        return list(respond(backend, run_dir, second_run, show_base, "", *settings, text, [], [], []))[-1][-1]

    *_, (_, tuned_after, base_after, _, status) = respond(backend, str(run), None, True, "", -1, 1.0, 8, "Hi",
                                                          tuned, base, [])
    assert "could not answer" in status and "fine-tuned: temperature -1.0 is out of range" in status
    assert (tuned_after, base_after) == (tuned, base), "a turn with no answer is taken back"
    assert "choose a fine-tuned run first" in message(None)
    assert "type a message first" in message(str(run), text="  ")
    assert "outside the allowed folders" in message("/etc")
    assert "outside the allowed folders" in message(str(run), second_run="/etc")
    half = work / "runs" / "half"
    half.mkdir()
    (half / "recipe.yaml").write_text((run / "recipe.yaml").read_text())
    assert "has no adapter yet" in message(str(run), second_run=str(half))


def test_chat_waits_while_training_runs_and_a_starting_run_frees_the_gpu(ui, monkeypatch, tmp_path):
    """Fake training jobs (a process that runs until a file appears) in the real run manager."""
    backend, (run, _), _ = ui
    manager = backend.manager
    gate = tmp_path / "finish"
    monkeypatch.setattr(Job, "command", lambda job: [sys.executable, "-c", textwrap.dedent(f"""
        import os, time
        while not os.path.exists({str(gate)!r}):
            time.sleep(0.05)""")])
    assert _chat(backend, [_request(run, [{"role": "user", "content": "hi"}])])[-1]["event"] == "done"
    assert backend.chat_worker.pid, "the worker holds a model"

    first = manager.submit(tmp_path / "a.yaml", tmp_path / "run-a")
    wait_for(lambda: manager.job_for(tmp_path / "run-a").state == "running", 30, "the fake run to start")
    assert backend.chat_worker.pid is None, "a starting run stops the chat worker: the GPU is the run's"

    page = respond(backend, str(run), None, False, "", 0.0, 1.0, 8, "hi", [], [], [])  # the Chat tab's Send
    assert next(page)[0] == "", "the message is taken"
    for _ in range(2):
        status = next(page)[-1]
        assert status.startswith(f"Waiting for training to finish ({Path(first.run_dir).name} holds the GPU)")
        assert backend.chat_worker.pid is None, "queued: nothing loaded while the run trains"
    gate.touch()  # the run ends
    *_, (_, tuned, _, _, status) = page
    assert status.startswith("Answered in") and [m["role"] for m in tuned] == ["user", "assistant"]

    gate.unlink()
    held = backend.chat([_request(run, [{"role": "user", "content": "hi"}])])
    assert next(held)["event"] == "text", "no run trains: the chat holds the GPU and answers"
    manager.submit(tmp_path / "b.yaml", tmp_path / "run-b")
    manager.poll()
    assert manager.job_for(tmp_path / "run-b").state == "queued", "a run waits for the answer in progress"
    assert list(held)[-1]["event"] == "done"
    manager.poll()
    assert manager.job_for(tmp_path / "run-b").state == "running" and backend.chat_worker.pid is None
    gate.touch()
    wait_for(lambda: (manager.poll(), manager.job_for(tmp_path / "run-b").state == "exited")[1], 30, "run b")


def test_the_worker_ends_with_the_ui_process(tmp_path):
    """However the UI process ends (here SIGKILL, no cleanup code runs), its worker exits and is no orphan."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from ui.chat_worker import ChatWorker
        from ui.runs import RunManager
        worker = ChatWorker(RunManager({str(tmp_path / 'runs')!r}))
        print(worker.stats()["loads"], worker.pid, flush=True)
        time.sleep(600)""")], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    loads, pid = map(int, parent.stdout.readline().split())
    assert loads == 0 and psutil.pid_exists(pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    worker = psutil.Process(pid)
    worker.wait(timeout=30)  # raises TimeoutExpired if it stays behind
    assert not psutil.pid_exists(pid) or worker.status() == psutil.STATUS_ZOMBIE


# A chat worker whose model writes a token every 0.2 s and never finishes (nor heeds a cancel: a model still
# loading does not), so only the UI's shutdown can end the reply being streamed.
ENDLESS_WORKER = """
import json, os, sys, threading, time
def answer(rid):
    print(json.dumps({"id": rid, "event": "loading"}), flush=True)
    while True:
        print(json.dumps({"id": rid, "event": "text", "text": "la "}), flush=True)
        time.sleep(0.2)
for line in sys.stdin:  # the UI closing the pipe ends the worker
    request = json.loads(line)
    if request.get("op") == "chat":
        open(os.environ["GENERATING"], "w").write(str(os.getpid()))
        threading.Thread(target=answer, args=(request["id"],), daemon=True).start()
"""


def test_ctrl_c_stops_the_ui_and_its_chat_worker_while_a_reply_streams(tmp_path):
    """SIGINT to `finetune ui` while a chat answer streams: the UI exits within seconds (it waited for the open
    reply, 10 s and more), and the chat worker with it."""
    import time

    from gradio_client import Client

    from tests.ui_support import free_port, tiny_recipe, write_recipe

    run = tmp_path / "runs" / "chatty"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    write_recipe(run / "recipe.yaml", tiny_recipe(tmp_path / "model", tmp_path / "data.jsonl", run))
    generating, port = tmp_path / "generating", free_port()
    ui = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        import ui.chat_worker
        ui.chat_worker.WORKER = [sys.executable, "-c", {ENDLESS_WORKER!r}]
        from ui.app import main
        raise SystemExit(main(["--port", "{port}", "--runs-dir", {str(tmp_path / 'runs')!r},
                               "--allow-dir", {str(tmp_path)!r}]))""")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "GENERATING": str(generating)})
    try:
        client = wait_for(lambda: _client(Client, port), 120, "the UI to serve")
        client.submit(str(run), None, True, "", 0.0, 0.9, 256, {"text": "hello", "files": []}, [], [], [],
                      api_name="/chat")
        wait_for(lambda: generating.exists() and generating.read_text(), 120, "the reply to stream")
        worker = psutil.Process(int(generating.read_text()))
        time.sleep(1)  # tokens are streaming to the page
        sent = time.monotonic()
        ui.send_signal(signal.SIGINT)
        assert ui.wait(timeout=60) == 0
        assert time.monotonic() - sent < 5, f"the UI took {time.monotonic() - sent:.1f} s to stop"
        worker.wait(timeout=10)  # raises TimeoutExpired if it stays behind
    finally:
        if ui.poll() is None:
            ui.kill()
            ui.wait()


def _client(client_class, port: int):
    try:
        return client_class(f"http://127.0.0.1:{port}/", verbose=False)
    except Exception:  # noqa: BLE001 - not serving yet
        return None
