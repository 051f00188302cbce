"""User-facing errors: the CLI prints these without a traceback and exits non-zero."""

from __future__ import annotations


class FinetuneError(Exception):
    """A problem the user can fix (bad recipe, bad data, missing file).

    `problems` holds one line per problem so several can be reported at once.
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


class RecipeError(FinetuneError):
    """The recipe does not validate; exit code 2 as for any usage error."""

    exit_code = 2


class UsageError(FinetuneError):
    """Command-line options that contradict each other (argparse's own errors exit 2 too)."""

    exit_code = 2


class DataError(FinetuneError):
    """A dataset file or record is malformed."""

    exit_code = 3


class ModelLoadError(FinetuneError):
    """The model cannot be found or loaded."""

    exit_code = 4
