"""How the studio answers a user's mistake: the SDK's problem and fix as JSON (or a page), with 404
for a name in the URL that does not exist, 400 for anything else wrong with the input, and 502 when
an endpoint the studio relays to fails. A user never sees a 500 for what they typed."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from llmopt.errors import LlmoptError, first_invalid

T = TypeVar("T")


class Problem(BaseModel):
    """Every error the studio answers with: what went wrong, and what to do about it."""

    error: str
    fix: str = ""


class NotFound(LlmoptError):
    """A record named in the URL does not exist (the SDK says so with an LlmoptError)."""


class Upstream(LlmoptError):
    """A server the studio relays to (an endpoint) did not answer as it should."""


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": Problem, "description": "Bad input: the problem and its fix"},
    401: {"model": Problem, "description": "No token, or a wrong one"},
    403: {"model": Problem, "description": "No CSRF token on a state-changing call from a browser"},
    404: {"model": Problem, "description": "No such record"},
}


def lookup(find: Callable[..., T], *args: Any) -> T:
    """A record by the name in the URL; the SDK's 'no such record' becomes a 404."""
    try:
        return find(*args)
    except LlmoptError as exc:
        raise NotFound(exc.problem, exc.fix) from None


def status_of(exc: LlmoptError) -> int:
    if isinstance(exc, NotFound):
        return 404
    return 502 if isinstance(exc, Upstream) else 400


def body(exc: LlmoptError) -> dict[str, str]:
    return Problem(error=" ".join(exc.problem.split()), fix=exc.fix).model_dump()


def as_problem(exc: Exception) -> LlmoptError:
    """An error in the SDK's words. A validation error (FastAPI's 422, or a type the SDK filled
    before it could check the value itself) names its first bad field, in one line."""
    if isinstance(exc, LlmoptError):
        return exc
    assert isinstance(exc, (RequestValidationError, ValidationError))
    where, problem = first_invalid(exc.errors(), skip=frozenset({"body"}))
    return LlmoptError(f"bad {where or 'request'}: {problem}", "see /openapi.json for what each call takes")


def json_error(request: Request, exc: Exception) -> Response:
    problem = as_problem(exc)
    return JSONResponse(body(problem), status_code=status_of(problem))
