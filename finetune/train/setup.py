"""The parts of one run's training loop, from the resolved recipe: accelerator, optimizer and scheduler,
the policies, and the loop itself (torchtune's recipe split: setup here, the loop in loop.py)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from transformers import get_scheduler

from finetune.compat import fresh_accelerator_state
from finetune.console import console
from finetune.data.batching import Batching, epoch_order
from finetune.data.batching import epoch_steps as cut_epoch
from finetune.optim import build_optimizer
from finetune.recipe.resolved import RunConfig
from finetune.recipe.schema import Recipe
from finetune.rl.step import prompts_per_step
from finetune.rundir import RunDir
from finetune.step.training_step import enable_checkpointing, mixed_precision
from finetune.train import distributed
from finetune.train.batch_engine import BatchEngine, record_batch_change
from finetune.train.checkpoints import numbered
from finetune.train.loop import (
    LoopData,
    MemorySettings,
    RunHooks,
    Schedule,
    TrainLoop,
    TrainParts,
    example_lengths,
)
from finetune.train.noise_scale import GradNormProbe, NoiseScale
from finetune.train.objectives import MethodContext, make_objective
from finetune.train.peak_memory import PeakMemory
from finetune.train.policy import Geometry, Policy
from finetune.train.recovery import OOMRecovery, record_recovery
from finetune.train.reporting import LiveFiles, ProgressBar
from finetune.train.train_state import save_checkpoint

SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup",
              "wsd": "warmup_stable_decay"}


def total_steps(recipe: Recipe, train: Sequence, batching: str = "random") -> int:
    """Loop steps for the run: max_steps, or epochs over the data (last partial batch included); steps of a
    token target (training.effective_batch_tokens) counted as the loop cuts each epoch under `batching`."""
    t = recipe.training
    if t.max_steps is not None:
        return t.max_steps
    train_examples = len(train)
    if t.effective_batch_tokens is not None:
        lengths = example_lengths(train)
        cut = Batching(batching, int(t.micro_batch_size), 1, token_budget=int(t.micro_batch_size) * max(lengths),
                       step_tokens=t.effective_batch_tokens)
        whole, part = divmod(t.epochs, 1)
        counts = [len(cut_epoch(epoch_order(train_examples, t.seed, e), lengths, cut, t.seed, e))
                  for e in range(math.ceil(t.epochs))]
        return max(1, sum(counts[:int(whole)]) + (math.ceil(part * counts[-1]) if part else 0))
    per_step = _step_examples(recipe, int(t.micro_batch_size), int(t.gradient_accumulation_steps))
    per_epoch = math.ceil(train_examples / (per_step * recipe.distributed.gpus))
    return max(1, math.ceil(per_epoch * t.epochs))


def _step_examples(recipe: Recipe, micro_batch: int, accumulation: int) -> int:
    """Examples one process's loop step reads: micro_batch x accumulation, or (grpo) the prompts whose
    completions those are."""
    if recipe.training.spec.generates:
        return prompts_per_step(micro_batch, accumulation, recipe.grpo.num_generations)
    return micro_batch * accumulation


def make_scheduler(recipe: Recipe, optimizer: torch.optim.Optimizer, steps: int) -> Any:
    """The learning-rate schedule over `steps` loop steps (transformers' schedules by name)."""
    t = recipe.training
    kwargs = {"num_decay_steps": max(1, round(t.decay_ratio * steps))} if t.lr_scheduler == "wsd" else None
    return get_scheduler(SCHEDULERS[t.lr_scheduler], getattr(optimizer, "optimizer", optimizer),
                         num_warmup_steps=round(t.warmup_ratio * steps), num_training_steps=steps,
                         scheduler_specific_kwargs=kwargs)


def make_accelerator(config: RunConfig, model: torch.nn.Module) -> Accelerator:
    """accelerate's Accelerator for the run: the device, mixed precision (bf16/fp16 autocast on CUDA) and
    the strategy of several processes."""
    cuda, recipe = torch.cuda.is_available(), config.recipe
    fresh_accelerator_state()
    plugins = distributed.accelerator_plugins(recipe, model, config.settings.micro_batch_size)
    return Accelerator(cpu=not cuda, mixed_precision=mixed_precision(recipe.model.dtype, cuda) or "no", **plugins)


def kept_checkpoint(root: Path) -> Callable[[], str]:
    """What a failure leaves to resume from, in words."""
    def kept() -> str:
        last = numbered(root)
        return f"the last checkpoint, {last[0].name}, is kept" if last else "no checkpoint was saved before it"

    return kept


def _prepared(config: RunConfig, model: torch.nn.Module, steps: int, measure_noise: bool
              ) -> tuple[TrainParts, GradNormProbe | None, Geometry]:
    """Checkpointing switched on, the accelerator, the noise probe (installed before the optimizer exists,
    so its hooks run before a layer-wise optimizer frees .grad), the optimizer, both prepared by
    accelerate, the schedule of `steps` loop steps, and the batch geometry."""
    s, t = config.settings, config.recipe.training
    enable_checkpointing(model, s.activation_checkpointing, s.checkpoint_every_n_layers)
    accelerator = make_accelerator(config, model)
    probe = GradNormProbe(model.parameters(), world=accelerator.num_processes) if measure_noise else None
    optimizer = build_optimizer(model, config.recipe.optimizer, t.learning_rate,
                                steps_per_update=s.gradient_accumulation_steps, max_grad_norm=t.max_grad_norm)
    model, optimizer = accelerator.prepare(model, optimizer)
    if config.recipe.training.spec.generates:  # a loop step: one loader batch of prompts (finetune.train.grpo)
        geometry = Geometry(micro_batch=_step_examples(config.recipe, s.micro_batch_size, s.gradient_accumulation_steps),
                            accumulation=1, processes=accelerator.num_processes, completion_rows=s.micro_batch_size)
    else:
        geometry = Geometry(micro_batch=s.micro_batch_size, accumulation=s.gradient_accumulation_steps,
                            processes=accelerator.num_processes)
    parts = TrainParts(model, optimizer, make_scheduler(config.recipe, optimizer, steps), accelerator)
    return parts, probe, geometry


def build_loop(config: RunConfig, model: torch.nn.Module, data: Any, run_dir: RunDir, steps: int, *,
               offload: Any, peak: PeakMemory, status_fields: dict, should_stop: Callable[[], bool],
               tokenizer: Any) -> TrainLoop:
    """The model prepared by accelerate, its optimizer and schedule, the method's objective, and the loop with
    its policies: the noise scale probe, then (one process) the batch engine and out-of-memory recovery, the
    memory peak, the run files and the progress bar, in that order (the order the loop calls their hooks in).
    A method that generates (GRPO): the memory peak, then its objective, which is a policy too (generation,
    its own recovery; finetune.train.grpo), the run files and the progress bar."""
    recipe, t = config.recipe, config.recipe.training
    objective = make_objective(config, MethodContext(tokenizer, run_dir))
    generates = t.spec.generates
    sharded = recipe.distributed.gpus > 1 and config.settings.strategy != "ddp"
    main = distributed.is_main()
    if t.noise_scale and main and (sharded or generates):
        console.print("noise scale: not measured with " + ("GRPO" if generates else "FSDP or DeepSpeed (distributed."
                                                           "strategy ddp measures it)"))
    parts, probe, geometry = _prepared(config, model, steps, t.noise_scale and not sharded and not generates)
    several = parts.accelerator.num_processes > 1
    policies: list[Policy]
    if generates:  # the tracker decides whether to track a step before the objective generates
        policies = [peak, objective]
    else:
        noise = NoiseScale(probe, t.noise_scale_split_every)
        policies = [noise]
        if not several:  # redoing a step on one process would leave the others waiting in a collective
            policies += [
                BatchEngine(config, noise, geometry, parts.accelerator.device,
                            record_batch_change(run_dir, status_fields)),
                OOMRecovery(recipe, run_dir.root, record_recovery(run_dir, steps, peak, status_fields))]
        policies.append(peak)
    policies += [LiveFiles(run_dir, steps, status_fields), ProgressBar(steps)]
    has_eval = data.eval is not None
    return TrainLoop(
        parts, LoopData(data.train, data.eval, data.collator, tokenizer.pad_token_id, config.settings.batching,
                        t.effective_batch_tokens),
        geometry,
        _schedule(config, steps, eval_steps=(t.eval_steps or steps) if has_eval else None,
                  save_steps=recipe.output.save_steps),
        objective, policies=policies, memory=MemorySettings(config.settings.chunked_loss, offload),
        hooks=RunHooks(save=lambda loop: save_checkpoint(loop, run_dir.checkpoints, recipe.output.save_total_limit),
                       should_stop=should_stop, kept=kept_checkpoint(run_dir.checkpoints)))


def _schedule(config: RunConfig, steps: int, *, eval_steps: int | None, save_steps: int | None) -> Schedule:
    t = config.recipe.training
    return Schedule(max_steps=steps, logging_steps=t.logging_steps, eval_steps=eval_steps, save_steps=save_steps,
                    max_grad_norm=t.max_grad_norm, seed=t.seed, learning_rate=t.learning_rate)


def simple_loop(config: RunConfig, model: torch.nn.Module, train_data: Any, collator: Callable[[list], Any],
                steps: int, *, checkpoints: Path | None = None, policies: list[Policy] | None = None) -> TrainLoop:
    """The loop for `model` as the recipe trains it, without a run directory (tests, benchmarks, callers
    who bring their own data): its optimizer and schedule, the method's objective, the noise scale if the
    recipe measures it, checkpoints in `checkpoints` every output.save_steps when given."""
    recipe, t = config.recipe, config.recipe.training
    parts, probe, geometry = _prepared(config, model, steps, t.noise_scale)
    save = (lambda loop: save_checkpoint(loop, checkpoints, recipe.output.save_total_limit)) if checkpoints else None
    return TrainLoop(
        parts, LoopData(train_data, None, collator, batching=config.settings.batching,
                        step_tokens=t.effective_batch_tokens), geometry,
        _schedule(config, steps, eval_steps=None, save_steps=recipe.output.save_steps if checkpoints else None),
        make_objective(config), policies=[NoiseScale(probe, t.noise_scale_split_every), *(policies or [])],
        memory=MemorySettings(chunked_loss=config.settings.chunked_loss), hooks=RunHooks(save=save))
