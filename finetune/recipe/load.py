"""Read a recipe YAML, apply `--set key=value` overrides, validate, and explain every problem."""

from __future__ import annotations

import difflib
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from finetune.errors import ProblemCode, RecipeError, RecipeProblem
from finetune.recipe.schema import SHAPE_KEYS, Recipe
from finetune.recipe.section import MAX_DEPTH

MAX_FILE_BYTES = 1 << 20  # a recipe is a few kilobytes; this bounds parse time and memory
MAX_VALUES = 10_000  # YAML values after alias expansion: a recipe has ~100; refuses "billion laughs" bombs

_LISTED = re.compile(r"^[A-Za-z_]\w*(\[\d+\])*$")  # a key, or a list key with its item's index (rewards[1])
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_MERGE = "tag:yaml.org,2002:merge"
_STR = "tag:yaml.org,2002:str"


class _SafeLoader(_Loader):  # type: ignore[misc, valid-type]
    """SafeLoader whose value errors (a 13th month, a 5,000-digit int) carry the line like any YAML error."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, OverflowError) as exc:
            raise yaml.constructor.ConstructorError(None, None, f"cannot read this value ({exc})",
                                                    node.start_mark) from None


Locations = dict[tuple[str, ...], str]


def _yaml_error(exc: yaml.YAMLError, source: str, text: str, numbered: bool) -> RecipeError:
    """One line: where the YAML broke (the line when `numbered`: not for a --set value) and what the parser says."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if not numbered:
        line = None
    elif mark is not None:
        line = mark.line + 1
    elif isinstance(exc, yaml.reader.ReaderError):
        line = text[:exc.position].count("\n") + 1
    else:
        line = None
    what = getattr(exc, "problem", None) or getattr(exc, "reason", None) or str(exc).splitlines()[0]
    where = f"{source}:{line}" if line else source
    if "nesting depth" in str(what):  # pyyaml >= 6.0.3 (libyaml) stops deep nesting itself, maybe before we do
        return _too_deep(where)
    hint = None if isinstance(exc, yaml.constructor.ConstructorError) else (
        "check the indentation and quoting on that line (YAML needs `key: value`)")
    return RecipeError(f"{where}: not valid YAML: {_clip(what)}", hint=hint)


def _clip(value: Any, n: int = 80) -> str:
    """A user's value made printable (repr) and short for a one-line message; a value nested too deep for
    repr (Python data given to api.validate) is shown to a few levels."""
    try:
        text = repr(value)
    except RecursionError:
        text = reprlib.repr(value)
    return text[:n] + "..." if len(text) > n else text


def _too_deep(where: str) -> RecipeError:
    """The one message for nesting too deep, whether our event check or pyyaml's own limit stopped it."""
    return RecipeError(f"{where}: nested more than {MAX_DEPTH} levels deep; a recipe is sections of keys "
                       "(see `finetune keys`)")


def _check_events(text: str, source: str) -> None:
    """Refuse deep nesting and oversized documents from the parser's event stream, before anything is built
    (composing recurses once per level, and aliases would be expanded by construction)."""
    depth = events = 0
    for event in yaml.parse(text, Loader=_SafeLoader):
        events += 1
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise _too_deep(f"{source}:{event.start_mark.line + 1}")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
        if events > MAX_VALUES:
            raise RecipeError(f"{source}:{event.start_mark.line + 1}: more than {MAX_VALUES} YAML values; "
                              "a recipe is sections of keys (see `finetune keys`)")


class _Checker:
    """Walk the composed node graph once, aliases shared not expanded: key names, duplicates, alias expansion,
    and the line of every key for error messages."""

    def __init__(self, source: str, where: str | None = None):
        self.source, self.where = source, where
        self.locations: Locations = {}
        self.problems: list[RecipeProblem] = []
        self.sizes: dict[int, int] = {}

    def at(self, node: yaml.Node) -> str:
        return self.where or f"{self.source}:{node.start_mark.line + 1}"

    def size(self, node: yaml.Node, path: tuple[str, ...]) -> int:
        """Values under `node` once aliases are expanded (each shared node is walked once)."""
        if id(node) in self.sizes:
            if self.sizes[id(node)] < 0:
                raise RecipeError(f"{self.at(node)}: {'.'.join(path) or '(recipe)'}: an alias refers to itself; "
                                  "write the value out")
            return self.sizes[id(node)]
        self.sizes[id(node)] = -1
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(self.size(item, path) for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += self.mapping(node, path)
        self.sizes[id(node)] = total
        if total > MAX_VALUES:
            raise RecipeError(f"{self.at(node)}: {'.'.join(path) or '(recipe)'}: YAML aliases expand to more than "
                              f"{MAX_VALUES} values; a recipe needs no aliases, write the values out")
        return total

    def mapping(self, node: yaml.MappingNode, path: tuple[str, ...]) -> int:
        seen: dict[str, int] = {}
        total = 0
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == _MERGE:
                total += self.size(value_node, path)
                continue
            name = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key_node.tag != _STR or not (name and name.isascii() and name.isidentifier()):
                shown = _clip(name) if isinstance(name, str) else f"a {type(key_node).__name__[:-4].lower()}"
                self.problems.append(RecipeProblem(
                    f"{self.at(key_node)}: {'.'.join(path) or '(recipe)'}: key {shown} is not a recipe key; keys "
                    "are names of letters, digits and _ (see `finetune keys`)", ".".join(path), "key_name"))
                total += self.size(value_node, path)
                continue
            key = (*path, name)
            if name in seen:
                self.problems.append(RecipeProblem(f"{self.at(key_node)}: {'.'.join(key)}: duplicate key (also on "
                                                   f"line {seen[name]}); the recipe must give it once",
                                                   ".".join(key), "duplicate"))
            seen[name] = line
            self.locations[key] = self.at(key_node)
            total += self.size(value_node, key)
        return total


def load_yaml(text: str, source: str, prefix: tuple[str, ...] = (), where: str | None = None
              ) -> tuple[Any, Locations]:
    """Parse YAML with limits (size, depth, alias expansion, key names, no duplicates): the data, and the
    location of every key ("file:line", or `where` for text that is not a file, such as a --set value, whose
    keys sit under `prefix`). Raises only RecipeError, whatever the text holds."""
    if len(text) > MAX_FILE_BYTES:
        raise RecipeError(f"{source}: {len(text)} characters; a recipe is at most {MAX_FILE_BYTES} bytes")
    checker = _Checker(source, where)
    try:
        _check_events(text, source)
        loader = _SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None:
                checker.size(node, prefix)
                if checker.problems:
                    raise RecipeError(f"{source} is not a valid recipe ({len(checker.problems)} problem(s)):",
                                      checker.problems[:20])
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, source, text, numbered=where is None) from None
    return data, checker.locations


def load_recipe_text(text: str, source: str = "recipe", overrides: list[str] | None = None) -> Recipe:
    """Parse, override and validate recipe YAML given as text (the UI's upload, a file's contents) with the
    same limits as a file; raises only RecipeError."""
    data, locations = load_yaml(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{source}:1: the recipe must be a mapping of sections (model:, data:, ...), "
                          f"not a {type(data).__name__}", hint="see `finetune keys` or recipes/*.yaml")
    apply_overrides(data, overrides or [], locations)
    return validate_recipe(data, source, locations=locations)


def parse_override(item: str) -> tuple[list[str], Any, Locations]:
    """`training.max_steps=10` -> (['training', 'max_steps'], 10, locations); the value is read as YAML with the
    recipe's limits."""
    if "=" not in item:
        raise RecipeError(f"--set {_clip(item)}: expected KEY=VALUE",
                          hint="use --set section.key=value, e.g. --set training.max_steps=10")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise RecipeError(f"--set {_clip(item)}: empty key; use --set section.key=value")
    bad = [p for p in path if not (p.isascii() and p.isidentifier())]
    if bad:
        raise RecipeError(f"--set {_clip(key)}: {_clip(bad[0])} is not a recipe key; keys are names of letters, "
                          "digits and _ (see `finetune keys`)")
    where = "--set"
    value, locations = load_yaml(raw, f"--set {'.'.join(path)}", tuple(path), where) if raw.strip() else (None, {})
    locations[tuple(path)] = where
    return path, value, locations


def apply_overrides(data: dict[str, Any], overrides: list[str], locations: Locations | None = None
                    ) -> dict[str, Any]:
    """Set each `section.key=value` in `data`; their keys' locations become the --set that gave them."""
    for item in overrides:
        path, value, where = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[path[-1]] = value
        if locations is not None:
            locations.update(where)
    return data


def _key_lines(text: str, source: str) -> Locations:
    """Each key path's location in the YAML text, for error messages ({} if the text does not parse)."""
    try:
        return load_yaml(text, source)[1]
    except RecipeError:
        return {}


def _submodel(model: type[BaseModel], path: tuple[str, ...]) -> type[BaseModel] | None:
    """The pydantic model class found by following `path` from `model` (None if it leaves models)."""
    for part in path:
        name, listed, _ = part.partition("[")
        field = model.model_fields.get(name)
        annotation = getattr(field, "annotation", None)
        if listed:  # an item of a list of sections: its section, when the items are of one kind
            items = _item_sections(annotation)
            if len(items) != 1:
                return None
            model = items[0]
            continue
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _code(pydantic_type: str) -> ProblemCode:
    """A pydantic error type as a ProblemCode."""
    named: dict[str, ProblemCode] = {"extra_forbidden": "unknown_key", "missing": "missing", "model_type": "section"}
    if pydantic_type in named:
        return named[pydantic_type]
    return "type" if pydantic_type.endswith(("_type", "_parsing")) else "value"


def describe_errors(exc: ValidationError, source: str, locations: Locations) -> list[RecipeProblem]:
    """One readable line per bad key: where, what was wrong, and what to write instead."""
    by_key: dict[tuple[str, ...], dict[str, ProblemCode]] = {}  # messages in order, each with its code
    given: dict[tuple[str, ...], Any] = {}
    for err in exc.errors():
        keys = _recipe_keys(err["loc"])
        if err["type"] == "extra_forbidden" and keys and keys[-1] != str(err["loc"][-1]):
            keys = (*keys, str(err["loc"][-1]))  # an unknown key of a list item, not taken for a union tag
        dotted = _dotted(keys)
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
        elif err["type"] == "model_type":  # pydantic says "a valid dictionary or instance of ModelConfig"
            msg = f"expected a section, its keys indented below it (see `finetune keys {dotted}`)"
            given[keys] = err.get("input")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if not isinstance(err.get("input"), dict):
                given[keys] = err.get("input")
            elif keys:  # a mapping where a value goes, or a section-wide check: the message still names the key
                msg = f"{dotted}: {msg}"
        by_key.setdefault(keys, {}).setdefault(msg, _code(err["type"]))
    problems = []
    for keys, msgs in by_key.items():
        plain = tuple(k.split("[", 1)[0] for k in keys)  # a list item: the line of its list's key
        known = keys if keys in locations else next(
            (plain[:n] for n in range(len(plain), 0, -1) if plain[:n] in locations), keys)
        where = f"{locations.get(known, source)}: "
        key = ".".join(keys)
        if keys in given:  # a bad value: union types give one message per branch, joined with "or"
            codes = set(msgs.values())
            code: ProblemCode = codes.pop() if len(codes) == 1 else "value"
            problems.append(RecipeProblem(f"{where}{_dotted(keys)}: {' or '.join(msgs)} (got {_clip(given[keys])})",
                                          key, code))
        else:
            problems.extend(RecipeProblem(where + m, key, c) for m, c in msgs.items())
    return problems


def _dotted(keys: tuple[str, ...]) -> str:
    """A key path as the user reads it: `model.path`, a name that is no identifier quoted (`model.'a b'`), a
    list item indexed (`grpo.rewards[1].pattern`)."""
    return ".".join(k if _LISTED.match(k) else _clip(k) for k in keys) or "(recipe)"


def _recipe_keys(loc: tuple[Any, ...]) -> tuple[str, ...]:
    """The recipe keys of a pydantic error location: its parts while they name a section or one of its keys,
    whatever their spelling (a key `int` too); what follows a key is pydantic's (union-branch names such as
    'int' or "literal['auto']", list indices). A list of sections (grpo.rewards) is followed into its items:
    `rewards[1]`, then the item's key, pydantic's name of the item's union member left out."""
    keys: list[str] = []
    model: type[BaseModel] | None = Recipe
    items: list[type[BaseModel]] = []  # the last key is a list of these sections
    for part in loc:
        if items and isinstance(part, int):
            keys[-1] += f"[{part}]"
            continue
        if items:
            owner = next((m for m in items if part in m.model_fields), None)
            if owner is None:  # the union member's tag
                continue
            model, items = owner, []
        if model is None:
            break
        keys.append(str(part))
        field = model.model_fields.get(str(part))
        items = _item_sections(field.annotation) if field is not None else []
        model = _submodel(model, (str(part),))
    return tuple(keys)


def _item_sections(annotation: Any) -> list[type[BaseModel]]:
    """The sections a list-valued key's items may be (`list[Reward] | None` -> the reward kinds); [] otherwise."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] \
        if typing.get_origin(annotation) in (typing.Union, types.UnionType) else [annotation]
    args = [typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a for a in args]  # a tagged member
    lists = [a for a in args if typing.get_origin(a) is list]
    if not lists:
        return []
    found: list[type[BaseModel]] = []
    pending = list(typing.get_args(lists[0]))
    while pending:
        item = pending.pop()
        if isinstance(item, type) and issubclass(item, BaseModel):
            found.append(item)
        elif typing.get_origin(item) is typing.Annotated:
            pending.append(typing.get_args(item)[0])
        else:
            pending.extend(typing.get_args(item))
    return found


def validate_recipe(data: Any, source: str = "recipe", text: str | None = None,
                    locations: Locations | None = None) -> Recipe:
    """Validate a recipe mapping, raising RecipeError with one message per problem.

    `locations` (or the YAML `text`, parsed again) put the file line of each bad key in its message."""
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe must be a YAML mapping of sections, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        if locations is None:
            locations = _key_lines(text or "", source)
        problems = describe_errors(exc, source, locations)
        raise RecipeError(f"{source} is not a valid recipe ({len(problems)} problem(s)):", problems) from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe file; raises only RecipeError, whatever the file holds."""
    path = Path(path)
    try:
        if not path.is_file():
            raise RecipeError(f"recipe file not found: {path}")
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read the recipe ({exc.strerror or exc})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise RecipeError(f"{path}: larger than {MAX_FILE_BYTES} bytes; a recipe is a small YAML file")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise RecipeError(f"{path}:{line}: not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); "
                          "a recipe is a YAML text file saved as UTF-8") from None
    return reward_files_from(load_recipe_text(text, str(path), overrides), path.parent)


def reward_files_from(recipe: Recipe, folder: Path) -> Recipe:
    """grpo.rewards of kind python name their file relative to the recipe's folder (the working directory for a
    recipe without one: the web UI's form): made absolute here, so the run (and its saved recipe.yaml, which
    --resume reads from the run directory) finds the same file."""
    from finetune.recipe.rewards import PythonReward

    rewards = recipe.grpo.rewards or []
    if not any(isinstance(r, PythonReward) for r in rewards):
        return recipe
    def absolute(reward: PythonReward) -> PythonReward:
        file, _, function = reward.function.rpartition(":")
        return reward.model_copy(update={"function": f"{(folder / file).resolve()}:{function}"})

    moved = [absolute(r) if isinstance(r, PythonReward) else r for r in rewards]
    return recipe.model_copy(update={"grpo": recipe.grpo.model_copy(update={"rewards": moved})})


def recipe_data(recipe: Recipe, mode: str = "python") -> dict[str, Any]:
    """`recipe` as a dict that validates back to the same recipe (every key, defaults included), except, with
    adapter.init_from, the adapter shape keys the recipe leaves to the saved adapter: written as defaults they
    would count as set and contradict it. Use it to change a recipe's values and validate it again."""
    unset = set(SHAPE_KEYS) - recipe.adapter.model_fields_set if recipe.adapter.init_from else set()
    return recipe.model_dump(mode=mode, exclude={"adapter": unset})


def recipe_to_yaml(recipe: Recipe) -> str:
    """The fully resolved recipe as YAML (see recipe_data for the adapter shape keys left out)."""
    return yaml.safe_dump(recipe_data(recipe, "json"), sort_keys=False)


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
