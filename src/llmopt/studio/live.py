"""Live pages: what a server-sent event stream is made of.

A `Feed` polls one source (a job's record, the list of evaluations) at most once a second while
anyone watches, and shares each value with every watcher: ten open tabs cost SQLite what one does.
`follow` tails a log file without asking the database whether its writer is alive (the watcher
passes what the feed last said). `merge` interleaves several of these into one stream.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Generic, Hashable, TypeVar

T = TypeVar("T")
POLL_S = 1.0  # a live page never reads a record more often than this
TAIL_BYTES = 64 << 10  # how far back a log tail starts
TAIL_POLL_S = 0.5


class Feed(Generic[T]):
    """One source, polled in a worker thread while it has watchers; a failed poll is shared as the
    exception it raised, and the feed stops (its source is gone)."""

    def __init__(self, poll: Callable[[], T], interval: float = POLL_S) -> None:
        self.poll, self.interval = poll, interval
        self.value: T | BaseException | None = None
        self.version = 0
        self.watchers = 0
        self._changed = asyncio.Condition()
        self._task: asyncio.Task | None = None

    async def watch(self) -> AsyncIterator[T | BaseException]:
        """The newest value now (once it is polled), then every later one."""
        self.watchers += 1
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        seen = 0
        try:
            while True:
                async with self._changed:
                    await self._changed.wait_for(lambda: self.version != seen)
                    seen, value = self.version, self.value
                yield value  # type: ignore[misc]
                if isinstance(value, BaseException):
                    return
        finally:
            self.watchers -= 1

    async def _run(self) -> None:
        while self.watchers > 0:
            try:
                value: Any = await asyncio.to_thread(self.poll)
            except Exception as exc:  # noqa: BLE001 -- handed to the watchers, who end their streams
                value = exc
            async with self._changed:
                self.value, self.version = value, self.version + 1
                self._changed.notify_all()
            if isinstance(value, BaseException):
                return
            await asyncio.sleep(self.interval)


class Feeds:
    """The feeds of one studio, by key (one event loop each: a test client may run several)."""

    def __init__(self) -> None:
        self._feeds: dict[tuple[int, Hashable], Feed[Any]] = {}

    def get(self, key: Hashable, poll: Callable[[], T]) -> Feed[T]:
        loop_key = (id(asyncio.get_running_loop()), key)
        feed = self._feeds.get(loop_key)
        if feed is None or (feed.watchers == 0 and isinstance(feed.value, BaseException)):
            feed = self._feeds[loop_key] = Feed(poll)
        return feed


def last_lines(path: Path, count: int) -> tuple[list[str], int]:
    """A log's last `count` lines and the offset they end at (where following starts)."""
    try:
        with path.open("rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(0, end - TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines(keepends=True)
    except FileNotFoundError:
        return [], 0
    if end > TAIL_BYTES and lines:
        lines = lines[1:]  # the first is cut
    return lines[-count:], end


async def follow(path: Path, offset: int, alive: Callable[[], bool]) -> AsyncIterator[str]:
    """Text appended to a log from `offset` on, in whole lines, until `alive()` is false and the
    file is drained."""
    pending = ""
    while True:
        chunk = _read_from(path, offset)
        offset += len(chunk)
        text = pending + chunk.decode(errors="replace")
        complete, _, pending = text.rpartition("\n")
        if complete:
            yield complete + "\n"
        if not chunk:
            if not alive():
                if pending:
                    yield pending
                return
            await asyncio.sleep(TAIL_POLL_S)


def _read_from(path: Path, offset: int) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read(1 << 20)
    except FileNotFoundError:
        return b""


async def merge(*streams: AsyncIterator[T]) -> AsyncIterator[T]:
    """Items from several streams as they come; ends when all have ended."""
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((False, item))
        finally:
            await queue.put((True, None))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            ended, item = await queue.get()
            if ended:
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
