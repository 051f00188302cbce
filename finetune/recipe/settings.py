"""The settings the planner decides, each tied to its recipe key in one typed table: the `Settings` fields.

The schema's `auto` keys, the planner's search, `Plan.apply`, `finetune measure` and resume
(`finetune.train.run.keep_resolved`) all read and write recipes through this table, so a new searched
setting is one field here (then its choices in plan/search.py and its price in plan/memory_model.py and
plan/cost_model.py). Torch-free: the schema imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from finetune.recipe.schema import Recipe


def _setting(key: str, label: str, *, fallback: Any = None, default: Any = dataclasses.MISSING,
             active: Callable[[Recipe], bool] | None = None) -> Any:
    """A `Settings` field stored at recipe `key` ("section.field"), shown as `label` in plan tables.

    fallback: the value `auto` takes when the model cannot be planned; only for settings whose plain value
    is always correct (None: a plan is needed to resolve `auto`). active: whether the setting matters for a
    recipe (None: always); an inactive one is neither planned nor written (its `default` stands for it)."""
    return dataclasses.field(default=default, metadata={"key": key, "label": label, "fallback": fallback,
                                                        "active": active})


def _several_processes(recipe: Recipe) -> bool:
    return recipe.distributed.gpus > 1


def _streams(recipe: Recipe) -> bool:
    """Weight streaming: frozen weights in one process (auto with full training or target_experts: none)."""
    return recipe.distributed.gpus == 1 and recipe.adapter.type != "full" and not recipe.adapter.target_experts


def _may_stream(recipe: Recipe) -> bool:
    """The streaming's own settings (read-ahead, resident layers) matter only where weights may stream."""
    return _streams(recipe) and recipe.memory.offload_weights != "none"


def _generates(recipe: Recipe) -> bool:
    return recipe.training.spec.generates


def _batches_rows(recipe: Recipe) -> bool:
    return not recipe.training.spec.generates  # grpo's rows are prompts: random (the schema refuses the rest)


def takes_images(recipe: Recipe) -> bool:
    """Whether model.path is a vision-language model (its config.json, read torch-free; a hub name: no)."""
    from pathlib import Path

    from finetune.errors import FinetuneError
    from finetune.recipe.families import check_config_file

    try:
        family = check_config_file(Path(recipe.model.path).expanduser())
    except (FinetuneError, OSError):
        return False
    return family is not None and family.vision is not None


@dataclasses.dataclass(frozen=True)
class Settings:
    """One concrete configuration the planner can evaluate (no `auto` left)."""

    micro_batch_size: int = _setting("training.micro_batch_size", "mb")
    gradient_accumulation_steps: int = _setting("training.gradient_accumulation_steps", "ga")
    activation_checkpointing: bool = _setting("memory.activation_checkpointing", "ckpt")
    checkpoint_every_n_layers: int = _setting("memory.checkpoint_every_n_layers", "every")
    offload: str = _setting("memory.offload", "offload")  # none or a tier of finetune.recipe.offload_tiers
    chunked_loss: bool = _setting("memory.chunked_loss", "chunked", fallback=False)
    bits: int | None = _setting("quantization.bits", "bits")
    optimizer: str = _setting("optimizer.name", "optimizer")
    tiled_mlp: bool = _setting("memory.tiled_mlp", "tiled", fallback=False, default=False)
    offload_experts: str = _setting("memory.offload_experts", "experts", fallback="none",
                                    default="none")  # none or a tier of finetune.recipe.offload_tiers
    offload_weights: str = _setting("memory.offload_weights", "stream", fallback="none", default="none",
                                    active=_streams)  # none or a tier: finetune.memory.weight_store
    # decoder layers weight streaming reads ahead (finetune.plan.weight_stream prices the window and the time)
    offload_weights_ahead: int = _setting("memory.offload_weights_ahead", "ahead", fallback=1, default=1,
                                          active=_may_stream)
    # the first decoder layers weight streaming leaves on the device (finetune.plan.weight_stream)
    offload_weights_resident: int = _setting("memory.offload_weights_resident", "resident", fallback=0, default=0,
                                             active=_may_stream)
    strategy: str = _setting("distributed.strategy", "strategy", fallback="ddp", default="ddp",
                             active=_several_processes)  # with one process there is nothing to distribute
    # completions per generate call (None: the step's all, what an out-of-memory recovery starts halving from)
    generation_batch_size: int | None = _setting("grpo.generation_batch_size", "gen", fallback=None, default=None,
                                                 active=_generates)
    # fused kernels (finetune.model.kernels): none or liger, whose fused loss replaces the chunked loss
    kernels: str = _setting("memory.kernels", "kernels", fallback="none", default="none")
    # per-layer torch.compile: on where the run's steps repay the compile time (finetune.model.kernels)
    compile: bool = _setting("training.compile", "compile", fallback=False, default=False)
    # a vision-language model's image pixel budget (None: the image processor's own limit)
    max_pixels: int | None = _setting("data.max_pixels", "pixels", default=None, active=takes_images)
    # how examples become micro-batches (finetune.data.batching); without a plan nothing prices the others
    batching: str = _setting("data.batching", "batching", fallback="random", default="random",
                             active=_batches_rows)


    @property
    def loss_without_logits(self) -> bool:
        """Whether the full logits never exist: the chunked loss, or Liger's fused linear cross-entropy that
        replaces it (priced alike)."""
        return bool(self.chunked_loss) or self.kernels == "liger"


class Setting(NamedTuple):
    name: str  # the Settings field, also the key in a plan's `settings`
    key: str  # where the recipe holds it: "section.field"
    label: str
    fallback: Any
    active: Callable[[Recipe], bool] | None = None

    def applies(self, recipe: Recipe) -> bool:
        """Whether the setting matters for `recipe` (distributed.strategy only with several processes)."""
        return self.active is None or self.active(recipe)


def table() -> list[Setting]:
    """The rows of the table, in field order."""
    return [Setting(f.name, f.metadata["key"], f.metadata["label"], f.metadata["fallback"], f.metadata["active"])
            for f in dataclasses.fields(Settings)]


def inactive_settings(recipe: Recipe) -> set[str]:
    """Names of the settings that do not matter for `recipe`: not planned, not written by Plan.apply."""
    return {s.name for s in table() if not s.applies(recipe)}


def read_settings(recipe: Recipe) -> dict[str, Any]:
    """Each setting's value in `recipe` by name, `auto` included."""
    out = {}
    for s in table():
        section, field = s.key.split(".")
        out[s.name] = getattr(getattr(recipe, section), field)
    return out


def write_settings(recipe: Recipe, values: Mapping[str, Any], *, validate: bool = True) -> Recipe:
    """A validated copy of `recipe` with `values` (by setting name; names not given stay) at their keys.

    validate=False: an unchecked copy, about ten times cheaper, for reading a combination's values (the
    planner checks each candidate's strategy on it); never write or run such a copy."""
    changes: dict[str, dict[str, Any]] = {}
    for s in table():
        if s.name in values:
            section, field = s.key.split(".")
            changes.setdefault(section, {})[field] = values[s.name]
    if not validate:
        return recipe.model_copy(update={section: getattr(recipe, section).model_copy(update=fields)
                                         for section, fields in changes.items()})
    from finetune.recipe.load import recipe_data

    data = recipe_data(recipe)
    for section, fields in changes.items():
        data[section].update(fields)
    return recipe.model_validate(data)


def auto_settings(recipe: Recipe) -> list[str]:
    """The names of the settings `recipe` leaves to the planner."""
    inactive = inactive_settings(recipe)
    return [name for name, value in read_settings(recipe).items() if value == "auto" and name not in inactive]


def auto_keys(recipe: Recipe) -> list[str]:
    """The recipe keys ("section.field") left to the planner."""
    keys = {s.name: s.key for s in table()}
    return [keys[name] for name in auto_settings(recipe)]


def auto_choices(recipe: Recipe, values: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe keys ("section.field") `recipe` leaves to the planner, each with the value it got in
    `values` (by setting name: a plan's `settings`), so what was chosen automatically can be named with its
    value."""
    keys = {s.name: s.key for s in table()}
    return {keys[name]: values[name] for name in auto_settings(recipe) if name in values}


def format_choices(choices: Mapping[str, Any]) -> list[str]:
    """`key=value` per choice, the value as a recipe writes it (true, null)."""
    def text(value: Any) -> str:
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    return [f"{key}={text(value)}" for key, value in choices.items()]
