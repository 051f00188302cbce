""""module:attribute" references: how the torch-free registries (optimizers, offload tiers) name code that
is imported only when a run builds it."""

from __future__ import annotations

import importlib
from typing import Any


def resolve(reference: str) -> Any:
    """The object `reference` ("module:attribute") names, imported now, not when the registry is."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)
