"""Training runs as separate processes: one at a time, the rest queued, the queue kept in a file.

The UI never trains in its own process: it launches `python -m finetune run RECIPE` (the same command a
user would type), stops it with SIGINT (the core saves a checkpoint and exits with state "stopped") and
resumes with `--resume`. The queue lives in `<runs_dir>/.ui/queue.json`, so a restarted UI still knows
which run is going and which wait; a background thread starts the next job when the GPU frees up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil

import finetune
from finetune.errors import FinetuneError
from finetune.rundir import HeldRun, RunDir, held_runs, tail

JobState = Literal["queued", "running", "exited", "cancelled", "refused"]  # refused: another process held the run


@dataclass
class Job:
    """One launch of `finetune run` (a fresh run or a resume)."""

    id: str
    run_dir: str
    recipe: str
    resume: bool = False
    allow_data_change: bool = False  # resume even though the data changed (finetune run --allow-data-change)
    state: JobState = "queued"
    pid: int | None = None
    returncode: int | None = None
    created: float = field(default_factory=time.time)
    refused: str = ""  # state "refused": the run lock's message (who held the run directory)

    @property
    def log(self) -> str:
        """Where the process's stdout/stderr go (errors before the core's own train.log exists)."""
        return str(Path(self.recipe).with_suffix(".log"))

    def lock_refusal(self) -> str:
        """The run lock's refusal while another process holds this job's run directory ('' while none does)."""
        try:
            RunDir(Path(self.run_dir)).refuse_if_locked("finetune run --resume" if self.resume else "finetune run")
        except FinetuneError as exc:
            return exc.message
        return ""

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "finetune", "run", self.recipe]
        if self.resume:
            cmd += ["--resume", "--set", f"output.dir={self.run_dir}"]
        if self.allow_data_change:
            cmd.append("--allow-data-change")
        return cmd


class RunManager:
    """Queue and supervise training processes for one runs folder."""

    def __init__(self, runs_dir: str | Path, cwd: str | Path | None = None, poll_s: float = 1.0):
        self.runs_dir = Path(runs_dir).resolve()
        self.cwd = Path(cwd or os.getcwd()).resolve()
        self.state_dir = self.runs_dir / ".ui"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._file = self.state_dir / "queue.json"
        self._lock = threading.RLock()
        self._procs: dict[str, subprocess.Popen] = {}
        self._jobs: list[Job] = self._load()
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gpu_holders = 0  # chats and exports using the GPU: no run starts meanwhile
        self._launch_hooks: list[Callable[[], None]] = []

    # -- persistence ---------------------------------------------------------------------------------
    def _load(self) -> list[Job]:
        try:
            rows = json.loads(self._file.read_text())
        except (OSError, ValueError):
            return []
        return [Job(**row) for row in rows if isinstance(row, dict)]

    def _save(self) -> None:
        tmp = self._file.with_suffix(".tmp")
        tmp.write_text(json.dumps([asdict(j) for j in self._jobs], indent=1))
        os.replace(tmp, self._file)

    # -- public --------------------------------------------------------------------------------------
    def new_recipe_path(self) -> Path:
        """A fresh file name for a recipe the UI is about to queue."""
        jobs_dir = self.state_dir / "jobs"
        jobs_dir.mkdir(exist_ok=True)
        return jobs_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}.yaml"

    def submit(self, recipe: str | Path, run_dir: str | Path, resume: bool = False,
               allow_data_change: bool = False) -> Job:
        """Queue a run; it starts as soon as no other run holds the GPU."""
        run_dir = str(Path(run_dir).resolve())
        with self._lock:
            if any(j.run_dir == run_dir and j.state in ("queued", "running") for j in self._jobs):
                raise FinetuneError(f"a run for {run_dir} is already queued or running",
                                    hint="stop it first, or choose another output.dir")
            job = Job(id=uuid.uuid4().hex[:8], run_dir=run_dir, recipe=str(Path(recipe).resolve()), resume=resume,
                      allow_data_change=allow_data_change)
            self._jobs.append(job)
            self._save()
        self.poll()
        return job

    def stop(self, run_dir: str | Path) -> str:
        """Stop the run of `run_dir`: SIGINT if it runs (checkpoint, then exit), drop it if queued."""
        run_dir = str(Path(run_dir).resolve())
        with self._lock:
            for job in self._jobs:
                if job.run_dir != run_dir:
                    continue
                if job.state == "queued":
                    job.state = "cancelled"
                    self._save()
                    return f"removed {run_dir} from the queue"
                if job.state == "running" and job.pid:
                    try:
                        os.kill(job.pid, signal.SIGINT)
                    except ProcessLookupError:
                        pass
                    return f"asked {run_dir} to stop: it saves a checkpoint, then exits"
        raise FinetuneError(f"no queued or running run for {run_dir}")

    def on_launch(self, hook: Callable[[], None]) -> None:
        """Call `hook` just before a run starts (the chat worker frees the GPU)."""
        self._launch_hooks.append(hook)

    def hold_gpu(self) -> Job | None:
        """Claim the GPU for work other than training (chat, export): None when claimed (then call
        release_gpu when done; queued runs wait until then), else the running job to wait for."""
        with self._lock:
            self.poll()
            running = next((j for j in self._jobs if j.state == "running"), None)
            if running is None:
                self._gpu_holders += 1
            return running

    def release_gpu(self) -> None:
        with self._lock:
            self._gpu_holders -= 1
        self.poll()

    def jobs(self) -> list[Job]:
        with self._lock:
            return [Job(**asdict(j)) for j in self._jobs]

    def outside_runs(self, folders: list[Path]) -> list[HeldRun]:
        """The run directories in `folders` held by a process this UI did not start (a `finetune run`, resume
        or export typed in a terminal): not one of its running jobs, nor this process or its children."""
        ours = {j.run_dir for j in self.jobs() if j.state == "running"}
        me = psutil.Process()
        pids = {me.pid, *(c.pid for c in me.children(recursive=True))}
        return [h for h in held_runs(folders) if str(h.root) not in ours and h.pid not in pids]

    def job_for(self, run_dir: str | Path) -> Job | None:
        """The newest job of a run directory."""
        run_dir = str(Path(run_dir).resolve())
        matches = [j for j in self.jobs() if j.run_dir == run_dir]
        return matches[-1] if matches else None

    def queue_position(self, job: Job) -> int:
        queued = [j.id for j in self.jobs() if j.state == "queued"]
        return queued.index(job.id) + 1 if job.id in queued else 0

    def run_state(self, run_dir: str | Path, status: dict[str, Any] | None = None) -> str:
        """What a run is doing, combining the job (queued, process alive) with the core's status.json (`status`:
        its content when the caller has read it already)."""
        job = self.job_for(run_dir)
        status = RunDir(run_dir).read_status() if status is None else status
        if job and job.state == "queued":
            return f"queued (position {self.queue_position(job)})"
        if job and job.state == "refused":
            return f"refused: {job.refused}"
        if job and job.state == "running":
            if status.get("pid") not in (None, job.pid):  # status.json of an earlier process
                return "starting"
            state = status.get("state", "starting")
            return f"{state}, process exiting" if state in ("stopped", "completed", "failed") else state
        state = status.get("state", "unknown")
        # "unknown": the process failed before it wrote status.json, or it trained nothing and removed its folder
        if job and job.state == "exited" and (state == "running" or state == "unknown" and job.returncode):
            return f"failed (process exited with code {job.returncode})"
        return state

    def process_log(self, run_dir: str | Path, lines: int = 40) -> str:
        job = self.job_for(run_dir)
        return tail(Path(job.log), lines) if job else ""

    def poll(self) -> None:
        """Reap finished processes and start the next queued job when none runs."""
        with self._lock:
            changed = False
            for job in self._jobs:
                if job.state == "running" and not self._alive(job):
                    proc = self._procs.pop(job.id, None)
                    job.returncode = proc.returncode if proc else None
                    # its process has gone, so a lock still held is another process's: the one that refused it
                    job.refused = job.lock_refusal() if job.returncode else ""
                    job.state = "refused" if job.refused else "exited"
                    changed = True
            if not any(j.state == "running" for j in self._jobs) and not self._gpu_holders:
                for nxt in [j for j in self._jobs if j.state == "queued"]:
                    self._launch(nxt)
                    changed = True
                    if nxt.state == "running":
                        break
            if changed:
                self._save()

    def start(self) -> RunManager:
        """Supervise in a background thread, so the queue moves on with no browser open."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="finetune-ui-runs", daemon=True)
            self._thread.start()
        return self

    def close(self, stop_runs: bool = False, timeout: float = 60) -> None:
        """Stop supervising; with `stop_runs`, SIGINT the running job and wait for it."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        if stop_runs:
            for job in self.jobs():
                if job.state in ("queued", "running"):
                    self.stop(job.run_dir)
            for proc in list(self._procs.values()):
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self.poll()

    # -- internals -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self._poll_s):
            self.poll()

    def _alive(self, job: Job) -> bool:
        proc = self._procs.get(job.id)
        if proc is not None:
            return proc.poll() is None
        try:  # a process started by an earlier UI: alive if that pid still runs finetune
            p = psutil.Process(job.pid)
            return p.status() != psutil.STATUS_ZOMBIE and "finetune" in " ".join(p.cmdline())
        except (psutil.Error, TypeError):
            return False

    def child_env(self) -> dict[str, str]:
        """The environment of a `finetune` child: the same finetune code as this UI process runs."""
        env = dict(os.environ)
        root = str(Path(finetune.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _launch(self, job: Job) -> None:
        """Start the job's process, or mark it refused while another process holds its run directory (a CLI
        run or export that started after it was queued): the queue moves on to the next."""
        job.refused = job.lock_refusal()
        if job.refused:
            job.state = "refused"
            return
        for hook in self._launch_hooks:
            hook()
        with open(job.log, "ab") as log:
            # A new session: Ctrl-C in the UI's terminal must not interrupt the training run.
            proc = subprocess.Popen(job.command(), cwd=self.cwd, env=self.child_env(), stdout=log,
                                    stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self._procs[job.id] = proc
        job.pid, job.state = proc.pid, "running"
