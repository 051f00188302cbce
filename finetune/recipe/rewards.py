"""The reward functions of a GRPO run, as typed configs: the `rewards` list and the trust key for user code.

Torch-free like the rest of the recipe layer, so the UI's form and `finetune keys` can read it. The scoring lives
in finetune/rl/rewards.py. Each entry picks a `kind`:

- answer: the completion's answer (inside `<tag>...</tag>`, or the first group of `pattern`) against the
  record's `field`, compared as text (`exact`) or as numbers (`numeric`, within `tolerance`); 1 or 0.
- format: 1 when `pattern` is found in the completion, else 0 (e.g. "the answer is inside <answer> tags").
- length: 1 when the completion's length in characters lies within [min_chars, max_chars], else 0.
- python: the user's function `file.py:function`, called as TRL calls reward functions, with the prompts, the
  completions and every field of the records as keyword lists; it runs code from a file, so it is refused unless
  `trust_python_code: true` (and, in the web UI, unless the server allows it: finetune/rl/rewards.py).

The rewards are summed with their `weight`s into one reward per completion.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from finetune.errors import RecipeError
from finetune.recipe.section import Section

KINDS = ("answer", "format", "length", "python")
_FUNCTION = re.compile(r"^[^:]+\.py:[A-Za-z_][A-Za-z0-9_]*$")


def _pattern(value: str | None) -> str | None:
    if value is not None:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"is not a valid regular expression ({exc})") from None
    return value


class _Reward(Section):
    weight: float = Field(1.0, description="How much this reward counts in the sum (negative: a penalty).")


class AnswerReward(_Reward):
    kind: Literal["answer"] = Field(description="The completion's answer against the record's answer field.")
    tag: str | None = Field(None, description="The answer is the text inside the last <tag>...</tag> (null and no "
                                              "pattern: answer).", pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$")
    pattern: str | None = Field(None, description="Instead of a tag: a regular expression whose first group (or "
                                                  "whole match) is the answer; the last match counts.")
    field: str = Field("answer", description="The record's field that holds the right answer.")
    compare: Literal["exact", "numeric"] = Field(
        "exact", description="exact: the same text (spaces around ignored); numeric: the same number.")
    tolerance: float = Field(1e-6, ge=0, description="numeric: the largest difference that still counts as equal.")

    _check_pattern = field_validator("pattern")(classmethod(lambda cls, v: _pattern(v)))

    @model_validator(mode="after")
    def _one_extractor(self) -> AnswerReward:
        if self.pattern is not None and self.tag is not None:
            raise ValueError("give either tag or pattern, not both")
        return self


class FormatReward(_Reward):
    kind: Literal["format"] = Field(description="1 when the completion contains a match of pattern.")
    pattern: str = Field(description="A regular expression searched in the completion (dot matches newlines).")

    _check_pattern = field_validator("pattern")(classmethod(lambda cls, v: _pattern(v)))


class LengthReward(_Reward):
    kind: Literal["length"] = Field(description="1 when the completion's length is within the bounds.")
    min_chars: int | None = Field(None, ge=0, description="Shortest completion, in characters, that scores.")
    max_chars: int | None = Field(None, ge=1, description="Longest completion, in characters, that scores.")

    @model_validator(mode="after")
    def _bounds(self) -> LengthReward:
        if self.min_chars is None and self.max_chars is None:
            raise ValueError("give min_chars, max_chars or both")
        if self.min_chars is not None and self.max_chars is not None and self.min_chars > self.max_chars:
            raise ValueError(f"min_chars {self.min_chars} is above max_chars {self.max_chars}")
        return self


class PythonReward(_Reward):
    kind: Literal["python"] = Field(description="Your own function, called as TRL calls reward functions.")
    function: str = Field(description="file.py:function, the file relative to the recipe's folder.")

    @field_validator("function")
    @classmethod
    def _reference(cls, value: str) -> str:
        if not _FUNCTION.match(value):
            raise ValueError("must be file.py:function_name, e.g. my_rewards.py:score")
        return value


def _kind(value: Any) -> Any:
    """The union's tag, read before validation (Section's checks run on every field, `kind` included)."""
    return value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)


Reward = Annotated[Annotated[AnswerReward, Tag("answer")] | Annotated[FormatReward, Tag("format")]
                   | Annotated[LengthReward, Tag("length")] | Annotated[PythonReward, Tag("python")],
                   Discriminator(_kind)]


class RewardsConfig(Section):
    rewards: list[Reward] = Field(description="The reward functions, summed with their weights.")
    trust_python_code: bool = Field(False, description="Run kind: python rewards (code from your files).")

    @model_validator(mode="after")
    def _trusted(self) -> RewardsConfig:
        if problem := self.untrusted():
            raise ValueError(problem)
        return self

    def python_keys(self, prefix: str = "") -> list[str]:
        """The keys of the kind python rewards (`grpo.rewards[1]`): the ones that run the user's code."""
        return [f"{prefix}rewards[{i}]" for i, r in enumerate(self.rewards or []) if isinstance(r, PythonReward)]

    def python_files(self, prefix: str = "") -> list[tuple[str, str]]:
        """(key, file) of each kind python reward's file (`grpo.rewards[1].function`, the part before `:`)."""
        return [(f"{prefix}rewards[{i}].function", r.function.rpartition(":")[0])
                for i, r in enumerate(self.rewards or []) if isinstance(r, PythonReward)]

    def untrusted(self, prefix: str = "") -> str | None:
        """Why the kind python rewards may not run (trust_python_code is off), keys prefixed with `prefix`
        (`grpo.` in a recipe); None when they may."""
        untrusted = self.python_keys(prefix)
        if not untrusted or self.trust_python_code:
            return None
        return (f"{', '.join(untrusted)}: kind python runs code from your files; set {prefix}trust_python_code: "
                f"true if you trust it, or use a built-in kind ({', '.join(KINDS[:-1])})")


def validate_rewards(data: Any, source: str = "recipe") -> RewardsConfig:
    """The rewards section, or RecipeError with one line per problem naming its key (`rewards[1].pattern`)."""
    try:
        return RewardsConfig.model_validate(data)
    except ValidationError as exc:
        problems = [f"{source}: {_describe(err)}" for err in exc.errors()]
        raise RecipeError(f"{source}: the rewards are not valid ({len(problems)} problem(s)):", problems) from None


def _describe(err: dict[str, Any]) -> str:
    """`rewards[1].pattern: is not a valid regular expression (...) (got '(')`: the key as written in YAML."""
    key, after_index = "", False
    for part in err["loc"]:
        if isinstance(part, int):
            key += f"[{part}]"
            after_index = True
        elif not (after_index and part in KINDS):  # pydantic names the union member after the index: not a key
            key += f".{part}" if key else str(part)
            after_index = False
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return f"{key}: unknown key"
    if err["type"] == "missing":
        return f"{key}: missing"
    if err["type"] == "union_tag_invalid":
        return f"{key}.kind: must be one of {', '.join(KINDS)} (got {err['input'].get('kind')!r})"
    if err["type"] == "union_tag_not_found":
        return f"{key}: missing kind (one of {', '.join(KINDS)})"
    shown = "" if isinstance(err.get("input"), dict) else f" (got {err.get('input')!r})"
    return f"{key}: {msg}{shown}" if key else msg
