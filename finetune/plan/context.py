"""Whether the recipe's context length can be planned at all: data.max_seq_len against the model's own limit
and against the data's longest record, checked before the planner's search (which would price an impossible
length for a minute and answer only that nothing fits), and a vision model's image tokens counted as the
planner counts them, so the preflight refuses images too long for max_seq_len."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from finetune.recipe.schema import Recipe

if TYPE_CHECKING:
    from finetune.data.build import TokenCounter


def check_context(recipe: Recipe) -> None:
    """Refuse, before the planner's search, a data.max_seq_len above the model's own limit (its config's
    max_position_embeddings: positions it never saw), naming the limit and how long the data's records are;
    otherwise the search prices the impossible length for a minute and answers only that nothing fits. A
    config that cannot be read yet (a hub id not downloaded) is checked by the plan's own reading of it."""
    from finetune.errors import RecipeError
    from finetune.plan.trace import planned_config

    try:
        text = planned_config(recipe.model.path, recipe.model.trust_remote_code).get_text_config()
    except Exception:  # noqa: BLE001 - the plan reads it again and reports what is wrong with it
        return
    limit = getattr(text, "max_position_embeddings", None)
    if isinstance(limit, int) and recipe.data.max_seq_len > limit:
        longest = longest_example(recipe)
        data = f"; {longest.text}" if longest else ""
        raise RecipeError(f"data.max_seq_len {recipe.data.max_seq_len:,} is above the model's own limit of {limit:,} "
                          f"positions (max_position_embeddings of {recipe.model.path}){data}",
                          hint=f"set data.max_seq_len to at most {limit:,}; the longest example's length is "
                               "enough (longer ones are cut or dropped, as data.truncation says)")


def context_note(recipe: Recipe) -> str | None:
    """For a plan where nothing fits: a line saying data.max_seq_len is far (4x) above the data's longest
    record, the length a step's memory grows with, or None."""
    longest = longest_example(recipe)
    if longest is None or recipe.data.max_seq_len <= 4 * longest.tokens:
        return None
    return (f"data.max_seq_len {recipe.data.max_seq_len:,} is far above the data's longest example ({longest.text}): "
            "a max_seq_len near that needs far less memory")


class Longest(NamedTuple):
    """The data's longest example: its tokens (or a bound on them) and how a message says it."""

    tokens: int
    text: str


def longest_example(recipe: Recipe) -> Longest | None:
    """The longest training example's tokens, counted with the model's own tokenizer where the plan reads the
    data here (finetune.plan.data: tokenized once, cached under the data fingerprint), else bounded by its
    record's bytes of JSON; None where the data cannot be read (the preflight says why)."""
    try:
        from finetune.plan.search import planned_data
        from finetune.plan.trace import planned_config

        shape = planned_data(recipe, planned_config(recipe.model.path, recipe.model.trust_remote_code)).shape
    except Exception:  # noqa: BLE001 - no tokenizer or config here: the bound from the bytes below
        shape = None
    if shape is not None:
        return Longest(shape.longest, f"the longest example of {recipe.data.label()} has {shape.longest:,} tokens")
    longest = longest_record_bytes(recipe)
    if longest is None:
        return None
    return Longest(longest, f"the longest record of {recipe.data.label()} is {longest:,} bytes of JSON, so at most "
                            f"about {longest:,} tokens")


def longest_record_bytes(recipe: Recipe) -> int | None:
    """The longest record of the data as UTF-8 JSON, in bytes: a bound on its tokens (a token holds at least
    one byte of its text; keys, quotes and braces outweigh a chat template's few markers) read in the time
    it takes to read the file, without a tokenizer. None where the data cannot be read (preflight says why)."""
    import json

    from finetune.data.mix import read_files
    from finetune.errors import FinetuneError

    try:
        values = [r.value for f in read_files(recipe.data) for r in f.read.records]
    except FinetuneError:
        return None
    return max((len(json.dumps(v, ensure_ascii=False).encode()) for v in values), default=None)


def image_token_counter(model_path: str, trust_remote_code: bool = False) -> TokenCounter | None:
    """A vision-language model's image tokens for a record's image sizes at a pixel budget, as the planner counts
    them (its config and preprocessor_config.json: finetune.plan.vision), so the preflight can refuse images too
    long for max_seq_len from their headers; None where the config cannot be read yet (a hub id not downloaded:
    the data build checks those records)."""
    from finetune.plan.trace import planned_config, real_config
    from finetune.plan.vision import image_tokens, planned_grids

    try:
        config = real_config(planned_config(model_path, trust_remote_code))
    except Exception:  # noqa: BLE001 - not readable before loading: the build's check remains
        return None
    seen: dict[tuple, int] = {}

    def count(sizes: list[tuple[int, int]], max_pixels: int | None) -> int:
        key = (tuple(sizes), max_pixels)
        if key not in seen:
            seen[key] = sum(image_tokens(config, g) for g in planned_grids(config, model_path, sizes, max_pixels))
        return seen[key]
    return count
