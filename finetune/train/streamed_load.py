"""Loading a model whose frozen weights stream (memory.offload_weights, memory.offload_experts: cpu or disk):
each layer's weights go into the weight store as they arrive (`finetune.memory.weight_store.stream_on_arrival`),
so the model is never whole on the device. For training (`streamed_load`) and for using a finished run
(`streamed_use`: generate, compare, eval and chat load the base as the run trained it, so a model that trained
only streamed can be used on the same card; finetune.api hands it to finetune.model.trained.loaded).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from finetune.console import console
from finetune.recipe.resolved import resolve
from finetune.recipe.schema import Recipe
from finetune.recipe.settings import Settings


def _stream_of(settings: Settings) -> tuple[str, str, int, int]:
    """(which store: weights or experts, its tier, its read-ahead, the layers it leaves on the device) of
    resolved `settings`."""
    if settings.offload_weights != "none":
        return "weights", settings.offload_weights, settings.offload_weights_ahead, settings.offload_weights_resident
    return "experts", settings.offload_experts, 1, 0


def streamed_load(recipe: Recipe, settings: Settings, offload_root: Path) -> AbstractContextManager | None:
    """memory.offload_weights (or memory.offload_experts) cpu or disk: the load that puts each layer's weights
    (experts) into the weight store as they arrive, its host RAM and disk checked first against what the planner
    prices; None without either. `offload_root`: the run directory (the disk tier's default folder is there)."""
    from finetune.memory.offload import offload_dir_for
    from finetune.memory.weight_store import EXPERTS, WEIGHTS, host_room, stream_on_arrival
    from finetune.plan.search import model_spec
    from finetune.plan.trace import planned_config
    from finetune.plan.weight_stream import host_bytes

    which, tier, ahead, resident = _stream_of(settings)
    if tier == "none":
        return None
    kind = WEIGHTS if which == "weights" else EXPERTS
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        planned = host_bytes(model_spec(recipe, planned_config(recipe.model.path, recipe.model.trust_remote_code),
                                        device), settings)
    except Exception as exc:  # noqa: BLE001 - a model the planner cannot trace: RAM checked as it fills
        console.print(f"{kind.key}: no price for this model's weights ({type(exc).__name__}): host RAM is checked "
                      "as they load, the disk as they are written", markup=False)
        planned = (0, 0)
    directory = offload_dir_for(recipe.memory, offload_root) if tier == "disk" else None
    return stream_on_arrival(tier, ahead, host_room(recipe.memory.offload_cpu_limit), directory, planned, kind,
                             resident)


@dataclass
class StreamedUse:
    """A finished run's base loaded as it trained: `arriving` (None: whole) goes to the load, `attach` completes
    the store on the loaded model (finetune.model.trained.loaded does both)."""

    recipe: Recipe
    root: Path
    arriving: AbstractContextManager | None
    stores: list = field(default_factory=list)

    def attach(self, model: torch.nn.Module) -> None:
        """The store's hooks on `model`'s layers (what did not arrive through the load joins it)."""
        if self.arriving is None:
            return
        from finetune.memory.offload import offload_dir_for
        from finetune.memory.weight_store import EXPERTS, WEIGHTS, host_room, offload_weights

        which, tier, ahead, resident = _stream_of(resolve(self.recipe).settings)
        directory = offload_dir_for(self.recipe.memory, self.root) if tier == "disk" else None
        self.stores.append(offload_weights(model, tier, ahead, host_room(self.recipe.memory.offload_cpu_limit),
                                           directory, WEIGHTS if which == "weights" else EXPERTS, resident))


@contextmanager
def streamed_use(recipe: Recipe, root: Path) -> Iterator[StreamedUse]:
    """Load a finished run's base (recipe: the run's resolved recipe, root: its directory) through the weight
    store where the run streamed it; the store closes (its files go) when the block ends."""
    try:
        settings = resolve(recipe).settings
    except ValueError:  # a recipe still auto (not what a run writes): loaded whole
        settings = None
    use = StreamedUse(recipe, root, streamed_load(recipe, settings, root) if settings is not None else None)
    try:
        yield use
    finally:
        for store in use.stores:
            if store is not None:
                store.close()
