"""The server-sent event streams of the live pages, in the two shapes they come in.

A record's page (a job, an endpoint, an evaluation) gets its fragments again whenever they change
and its log as it grows, then an `end` event once the record stops being active. A list page gets a
row whenever that record changes, and `<kind>s-changed` when records come or go (the page then
reloads its table). Both read the records through a shared `Feed`, so at most once a second.
"""

from __future__ import annotations

from collections import deque
from html import escape
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable

from sse_starlette import EventSourceResponse

from llmopt.studio.live import Feed, follow, last_lines, merge

LOG_LINES = 200  # a log tail starts with this many lines


def tail(lines: Iterable[str], count: int) -> dict[str, list[str]]:
    """A log's last lines, as the API returns them."""
    return {"lines": [line.rstrip("\n") for line in deque(lines, maxlen=count)]}


def log_html(text: str) -> str:
    """Log text as lines the page appends to its log box."""
    return "".join(f"<div>{escape(line)}</div>" for line in text.splitlines())


def record_page(feed: Feed[Any], fragments: Callable[[Any], dict[str, str]], log_path: Path | None,
                active: Callable[[Any], bool]) -> EventSourceResponse:
    alive = {"now": True}

    async def updates() -> AsyncIterator[dict[str, str]]:
        shown: dict[str, str] = {}
        async for record in feed.watch():
            if isinstance(record, BaseException):
                break
            alive["now"] = active(record)
            for event, html in fragments(record).items():
                if shown.get(event) != html:
                    shown[event] = html
                    yield {"event": event, "data": html}
            if not alive["now"]:
                break
        alive["now"] = False

    async def log() -> AsyncIterator[dict[str, str]]:
        if log_path is None:
            return
        lines, offset = last_lines(log_path, LOG_LINES)
        if lines:
            yield {"event": "log", "data": log_html("".join(lines))}
        async for text in follow(log_path, offset, lambda: alive["now"]):
            yield {"event": "log", "data": log_html(text)}

    async def events() -> AsyncIterator[dict[str, str]]:
        async for event in merge(updates(), log()):
            yield event
        yield {"event": "end", "data": ""}

    return EventSourceResponse(events())


def list_page(feed: Feed[list[Any]], kind: str, key: Callable[[Any], str], signature: Callable[[Any], Any],
              row: Callable[[Any], str]) -> EventSourceResponse:
    """Rows as their records change. The first poll asks the page to reload its table: what changed
    between the page's rendering and this stream's start is not lost."""
    async def events() -> AsyncIterator[dict[str, str]]:
        shown: dict[str, Any] | None = None
        async for records in feed.watch():
            if isinstance(records, BaseException):
                return
            current = {key(r): r for r in records}
            if shown is None or current.keys() != shown.keys():
                yield {"event": f"{kind}s-changed", "data": ""}
            else:
                for name, record in current.items():
                    if signature(record) != shown[name]:
                        yield {"event": f"{kind}-{name}", "data": row(record)}
            shown = {name: signature(record) for name, record in current.items()}

    return EventSourceResponse(events())
