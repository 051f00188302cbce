"""The UI's side of the chat worker: one `python -m ui.chat_serve` process that keeps the models the chat shows
loaded between messages (another run chosen: the last one's let go), queued behind training so the two never
share the GPU.

The worker starts on the first message and is stopped (freeing every byte of GPU memory, CUDA context
included) when a training run or an export is about to start; the next message starts it again. It reads
its requests from a pipe, so it also ends by itself when the UI process goes away, however that happens.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ui.runs import RunManager

WORKER = [sys.executable, "-m", "ui.chat_serve"]


class ChatWorker:
    """Drives the chat worker process for one run manager (whose training jobs it waits for)."""

    def __init__(self, manager: RunManager, poll_s: float = 0.5):
        self.manager = manager
        self.poll_s = poll_s
        self.log = manager.state_dir / "chat-worker.log"
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one request at a time on the pipe
        self._ids = itertools.count(1)
        self._closed = False  # the UI is stopping: no worker is started again
        manager.on_launch(self.release)  # training needs the GPU: free it

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs."""
        return self._proc.pid if self._proc and self._proc.poll() is None else None

    @contextlib.contextmanager
    def gpu(self) -> Iterator[Iterator[dict[str, Any]]]:
        """Hold the GPU against training runs for the body; yields the waiting events to pass on first
        ({"event": "waiting", "run": the training run}), one per poll until no run trains."""
        held = []

        def wait() -> Iterator[dict[str, Any]]:
            while (job := self.manager.hold_gpu()) is not None:
                yield {"event": "waiting", "run": job.run_dir}
                time.sleep(self.poll_s)
            held.append(True)

        try:
            yield wait()
        finally:
            if held:
                self.manager.release_gpu()

    def chat(self, requests: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """Answer each request (run, adapter, messages, system, temperature, top_p, max_new_tokens) in turn,
        once no training run holds the GPU; yields the worker's events, each tagged with its request's
        index as "column". Closing the iterator mid-reply cancels that reply. The worker keeps the models
        these requests use and lets go of the others (an earlier run's), its memory and files freed."""
        shown = [{"run": request["run"], "adapter": request.get("adapter", True)} for request in requests]
        with self.gpu() as waiting:
            yield from waiting
            with self._lock:
                for column, request in enumerate(requests):
                    with contextlib.closing(self._ask({"op": "chat", **request, "keep": shown})) as events:
                        for event in events:
                            yield {**event, "column": column}

    def stats(self) -> dict[str, Any]:
        """The worker's counters (model loads), starting it if needed."""
        with self._lock:
            return next(self._ask({"op": "stats"}))

    def _ask(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        rid = next(self._ids)
        try:
            proc = self._start()
        except WorkerGone as exc:
            yield {"id": rid, "event": "error", "message": str(exc)}
            return
        finished = False
        try:
            self._send(proc, {**request, "id": rid})
            while True:
                try:
                    event = self._read(proc)
                except WorkerGone as exc:
                    finished = True
                    self._proc = None
                    yield {"id": rid, "event": "error", "message": str(exc)}
                    return
                if event.get("id") != rid:
                    continue  # the tail of an earlier, cancelled request
                finished = event["event"] in ("done", "error", "stats")
                yield event
                if finished:
                    return
        finally:
            if not finished and proc.poll() is None:  # abandoned mid-reply: stop generating, drain its events
                try:
                    self._send(proc, {"op": "cancel", "id": rid})
                    while (event := self._read(proc)).get("id") != rid or event["event"] not in ("done", "error"):
                        pass
                except (OSError, WorkerGone):
                    self.stop()

    def _start(self) -> subprocess.Popen:
        if self._closed:
            raise WorkerGone("the UI is stopping: no chat until it is started again")
        if self._proc is None or self._proc.poll() is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log, "ab") as log:
                # Its own session: Ctrl-C in the UI's terminal reaches the UI, which then closes the pipe.
                self._proc = subprocess.Popen(WORKER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                              text=True, bufsize=1, cwd=self.manager.cwd,
                                              env=self.manager.child_env(), start_new_session=True)
        return self._proc

    def _send(self, proc: subprocess.Popen, request: dict[str, Any]) -> None:
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()

    def _read(self, proc: subprocess.Popen) -> dict[str, Any]:
        line = proc.stdout.readline()
        if not line:
            code = proc.wait()
            raise WorkerGone(f"the chat worker stopped (exit code {code}); its log: {self.log}")
        return json.loads(line)

    def release(self) -> None:
        """Stop the worker once the message being answered (if any) is done: the GPU is needed elsewhere."""
        with self._lock:
            self.stop()

    def close(self, timeout: float = 10) -> None:
        """Stop the worker for good (the UI is stopping): a reply being streamed ends at once, with an error
        event, and the next request (another column's) starts no new worker. Not under the request lock: the
        request streaming now holds it."""
        self._closed = True
        self.stop(timeout)

    def stop(self, timeout: float = 10) -> None:
        """End the worker (and free its models): close its pipe; if it does not exit in time (a reply being
        generated), SIGTERM, which still closes its weight stores (a streamed base's files removed); then kill."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.stdin.close()
        for end in (proc.terminate, proc.kill):
            try:
                proc.wait(timeout)
                break
            except subprocess.TimeoutExpired:
                end()
        proc.wait()
        with contextlib.suppress(OSError):
            proc.stdout.close()


class WorkerGone(RuntimeError):
    """The worker process ended while a reply was expected."""

