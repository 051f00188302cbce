"""The Hugging Face Trainer, configured from a recipe; the hooks where memory techniques plug in."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from finetune.console import console
from finetune.errors import FinetuneError
from finetune.memory.offload import ActivationOffload
from finetune.memory.preference import PreferenceLoss, metric_means
from finetune.memory.step import compute_loss, forward_backward, mixed_precision
from finetune.memory.tracker_callback import PeakMemoryCallback
from finetune.optim import build_optimizer, layerwise_of, register_safe_globals
from finetune.recipe.schema import Recipe
from finetune.rundir import atomic_write_json
from finetune.train.checkpoints import STAGING, checkpoint_fault, numbered, publish, stage
from finetune.train.noise_scale import GradNormProbe, NoiseScaleEMA, labelled_tokens

NOISE_SCALE_FILE = "noise_scale.json"  # in each checkpoint folder: the smoothed estimate, for an exact --resume
_SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup",
               "wsd": "warmup_stable_decay"}


class TrainingDiverged(FinetuneError):
    """Loss, gradient norm or weights became NaN/inf: the run stops before that state is applied or saved."""


class CheckpointWriteError(FinetuneError):
    """A checkpoint could not be written (disk full, permissions); the previous one is untouched."""


def total_steps(recipe: Recipe, train_examples: int) -> int:
    """Optimizer steps for the run: max_steps, or epochs over the data (last partial batch included)."""
    t = recipe.training
    if t.max_steps is not None:
        return t.max_steps
    per_epoch = math.ceil(train_examples / (int(t.micro_batch_size) * int(t.gradient_accumulation_steps)
                                            * recipe.distributed.gpus))
    return max(1, math.ceil(per_epoch * t.epochs))


def training_arguments(recipe: Recipe, output_dir: Path, steps: int, has_eval: bool,
                       **distributed: Any) -> TrainingArguments:
    """Translate the (fully resolved, no `auto`) recipe into TrainingArguments; `distributed`: the strategy's
    own arguments (finetune.train.distributed.training_kwargs)."""
    t, m = recipe.training, recipe.memory
    dtype = recipe.model.dtype
    cuda = torch.cuda.is_available()
    if has_eval:
        eval_kwargs = dict(eval_strategy="steps", eval_steps=t.eval_steps or steps)
    else:
        eval_kwargs = dict(eval_strategy="no")
    scheduler_kwargs = {}
    if t.lr_scheduler == "wsd":
        scheduler_kwargs = {"num_decay_steps": max(1, round(t.decay_ratio * steps))}
    checkpointing = bool(m.activation_checkpointing)
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=int(t.micro_batch_size),
        per_device_eval_batch_size=int(t.micro_batch_size),
        gradient_accumulation_steps=int(t.gradient_accumulation_steps),
        learning_rate=t.learning_rate,
        lr_scheduler_type=_SCHEDULERS[t.lr_scheduler],
        lr_scheduler_kwargs=scheduler_kwargs,
        warmup_steps=round(t.warmup_ratio * steps),
        max_grad_norm=t.max_grad_norm if t.max_grad_norm is not None else 0.0,
        seed=t.seed,
        data_seed=t.seed,
        logging_steps=t.logging_steps,
        save_strategy="steps",
        save_steps=recipe.output.save_steps,
        save_total_limit=recipe.output.save_total_limit,
        activation_checkpointing=checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False, "every_n_layers": m.checkpoint_every_n_layers}
        if checkpointing else None,
        bf16=mixed_precision(dtype, cuda) == "bf16",
        fp16=mixed_precision(dtype, cuda) == "fp16",
        use_cpu=not cuda,
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        include_num_input_tokens_seen="non_padding",
        dataloader_num_workers=0,
        **eval_kwargs,
        **distributed,
    )


def _all_finite(params) -> bool:
    """Check in 16M-element slices, so a full fine-tune's largest matrix needs no full-size temporary."""
    for p in params:
        for part in p.detach().reshape(-1).split(1 << 24):
            if not bool(torch.isfinite(part).all()):
                return False
    return True


def _write_failure(exc: Exception, folder: Path) -> str | None:
    """Why a save failed, if it is the disk's fault; None for an error that is not about writing.

    torch.save reports a full disk as a RuntimeError from its C++ stream writer, and the tokenizers library
    (Rust) as a plain Exception ending in "(os error 28)": neither is an OSError.
    """
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc} ({exc.filename})" if exc.filename else str(exc.strerror or exc)
    if not any(s in str(exc) for s in ("iostream", "PytorchStreamWriter", "unexpected pos", "file write failed",
                                        "(os error ")):
        return None
    free = shutil.disk_usage(folder).free
    if free < 1 << 20:
        return f"{os.strerror(errno.ENOSPC)} ({free // 1024} KiB free)"
    return f"could not write the file ({str(exc).splitlines()[0]})"


class FinetuneTrainer(Trainer):
    """Trainer with the recipe at hand, so memory techniques (optimizers, offload, chunked loss) can plug in."""

    def __init__(self, *args, recipe: Recipe, offload: ActivationOffload | None = None, **kwargs):
        self.recipe = recipe
        self.offload = offload
        self.preference = PreferenceLoss.of(recipe.training)  # None for sft
        self._preference_metrics: dict[str, dict] = {"train": {}, "eval": {}}  # summed until logged
        self._loss_finite: torch.Tensor | None = None  # all micro-batch losses of this step finite (no sync)
        register_safe_globals()  # checkpoints hold GaLore/APOLLO projectors; resume loads with weights_only
        super().__init__(*args, **kwargs)
        # Installed before the optimizer exists, so its hooks run before a layer-wise optimizer frees .grad.
        # Several processes: DDP only (FSDP and DeepSpeed replace the parameters the hooks would sit on).
        self.noise_scale = NoiseScaleEMA()
        sharded = self.is_fsdp_enabled or self.is_deepspeed_enabled
        if recipe.training.noise_scale and sharded and self.args.process_index == 0:
            console.print("noise scale: not measured with FSDP or DeepSpeed (distributed.strategy ddp measures it)")
        self.noise_probe = GradNormProbe(self.model.parameters(), world=self.accelerator.num_processes) \
            if recipe.training.noise_scale and not sharded else None

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's loader batches, fetched through the CPU memory tracker, which tracks only the steps that
        can set a new peak (finetune/memory/tracker_callback.py)."""
        def fetch():
            return super(FinetuneTrainer, self).get_batch_samples(epoch_iterator, num_batches, device)

        peak = self._peak_callback()
        return peak.fetch_step(fetch) if peak is not None else fetch()

    def _peak_callback(self) -> PeakMemoryCallback | None:
        return next((c for c in self.callback_handler.callbacks if isinstance(c, PeakMemoryCallback)), None)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One forward + backward: finetune.memory.step.forward_backward, the step the planner traces and
        `finetune measure` runs (loss scaling, autocast, offload and chunked loss as configured here)."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        num_items = num_items_in_batch if self.model_accepts_loss_kwargs else None
        # Several processes: the loss is normalised by the labelled tokens of all of them and DDP/FSDP average
        # the gradients, so it is multiplied by their number, as Trainer.compute_loss does (one process: 1).
        scale = self.accelerator.num_processes \
            if num_items is not None and self.args.average_tokens_across_devices else 1
        if self.noise_probe is not None and "labels" in inputs:
            tokens = labelled_tokens(inputs)  # device scalars: the probe reads them at the step's end
            self.noise_probe.micro_batch(tokens, scale * tokens / num_items if num_items is not None
                                         else 1 / self.current_gradient_accumulation_steps)
        def run() -> torch.Tensor:
            return forward_backward(
                model, self._prepare_inputs(inputs), accumulation=self.current_gradient_accumulation_steps,
                num_items_in_batch=num_items,
                chunked_loss=self.recipe.memory.chunked_loss is True and "labels" in inputs,
                autocast=self.accelerator.autocast, offload=self.offload,
                backward=lambda loss: self._backward(loss * scale if scale != 1 else loss),
                preference=self.preference, metrics=self._preference_metrics["train"])

        peak = self._peak_callback()  # the CPU tracker sees only the micro-batches of steps that can set a peak
        loss = peak.micro_batch(run) if peak is not None else run()
        loss = loss * scale if scale != 1 else loss
        finite = torch.isfinite(loss).all()
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        return loss

    def _backward(self, loss: torch.Tensor) -> None:
        """accelerator.backward as Trainer.training_step calls it: DeepSpeed must not divide the loss by the
        accumulation again (forward_backward already did)."""
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            self.accelerator.backward(loss, scale_wrt_gas=False)
        else:
            self.accelerator.backward(loss)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation of a preference method: its loss, with rewards and margins kept for the eval log."""
        if self.preference is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        with torch.no_grad(), self.accelerator.autocast():
            loss = compute_loss(model, self._prepare_inputs(inputs), chunked_loss=self.recipe.memory.chunked_loss is True,
                                preference=self.preference, metrics=self._preference_metrics["eval"])
        return loss.detach(), None, None

    def evaluation_loop(self, *args, metric_key_prefix: str = "eval", **kwargs):
        """Preference runs: the evaluation's rewards, margins and accuracy join its metrics (and its log)."""
        output = super().evaluation_loop(*args, metric_key_prefix=metric_key_prefix, **kwargs)
        if self.preference is not None:
            output.metrics.update(metric_means(self._preference_metrics["eval"], f"{metric_key_prefix}_"))
            self._preference_metrics["eval"] = {}
        return output


    def create_optimizer(self, model=None):
        """Every optimizer of the recipe (APOLLO, GaLore, 8-bit, layer-wise...) comes from finetune.optim."""
        if self.optimizer is None:
            self.optimizer = build_optimizer(
                self.model, self.recipe.optimizer, self.args.learning_rate,
                steps_per_update=self.args.gradient_accumulation_steps, max_grad_norm=self.args.max_grad_norm)
        return self.optimizer

    def _observe_noise(self) -> None:
        """The step's noise-scale observation, from the gradients as accumulated (before clipping); the
        second call of a step finds nothing new."""
        if self.noise_probe is not None:
            observation = self.noise_probe.finish()
            if observation is not None:
                self.noise_scale.update(observation)

    def _clip_grad_norm(self, model):
        self._observe_noise()
        # Layer-wise updates clip and measure inside the optimizer: the full gradient is never resident.
        layerwise = layerwise_of(self.optimizer)
        return layerwise.grad_norm() if layerwise else super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        """Also the divergence guard and the noise-scale observation: runs once per optimizer step, after the
        last backward and before the update is applied."""
        self._observe_noise()
        layerwise = layerwise_of(self.optimizer)
        norm = layerwise.grad_norm() if layerwise else super()._get_grad_norm(model, grad_norm)
        loss_finite, self._loss_finite = self._loss_finite, None
        if loss_finite is not None and not bool(loss_finite):
            self._diverged("the training loss is NaN or inf")
        if norm is not None and not math.isfinite(float(norm)):
            self._diverged(f"the gradient norm is {float(norm)}")
        if (peak := self._peak_callback()) is not None:
            peak.keep(norm)  # the Trainer keeps it into the next step
        return norm

    def _diverged(self, what: str) -> None:
        last = numbered(Path(self.args.output_dir))
        kept = f"the last checkpoint, {last[0].name}, is kept" if last else "no checkpoint was saved before it"
        raise TrainingDiverged(
            f"training diverged at step {self.state.global_step + 1}: {what}; stopped ({kept})",
            hint=f"lower training.learning_rate (now {self.args.learning_rate:g}), keep training.max_grad_norm "
                 "on, or check the data for broken examples")

    def _save_checkpoint(self, model, trial) -> None:
        """Write checkpoint-N in a staging folder and rename it when complete (a kill or a full disk never
        leaves a half checkpoint where --resume looks); weights that are already NaN/inf are never saved."""
        if not self._weights_finite():
            self._diverged("the trained weights hold NaN/inf")
        root = Path(self._get_output_dir(trial))
        # Several processes: rank 0 prepares and publishes the staging folder; every rank writes its part
        # (its RNG state, FSDP/ZeRO gathering) in between.
        main = self.args.process_index == 0
        staging = stage(root) if main else root / STAGING
        self.accelerator.wait_for_everyone()
        output_dir, limit = self.args.output_dir, self.args.save_total_limit
        self.args.output_dir, self.args.save_total_limit = str(staging), None  # rotate only once published
        try:
            super()._save_checkpoint(model, trial)
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            self.accelerator.wait_for_everyone()
            if main:
                publish(staging / name, root / name)
            self.accelerator.wait_for_everyone()
        except Exception as exc:  # noqa: BLE001 - only a write failure is reported; anything else is raised again
            reason = _write_failure(exc, root)
            if reason is None:
                raise
            shutil.rmtree(staging, ignore_errors=True)  # give the space back for status.json
            last = numbered(root)
            kept = f"{last[0].name} is kept and can be resumed" if last else "no earlier checkpoint exists"
            raise CheckpointWriteError(
                f"cannot write checkpoint {self.state.global_step} in {root}: {reason}; {kept}",
                hint="free disk space or fix the folder's permissions, then run again with --resume") from None
        finally:
            self.args.output_dir, self.args.save_total_limit = output_dir, limit
        if not main:
            return
        shutil.rmtree(staging, ignore_errors=True)
        rotate_checkpoints(output_dir=str(root), save_total_limit=limit,
                           best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _weights_finite(self) -> bool:
        """All trained weights finite, on every process (FSDP/ZeRO: each checks its shard, all agree)."""
        local = _all_finite(p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()
                            if p.requires_grad)
        if self.accelerator.num_processes == 1:
            return local
        flag = torch.tensor(float(local), device=self.accelerator.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Training log rows also carry the smoothed noise scale (gns, grad_sq, trace_sigma) once known, and
        for preference methods the rewards, margins and accuracy (means since the last training log)."""
        if "loss" in logs and (values := self.noise_scale.values()) is not None:
            logs = {**logs, **{k: float(f"{v:.6g}") for k, v in values.items()}}
        if self.preference is not None and "loss" in logs:
            logs = {**logs, **metric_means(self._preference_metrics["train"])}
            self._preference_metrics["train"] = {}
        super().log(logs, start_time)

    def _save_rng_state(self, output_dir) -> None:
        checkpoint_fault(Path(output_dir), self.state.global_step)  # test hook; a no-op unless its env var is set
        super()._save_rng_state(output_dir)
        atomic_write_json(Path(output_dir) / NOISE_SCALE_FILE, self.noise_scale.state_dict())

    def _load_rng_state(self, checkpoint) -> None:
        super()._load_rng_state(checkpoint)
        path = Path(checkpoint) / NOISE_SCALE_FILE if checkpoint else None
        if path is not None and path.is_file():  # absent in checkpoints of earlier versions: start afresh
            self.noise_scale.load_state_dict(json.loads(path.read_text()))
