"""Recipe reference generated from the schema: `finetune keys` and docs/recipe.md share this text."""

from __future__ import annotations

import typing

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from finetune.recipe.load import iter_fields
from finetune.units import size_text


def type_text(annotation) -> str:
    """A short human spelling of a field type: `int | auto`, `lora | dora | full`."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join("null" if a is None else str(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(type_text(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        base, *metadata = typing.get_args(annotation)
        sized = any(type(m).__name__ == "BeforeValidator" for m in metadata) or "size" in metadata
        return "size (e.g. 12GiB)" if sized else type_text(base)
    if origin in (list, tuple):
        return f"{origin.__name__}[{', '.join(type_text(a) for a in typing.get_args(annotation) if a is not ...)}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo, sized: bool = False) -> str:
    """The default as a recipe would spell it; `sized`: a byte size, in units (512 MiB, not 536870912)."""
    if field.default is PydanticUndefined and field.default_factory is None:
        return "(required)"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if sized and isinstance(value, int):
        return size_text(value)
    return str(value)


def reference_rows(section: str | None = None) -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every leaf key, optionally within one section."""
    rows = []
    for key, field, is_section in iter_fields():
        if is_section or (section and not key.startswith(section + ".")):
            continue
        annotation = field.annotation
        if field.metadata and any(type(m).__name__ == "BeforeValidator" for m in field.metadata):
            annotation = typing.Annotated[int, "size"]
        typ = type_text(annotation)
        rows.append((key, typ, default_text(field, sized=typ.startswith("size")), field.description or ""))
    return rows


def reference_markdown() -> str:
    lines = ["# Recipe reference", "",
             "Generated from `finetune/recipe/schema.py` by `finetune keys --markdown`; do not edit by hand.", "",
             "| key | type | default | description |", "| --- | --- | --- | --- |"]
    for key, typ, default, desc in reference_rows():
        cells = [f"`{key}`", typ, f"`{default}`", desc]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


TYPE_COLUMN = 24  # wrapped: a long type (the reward list, the optimizer names) wraps within this width
NARROW = 32  # wrapped: below this many columns for descriptions, each description goes under its key


def reference_text(section: str | None = None, width: int | None = None) -> str:
    """`finetune keys`: key, type, default, description. Without `width` (stdout is a pipe or a file) one line
    per key, its four fields separated by tabs, nothing padded, cut or wrapped, so `finetune keys | grep` finds
    a key with its whole description, `cut -f` takes a column, and a pager's lines are as long as their text
    (padding to the widest type made them hundreds of characters); with `width` (a terminal's) aligned columns
    where every line fits it: the type and description wrap within their columns, or, where the description
    column would be narrower than NARROW, each description goes under its key, indented."""
    import itertools
    import textwrap

    header = ("key", "type", "default", "description")
    rows = [header, *reference_rows(section)]
    if width is None:
        return "".join("\t".join(row) + "\n" for row in rows)
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    width = max(width, 20)  # narrower than any real terminal: lines may overflow it
    widths[1] = min(widths[1], TYPE_COLUMN)
    described = width - sum(widths) - 6
    out = []
    for row in rows:
        if described < NARROW:
            cells = [textwrap.wrap("  ".join(row[:3]), width, subsequent_indent="    ") or [""],
                     textwrap.wrap(row[3], width, initial_indent="    ", subsequent_indent="    ",
                                   break_on_hyphens=False)]
            out += [line.rstrip() + "\n" for line in itertools.chain(*cells)]
            continue
        cells = [textwrap.wrap(text, w, break_on_hyphens=False) or [""]
                 for text, w in zip(row, [*widths, described], strict=True)]
        for parts in itertools.zip_longest(*cells, fillvalue=""):
            out.append("  ".join([*(c.ljust(w) for c, w in zip(parts[:3], widths, strict=True)), parts[3]]).rstrip()
                       + "\n")
    return "".join(out)
