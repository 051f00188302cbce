"""The random number streams a step draws from (Python, NumPy, torch CPU and CUDA): taken and put back so a
retried step and a resumed run draw exactly what an uninterrupted run draws. `saveable` turns a state into
plain values and tensors, so a checkpoint holding it loads with torch's weights-only loader (taking a state
stays free of tensor operations: it is taken in every step)."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def saveable(state: dict) -> dict:
    """`state` with NumPy's key array as a tensor (weights-only loadable)."""
    kind, keys, pos, has_gauss, cached = state["numpy"]
    return {**state, "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]}


def set_rng_state(state: dict) -> None:
    """Put back a state from rng_state() or, loaded from a checkpoint, from saveable()."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    if isinstance(keys, torch.Tensor):
        keys = keys.numpy().astype(np.uint32)
    np.random.set_state((kind, keys, pos, has_gauss, cached))
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
