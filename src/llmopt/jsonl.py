"""The user's JSONL files (workloads, calibration text): one reader, strict about what a line is.

A line is a JSON object with "messages" (chat turns), or "prompt" or "text" (one string), and
optionally "max_tokens" and "expected". Anything else is a bad line, never an exception: the
caller decides whether bad lines are skipped (a load test) or refused (calibration).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from llmopt.errors import LlmoptError

MAX_TOKENS_LIMIT = 1 << 20
MAX_LINE_BYTES = 16 << 20


@dataclass(frozen=True)
class Line:
    number: int
    messages: tuple[dict[str, str], ...] | None  # chat turns, or None for plain text
    text: str | None  # "prompt" or "text"
    max_tokens: int | None
    expected: str | None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def parse(raw: bytes, number: int) -> Line:
    """One line; raises ValueError with the reason when it is not a valid record."""
    if len(raw) > MAX_LINE_BYTES:
        raise ValueError("line longer than 16 MB")
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    messages = None
    if "messages" in data:
        turns = data["messages"]
        if not isinstance(turns, list) or not turns or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in turns
        ):
            raise ValueError('"messages" must be a non-empty list of {"role": ..., "content": ...}')
        messages = tuple({"role": m["role"], "content": m["content"]} for m in turns)
    text = data.get("prompt", data.get("text"))
    if messages is None and (not isinstance(text, str) or not text):
        raise ValueError('no "messages", "prompt" or "text"')
    max_tokens = data.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or not 0 < max_tokens <= MAX_TOKENS_LIMIT):
        raise ValueError(f'"max_tokens" must be an integer from 1 to {MAX_TOKENS_LIMIT}')
    expected = data.get("expected")
    if expected is not None and not isinstance(expected, (str, int, float)):
        raise ValueError('"expected" must be a string')
    return Line(number, messages, text if isinstance(text, str) else None, max_tokens,
                None if expected is None else str(expected))


def read(path: Path, what: str) -> tuple[list[Line], dict[int, str]]:
    """Every line of a file: the valid ones, and the reason each other non-empty line was refused."""
    if not path.is_file():
        raise LlmoptError(f"{what} '{path}' is not a file", "pass the path of a .jsonl file")
    good: list[Line] = []
    bad: dict[int, str] = {}
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                good.append(parse(raw, number))
            except ValueError as exc:
                bad[number] = str(exc)
    return good, bad
