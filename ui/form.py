"""The recipe form, generated from the schema: one widget per recipe key, values to and from a recipe dict.

The schema (`finetune.recipe.schema.Recipe`) is the only source of keys, types, defaults and hints, so a
key added there shows up here without touching the UI.
"""

from __future__ import annotations

import json
import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from pydantic import BeforeValidator
from pydantic.fields import FieldInfo

from finetune.errors import RecipeError
from finetune.recipe import init_from
from finetune.recipe.load import iter_fields, load_yaml
from finetune.recipe.schema import SHAPE_KEYS
from finetune.recipe.settings import table
from finetune.units import size_text

Kind = Literal["checkbox", "number", "dropdown", "text", "bytes", "yaml"]
NULL = "null"
_OMIT = object()  # an empty widget: leave the key out so the schema's default (or "missing") applies


@dataclass(frozen=True)
class FieldSpec:
    """How one recipe key is shown and read back."""

    key: str
    kind: Kind
    description: str
    nullable: bool = False
    required: bool = False
    integer: bool = False
    choices: tuple[tuple[str, Any], ...] = ()  # (shown text, recipe value) for dropdowns
    custom: bool = False  # dropdown also accepts a typed value (an int where `auto` is a choice)
    default: Any = None  # the schema's default (None for a required key)
    planned: bool = False  # the planner decides it when it is `auto` (finetune/recipe/settings.py)

    @property
    def section(self) -> str:
        return self.key.split(".", 1)[0]

    @property
    def name(self) -> str:
        return self.key.rsplit(".", 1)[-1]

    @property
    def step(self) -> float:
        """The arrows' step of a number widget: 1 for whole numbers; for a decimal, a tenth of its default's
        leading digit (learning rate 2e-4 steps by 1e-5, warmup_ratio 0.03 by 0.001), 0.01 without one."""
        if self.integer:
            return 1
        if not isinstance(self.default, int | float) or not self.default:
            return 0.01
        return 10.0 ** (math.floor(math.log10(abs(self.default))) - 1)

    @property
    def elem_id(self) -> str:
        return "field-" + self.key.replace(".", "-")

    @property
    def placeholder(self) -> str:
        """What an empty text box means, for people: "required", the default the key then takes, or what its
        null does, in the schema description's own words ("null: at the end" -> "empty: at the end")."""
        if self.required:
            return "required"
        if not self.nullable:  # left out of the recipe: the schema's default applies
            shown = size_text(self.default) if self.kind == "bytes" and isinstance(self.default, int) \
                else to_widget(self, self.default)
            return f"empty: the default, {shown or NULL}"
        if said := _NULL_MEANS.search(self.description):
            return "empty: " + " ".join(said.group(1).replace("`", "").split())
        return "empty: none"

    @property
    def info(self) -> str:
        """The hint under the widget: what the key does, its default, and whether the planner picks it."""
        default = "none (required)" if self.required else _show(self.default)
        if self.kind == "bytes" and isinstance(self.default, int):
            default = format_size(self.default)
        text = f"{self.description} Default: {default}."
        if self.planned:
            text += " Planner-decided when auto" + (" (the default)." if self.default == "auto" else ".")
        return text


# What a description says null (or the default) means: "null: at the end", "null trains for `epochs`", "null
# disables clipping", "default: the tokenizer's, else ...": its first clause, without a parenthesis or a comma.
_NULL_MEANS = re.compile(r"\b(?:null|default):?\s+(.+?)\s*(?:[;:(,]|\.(?:\s|$)|$)")


def _flatten(annotation: Any) -> list[Any]:
    """The members of a (nested) union, with Literal values expanded to ('literal', value) pairs."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _flatten(arg)]
    if origin is Literal:
        return [("literal", v) for v in typing.get_args(annotation)]
    return [annotation]


def _is_bytes(annotation: Any, field: FieldInfo) -> bool:
    metas = list(field.metadata)
    for member in _flatten(annotation):
        if typing.get_origin(member) is typing.Annotated:
            metas.extend(typing.get_args(member)[1:])
    return any(isinstance(m, BeforeValidator) for m in metas)


def _show(value: Any) -> str:
    if value is None:
        return NULL
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def field_spec(key: str, field: FieldInfo) -> FieldSpec:
    """Pick the widget for one schema field from its type annotation."""
    members = _flatten(field.annotation)
    literals = [m[1] for m in members if isinstance(m, tuple)]
    bases = {m for m in members if not isinstance(m, tuple) and m is not type(None)}
    nullable = type(None) in members
    default = None if field.is_required() else field.get_default(call_default_factory=True)
    common = dict(key=key, description=field.description or "", nullable=nullable, required=field.is_required(),
                  default=list(default) if isinstance(default, tuple) else default,
                  planned=key in {s.key for s in table()})
    if _is_bytes(field.annotation, field):
        return FieldSpec(kind="bytes", **common)
    if bases == {bool} and not literals:
        return FieldSpec(kind="checkbox", **common)
    if literals and bases <= {bool, int}:
        values = ([True, False] if bool in bases else []) + literals + ([None] if nullable else [])
        return FieldSpec(kind="dropdown", choices=tuple((_show(v), v) for v in values), custom=int in bases,
                         integer=int in bases, **common)
    if bases in ({int}, {float}) and not literals and not nullable:  # a Number widget cannot be empty
        return FieldSpec(kind="number", integer=bases == {int}, **common)
    if bases == {str} and not literals:
        return FieldSpec(kind="text", **common)
    return FieldSpec(kind="yaml", **common)


def form_specs() -> list[FieldSpec]:
    """Every recipe key in schema order (sections in YAML order)."""
    return [field_spec(key, field) for key, field, is_section in iter_fields() if not is_section]


def sections() -> list[tuple[str, str]]:
    """(section name, description) in schema order."""
    return [(key, field.description or "") for key, field, is_section in iter_fields() if is_section]


def _empty(spec: FieldSpec) -> Any:
    return None if spec.nullable else _OMIT


def from_widget(spec: FieldSpec, raw: Any) -> Any:
    """A widget's value as the recipe value it stands for (`_OMIT` for an empty widget)."""
    if spec.kind == "checkbox":
        return bool(raw)
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return _empty(spec)
    if spec.kind == "number":
        return int(raw) if spec.integer and float(raw).is_integer() else float(raw)
    if spec.kind == "dropdown":
        shown = dict(spec.choices)
        if raw in shown:
            return shown[raw]
        return _parse_yaml(str(raw))
    if spec.kind == "text":
        return raw
    if spec.kind == "bytes":
        return int(raw) if str(raw).strip().isdigit() else raw.strip()
    return _parse_yaml(str(raw))


def _parse_yaml(text: str) -> Any:
    try:
        return load_yaml(text, "a form field")[0]
    except RecipeError:
        return text  # the schema then names the key and says what it expected


def to_widget(spec: FieldSpec, value: Any) -> Any:
    """A recipe value as the widget shows it."""
    if spec.kind == "checkbox":
        return bool(value)
    if spec.kind == "number":
        return value
    if spec.kind == "dropdown":
        return _show(value)
    if value is None:
        return ""
    if spec.kind == "bytes":
        return format_size(value) if isinstance(value, int) else str(value)
    if spec.kind == "text":
        return str(value)
    if isinstance(value, str):  # as typed, unless YAML would read it as something else (`a: b`, `#x`, `1.0`)
        return value if _parse_yaml(value) == value else json.dumps(value, ensure_ascii=False)
    dumped = yaml.safe_dump(list(value) if isinstance(value, tuple) else value, default_flow_style=True,
                            width=math.inf)  # one line: the widget is a one-line text box
    return dumped.strip().removesuffix("...").strip()


def format_size(n: int) -> str:
    """An exact byte count in the largest binary unit that divides it: 1048576 -> 1MiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def values_to_dict(specs: list[FieldSpec], values: list[Any]) -> dict[str, Any]:
    """Widget values (in spec order) -> the nested recipe mapping the CLI would read from YAML.

    Every widget shows a value, but with adapter.init_from set the adapter's shape keys (schema.SHAPE_KEYS:
    r, alpha, ...) still at the schema's default are left out, as a YAML recipe would leave them: the saved
    adapter's shape fills them, while a default written out would be a different shape, refused."""
    read = [(spec, from_widget(spec, raw)) for spec, raw in zip(specs, values, strict=True)]
    starts = any(spec.key == init_from.KEY and value not in (None, _OMIT) for spec, value in read)
    data: dict[str, Any] = {}
    for spec, value in read:
        if value is _OMIT or (starts and spec.section == "adapter" and spec.name in SHAPE_KEYS
                              and value == spec.default):
            continue
        node = data
        *parents, last = spec.key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return data


def dict_to_values(specs: list[FieldSpec], data: dict[str, Any]) -> list[Any]:
    """A (validated, fully resolved) recipe mapping -> widget values in spec order."""
    out = []
    for spec in specs:
        node: Any = data
        for part in spec.key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out.append(to_widget(spec, node))
    return out
