"""docs/architecture.md's "How to add ..." lists for a training method and a model family, checked against the
registries: each is a short list, every file, module, function and recipe key it names exists, and it mentions
every field of the registry entry it asks for (a field added to `MethodSpec` or `Family` fails here until the
list says what to give it)."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from finetune.recipe.families import Family
from finetune.recipe.methods import MethodSpec
from finetune.recipe.schema import Recipe

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
MAX_ITEMS = 8  # a short list: a reader holds it in mind while adding the entry

# The "How to add ..." entry, the registry entry class it asks for, the module that holds the registry.
ENTRIES = {
    "A training method": (MethodSpec, "finetune.recipe.methods"),
    "A model family": (Family, "finetune.recipe.families"),
}


def how_to_add(text: str, title: str) -> tuple[str, list[str]]:
    """The entry `title` of the "How to add ..." section: its whole text and its list items (each item's lines
    joined)."""
    section = text.split("### How to add ...", 1)[1].split("\n## ", 1)[0]
    match = re.search(rf"^- \*\*{re.escape(title)}\*\*:(.*?)(?=^- \*\*|\Z)", section, re.S | re.M)
    assert match, f"docs/architecture.md: no '- **{title}**:' entry under 'How to add ...'"
    body = match.group(1)
    items: list[str] = []
    for line in body.splitlines():
        if line.startswith("  - "):
            items.append(line[4:])
        elif line.startswith("    ") and items:
            items[-1] += " " + line.strip()
    return body, items


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _resolves(dotted: str) -> bool:
    """A module, or an attribute of one (`finetune.model.moe.experts_of`)."""
    if _module(dotted) is not None:
        return True
    module, _, attr = dotted.rpartition(".")
    return bool(module) and _module(module) is not None and hasattr(_module(module), attr)


def _module_of_path(token: str) -> str | None:
    return token.removesuffix(".py").replace("/", ".") if token.startswith("finetune/") and token.endswith(".py") \
        else None


def problems(body: str, items: list[str], entry: type, registry: str) -> list[str]:
    """What the entry's text gets wrong about the code (empty: nothing)."""
    found = []
    if not 3 <= len(items) <= MAX_ITEMS:
        found.append(f"a short list of 3 to {MAX_ITEMS} items, not {len(items)}")
    listed = " ".join(items)
    tokens = re.findall(r"`([^`]+)`", body)
    modules = [registry, *(m for t in tokens for m in [_module_of_path(t), t.partition(":")[0] if ":" in t else None,
                                                        t if t.startswith("finetune.") and _module(t) else None] if m)]
    fields = {f.name for f in dataclasses.fields(entry)}
    for token in re.findall(r"`([^`]+)`", listed):
        if " " in token or token.startswith("("):
            continue  # a signature or an example, not a name
        name, _, value = token.partition("=")
        if value:
            if name not in fields:
                found.append(f"`{token}`: {entry.__name__} has no field {name!r}")
            if value in ("True", "False", "None") or value.isdigit():
                continue  # a plain value
            token = value.strip('"')
        token = re.sub(r"\(.*\)$", "", token)
        if "/" in token:
            path = ROOT / token
            if not (path.exists() or "NAME" in token and path.parent.is_dir()):
                found.append(f"`{token}`: no such file")
        elif ":" in token:
            module, _, attr = token.partition(":")
            if _module(module) is None or not hasattr(_module(module), attr):
                found.append(f"`{token}`: cannot import {attr} from {module}")
        elif token.startswith("finetune."):
            if not _resolves(token):
                found.append(f"`{token}`: no such module or name")
        elif "." in token:
            section, _, key = token.partition(".")
            if section not in Recipe.model_fields or key not in Recipe.model_fields[section].annotation.model_fields:
                found.append(f"`{token}`: no such recipe key")
        elif token not in fields and not any(hasattr(_module(m), token) for m in modules if _module(m)):
            found.append(f"`{token}`: neither a field of {entry.__name__} nor a name in {sorted(set(modules))}")
    named = {re.sub(r"=.*", "", t) for t in re.findall(r"`([^`]+)`", listed)}
    found += [f"field `{f}` of {entry.__name__} is not in the list" for f in sorted(fields - named)]
    return found


@pytest.mark.parametrize("title", sorted(ENTRIES))
def test_how_to_add_list_matches_the_registry(title):
    entry, registry = ENTRIES[title]
    body, items = how_to_add(DOC.read_text(), title)
    assert f"`{entry.__name__}`" in body, f"{title}: the list names the entry class {entry.__name__}"
    bad = problems(body, items, entry, registry)
    assert not bad, f"docs/architecture.md, How to add {title.lower()}:\n" + "\n".join(bad)


def test_the_check_catches_a_stale_list():
    """A missing field, a file that is not there, a function a module lacks and a recipe key that does not exist
    are each named; the real entry's text passes."""
    body, items = how_to_add(DOC.read_text(), "A training method")
    stale = body.replace("`whole_batch`", "whole_batch").replace("`simpo_loss`", "`simpo_loss_v2`") \
        .replace("`tests/test_preference_train.py`", "`tests/test_no_such_file.py`") \
        .replace("`training.method`", "`training.no_such_key`")
    bad = problems(stale, how_to_add("### How to add ...\n- **A training method**:" + stale,
                                     "A training method")[1], MethodSpec, "finetune.recipe.methods")
    assert any("whole_batch" in p and "not in the list" in p for p in bad), bad
    assert any("simpo_loss_v2" in p for p in bad) and any("test_no_such_file.py" in p for p in bad), bad
    assert any("training.no_such_key" in p for p in bad), bad
    assert not problems(body, items, MethodSpec, "finetune.recipe.methods")
