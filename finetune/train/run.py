"""One fine-tuning run: recipe -> build (model, data) -> train -> run directory.

Why one module of ~600 lines: a run's phases (preflight, build, plan, train, save, give back) in the order a run
goes through them; the loop, its policies, checkpoints and recovery are modules of their own.
"""

from __future__ import annotations

import errno
import shutil
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import set_seed

from finetune.compat import graph_breaks
from finetune.console import console
from finetune.data.build import evaluable_split
from finetune.data.fingerprint import DataChanged, check_resumed_data
from finetune.errors import FinetuneError, RecipeError, UsageError
from finetune.memory.offload import activation_offload, preflight_offload
from finetune.plan import Plan, blocked_by_room, predict, room_error
from finetune.plan.search import data_for_run
from finetune.recipe.batch_rules import apply_batch_rules, reference_batch
from finetune.recipe.init_from import init_from_record, resolve_init_from
from finetune.recipe.load import load_recipe, recipe_to_yaml
from finetune.recipe.resolved import RunConfig, resolve
from finetune.recipe.schema import Recipe, max_prompt_tokens
from finetune.recipe.settings import (
    Settings,
    auto_choices,
    auto_keys,
    auto_settings,
    format_choices,
    read_settings,
    write_settings,
)
from finetune.recipe.settings import table as settings_table
from finetune.rundir import (
    EVAL_PREFIX,
    RunDir,
    RunLock,
    atomic_write_json,
    atomic_write_text,
    is_eval_row,
    read_json,
    replace_dir,
)
from finetune.step.preference import PreferenceLoss, loads_reference_adapter
from finetune.step.training_step import autocast_for, mixed_precision
from finetune.train import distributed
from finetune.train.batch_engine import BatchEngine, batch_summary
from finetune.train.checkpoints import check_output_dir, find_resumable, report_skipped, step_of
from finetune.train.environment import environment_summary
from finetune.train.loop import TrainLoop
from finetune.train.peak_memory import PeakMemory
from finetune.train.plan_files import save_plan
from finetune.train.plots import plot_loss_curve
from finetune.train.recovery import OOMRecovery, keep_recovered
from finetune.train.reporting import StopOnSignal
from finetune.train.setup import build_loop, total_steps
from finetune.train.streamed_load import streamed_load
from finetune.train.train_state import load_checkpoint
from finetune.units import format_bytes

if TYPE_CHECKING:
    from finetune.data.build import DataRead
    from finetune.data.bundle import DataBundle
    from finetune.data.vision import VisionData
    from finetune.model.load import LoadedModel

# Disk full, quota, permissions, read-only folder: the user's to fix, so a message instead of a traceback.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG}


@dataclass
class RunResult:
    run_dir: Path
    state: str  # completed | stopped
    steps: int
    final_loss: float | None
    eval_loss: float | None
    eval_before: dict | None = None  # held-out metrics before training (preference methods, GRPO)
    eval_after: dict | None = None


def _prepare_run_dir(recipe: Recipe, resume: bool, overwrite: bool, held: list[RunLock]
                     ) -> tuple[RunDir, str | None]:
    """Lock the run directory (into `held`, released when the run ends), then check it against --resume /
    --overwrite under the lock; return it and the checkpoint to resume from."""
    run = RunDir(Path(recipe.output.dir))
    held.append(run.lock("finetune run --resume" if resume else "finetune run", create=not resume))
    if overwrite and not resume and run.root.exists():
        run.remove()
    if resume:
        found = find_resumable(run.checkpoints)
        report_skipped(found.skipped)
        if found.newest is None:
            raise UsageError(f"--resume: no checkpoint to resume from in {run.checkpoints}",
                                hint="start the run without --resume (checkpoints are saved every output.save_steps)")
        console.print(f"resuming from {found.newest}")
        return run, str(found.newest)
    check_output_dir(recipe, resume, overwrite)
    run.create()
    return run, None


def _plan(recipe: Recipe, keep: Callable[[DataRead], None]) -> tuple[Plan | None, Recipe]:
    """Plan the memory before loading anything; `auto` settings become the planner's choice. The data the plan
    reads and tokenizes goes to `keep`, for the build to take over (read and tokenized once).

    A plan that cannot be made stops the run: the fit the plan promises is never dropped silently. Only
    `memory.plan: false` (`finetune run --no-plan`) trains without one, and only where every open `auto`
    setting has a plain value that is always safe.
    """
    auto = auto_keys(recipe)
    if not recipe.memory.plan:
        open_settings = [s for s in settings_table() if s.key in auto]
        undecided = [s.key for s in open_settings if s.fallback is None]
        if undecided:
            raise RecipeError(f"memory.plan: false leaves {', '.join(undecided)} = auto undecided (only the planner "
                              "chooses them)", hint="give those keys explicit values, or plan (memory.plan: true)")
        chosen = ", ".join(f"{s.key}: auto -> {str(s.fallback).lower()}" for s in open_settings)
        console.print("[yellow]memory plan skipped (memory.plan: false): nothing predicts whether a step fits"
                      + (f"; {chosen}" if chosen else ""))
        return None, write_settings(recipe, {s.name: s.fallback for s in open_settings})
    try:
        if (read := data_for_run(recipe).read) is not None:
            keep(read)
        plan = predict(recipe)  # finds the data's shape in the planner's cache
    except FinetuneError:
        raise
    except Exception as exc:
        reason = (str(exc).splitlines() or [""])[0]
        raise FinetuneError(f"cannot make the memory plan: {type(exc).__name__}: {reason}",
                            hint="train without a plan only on purpose: finetune run --no-plan "
                                 "(recipe key memory.plan: false)") from None
    budget = f"{format_bytes(plan.peak_bytes)} predicted peak {plan.planned_for() or 'at data.max_seq_len'}".rstrip() \
        + f", budget {format_bytes(plan.budget_bytes)}"
    if not plan.fits:
        needed = f"; the leanest plan needs a budget of {format_bytes(plan.min_budget_bytes)}" \
            if plan.min_budget_bytes else ""
        if (blocked := blocked_by_room(plan)) is not None:  # the offload folder or RAM, not the budget
            raise room_error(recipe, blocked)
        if auto:
            raise FinetuneError(f"no settings fit the memory budget: {budget}{needed}", problems=plan.fix_lines(),
                                hint="set one of the keys above to auto, or run `finetune plan RECIPE` to see what "
                                     "was tried and why it was rejected" if plan.fixes else
                                "run `finetune plan RECIPE` to see what was tried and why it was rejected")
        console.print(f"[yellow]warning: this recipe is predicted not to fit: {budget}{needed}")
        for line in plan.fix_lines():
            console.print(f"  {line}", style="yellow", markup=False)
    else:
        chosen = ", ".join(format_choices(auto_choices(recipe, plan.settings)))
        console.print(f"memory plan: {budget}" + (f"; chose {chosen} automatically" if chosen else ""))
    for note in plan.notes:
        console.print(f"memory plan: {note}", markup=False)
    return plan, plan.apply(recipe).recipe if auto else recipe


def keep_resolved(recipe: Recipe, saved: Recipe) -> Recipe:
    """On resume, `auto` keys take the values the interrupted run chose (saved in its recipe.yaml), so the
    checkpoint continues with the same micro-batch, accumulation and memory settings; other keys (a longer
    max_steps, say) still come from the recipe given now.

    At another world size the strategy is planned again and an `auto` accumulation is rescaled so the
    effective batch (micro-batch x accumulation x processes) stays the interrupted run's."""
    chosen = read_settings(saved)
    names = auto_settings(recipe)
    if saved.distributed.gpus != recipe.distributed.gpus:
        names = [n for n in names if n != "strategy"]
        if "gradient_accumulation_steps" in names:
            batch = int(chosen["micro_batch_size"]) * int(chosen["gradient_accumulation_steps"]) * saved.distributed.gpus
            per_step = int(chosen["micro_batch_size"]) * recipe.distributed.gpus
            if batch % per_step:
                raise FinetuneError(
                    f"--resume with {recipe.distributed.gpus} processes: the run's effective batch {batch} is not a "
                    f"multiple of micro-batch {chosen['micro_batch_size']} x {recipe.distributed.gpus} processes",
                    hint="resume with a number of processes that divides it")
            chosen = {**chosen, "gradient_accumulation_steps": batch // per_step}
    return write_settings(recipe, {name: chosen[name] for name in names})


def run(recipe: Recipe, *, resume: bool = False, overwrite: bool = False,
        allow_data_change: bool = False, base: LoadedModel | None = None) -> RunResult:
    """Fine-tune as the recipe says and fill the run directory. Ctrl-C saves a checkpoint and stops.
    `--resume` refuses data other than the run's (finetune.data.fingerprint) unless `allow_data_change`.
    `base`: train on this already loaded model instead of loading recipe.model (`load_base`; the recipe must
    name the same model and quantization), and hand it back as loaded when the run ends, for the next run.

    Under torchrun / accelerate launch every process runs this; rank 0 alone writes the run directory."""
    if base is not None:
        check_lendable(recipe)
    recipe = resolve_init_from(recipe)  # before the run directory exists: a bad adapter.init_from writes nothing
    distributed.join(recipe)
    main = distributed.is_main()
    held: list[RunLock] = []  # rank 0's lock on the run directory
    try:
        run_dir, checkpoint = distributed.on_main(lambda: _prepare_run_dir(recipe, resume, overwrite, held))
    except BaseException:
        for lock in held:
            lock.release()
        raise
    stopper = StopOnSignal()
    stopper.install()
    if not main:
        try:
            return _plan_build_train(recipe, run_dir, checkpoint, stopper, allow_data_change, main=False)
        finally:
            stopper.uninstall()
    before = run_dir.read_status()
    try:
        run_dir.write_status("planning")
        run_dir.log_line(f"run started (resume from {checkpoint})" if checkpoint else "run started")
        return _plan_build_train(recipe, run_dir, checkpoint, stopper, allow_data_change, base=base)
    except DataChanged as exc:  # a refused resume trained nothing: the run keeps its state, with the reason
        kept = {k: v for k, v in before.items() if k not in ("state", "pid", "updated", "error")}
        run_dir.write_status(before.get("state", "stopped"), **kept, error=f"resume refused: {exc}")
        run_dir.log_line(f"resume refused: {exc}")
        raise
    except torch.OutOfMemoryError as exc:  # outside a step's forward/backward: the optimizer update, evaluation
        error = FinetuneError(
            "out of memory outside the forward/backward that recovery redoes (loading the model, the reference "
            f"pass, the optimizer update or evaluation): {str(exc).strip().splitlines()[0] if str(exc).strip() else 'no details'}",
            hint="free GPU memory or set memory.gpu_memory lower, then run again (with --resume if a checkpoint "
                 "was saved)")
        _record_end(run_dir, "failed", error)
        raise error from None
    except OSError as exc:
        if exc.errno not in _WRITE_ERRNOS:
            _record_end(run_dir, "failed", exc)
            raise
        error = FinetuneError(f"cannot write {exc.filename or run_dir.root}: {exc.strerror or exc}",
                              hint="free disk space or fix the folder's permissions, then run again with --resume")
        _record_end(run_dir, "failed", error)
        raise error from None
    except BaseException as exc:
        _record_end(run_dir, "stopped" if isinstance(exc, KeyboardInterrupt) else "failed", exc)
        raise
    finally:
        stopper.uninstall()
        give_back(base)
        for lock in held:
            lock.release()


def check_lendable(recipe: Recipe) -> None:
    """What a lent model (run(base=...)) cannot do, refused before anything is written: full fine-tuning and
    adapter.vision full (the next run would start from changed weights), torch.compile (compiled layers stay
    compiled), Liger's kernels (its norms and MLPs stay swapped in), expert offload (the experts stay off the
    device, the disk tier's files are gone) and several processes (each loads its own)."""
    refused = {"adapter.type: full": recipe.adapter.type == "full", "training.compile: true": recipe.training.compile is True,
               "memory.kernels: liger": recipe.memory.kernels == "liger",
               # the vision tower's own weights train too: peft's unload hands back its trained copy
               "adapter.vision: full": recipe.adapter.vision == "full",
               f"memory.offload_experts: {recipe.memory.offload_experts}": recipe.memory.offload_experts != "none",
               f"memory.offload_weights: {recipe.memory.offload_weights}": recipe.memory.offload_weights != "none",
               f"distributed.gpus: {recipe.distributed.gpus}": recipe.distributed.gpus > 1}
    for key, bad in refused.items():
        if bad:
            raise UsageError(f"{key}: a run on an already loaded model (base=) trains adapters only, uncompiled, "
                             "with the weights where they were loaded, in one process",
                             hint="run without base= to load the model for this recipe")


# a lent model -> the peft model its run wrapped it in (finetune.model.adapter.apply_adapter), until given back
_ADAPTED: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()


def give_back(base: LoadedModel | None) -> None:
    """The lent model as load_model returned it: adapters (peft's injected layers) replaced by the layers they
    wrap, tiled norms and MLPs plain again, checkpointing and the input-gradient hook off."""
    if base is None:
        return
    from finetune.memory.layer_recompute import restore_layers
    from finetune.model.vision import inputs_require_grad_off

    model = base.model
    adapted = _ADAPTED.pop(model, None)
    if adapted is not None:  # peft's own: each injected layer replaced by the one it wraps, its config dropped
        adapted.unload()
    restore_layers(model)
    inputs_require_grad_off(model)
    if model.is_activation_checkpointing:
        model.activation_checkpointing_disable()
    model.zero_grad(set_to_none=True)


def _record_end(run_dir: RunDir, state: str, exc: BaseException) -> None:
    """status.json and train.log say how the run ended (status.json even on a full disk, see write_status); if
    even that cannot be written, say so on screen. A run that trained nothing leaves no folder
    (RunDir.discard_untrained)."""
    if run_dir.discard_untrained():
        console.print(f"nothing was trained; removed {run_dir.root}", markup=False)
        return
    for path, write in ((run_dir.status, lambda: run_dir.write_status(state, error=f"{type(exc).__name__}: {exc}")),
                        (run_dir.log, lambda: run_dir.log_line(f"run {state}: {type(exc).__name__}: {exc}"))):
        try:
            write()
        except OSError as write_error:
            console.print(f"[red]could not record the end of the run in {path}: {write_error.strerror}")


@dataclass
class _Prepared:
    """What `_prepare` settles before anything loads: the recipe the run trains with (a resumed run's `auto`
    values, the plan's choices, the batch rules applied), its typed settings and the plan (None: not planned)."""

    config: RunConfig
    plan: Plan | None
    data: DataRead | None = None  # rank 0: the data as the plan read and tokenized it, until the build takes it over

    @property
    def recipe(self) -> Recipe:
        return self.config.recipe


@dataclass
class _Built:
    """What `_build` makes: the loop over the model and the data, and what the record reports of them."""

    loop: TrainLoop
    tokenizer: Any
    data: DataBundle
    peak: PeakMemory
    steps: int  # the run's optimizer steps (max_steps, or the epochs' steps)
    status_fields: dict  # kept in every status.json write
    parameters: tuple[int, int]  # trainable, total
    started: dict | None  # adapter.init_from: the start adapter's record (rank 0)
    experts: Any = None  # the expert offload (memory.offload_experts), closed when training ends


@dataclass
class _Trained:
    """What `_train` ends with: the result, the held-out metrics before and after, and when training began."""

    result: RunResult
    before: dict | None
    after: dict
    start: float  # time.time() and time.process_time() as the loop started, and its step then
    cpu_start: float
    first_step: int


def _plan_build_train(recipe: Recipe, run_dir: RunDir, checkpoint: str | None, stopper: StopOnSignal,
                      allow_data_change: bool = False, main: bool = True, base: LoadedModel | None = None
                      ) -> RunResult:
    """A run's four stages: prepare (plan, settings), build (model, data, loop), train, record (rank 0)."""
    prepared = _prepare(recipe, run_dir, checkpoint, main)
    built = _build(prepared, run_dir, checkpoint, stopper, allow_data_change, main, base)
    trained = _train(built, run_dir, checkpoint, main, recipe)
    if main:
        _record(prepared, built, trained, run_dir)
    return trained.result


def _prepare(recipe: Recipe, run_dir: RunDir, checkpoint: str | None, main: bool) -> _Prepared:
    """The settings the run trains with: a resumed run keeps its chosen `auto` values and recoveries, one plan
    for all processes decides the rest, the batch rules scale for the batch; rank 0 saves the run files (a
    resume once its data is checked) and says what it decided."""
    reference = reference_batch(recipe)  # before a resume fills in the batch the interrupted run used
    if checkpoint and run_dir.recipe.is_file():
        saved = load_recipe(run_dir.recipe)
        recipe = keep_recovered(keep_resolved(recipe, saved), saved, run_dir.root)
    read: list[DataRead] = []  # kept on rank 0, not sent to the other processes with the plan
    plan, recipe = distributed.on_main(lambda: _plan(recipe, read.append))  # one plan for all processes
    recipe, rule = apply_batch_rules(recipe, reference)
    # no `auto` left in the settings the run trains with
    prepared = _Prepared(resolve(recipe), plan, read[0] if read else None)
    if main:
        if rule is not None:
            console.print(f"batch rules: {rule.describe()}")
            run_dir.log_line(f"batch rules: {rule.describe()}")
        if not checkpoint:  # a resume writes them once its data is checked: a refused one leaves them as they were
            _save_run_files(run_dir, plan, recipe)
        run_dir.write_status("loading")
    if recipe.distributed.gpus > 1:
        console.print(f"distributed: {recipe.distributed.gpus} processes, strategy {recipe.distributed.strategy}")
    return prepared


def _build(prepared: _Prepared, run_dir: RunDir, checkpoint: str | None, stopper: StopOnSignal,
           allow_data_change: bool, main: bool, base: LoadedModel | None) -> _Built:
    """The model (loaded or lent, adapter, memory settings, compiled), the data (checked against a resumed
    run's, the reference log-probabilities where precomputed), the activation offload and the loop, at the
    checkpoint's state when resuming."""
    from finetune.model.adapter import count_parameters

    recipe, settings = prepared.recipe, prepared.config.settings
    model, tokenizer, started, experts, vision = _model(recipe, settings, run_dir, main, base)
    trainable, total = count_parameters(model)
    console.print(f"model: {recipe.model.path}  trainable {trainable:,} of {total:,} parameters "
                  f"({100 * trainable / max(total, 1):.2f}%)")
    data = _data(recipe, tokenizer, vision, run_dir, checkpoint, allow_data_change, main, prepared.data)
    prepared.data = None  # built: training holds the datasets, not the records and tokens they were made from
    if main and checkpoint:
        _save_run_files(run_dir, prepared.plan, recipe)
    if recipe.training.precompute_reference:  # before the loop: no optimizer state or gradients yet
        from finetune.train.reference_pass import attach_reference

        data = attach_reference(model, data, recipe, run_dir,
                                autocast_for(mixed_precision(recipe.model.dtype, torch.cuda.is_available())),
                                lambda: stopper.requested)

    steps = total_steps(recipe, data.train, prepared.config.settings.batching)
    if checkpoint and main:
        damaged = run_dir.truncate_metrics(step_of(checkpoint))
        if damaged:
            console.print(f"[yellow]--resume: {run_dir.metrics}: dropped {damaged} damaged line(s)")
    status_fields: dict = {  # kept in every status.json write (the UI re-plans at the longest sequence)
        "longest_sequence_tokens": data.stats["max_example_tokens"] if "max_example_tokens" in data.stats
        and not recipe.data.packing else recipe.data.max_seq_len}
    # A bad offload_dir fails here, before the first step and before anything is written there.
    preflight_offload(model, recipe.memory, run_dir.root, settings.micro_batch_size, recipe.data.max_seq_len)
    offload = activation_offload(model, recipe.memory, run_dir.root)
    peak = PeakMemory(prepared.plan.peak_bytes if prepared.plan is not None else None)
    config = prepared.config
    loop = build_loop(config, model, data, run_dir, steps, offload=offload, peak=peak, status_fields=status_fields,
                      should_stop=lambda: stopper.requested, tokenizer=tokenizer)
    if checkpoint:
        load_checkpoint(loop, Path(checkpoint))
    return _Built(loop, tokenizer, data, peak, steps, status_fields, (trainable, total), started, experts)


def _model(recipe: Recipe, settings: Settings, run_dir: RunDir, main: bool, base: LoadedModel | None
           ) -> tuple[torch.nn.Module, Any, dict | None, Any, VisionData | None]:
    """The model to train (loaded, or the lent `base`) with its adapter and memory settings, the tokenizer,
    rank 0's record of adapter.init_from's start adapter (None without one), the expert offload (None
    without one) and a vision-language model's image processor (None for a text model)."""
    from finetune.memory.layer_recompute import compile_layers
    from finetune.memory.memory_config import apply_memory_config
    from finetune.model.adapter import apply_adapter
    from finetune.model.kernels import apply_kernels
    from finetune.model.load import load_model
    from finetune.model.vision import vision_data

    set_seed(recipe.training.seed)  # adapter initialisation is random: make it reproducible (same on all ranks)
    if base is None:
        model, tokenizer, path = load_model(recipe.model, recipe.quantization, sharded=recipe.distributed.gpus > 1
                                            and recipe.distributed.strategy == "fsdp",
                                            packing=recipe.data.packing,
                                            arriving=streamed_load(recipe, settings, run_dir.root))
    else:
        mismatch = base.mismatch(recipe.model, recipe.quantization)
        if mismatch is not None:
            raise UsageError(f"{mismatch}: the recipe does not describe the already loaded model (base=)",
                             hint="give the recipe the model and quantization keys the model was loaded with")
        model, tokenizer, path = base.model, base.tokenizer, base.path
    vision = vision_data(model.config, path, tokenizer, settings.max_pixels)  # a vision-language model's images
    model = apply_adapter(model, recipe.adapter, checkpointing=settings.activation_checkpointing,
                          reference=loads_reference_adapter(recipe), digest=main)
    if base is not None:
        _ADAPTED[base.model] = model  # the peft model give_back unloads
    # results.json's record of the start adapter: rank 0 writes it, hashing the bytes apply_adapter read.
    started = init_from_record(recipe.adapter.init_from) if main and recipe.adapter.init_from is not None \
        else None
    if started is not None:
        run_dir.log_line(f"adapter.init_from: started from {started['adapter']} (sha256 {started['sha256']})")
    experts = apply_memory_config(model, recipe.memory, run_dir.root)  # closed (its files removed) after training
    fused = apply_kernels(model, recipe.memory.kernels)
    if fused:
        console.print(f"kernels: Liger's {', '.join(fused)}", markup=False, highlight=False)
        _preference_kernels_line(model, recipe, run_dir)
    compile_layers(model, recipe.training.compile)
    return model, tokenizer, started, experts, vision


def _preference_kernels_line(model: torch.nn.Module, recipe: Recipe, run_dir: RunDir) -> None:
    """Under memory.kernels: liger, which loss a preference method runs (Liger's fused one or ours, and why):
    printed and in the run's log."""
    from finetune.memory.chunked_loss import head_of
    from finetune.step.liger_losses import head_problem, kernels_line

    loss = PreferenceLoss.of(recipe.training)
    if loss is not None:
        _, head, softcap, _ = head_of(model)
        line = kernels_line(loss, head_problem(head, softcap))
        console.print(line, markup=False, highlight=False)
        run_dir.log_line(line)



def _data(recipe: Recipe, tokenizer: Any, vision: VisionData | None, run_dir: RunDir, checkpoint: str | None,
          allow_data_change: bool, main: bool, read: DataRead | None = None) -> DataBundle:
    """The training method's data (its images through `vision`, a vision-language model's), its fingerprint checked against a resumed run's (`DataChanged`) and saved,
    its counts and warnings on screen and (rank 0) in the run directory. `read`: the data as the plan read and
    tokenized it, which the build takes over where its examples are the build's (finetune.data.build.DataRead)."""
    from finetune.data import build_datasets

    data = build_datasets(recipe.data, tokenizer, recipe.training.seed, recipe.training.method,
                          max_prompt_tokens(recipe) if recipe.training.spec.generates else None, vision, read)
    console.print(f"data: {data.summary()} (every count: {run_dir.data_stats})", markup=False, highlight=False)
    distributed.on_main(lambda: _record_data(run_dir, data.fingerprint, checkpoint is not None, allow_data_change))
    for warning in data.warnings:
        console.print(f"data: {warning}", style="yellow", markup=False)
    if main:
        atomic_write_json(run_dir.data_stats, data.stats)
        run_dir.log_line(f"data stats: {data.stats}")
        for warning in data.warnings:
            run_dir.log_line(f"data warning: {warning}")
    return data


def _train(built: _Built, run_dir: RunDir, checkpoint: str | None, main: bool, recipe: Recipe) -> _Trained:
    """The held-out metrics before training (preference methods and GRPO, on a fresh run), the loop's fit (the
    peak tracker and offload closed however it ends), the final evaluation and, when completed, the adapter."""
    loop, data, peak = built.loop, built.data, built.peak
    # Preference methods and GRPO: the held-out rewards before training, so results.json shows what changed.
    before = None
    if data.eval is not None and loop.objective.evaluates_before and not checkpoint:
        before = loop.evaluate("held-out evaluation before training")
        if before is None:  # Ctrl-C: nothing trained, nothing to resume (run() removes the folder)
            raise KeyboardInterrupt
    start, cpu_start, first_step = time.time(), time.process_time(), loop.state.step
    try:
        loop.fit()
    finally:
        peak.close()  # also after an error
        if loop.offload is not None:  # an out-of-memory recovery may have turned it on or changed it
            loop.offload.close()  # removes every file the disk tier still holds, also after an error
        from finetune.memory.weight_store import weight_store_of

        for frozen in (built.experts, weight_store_of(loop.model)):  # and a store a recovery turned on
            if frozen is not None:
                frozen.close()  # the expert offload's or the weight store's files too
    if main and peak.tracked_steps:
        run_dir.log_line(f"memory tracker: tracked {len(peak.tracked_steps)} of {loop.state.step} steps "
                         f"(those that could set a new peak): {', '.join(str(s + 1) for s in peak.tracked_steps)}")
    breaks = graph_breaks()  # training.compile: regions torch could not capture ran eagerly
    if main and breaks:
        console.print(f"training.compile: {breaks} graph break(s): those regions ran uncompiled", markup=False)
        run_dir.log_line(f"training.compile: {breaks} graph break(s) in this process (regions run uncompiled)")
    after = _final_evaluation(loop, run_dir, main, recipe) if data.eval is not None else {}
    state = "stopped" if loop.stopped else "completed"
    if state == "completed":
        _save_result(loop, built.tokenizer, run_dir, main)
    losses = [h["loss"] for h in loop.state.log_history if "loss" in h]
    result = RunResult(run_dir.root, state, loop.state.step, losses[-1] if losses else None,
                       after.get(f"{EVAL_PREFIX}loss"), before, after or None)
    return _Trained(result, before, after, start, cpu_start, first_step)


def _record(prepared: _Prepared, built: _Built, trained: _Trained, run_dir: RunDir) -> None:
    """Rank 0's record of the run: results.json, the loss plot, the final status and log line."""
    loop, result, data = built.loop, trained.result, built.data
    engine = next((p for p in loop.policies if isinstance(p, BatchEngine)), None)
    trainable, total = built.parameters
    atomic_write_json(run_dir.results, {
        "state": result.state, "steps": result.steps, "final_loss": result.final_loss, "eval_loss": result.eval_loss,
        "train_runtime_s": round(time.time() - trained.start, 2),
        "train_cpu_s": round(time.process_time() - trained.cpu_start, 2),
        "train_metrics": loop.train_metrics(time.time() - trained.start, trained.first_step), "data": data.stats,
        "trainable_parameters": trainable, "total_parameters": total,
        **({"init_from": built.started} if built.started is not None else {}),
        **({"eval_before": trained.before, "eval_after": trained.after} if trained.before is not None else {}),
        "offload": dict(loop.offload.stats, tier=_memory(loop, prepared.recipe).offload) if loop.offload is not None
        else None,
        **(batch_summary(engine, loop, run_dir.read_metrics(), data.stats) if engine is not None else {})})
    plot_loss_curve(run_dir)
    run_dir.write_status(result.state, step=result.steps, max_steps=built.steps, **built.status_fields)
    run_dir.log_line(f"run {result.state} at step {result.steps}")


def _memory(loop: TrainLoop, recipe: Recipe):
    """The memory settings in use at the end (an out-of-memory recovery may have changed them)."""
    recovery = next((p for p in loop.policies if isinstance(p, OOMRecovery)), None)
    return (recovery.recipe if recovery is not None else recipe).memory


def _save_run_files(run_dir: RunDir, plan: Plan | None, recipe: Recipe) -> None:
    """The plan, the recipe as run (`auto` resolved) and the environment."""
    if plan is not None:
        save_plan(run_dir, plan)
    atomic_write_text(run_dir.recipe, recipe_to_yaml(recipe))
    atomic_write_json(run_dir.env, environment_summary())


def _record_data(run_dir: RunDir, fingerprint: dict, resumed: bool, allow_change: bool) -> None:
    """Save what decided the examples; on resume first compare with what the run saved (DataChanged)."""
    if resumed:
        changes = check_resumed_data(read_json(run_dir.data_fingerprint), fingerprint, str(run_dir.root),
                                     allow_change)
        if changes:
            console.print(f"[yellow]--allow-data-change: resuming on changed data: {'; '.join(changes)}")
            run_dir.log_line(f"resumed on changed data (--allow-data-change): {'; '.join(changes)}")
    atomic_write_json(run_dir.data_fingerprint, fingerprint)


def _final_evaluation(loop: TrainLoop, run_dir: RunDir, main: bool, recipe: Recipe) -> dict[str, float]:
    """The evaluation at the last step: the loop's own when it ran one there (evaluating again would log a
    second row for the same step in metrics.jsonl), else a new one. Empty after a stop asked for (Ctrl-C,
    before or during it; one process): the checkpoint (or, training complete, the adapter) is what the user waits
    for; the resumed run evaluates at its end, or `finetune eval` measures the adapter later."""
    last = next((row for row in reversed(loop.state.log_history) if is_eval_row(row)), None)
    if last is not None and last.get("step") == loop.state.step:
        return {k: v for k, v in last.items() if k not in ("step", "epoch")}
    stop = loop.processes == 1 and loop.hooks.should_stop()  # several: each would decide apart, then wait
    after = loop.evaluate("final evaluation") if not stop else None
    if after is None:
        data = "" if evaluable_split(recipe.data, recipe.training.method) else " --data HELD_OUT_FILE"
        later = ("the resumed run evaluates at its end" if loop.stopped else  # no adapter yet for `eval`
                 f"measure the run later with: finetune eval {run_dir.root}{data}")
        line = f"final evaluation skipped (stop requested); {later}"
        if main:
            console.print(line, style="yellow", markup=False, highlight=False)
            run_dir.log_line(line)
    return after or {}


def _save_result(loop: TrainLoop, tokenizer, run_dir: RunDir, main: bool = True) -> None:
    """Save the adapter (or the full model) with its tokenizer, atomically, to run/adapter.

    Several processes: every rank takes part in gathering the weights (FSDP), rank 0 writes."""
    tmp = run_dir.adapter_staging
    accelerator = loop.accelerator
    state_dict = accelerator.get_state_dict(loop.model) if loop.processes > 1 else None
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(loop.model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        replace_dir(tmp, run_dir.adapter)
    distributed.barrier()
