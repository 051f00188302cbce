"""User-facing errors: the CLI prints these without a traceback and exits non-zero."""

from __future__ import annotations

from typing import Any, Literal

# What is wrong with one recipe key, for code that acts on it (the UI); the message says it for people.
# missing: a required key is not given; unknown_key: no such key (a typo); key_name: a key that is no name;
# duplicate: a key given twice; section: a value where a section of keys goes; type: a value of the wrong
# type; value: a value of the right type that is not allowed (a range, a choice, a rule between keys).
ProblemCode = Literal["missing", "unknown_key", "key_name", "duplicate", "section", "type", "value"]


class RecipeProblem(str):
    """One problem of a recipe: the line shown to people (the string itself, as before it had fields), the
    recipe `key` it concerns (dotted, "" for the whole recipe) and its `code` (ProblemCode). A str, so every
    reader of `FinetuneError.problems` (joins, `in`, JSON) keeps working; immutable like one."""

    key: str
    code: ProblemCode

    def __new__(cls, message: str, key: str, code: ProblemCode) -> RecipeProblem:
        self = super().__new__(cls, message)
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "code", code)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"RecipeProblem is immutable: cannot set {name}")

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (gradio queues, multiprocessing) keep the fields
        return RecipeProblem, (str(self), self.key, self.code)


class FinetuneError(Exception):
    """A problem the user can fix (bad recipe, bad data, missing file).

    `problems` holds one line per problem so several can be reported at once (a recipe's: `RecipeProblem`s).
    """

    exit_code = 1

    def __init__(self, message: str, problems: list[str] | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.problems = problems or []
        self.hint = hint

    def __str__(self) -> str:
        lines = [self.message, *(f"  - {p}" for p in self.problems)]
        if self.hint:
            lines.append(self.hint)
        return "\n".join(lines)


class UsageError(FinetuneError):
    """A command-line argument (or the UI field behind one) that is wrong: a size without a unit, a folder that
    is not a finished run. Exit code 2, as argparse gives for the arguments it checks itself."""

    exit_code = 2


class RecipeError(UsageError):
    """The recipe does not validate; exit code 2 as for any usage error."""


class DataError(FinetuneError):
    """A dataset file or record is malformed."""

    exit_code = 3


class ModelLoadError(FinetuneError):
    """The model cannot be found or loaded."""

    exit_code = 4
