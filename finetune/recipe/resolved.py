"""A recipe resolved for a run: every planner-decided setting has its value, typed (`Settings`, no `auto`).

`Plan.apply` returns one; `finetune run` builds and trains from one, so nothing downstream re-checks a
setting with int(...), bool(...) or `is True`. Torch-free (the recipe layer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from finetune.recipe import settings as table_module
from finetune.recipe.settings import Settings, inactive_settings, read_settings, table

if TYPE_CHECKING:
    from finetune.recipe.schema import Recipe


@dataclass(frozen=True)
class RunConfig:
    """`recipe` with its settings resolved (recipe.yaml and the builders read the recipe; the loop and the
    policies read `settings`)."""

    recipe: Recipe
    settings: Settings

    @property
    def batch_auto(self) -> bool:
        """effective_batch_size: auto: the batch follows the measured noise scale during the run."""
        return self.recipe.training.effective_batch_size == "auto"


def resolve(recipe: Recipe) -> RunConfig:
    """The run config of a recipe whose planner-decided settings are all set (ValueError naming the keys
    still `auto`: plan it first). A setting that does not apply (distributed.strategy with one process)
    takes its default."""
    values, inactive = read_settings(recipe), inactive_settings(recipe)
    left = [s.key for s in table() if values[s.name] == "auto" and s.name not in inactive]
    if left:
        raise ValueError(f"{', '.join(left)} still auto: plan the recipe first (finetune.plan.predict)")
    typed = table_module.Settings  # the table as it is now (a test may widen it)
    defaults = {f.name: f.default for f in dataclasses.fields(typed)}
    return RunConfig(recipe, typed(**{name: defaults[name] if name in inactive else value
                                      for name, value in values.items()}))
