"""How a generated answer is scored against the expected one: exact, contains and numeric match.

Text is compared after trimming, case folding and collapsing whitespace, so "Paris." and " paris. " agree on
exact; contains asks whether the expected text appears inside the answer; numeric compares the last number of
each (commas as thousands separators ignored), and is None when the expected answer holds no number.
"""

from __future__ import annotations

import math
import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
KINDS = ("exact", "contains", "numeric")


def _norm(text: str) -> str:
    return " ".join(text.casefold().split())


def last_number(text: str) -> float | None:
    """The last number written in `text`, or None."""
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def score(answer: str, expected: str) -> dict[str, bool | None]:
    """{"exact", "contains", "numeric"} for one generated answer."""
    want = last_number(expected)
    got = last_number(answer)
    return {
        "exact": _norm(answer) == _norm(expected),
        "contains": _norm(expected) in _norm(answer),
        "numeric": None if want is None else got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9),
    }
