"""`training.effective_batch_size: auto`: the batch grows with the measured gradient noise scale.

Why a policy of its own: the critical batch starts near one sequence and grows during training, so the run
starts with updates of one sequence and accumulates more loader batches per update as the measured noise scale
supports, while the micro-batch, the data order and the schedule stay in loader batches; checkpoints fall on
group boundaries, so `--resume` continues exactly. More in docs/training.md, "The batch engine in the code".
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from finetune.console import console
from finetune.recipe.batch_rules import (
    MAX_ACCUMULATION,
    StepTimes,
    advise,
    best_accumulation,
    scale_for_batch,
    update_batch,
)
from finetune.recipe.resolved import RunConfig
from finetune.rundir import RunDir
from finetune.train.noise_scale import NoiseScale, labelled_tokens
from finetune.train.policy import Geometry, Micro, Part, Policy, Step, Update
from finetune.train.sub_updates import plan_sub_updates

MIN_OBSERVATIONS = 5  # fresh noise-scale observations between two changes


class _Clock:
    """Marks on the device's timeline: CUDA events (resolved later, no host sync per step) or the host clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def done(self, end) -> bool:
        """Whether the device has reached mark `end` (reading it then waits for nothing)."""
        return not self.cuda or end.query()

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000


class BatchEngine(Policy):
    """The update batch and the accumulation follow the noise scale when effective_batch_size is auto (see
    the module docstring); with a fixed batch it only times the steps (results.json's advice uses them)."""

    key = "batch_engine"

    def __init__(self, config: RunConfig, noise: NoiseScale, geometry: Geometry, device: torch.device,
                 on_batch_change: Callable[[dict], None] | None = None):
        recipe = config.recipe
        self.recipe, self.noise = recipe, noise
        self.engine_on = config.batch_auto
        self.on_batch_change = on_batch_change
        self.step_batch = geometry.micro_batch * geometry.accumulation  # sequences per loop step
        self.micro_batch, self.loop_accumulation = geometry.micro_batch, geometry.accumulation
        # A step that cannot be split (one sequence, or a layer-wise optimizer updating inside backward) is
        # measured by a two-batch group every noise_scale_split_every loader batches (module docstring).
        self._unsplittable = geometry.accumulation == 1 and (geometry.micro_batch == 1 or recipe.optimizer.layerwise)
        self.accumulation = 1
        self._size = 1  # loop steps of the group in progress (accumulation, or 2 for a measuring pair)
        self.times = StepTimes(update_in_backward=recipe.optimizer.layerwise)
        self._clock = _Clock(device)
        self._marks: list = []  # [start, forward-backward end] of this step
        self._timed: list[tuple] = []  # (start, forward-backward end, end, updated), resolved when deciding
        self._observations_at_change = self._decided_at = 0
        # labelled tokens per sequence, on average: a device scalar until a decision reads it (no sync per batch)
        self._tokens, self._sequences = 0, 0
        self._base: tuple[list[float], tuple[float, float]] | None = None  # starting LRs and betas
        self._since_pair = 0  # sub-updates since the last measuring pair of chunks
        self._sub_step = False  # the step in progress runs as several updates (not timed)
        self._loaded = False
        self._warmup_ended: int | None = None  # a resumed run's update batch whose warmup cannot go on
        self.geometry = geometry  # the loop's; the engine changes it through loop.set_geometry
        why_not = self.no_warmup(geometry) if self.engine_on else None
        # the warmup starts at one sequence per update where it can (module docstring)
        self._start = (self.step_batch if why_not else 1) if self.engine_on else None
        geometry.update_batch = self._start  # the loop does not exist yet: its starting geometry
        if self.engine_on:
            if why_not and self.step_batch > 1:
                console.print(f"batch warmup: off ({why_not}); updates of the whole micro-batch from the start")

    def no_warmup(self, geometry: Geometry) -> str | None:
        """Why updates smaller than the loader batch cannot run here (None: they can)."""
        if self.recipe.optimizer.layerwise:
            return "a layer-wise optimizer updates inside backward, so an update cannot end inside a micro-batch"
        if self.recipe.training.spec.whole_batch:
            return self.recipe.training.spec.whole_batch
        if geometry.accumulation > 1:
            return (f"each step accumulates {geometry.accumulation} loader batches "
                    "(an out-of-memory recovery's settings)")
        if geometry.processes > 1:
            return "several processes"
        return None

    @property
    def update_batch(self) -> int | None:
        return self.geometry.update_batch

    def sub_updating(self) -> bool:
        """Whether steps run as several updates now (the warmup is below the loader batch)."""
        return self.update_batch is not None and self.update_batch < self.micro_batch

    # -- the loop's hooks ---------------------------------------------------------------------------------
    def on_train_begin(self, loop) -> None:
        if not self.engine_on:
            return
        if not self._loaded and self.sub_updating():  # the run's first change: to updates of u sequences
            self._record(self._changed(loop, (self.step_batch, 1), None, None, step=0))
        if self._warmup_ended is not None:
            console.print(f"batch warmup: ended on resume ({self.no_warmup(loop.geometry)})")
            self._record(self._changed(loop, (self._warmup_ended, self.accumulation), None, None, loop.state.step))
            self._warmup_ended = None
        loop.set_geometry(group=self._size)

    def plan_updates(self, loop, step: Step, updates: list[Update]) -> list[Update]:
        self._sub_step = False
        if not (self.engine_on and self.sub_updating() and len(step.batches) == 1):
            return updates
        self._sub_step = True
        probe = self.noise.probe is not None
        chunked, self._since_pair = plan_sub_updates(step.batches[0], self.update_batch,
                                                     self.recipe.training.noise_scale_split_every, probe,
                                                     self._since_pair)
        rows = step.batches[0]
        total = updates[0].num_items
        planned = []
        for chunks in chunked:
            micro = [Micro(c, loop.collate(c)) for c in chunks]
            items = None
            if total is not None:
                items = sum(labelled_tokens(m.batch) for m in micro)
            share = items / total if items is not None else sum(map(len, chunks)) / len(rows)
            planned.append(Update(micro_batches=micro, num_items=items, share=share))
        return planned

    def on_step_begin(self, loop, step: Step) -> None:
        self._marks = [self._clock.mark()]
        if self.engine_on and not loop.steps_waiting and self._size != (size := self._group_size(loop)):
            self._size = size
            loop.set_geometry(group=size)

    def around_micro_batch(self, loop, part: Part, run) -> torch.Tensor:
        loss = run()
        self._marks[1:] = [self._clock.mark()]
        return loss

    def defers(self, loop, step: Step) -> bool:
        return self.engine_on and loop.steps_waiting + 1 < self._size and step.number < loop.schedule.max_steps

    @torch.no_grad()
    def before_update(self, loop, update: Update) -> None:
        """The group's update is the mean of its loader batches' gradients (each already a token mean)."""
        size = loop.steps_waiting + 1
        if self.engine_on and size > 1:
            for p in loop.model.parameters():
                if p.grad is not None:
                    p.grad.div_(size)

    def on_step_end(self, loop, step: Step) -> None:
        if self.engine_on:
            for rows, batch in zip(step.batches, step.collated, strict=True):
                if "labels" in batch:
                    self._tokens = self._tokens + labelled_tokens(batch)
                    self._sequences += len(rows)
        if self._sub_step:  # a step of several updates is not timed (StepTimes: one update each)
            self._marks = []
        self._time(updated=not step.deferred)
        if self.engine_on and not step.deferred:
            self._decide(loop)

    def on_oom(self, loop, step: Step, failure: str, phase: str) -> bool:
        self._marks = []  # a step with a retry is not timed
        return False

    # -- the decision -------------------------------------------------------------------------------------
    def _group_size(self, loop) -> int:
        """Loop steps of the group starting now: the accumulation, or a measuring pair (module docstring)."""
        every, done = self.recipe.training.noise_scale_split_every, loop.state.step
        pair = (self.accumulation == 1 and self._unsplittable and self.noise.probe is not None
                and (done // every) != (done + 2) // every)
        return 2 if pair else self.accumulation

    def _time(self, updated: bool) -> None:
        if len(self._marks) == 2:
            self._timed.append((*self._marks, self._clock.mark(), updated))
        self._marks = []
        if len(self._timed) >= 256:  # a run that seldom decides: resolve the older events now
            self._resolve_marks(wait=True)

    def step_times(self) -> tuple[float, float] | None:
        """(t_micro, t_opt) in seconds from the steps the device has finished (see StepTimes); a decision does
        not stall the GPU on the step just launched."""
        self._resolve_marks(wait=False)
        return self.times.estimate()

    def _resolve_marks(self, wait: bool) -> None:
        """Turn the finished steps' marks (with `wait`, all of them) into StepTimes samples."""
        pending = []
        for start, middle, end, updated in self._timed:
            if wait or self._clock.done(end):
                self.times.add(self._clock.seconds(start, middle), self._clock.seconds(middle, end), updated)
            else:
                pending.append((start, middle, end, updated))
        self._timed = pending

    def _decide(self, loop) -> None:
        observed = self.noise.ema.steps
        if observed - self._observations_at_change < MIN_OBSERVATIONS or not self._sequences \
                or observed == self._decided_at:  # decide only on a new observation (its step synced anyway)
            return
        self._decided_at = observed
        values = self.noise.ema.values() or {}
        times = self.step_times()
        old = (self.update_batch, self.accumulation)
        per_sequence = float(self._tokens) / self._sequences
        if self.sub_updating():  # the warmup: the update batch grows first, accumulation waits
            loop.set_geometry(update_batch=update_batch(values.get("gns"), per_sequence, self.update_batch,
                                                        self.step_batch))
        else:
            self.accumulation = best_accumulation(
                values.get("gns"), per_sequence * self.step_batch,
                *(times or (None, None)), current=self.accumulation, limit=MAX_ACCUMULATION)
        if (self.update_batch, self.accumulation) == old:
            return
        self._observations_at_change = observed
        self._record(self._changed(loop, old, values.get("gns"), times, step=loop.state.step))

    def _record(self, event: dict) -> None:
        if self.on_batch_change is not None:
            self.on_batch_change(event)

    def _changed(self, loop, old: tuple[int, int], gns: float | None, times, step: int) -> dict:
        """Apply the rules for the batch now chosen; the `batch_changed` event from `old` (update batch,
        accumulation). The effective batch is update batch x accumulation (the update batch is the loader
        batch once the warmup reached it)."""
        def batch(update: int, accumulation: int) -> dict:
            return {"update_batch": update, "gradient_accumulation_steps": accumulation,
                    "effective_batch_size": update * accumulation}

        lr, beta2 = self._apply_rules(loop, self.update_batch * self.accumulation)
        return {"event": "batch_changed", "step": step, "from": batch(*old),
                "to": batch(self.update_batch, self.accumulation), "gns": gns, "learning_rate": lr, "beta2": beta2,
                "t_micro": times and times[0], "t_opt": times and times[1]}

    def _apply_rules(self, loop, batch: int) -> tuple[float, float | None]:
        """Peak learning rate and beta2 for `batch` sequences, from the recipe's values, which are for its
        reference_batch_size (one step's batch when the recipe names none)."""
        reference = self.recipe.training.reference_batch_size or self.step_batch
        groups = loop.optimizer.param_groups
        scheduler = loop.scheduler
        if self._base is None:
            self._base = (list(scheduler.base_lrs), tuple(self.recipe.optimizer.betas))
        base_lrs, betas = self._base
        rule = scale_for_batch(1.0, betas, self.recipe.optimizer.name, reference, batch)
        # the optimizer's learning rates too: a change applies before the scheduler's next step
        new = [lr * rule.new_learning_rate for lr in base_lrs]
        for group, old, lr in zip(groups, scheduler.base_lrs, new, strict=True):
            group["lr"] *= lr / old
        scheduler.base_lrs = new
        if rule.new_betas is not None:
            for group in groups:
                if "betas" in group:
                    group["betas"] = (group["betas"][0], rule.new_betas[1])
        return base_lrs[0] * rule.new_learning_rate, rule.new_betas[1] if rule.new_betas else None

    # -- the train state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        self._resolve_marks(wait=True)
        return {"accumulation": self.accumulation, "observations_at_change": self._observations_at_change,
                "since_pair": self._since_pair, "decided_at": self._decided_at,
                "tokens": int(self._tokens), "sequences": self._sequences, "size": self._size,
                "times": self.times.state_dict(),
                "base": self._base and {"lrs": self._base[0], "betas": list(self._base[1])}}

    def load_state_dict(self, state: dict) -> None:
        if not self.engine_on:
            return
        self._loaded = True
        self.accumulation = state["accumulation"]
        saved = self.geometry.update_batch or self.step_batch  # the loop restored the geometry first
        if self._start < self.step_batch:  # the warmup can go on
            self.geometry.update_batch = min(saved, self.step_batch)
            self._since_pair = state["since_pair"]
        else:
            self.geometry.update_batch = self._start
            if saved < self._start:  # the warmup cannot go on here: recorded at the start
                self._warmup_ended = saved
        self._size = state["size"]
        self.times.load_state_dict(state["times"])
        self._observations_at_change, self._decided_at = state["observations_at_change"], state["decided_at"]
        # a checkpoint of an earlier version counted loader batches of micro_batch rows
        self._tokens = state["tokens"]
        self._sequences = state.get("sequences", state.get("batches", 0) * self.micro_batch)
        if state["base"]:
            self._base = (state["base"]["lrs"], tuple(state["base"]["betas"]))


def record_batch_change(run_dir: RunDir, status_fields: dict) -> Callable[[dict], None]:
    """on_batch_change for a run directory: a metrics.jsonl event row (the UI marks "batch changed"),
    train.log, the console, and the batch in every later status.json."""
    def record(event: dict) -> None:
        run_dir.append_metrics(event)
        gns = f" (noise scale {event['gns']:.4g} tokens)" if event["gns"] else ""
        line = (f"batch changed after step {event['step']}: effective batch {event['from']['effective_batch_size']} "
                f"-> {event['to']['effective_batch_size']}{gns}, learning rate {event['learning_rate']:.3g}"
                + (f", beta2 {event['beta2']:.6g}" if event["beta2"] else ""))
        run_dir.log_line(line)
        console.print(line)
        status_fields["batch_changed"] = event

    return record


def batch_summary(engine: BatchEngine, loop, rows: list[dict], stats: dict) -> dict:
    """results.json's account of the batch: what was used (and every change), the noise scale over time and
    the advice for the next run (finetune.recipe.batch_rules.advise; `finetune plan --advice` applies it)."""
    g = loop.geometry
    micro = g.part_rows
    accumulation = (engine.accumulation if engine.engine_on else 1) * g.accumulation * g.splits
    series = [[r["step"], r["gns"]] for r in rows if r.get("gns") and "event" not in r]
    values = engine.noise.ema.values() or {}
    engine._resolve_marks(wait=True)  # the run is over: every step's marks
    times = engine.times.estimate()  # per loop step: its forward-backwards are that many loader batches
    betas = next((tuple(grp["betas"]) for grp in loop.optimizer.param_groups if "betas" in grp),
                 tuple(engine.recipe.optimizer.betas))
    tokens_per_sequence = stats.get("loss_tokens", 0) / max(stats.get("train_sequences") or 1, 1)
    # Still in the warmup: updates of update_batch sequences, each loader batch several of them.
    used = engine.update_batch if engine.engine_on and engine.sub_updating() else micro * accumulation
    return {
        "batch": {"micro_batch_size": micro, "gradient_accumulation_steps": accumulation,
                  "effective_batch_size": used, "auto": engine.engine_on,
                  **({"update_batch": engine.update_batch} if engine.engine_on else {}),
                  **({"effective_batch_tokens": tokens} if (tokens := engine.recipe.training.effective_batch_tokens)
                     else {}),
                  "changes": [r for r in rows if r.get("event") == "batch_changed"]},
        "noise_scale": {"unit": "labelled tokens", "final": values.get("gns"), "grad_sq": values.get("grad_sq"),
                        "trace_sigma": values.get("trace_sigma"), "tokens_per_sequence": round(tokens_per_sequence, 2),
                        "series": series[:: max(1, len(series) // 200)]},
        "advice": advise(values.get("gns"), tokens_per_sequence, g.micro_batch, used,
                         float(loop.scheduler.base_lrs[0]), betas, engine.recipe.optimizer.name,
                         times and (times[0] / g.accumulation, times[1])),
    }
