"""The run directory's live files (metrics.jsonl, status.json, train.log) and the progress (a bar or log lines), as
loop policies; and a clean stop on Ctrl-C."""

from __future__ import annotations

import signal
import time

from rich.progress import Progress

from finetune.console import ProgressLines, console, progress_bar
from finetune.memory.chunked_loss import AUX_LOSS
from finetune.rundir import COLLAPSED_EVENT, EVAL_PREFIX, TRAINING_WARNING, RunDir, is_eval_row
from finetune.step.preference import METRIC_PREFIXES
from finetune.train.grpo import METRIC_PREFIXES as GRPO_METRICS
from finetune.train.noise_scale import KEYS as NOISE_SCALE_KEYS
from finetune.train.policy import Policy
from finetune.units import format_number

FLAT_STEPS = 3  # logged steps in a row with a zero gradient norm or the same loss: the run has stopped learning


class CollapseWatch:
    """Notices a run that stopped learning (a gradient norm of exactly 0, or the same loss FLAT_STEPS logged
    steps in a row), which would otherwise end "completed" with weights that learned nothing. A single zero
    norm is not enough: a layer-wise optimizer logs 0 before it has measured one."""

    def __init__(self) -> None:
        self.rows: list[tuple[float | None, float | None]] = []  # (loss, grad_norm) of the last logged steps
        self.warning: str | None = None

    def observe(self, step: int, loss: float | None, grad_norm: float | None) -> str | None:
        """The warning, the first time the run looks collapsed at `step`; else None."""
        if self.warning is not None:
            return None
        self.rows = [*self.rows, (loss, grad_norm)][-FLAT_STEPS:]
        if len(self.rows) < FLAT_STEPS:
            return None
        losses = [r[0] for r in self.rows]
        if all(r[1] == 0 for r in self.rows):
            why = f"the gradient norm has been 0 for {FLAT_STEPS} logged steps"
        elif None not in losses and max(losses) - min(losses) <= 1e-6 * max(abs(losses[0]), 1e-12):
            why = f"the loss has stayed at {losses[0]:.6g} for {FLAT_STEPS} logged steps"
        else:
            return None
        self.warning = (f"training collapsed at step {step}: {why}, so the weights no longer learn; lower "
                        "training.learning_rate (or adapter.alpha), or keep training.max_grad_norm set")
        return self.warning


class LiveFiles(Policy):
    """One JSON line per logged step (and per evaluation) in metrics.jsonl, train.log; live status in
    status.json. Several processes: rank 0 alone writes (asked at every hook: the evaluation before training
    logs before on_train_begin)."""

    def __init__(self, run: RunDir, max_steps: int, status_fields: dict | None = None):
        self.run = run
        self.max_steps = max_steps
        self.start = time.time()
        self._last_time = self.start
        self._last_tokens = 0
        self._first_step: int | None = None
        self.status_fields: dict = status_fields if status_fields is not None else {}  # kept in every write
        self.collapse = CollapseWatch()

    def on_train_begin(self, loop) -> None:
        self._first_step = loop.state.step
        self._last_tokens = loop.state.tokens_seen
        self._last_time = self.start = time.time()
        if loop.rank == 0:
            self.run.write_status("running", step=loop.state.step, max_steps=self.max_steps, **self.status_fields)

    def on_step_end(self, loop, step) -> None:
        """The first trained step goes to status.json at once, whatever logging_steps says: a run that fails
        after it is no run that trained nothing (RunDir.discard_untrained keeps its folder and its error)."""
        if loop.rank == 0 and loop.state.step == (self._first_step or 0) + 1:
            self.run.write_status("running", step=loop.state.step, max_steps=self.max_steps, **self.status_fields)

    def log(self, loop, logs: dict) -> None:
        if loop.rank != 0:
            return
        now = time.time()
        collapsed = None
        row = {"step": logs["step"], "epoch": logs["epoch"], "elapsed_s": round(now - self.start, 3)}
        if is_eval_row(logs):
            row.update({k: v for k, v in logs.items() if k.startswith(EVAL_PREFIX)})
        else:
            tokens = logs["tokens_seen"]
            dt = max(now - self._last_time, 1e-9)
            row.update(
                loss=logs["loss"], learning_rate=logs.get("learning_rate"), grad_norm=logs.get("grad_norm"),
                tokens_per_second=round((tokens - self._last_tokens) / dt, 2), tokens_seen=int(tokens),
                # PeakMemory runs first: CUDA's allocator peak, or the CPU tensor tracker's.
                peak_memory_bytes=logs.get("peak_memory_bytes"),
            )
            # The gradient noise scale (finetune/train/noise_scale.py), once there is an estimate.
            row.update({k: logs[k] for k in NOISE_SCALE_KEYS if k in logs})
            row.update({k: v for k, v in logs.items() if k.startswith(METRIC_PREFIXES + GRPO_METRICS + (AUX_LOSS,))})
            self._last_time, self._last_tokens = now, tokens
            if "reward" not in logs:  # GRPO's gradient is 0 whenever every group's rewards are equal
                collapsed = self.collapse.observe(logs["step"], row["loss"], row["grad_norm"])
        if "peak_memory_breakdown" in logs:  # the CPU tensor tracker splits the peak by component
            row["peak_memory_breakdown"] = logs["peak_memory_breakdown"]
        if "memory_warning" in logs:
            row["memory_warning"] = logs["memory_warning"]
            console.print(f"[yellow]warning: {logs['memory_warning']}")
        self.run.append_metrics(row)
        self.run.log_line(" ".join(f"{k}={format_number(v)}" for k, v in row.items() if not isinstance(v, dict)))
        if collapsed is not None:  # said once: on screen, as an event row, in status.json for the UI
            console.print(f"[yellow]warning: {collapsed}")
            self.run.append_metrics({"event": COLLAPSED_EVENT, "step": logs["step"], "detail": collapsed})
            self.run.log_line(f"warning: {collapsed}")
            self.status_fields[TRAINING_WARNING] = collapsed
        self.run.write_status("running", step=loop.state.step, max_steps=self.max_steps,
                              eta_s=self._eta(loop.state.step), **self.status_fields)

    def on_save(self, loop, folder: str) -> None:
        """An event row, so the curves can mark where a checkpoint was saved."""
        if loop.rank == 0:
            self.run.append_metrics({"event": "checkpoint_saved", "step": loop.state.step})

    def _eta(self, step: int) -> float | None:
        done = step - (self._first_step or 0)
        if done <= 0:
            return None
        return round((time.time() - self.start) / done * (self.max_steps - step), 1)


class ProgressBar(Policy):
    """Step, loss, tokens/s and ETA (rank 0 only): a live bar on a terminal, plain lines in a log."""

    def __init__(self, max_steps: int):
        self.max_steps = max_steps
        self.progress: Progress | ProgressLines | None = None
        self.task = None
        self._last = (time.time(), 0)

    def on_train_begin(self, loop) -> None:
        if loop.rank != 0:  # one progress bar, not one per process
            return
        self.progress = progress_bar("train", info=True)
        self.progress.start()
        self.task = self.progress.add_task("train", total=self.max_steps, completed=loop.state.step, info="")
        self._last = (time.time(), loop.state.tokens_seen)

    def on_step_end(self, loop, step) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=loop.state.step)

    def log(self, loop, row: dict) -> None:
        if self.progress is None or "loss" not in row:
            return
        now, tokens = time.time(), row["tokens_seen"]
        tokens_per_s = (tokens - self._last[1]) / max(now - self._last[0], 1e-9)
        self._last = (now, tokens)
        self.progress.update(self.task, info=f"loss {row['loss']:.4f}  {tokens_per_s:,.0f} tok/s")

    def on_train_end(self, loop) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class StopOnSignal:
    """First Ctrl-C (or SIGTERM): save a checkpoint at the end of the current step and stop. Second: abort.
    The loop asks `requested` after each step."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        console.print("[yellow]stop requested: stopping after this step or batch, with a checkpoint once training "
                      "has begun (Ctrl-C again aborts at once)[/yellow]")
