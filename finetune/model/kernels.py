"""Faster kernels where they run: Liger Kernel's fused kernels on CUDA, and the per-layer torch.compile on CUDA and
the CPU, with what the planner prices them at and when it picks them.

More in docs/training.md, "Kernels in the code (finetune/model/kernels.py)".
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetune.errors import RecipeError
from finetune.recipe.families import family_for

# Liger's end-to-end figures (its README: Llama-3-8B, +20% throughput), what the planner prices `liger` at until
# the GPU kit measures them; the fused loss itself is priced as the chunked loss it replaces (memory and time).
LIGER_SPEEDUP = 1.20
# The kernels a family's apply function may take, all switched on (`cross_entropy`, the unfused-head loss, is
# left off: the fused loss replaces it).
KERNEL_ARGS = ("rope", "rms_norm", "swiglu", "geglu", "fused_linear_cross_entropy")


# training.compile per device: (step speedup, steps after which the compile time is repaid). CPU: measured by
# benchmarks/compile.py on a tiny dense model, the slower of two runs (1.25x, a cold compile of 166 s repaid
# after 978 steps; results/compile-cpu.txt: 1.40x, 604 steps); CUDA: declared (torchtune reports compiled QLoRA gains of this order) until the GPU kit
# measures compile on and off. A checkpointed layer runs uncompiled (a graph break: see compile_pays), so
# neither figure applies there.
COMPILE: dict[str, tuple[float, int]] = {"cpu": (1.25, 1000), "cuda": (1.15, 200)}


def liger_installed() -> bool:
    """Whether liger-kernel and triton can be imported (the `cuda` extra)."""
    return all(importlib.util.find_spec(name) is not None for name in ("liger_kernel", "triton"))


def liger_function(model_type: str) -> Callable[..., None] | None:
    """Liger's public per-model entry point for a transformers model_type (None: the family is not covered)."""
    import liger_kernel.transformers as liger

    return getattr(liger, f"apply_liger_kernel_to_{model_type}", None)


def lora_on_head(adapter: Any) -> bool:
    """Whether the recipe's adapter puts a LoRA on the LM head (which Liger's fused loss would skip)."""
    targets = adapter.target_modules
    return adapter.type != "full" and (targets == "lm_head" or isinstance(targets, list) and "lm_head" in targets)


def _config_model_type(model_path: str) -> str | None:
    """model_type of a local config.json (torch-free), None for a hub id."""
    file = Path(model_path).expanduser()
    file = file / "config.json" if file.is_dir() else file
    if file.suffix != ".json" or not file.is_file():
        return None
    data = json.loads(file.read_text())
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else None
    return data.get("model_type") if text is None or data.get("model_type") else text.get("model_type")


def liger_problem(recipe: Any, cuda: bool) -> str | None:
    """Why `memory.kernels: liger` cannot run this recipe here (one clause), None where it can."""
    if not cuda:
        return "Liger's Triton kernels run on CUDA GPUs and torch sees none"
    if not liger_installed():
        return "liger-kernel (with triton) is not installed"
    if lora_on_head(recipe.adapter):
        return ("adapter.target_modules puts a LoRA on lm_head, which Liger's fused linear cross-entropy would skip "
                "(it multiplies by the head's base weight)")
    model_type = _config_model_type(recipe.model.path)
    if model_type is not None and liger_function(model_type) is None:
        return f"Liger has no kernels for {model_type} models"
    return None


def check_kernels(recipe: Any) -> None:
    """`memory.kernels: liger` refused before any model loads (finetune.api.preflight) where it cannot run."""
    if recipe.memory.kernels != "liger":
        return
    import torch

    problem = liger_problem(recipe, torch.cuda.is_available())
    if problem is not None:
        raise RecipeError(f"memory.kernels: liger: {problem}",
                          hint="set memory.kernels: none (or auto: Liger where it runs), or install the cuda extra "
                               "on a CUDA machine: pip install -c finetune/constraints.txt -e \".[cuda]\"")


def kernel_choices(recipe: Any, device: str) -> list[str]:
    """What `memory.kernels: auto` may become: liger where it runs (CUDA, installed, family covered, no LoRA on
    the head), else none."""
    return ["none", "liger"] if liger_problem(recipe, device == "cuda") is None else ["none"]


def causal_lm(model: Any) -> Any:
    """The transformers model under peft's wrappers (its LoRA layers stay injected)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def apply_kernels(model: Any, kernels: str, only: tuple[str, ...] = KERNEL_ARGS) -> list[str]:
    """Apply the resolved `memory.kernels` to a loaded (peft-wrapped or plain) model in place; returns the
    kernels switched on (those of `only` that the family's function takes). `only`: a subset, for the
    CPU tests that run the kernels Triton's interpreter can run."""
    if kernels != "liger":
        return []
    inner = causal_lm(model)
    model_type = inner.config.model_type
    function = liger_function(model_type)
    if function is None:
        raise RecipeError(f"memory.kernels: liger: Liger has no kernels for {model_type} models",
                          hint="set memory.kernels: none")
    accepted = inspect.signature(function).parameters
    chosen = {name: name in only for name in KERNEL_ARGS if name in accepted}
    function(**chosen, **({"cross_entropy": False} if "cross_entropy" in accepted else {}), model=inner)
    return [name for name, on in chosen.items() if on]


def kernel_speedup(settings: Any, device: str) -> float:
    """The step speedup the planner prices `settings`' kernels and compile at (1: none)."""
    speed = LIGER_SPEEDUP if settings.kernels == "liger" else 1.0
    compiled = settings.compile and not settings.activation_checkpointing
    return speed * (COMPILE.get(device, (1.0, 0))[0] if compiled else 1.0)


def planned_steps(recipe: Any) -> int | None:
    """The run's optimizer steps where the recipe gives them (training.max_steps) or they can be counted
    without reading the data (one record a line in .jsonl files, or data.path entries' `records`); None
    otherwise. Counted at a fixed effective batch (or micro-batch x accumulation), else one sequence a step."""
    training = recipe.training
    if training.max_steps is not None:
        return training.max_steps
    records = 0
    for entry in recipe.data.files():
        path = Path(entry.path).expanduser()
        if entry.records is not None:
            records += entry.records
        elif path.suffix == ".jsonl" and path.is_file():
            with path.open("rb") as f:
                records += sum(1 for line in f if line.strip())
        else:
            return None
    batch = training.effective_batch_size if isinstance(training.effective_batch_size, int) else (
        training.micro_batch_size * training.gradient_accumulation_steps
        if isinstance(training.micro_batch_size, int) and isinstance(training.gradient_accumulation_steps, int)
        else 1)
    return max(1, int(records * training.epochs) // batch)


def compile_pays(recipe: Any, device: str) -> bool:
    """What `training.compile: auto` becomes: on where compiling can run here and the run's steps reach twice
    COMPILE's break-even count, off for short runs and runs of unknown length, for mixture-of-experts models
    (their routing breaks the graph: benchmarks/compile.py measured the compiled MoE step slower) and with
    activation checkpointing on (transformers' checkpointed layer sets a context variable, a side effect dynamo
    will not replay in the recompute: the layer breaks the graph and runs uncompiled)."""
    if compile_problem(device, recipe.memory.offload_experts) is not None or device not in COMPILE \
            or recipe.memory.activation_checkpointing is True:
        return False
    model_type = _config_model_type(recipe.model.path)
    family = family_for(model_type) if model_type is not None else None
    if family is not None and family.experts is not None:
        return False
    steps = planned_steps(recipe)
    return steps is not None and steps >= 2 * COMPILE[device][1]


def cxx_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would use ($CXX, else g++ or clang++ on PATH), or None."""
    import os
    import shutil

    return next((c for c in (os.environ.get("CXX"), "g++", "clang++") if c and shutil.which(c)), None)


def compile_problem(device: str, offload_experts: str = "none") -> str | None:
    """Why training.compile cannot run here (one clause), None where it can: on the CPU without a C++ compiler
    (inductor's CPU backend builds C++), and with memory.offload_experts (the expert store swaps weights in from
    a reader thread during forward, which a compiled graph cannot follow)."""
    if device == "cpu" and cxx_compiler() is None:
        return "torch.compile on the CPU needs a C++ compiler (g++, clang++ or $CXX) and none is on PATH"
    if offload_experts != "none":
        return (f"memory.offload_experts: {offload_experts} swaps the experts in during forward, which a compiled "
                "graph cannot follow")
    return None


def check_compile(recipe: Any) -> None:
    """`training.compile: true` refused before any model loads (finetune.api.preflight) where it cannot run."""
    if recipe.training.compile is not True:
        return
    import torch

    problem = compile_problem("cuda" if torch.cuda.is_available() else "cpu", recipe.memory.offload_experts)
    if problem is not None:
        raise RecipeError(f"training.compile: {problem}", hint="set training.compile: false (or auto)")
