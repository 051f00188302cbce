"""The base of every recipe section: unknown keys are errors, values are plain (no `true` for a number, no
empty string), numbers finite. Its own module so that section types outside schema.py (the rewards list,
finetune/recipe/rewards.py) and schema.py, which uses them, share it without an import cycle."""

from __future__ import annotations

import math
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

MAX_DEPTH = 16  # sections hold keys hold lists: 4 levels are used, the rest is room (YAML and Python data alike)


class Section(BaseModel):
    """Base for recipe sections: unknown keys are errors, assignments are validated, numbers are finite."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=False,
                              allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _plain_values(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse what pydantic's lax mode would let through: true for a number, .inf, "", NUL, []."""
        field = cls.model_fields[info.field_name]
        _check_value(value, bool in _leaf_types(field.annotation))
        return value


def _leaf_types(annotation: Any) -> set[Any]:
    """Every type or literal value a field annotation admits (bool for a `bool` field)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return {type(a) if isinstance(a, bool) else a for a in typing.get_args(annotation)}
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        args = typing.get_args(annotation)
        return set().union(*(_leaf_types(a) for a in (args[:1] if origin is typing.Annotated else args)))
    return {annotation}


def _check_value(value: Any, bool_ok: bool, depth: int = 2) -> None:
    """`depth`: the value's level in the recipe (a section's key is 2); a list nested past MAX_DEPTH is refused
    here, before anything recurses through it (api.validate takes Python data that no YAML reader checked)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested more than {MAX_DEPTH} levels deep; a recipe is sections of keys")
    if isinstance(value, bool) and not bool_ok:
        raise ValueError(f"expected a number or a name here, not {str(value).lower()}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be a finite number, not {value}")
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("must not be empty; remove the key (or write null) for the default")
        if "\x00" in value:
            raise ValueError("must not contain a NUL character")
    if isinstance(value, list | tuple):
        if not value:
            raise ValueError("must not be an empty list; remove the key for the default")
        for item in value:
            _check_value(item, bool_ok=False, depth=depth + 1)
