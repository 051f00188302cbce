"""Several processes (GPUs, nodes): the world from the launcher's environment, accelerate's settings for the
recipe's `distributed.strategy`, rank-0-only writes, and `finetune run --gpus N`.

The engine is accelerate's, driven by the training loop (finetune/train/loop.py) through `Accelerator`:
DDP, FSDP2 (`FullyShardedDataParallelPlugin` version 2) or DeepSpeed ZeRO (optional dependency). torchrun and `accelerate launch` set
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR; with them set, `finetune run` joins that world.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from finetune.errors import FinetuneError
from finetune.recipe.schema import Recipe

WORLD_ENV = "WORLD_SIZE"
T = TypeVar("T")


def world_size() -> int:
    """Processes in the job as the launcher says (1 when started without torchrun / accelerate launch)."""
    try:
        return max(1, int(os.environ.get(WORLD_ENV, "1")))
    except ValueError:
        return 1


def rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def is_main() -> bool:
    """Rank 0 writes the run directory; the other processes only train."""
    return rank() == 0


def join(recipe: Recipe) -> None:
    """Check the recipe against the launcher's world and start the process group (gloo on CPU, nccl on CUDA)
    through accelerate, before the model is loaded, so each process loads onto its own GPU."""
    world = world_size()
    if world != recipe.distributed.gpus:
        raise FinetuneError(
            f"distributed.gpus={recipe.distributed.gpus} but the launcher started {world} process(es)",
            hint="leave distributed.gpus to the launcher: `finetune run` sets it from WORLD_SIZE, or use "
                 "`finetune run RECIPE --gpus N`")
    check_available(recipe)
    if world > 1:
        from accelerate import PartialState

        PartialState(cpu=not torch.cuda.is_available())


def check_available(recipe: Recipe) -> None:
    """What the schema cannot see: an optional engine that is not installed."""
    d = recipe.distributed
    if d.gpus > 1 and d.strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise FinetuneError("distributed.strategy=deepspeed but the deepspeed package is not installed",
                            hint="pip install deepspeed (it needs a CUDA toolkit to build its ops), or use "
                                 "distributed.strategy: fsdp (FSDP2, part of torch)")


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def on_main(make: Callable[[], T]) -> T:
    """`make()` run by rank 0 alone, its result given to every process (the other ranks raise rank 0's
    FinetuneError, so all stop with its message): preparing the run directory, and the plan, which must
    be one for all (each rank's own free GPU memory could otherwise choose another micro-batch)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return make()
    box: list[Any] = [None]
    if is_main():
        try:
            box[0] = make()
        except FinetuneError as exc:
            box[0] = exc
            torch.distributed.broadcast_object_list(box, src=0)
            raise
    torch.distributed.broadcast_object_list(box, src=0)
    if isinstance(box[0], FinetuneError):
        raise box[0]
    return box[0]


def decoder_layer_classes(model: torch.nn.Module) -> list[str]:
    """Class names of the model's repeated blocks: FSDP2's units (`transformer_layer_cls_to_wrap`)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    base = getattr(model, "get_base_model", lambda: model)()
    names |= set(getattr(base, "_no_split_modules", None) or [])
    present = {type(m).__name__ for m in model.modules()}
    return sorted(names & present)


def accelerator_plugins(recipe: Recipe, model: torch.nn.Module | None, micro_batch: int) -> dict[str, Any]:
    """accelerate's plugin for the strategy (nothing with one process or DDP, which is accelerate's default
    with several).

    fsdp: FSDP2 over each decoder layer, FULL_STATE_DICT so the saved model is whole (loadable without FSDP;
    finetune.train.train_state gathers checkpoints whole too, resumable at any world size). deepspeed: ZeRO
    stage and optimizer-state offload; the loop accumulates itself, so DeepSpeed steps every update with
    `micro_batch` rows per process (and clips, as accelerate leaves clipping to it)."""
    d = recipe.distributed
    if d.gpus == 1 or d.strategy == "ddp":
        return {}
    if d.strategy == "fsdp":
        from accelerate import FullyShardedDataParallelPlugin

        layers = decoder_layer_classes(model) if model is not None else []
        return {"fsdp_plugin": FullyShardedDataParallelPlugin(
            fsdp_version=2, reshard_after_forward=True, state_dict_type="FULL_STATE_DICT",
            auto_wrap_policy="transformer_based_wrap" if layers else "no_wrap", cpu_ram_efficient_loading=False,
            **({"transformer_cls_names_to_wrap": layers} if layers else {}))}
    from accelerate import DeepSpeedPlugin

    zero: dict[str, Any] = {"stage": d.zero_stage, "overlap_comm": True, "contiguous_gradients": True}
    if d.deepspeed_offload != "none":
        zero["offload_optimizer"] = {"device": d.deepspeed_offload, "pin_memory": True,
                                     **({"nvme_path": d.deepspeed_nvme_path} if d.deepspeed_nvme_path else {})}
    from finetune.step.training_step import mixed_precision

    precision = mixed_precision(recipe.model.dtype, torch.cuda.is_available())
    return {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config={
        "zero_optimization": zero, "zero_allow_untested_optimizer": True,
        "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
        "gradient_clipping": recipe.training.max_grad_norm or 0.0, "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"}})}


def launch(argv: list[str], gpus: int) -> int:
    """`finetune run ... --gpus N`: start N local processes with torchrun running `finetune run ...` (argv
    without --gpus); each joins the world from the environment. Returns torchrun's exit code."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
               "-m", "finetune", *argv]
    # In its own session, so that Ctrl-C reaches the ranks once: this process (Ctrl-C, or the UI's stop)
    # passes SIGINT/SIGTERM to torchrun, which passes it to every rank; each saves its part of a checkpoint
    # and stops, as one process does (torchrun kills ranks still running 30 s later).
    child = subprocess.Popen(command, start_new_session=True)
    previous = {sig: signal.signal(sig, lambda signum, frame: child.send_signal(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
