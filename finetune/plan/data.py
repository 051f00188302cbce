"""The data a plan is made for: the recipe's examples, read and tokenized before the plan.

Why: the run pads each micro-batch to its longest row, so the largest batch it forms is made of the longest
example, not of data.max_seq_len tokens; a plan made for max_seq_len is 2x high on short data and picks
settings (micro-batch, tiled MLP, chunked loss) for rows that never come. Where the data cannot be tokenized
before the run (no tokenizer on this machine: a config.json alone, a hub id not downloaded; the data not
there), the plan keeps max_seq_len, an upper bound, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.data.shape import DataShape
from finetune.errors import FinetuneError
from finetune.recipe.schema import Recipe
from finetune.units import cache_dir

if TYPE_CHECKING:
    from finetune.data.build import DataRead


@dataclass(frozen=True)
class PlannedData:
    """The data's shape (None where it could not be read) and, then, why: the note the plan carries."""

    shape: DataShape | None
    note: str | None = None
    # the data as read and tokenized for this plan, for a run's build to take over (`read_data(keep_read=True)`
    # only: the planner's cache keeps the shape, never the records and their tokens)
    read: DataRead | None = None


def _stamps(recipe: Recipe) -> tuple:
    """The data files' and the model folder's versions: an edited file is read again in the same process."""
    data = recipe.data
    files = [data.path] if isinstance(data.path, str) else [f.path for f in data.path]
    out = []
    for f in [*files, recipe.model.path]:
        try:
            s = Path(f).expanduser().stat()
            out.append((f, s.st_mtime_ns, s.st_size))
        except OSError:
            out.append((f, None, None))
    return tuple(out)


def read_data(recipe: Recipe, takes_images: bool, planner: Any, keep_read: bool = False) -> PlannedData:
    """The recipe's training examples as `finetune.data.build.data_shape` measures them with the model's own
    tokenizer (never downloaded or converted here), remembered by `planner` per data (but data.max_pixels and
    data.batching, which the shape does not depend on: a plan per pixel budget, an out-of-memory re-plan of the
    chosen settings read nothing again) and file versions, and cached on disk under the data fingerprint; else
    a PlannedData with the reason in its note. Prompt-only data (grpo) is sized by its generation settings: no
    shape, no note. `keep_read`: read now, and the PlannedData keeps the data as read and tokenized (`read`),
    which `finetune run` hands to its build."""
    if recipe.training.spec.generates:
        return PlannedData(None)
    key = (recipe.data.model_dump_json(exclude={"max_pixels", "batching"}), recipe.model.path,
           recipe.model.revision, recipe.training.method, recipe.training.seed, takes_images, _stamps(recipe))
    if not keep_read:  # the planner's cache keeps the shape, never the records and their tokens
        return planner.data.get_or_compute(key, lambda: replace(_read(recipe, takes_images), read=None))
    planned = _read(recipe, takes_images)
    planner.data.get_or_compute(key, lambda: replace(planned, read=None))
    return planned


def _read(recipe: Recipe, takes_images: bool) -> PlannedData:
    from finetune.data.build import data_read, data_shape
    from finetune.model.load import local_tokenizer

    bound = f"planned for data.max_seq_len {recipe.data.max_seq_len:,} (an upper bound)"
    tokenizer, why = local_tokenizer(recipe.model)
    if tokenizer is None:
        return PlannedData(None, f"{bound}: the data was not tokenized before the plan: {why}")
    try:
        read = data_read(recipe.data, recipe.training.method)
        shape = data_shape(recipe.data, tokenizer, recipe.training.seed, recipe.training.method, takes_images,
                           cache=cache_dir() / "data_shapes", read=read)
    except FinetuneError as exc:
        return PlannedData(None, f"{bound}: the data could not be read before the plan: {exc.message}")
    return PlannedData(shape, read=read)
