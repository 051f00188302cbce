"""env.json of a run: the versions and device it ran on (here, not in finetune.rundir, because it asks torch)."""

from __future__ import annotations

import os
import platform


def environment_summary() -> dict:
    """Versions and device, so a result can be reproduced and compared."""
    import importlib.metadata as md

    import torch

    versions = {}
    for pkg in ("finetune", "torch", "transformers", "peft", "trl", "accelerate", "datasets", "bitsandbytes"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    env = {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
           "packages": versions, "cuda": torch.version.cuda, "device": "cpu"}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device="cuda", gpu=props.name, gpu_memory_bytes=props.total_memory)
    return env
