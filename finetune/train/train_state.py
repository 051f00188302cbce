"""One checkpoint of the training loop: written whole or not at all, read back exactly.

checkpoint-N/ holds `train_state.pt` (the trained weights, the optimizer's, the scheduler's, the loop's and
the policies' state: one state_dict, loaded with torch's weights-only loader), `rng_state_R.pth` per process
(each process draws from its own streams), and for an adapter the standard peft folder files
(adapter_config.json, adapter_model.safetensors), usable like any saved adapter. It is written in the staging
folder and published with its completion marker (finetune.train.checkpoints). Several processes: the
weights and the optimizer's state are gathered whole (FSDP2's shards included, through torch's
distributed-checkpoint state-dict API), so a checkpoint resumes at any number of processes.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from finetune.errors import FinetuneError
from finetune.optim import register_safe_globals
from finetune.train.checkpoints import STAGING, TRAIN_STATE, checkpoint_fault, numbered, publish, stage
from finetune.train.loop import TrainLoop
from finetune.train.rng import rng_state, saveable, set_rng_state

FORMAT = 2  # of train_state.pt; 1 was the transformers.Trainer's layout (trainer_state.json, optimizer.pt)
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
_FULL = StateDictOptions(full_state_dict=True, strict=False)


class CheckpointWriteError(FinetuneError):
    """A checkpoint could not be written (disk full, permissions); the previous one is untouched."""


def rng_file(rank: int) -> str:
    return f"rng_state_{rank}.pth"


def _barrier(loop: TrainLoop) -> None:
    if loop.processes > 1:
        loop.accelerator.wait_for_everyone()


def _sharded(loop: TrainLoop) -> bool:
    from accelerate.utils import DistributedType

    return loop.accelerator.distributed_type == DistributedType.FSDP


def _module(loop: TrainLoop) -> torch.nn.Module:
    """The model whose parameter names the state uses: FSDP2 shards in place; DDP wraps."""
    return loop.model if _sharded(loop) else loop.accelerator.unwrap_model(loop.model)


def _raw_optimizer(loop: TrainLoop) -> torch.optim.Optimizer:
    return getattr(loop.optimizer, "optimizer", loop.optimizer)


def _all_finite(params) -> bool:
    """Check in 16M-element slices, so a full fine-tune's largest matrix needs no full-size temporary."""
    for p in params:
        for part in p.detach().reshape(-1).split(1 << 24):
            if not bool(torch.isfinite(part).all()):
                return False
    return True


def weights_finite(loop: TrainLoop) -> bool:
    """All trained weights finite, on every process (FSDP: each checks its shard, all agree)."""
    local = _all_finite(p.to_local() if hasattr(p, "to_local") else p for p in loop.model.parameters()
                        if p.requires_grad)
    if loop.processes == 1:
        return local
    flag = torch.tensor(float(local), device=loop.accelerator.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


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


def _weights(loop: TrainLoop) -> dict[str, torch.Tensor]:
    """The trained weights by parameter name, whole, on the CPU (FSDP: gathered from the shards)."""
    module = _module(loop)
    if _sharded(loop):
        return get_model_state_dict(module, options=_GATHER)
    return {name: p.detach().to("cpu", copy=True) for name, p in module.named_parameters() if p.requires_grad}


def _load_weights(loop: TrainLoop, weights: dict[str, torch.Tensor], folder: Path) -> None:
    module = _module(loop)
    if _sharded(loop):
        set_model_state_dict(module, weights, options=_FULL)
        return
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    missing = sorted(set(params) - set(weights))
    if missing:
        raise FinetuneError(f"{folder / TRAIN_STATE} does not hold the trained weight {missing[0]} "
                            f"({len(missing)} missing): it was saved from another model or adapter",
                            hint="resume with the recipe that started the run, or start it again")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])


def _optimizer_state(loop: TrainLoop) -> tuple[dict, bool]:
    """The optimizer's state, whole; True when keyed by parameter name (FSDP) rather than by position."""
    if _sharded(loop):
        return get_optimizer_state_dict(loop.model, _raw_optimizer(loop), options=_GATHER), True
    return _raw_optimizer(loop).state_dict(), False


def save_checkpoint(loop: TrainLoop, root: Path, save_total_limit: int | None = None) -> str:
    """Write checkpoint-<step> of `loop` under `root` (every process calls it; rank 0 writes the shared
    files); keep the newest `save_total_limit`. Weights that are already NaN/inf are never saved."""
    step = loop.state.step
    if not weights_finite(loop):
        loop.diverged(step, "the trained weights hold NaN/inf")
    main = loop.rank == 0
    staging = stage(root) if main else root / STAGING
    _barrier(loop)
    name = f"checkpoint-{step}"
    folder = staging / name
    try:
        module = _module(loop)
        weights = _weights(loop)
        optimizer, by_name = _optimizer_state(loop)
        if main:
            folder.mkdir(parents=True, exist_ok=True)
            if hasattr(module, "peft_config"):  # the standard adapter files, usable as any saved adapter
                module.save_pretrained(folder, state_dict=weights, safe_serialization=True)
            torch.save({"format": FORMAT, "weights": weights, "optimizer": optimizer, "optimizer_by_name": by_name,
                        **loop.state_dict()}, folder / TRAIN_STATE)
        _barrier(loop)
        torch.save(saveable(rng_state()), folder / rng_file(loop.rank))
        if main:
            checkpoint_fault(folder, step)  # test hook; a no-op unless its env var is set
        _barrier(loop)
        if main:
            publish(folder, root / name)
        _barrier(loop)
    except Exception as exc:  # noqa: BLE001 - only a write failure is reported; anything else is raised again
        reason = _write_failure(exc, root)
        if reason is None:
            raise
        shutil.rmtree(staging, ignore_errors=True)  # give the space back for status.json
        last = numbered(root)
        kept = f"{last[0].name} is kept and can be resumed" if last else "no earlier checkpoint exists"
        raise CheckpointWriteError(
            f"cannot write checkpoint {step} in {root}: {reason}; {kept}",
            hint="free disk space or fix the folder's permissions, then run again with --resume") from None
    if main:
        shutil.rmtree(staging, ignore_errors=True)
        if save_total_limit:
            for old in numbered(root)[save_total_limit:]:
                shutil.rmtree(old, ignore_errors=True)
    return str(root / name)


def load_checkpoint(loop: TrainLoop, folder: Path) -> None:
    """Put `loop` back to the state saved in `folder` (at any number of processes)."""
    register_safe_globals()  # GaLore/APOLLO projectors in the optimizer state
    state: dict[str, Any] = torch.load(folder / TRAIN_STATE, map_location="cpu", weights_only=True)
    if state.get("format") != FORMAT:
        raise FinetuneError(f"{folder} was written by another version of finetune (train state format "
                            f"{state.get('format')}, this version reads {FORMAT})",
                            hint="resume it with the version that wrote it, or start the run again")
    module = _module(loop)
    _load_weights(loop, state["weights"], folder)
    if state["optimizer_by_name"]:
        set_optimizer_state_dict(module, _raw_optimizer(loop), state["optimizer"], options=_FULL)
    else:
        _raw_optimizer(loop).load_state_dict(state["optimizer"])
    loop.load_state_dict(state)
    own = folder / rng_file(loop.rank)
    path = own if own.is_file() else folder / rng_file(0)  # more processes now than when it was saved
    set_rng_state(torch.load(path, map_location="cpu", weights_only=True))
