"""The one place the UI parses YAML text from the page (an uploaded recipe, a form field's value).

It is a stop-gap: finetune.recipe.load is getting limits on size, nesting and alias expansion (a 700-byte
alias bomb must be refused in milliseconds); when it offers a text-parsing function, this module calls it.
"""

from __future__ import annotations

from typing import Any

import yaml

from finetune.errors import RecipeError

MAX_BYTES = 1 << 20  # a recipe is a few KiB; anything this big is a mistake or an attack


def parse_yaml(text: str, source: str) -> Any:
    """The YAML value of `text`; RecipeError (naming `source`) when it is too big or not YAML."""
    if len(text) > MAX_BYTES:
        raise RecipeError(f"{source} is {len(text):,} characters long: a recipe is at most {MAX_BYTES:,}")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{source} is not valid YAML: {exc}") from None
