"""The one error type users see: a problem and its fix, printable on one line."""

from collections.abc import Sequence
from typing import Any


class LlmoptError(Exception):
    """A user-facing failure. `fix` tells the user what to do about it."""

    def __init__(self, problem: str, fix: str = "") -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem} -- {fix}" if fix else problem)

    def one_line(self) -> str:
        return " ".join(str(self).split())


def first_invalid(errors: Sequence[Any], skip: frozenset[str] = frozenset()) -> tuple[str, str]:
    """The first problem of a validation error (pydantic's or FastAPI's `errors()`), for a one-line
    message: the field's dotted path ('' where the object as a whole was refused), and what is wrong."""
    first = errors[0]
    where = ".".join(str(p) for p in first.get("loc", ()) if p not in skip)
    what = "unknown key" if first.get("type") == "extra_forbidden" else first.get("msg", "invalid")
    return where, what.removeprefix("Value error, ")
