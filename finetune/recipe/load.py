"""Read a recipe YAML, apply `--set key=value` overrides, validate, and explain every problem."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from finetune.errors import RecipeError
from finetune.recipe.schema import Recipe


def parse_override(item: str) -> tuple[list[str], Any]:
    """`training.max_steps=10` -> (['training', 'max_steps'], 10); the value is read as YAML."""
    if "=" not in item:
        raise RecipeError(f"bad --set {item!r}", hint="use --set section.key=value, e.g. --set training.max_steps=10")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise RecipeError(f"bad --set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise RecipeError(f"bad --set {item!r}: value is not valid YAML ({exc})") from None
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[path[-1]] = value
    return data


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Map each key path in the YAML to its 1-based line number, for error messages."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, prefix: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                path = (*prefix, str(key_node.value))
                lines[path] = key_node.start_mark.line + 1
                walk(value_node, path)

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, ())
    return lines


def _submodel(model: type[BaseModel], path: tuple[str, ...]) -> type[BaseModel] | None:
    """The pydantic model class found by following `path` from `model` (None if it leaves models)."""
    for part in path:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def describe_errors(exc: ValidationError, source: str, key_lines: dict[tuple[str, ...], int]) -> list[str]:
    """One readable line per bad key: where, what was wrong, and what to write instead."""
    by_key: dict[tuple[str, ...], list[str]] = {}
    given: dict[tuple[str, ...], Any] = {}
    for err in exc.errors():
        # pydantic adds union-branch names such as 'int' or "literal['auto']" to loc; keep only real keys.
        keys = tuple(str(p) for p in err["loc"] if _is_key(str(p)))
        dotted = ".".join(keys) or "(recipe)"
        if err["type"] == "extra_forbidden":
            parent = _submodel(Recipe, keys[:-1])
            choices = list(parent.model_fields) if parent else []
            close = difflib.get_close_matches(keys[-1], choices, n=1, cutoff=0.6)
            prefix = ".".join(keys[:-1])
            msg = f"unknown key {dotted}"
            if close:
                msg += f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?"
            elif choices:
                msg += f"; valid keys here: {', '.join(choices)}"
        elif err["type"] == "missing":
            msg = f"missing required key {dotted}"
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if not isinstance(err.get("input"), dict):
                given[keys] = err.get("input")
        by_key.setdefault(keys, [])
        if msg not in by_key[keys]:
            by_key[keys].append(msg)
    problems = []
    for keys, msgs in by_key.items():
        line = key_lines.get(keys)
        where = f"{source}:{line}: " if line else f"{source}: "
        if keys in given:  # a bad value: union types give one message per branch, joined with "or"
            text = f"{'.'.join(keys) or '(recipe)'}: {' or '.join(msgs)} (got {given[keys]!r})"
            problems.append(where + text)
        else:
            problems.extend(where + m for m in msgs)
    return problems


def _is_key(part: str) -> bool:
    return part.isidentifier() and not part.startswith(("literal", "function")) and part not in {
        "int", "str", "float", "bool", "list", "none", "tuple", "dict", "constrained-int", "constrained-float"}


def validate_recipe(data: Any, source: str = "recipe", text: str | None = None) -> Recipe:
    """Validate a recipe mapping, raising RecipeError with one message per problem."""
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe must be a YAML mapping of sections, got {type(data).__name__}")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        problems = describe_errors(exc, source, _key_lines(text or ""))
        raise RecipeError(f"{source} is not a valid recipe ({len(problems)} problem(s)):", problems) from None
    from finetune.optim.presets import recipe_problems  # combinations only the optimizer package understands

    problems = [f"{source}: {p}" for p in recipe_problems(recipe)]
    if problems:
        raise RecipeError(f"{source} is not a valid recipe ({len(problems)} problem(s)):", problems)
    return recipe


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe file."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    text = path.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path} is not valid YAML: {exc}") from None
    if isinstance(data, dict):
        apply_overrides(data, overrides or [])
    return validate_recipe(data, str(path), text)


def recipe_to_yaml(recipe: Recipe) -> str:
    """The fully resolved recipe as YAML (every key, defaults included)."""
    data = recipe.model_dump(mode="json")
    return yaml.safe_dump(data, sort_keys=False)


def iter_fields(model: type[BaseModel] = Recipe, prefix: str = ""):
    """Yield (dotted key, field info, is_section) over the schema, depth first, for docs, --help and the UI."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield key, field, True
            yield from iter_fields(annotation, key + ".")
        else:
            yield key, field, False
