"""Work the studio runs in a thread because its SDK call blocks until the work is done: a deploy
(until the endpoint answers), a configuration's deploy (its job, then the deploy), a
recommendation (every candidate). A task is kept in memory for the life of the studio, with its
progress, its result or its error; the records the SDK keeps (endpoints, jobs) outlive it.

Starting one waits a moment for the SDK to refuse bad input, so a form shows that error at once
rather than on a later page.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from llmopt.errors import LlmoptError
from llmopt.studio.problems import NotFound, Problem

log = logging.getLogger("llmopt.studio")
REFUSAL_WAIT_S = 2.0  # how long starting a task waits for the SDK to refuse its input


@dataclass
class Task:
    id: str
    kind: str  # deploy | deploy-config | recommendation
    label: str
    status: Literal["running", "done", "failed"] = "running"
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    error: Problem | None = None
    result: Any = None  # what the SDK call returned
    state: dict[str, Any] = field(default_factory=dict)  # progress, as the work reports it
    version: int = 0  # bumped by every change: a live page sends only what changed
    accepted: threading.Event = field(default_factory=threading.Event)  # past the SDK's checks

    def report(self, **state: Any) -> None:
        self.state.update(state)
        self.version += 1

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "label": self.label, "status": self.status, "started_at": self.started_at,
                "ended_at": self.ended_at, "error": self.error.model_dump() if self.error else None,
                "progress": {k: v for k, v in self.state.items() if isinstance(v, (str, int, float, bool, type(None)))}}


class Tasks:
    def __init__(self) -> None:
        self._tasks: dict[str, Task] = {}

    def start(self, kind: str, label: str, work: Callable[[Task], Any], wait_s: float = REFUSAL_WAIT_S) -> Task:
        """Run `work(task)` in a thread; raise its LlmoptError if it fails before `wait_s` (or
        before it marks itself accepted)."""
        task = Task(id=f"{kind}-{secrets.token_hex(4)}", kind=kind, label=label)
        self._tasks[task.id] = task
        thread = threading.Thread(target=self._run, args=(task, work), name=f"studio-{task.id}", daemon=True)
        thread.start()
        task.accepted.wait(wait_s)
        if task.status == "failed" and task.error is not None:
            del self._tasks[task.id]
            raise LlmoptError(task.error.error, task.error.fix)
        return task

    def _run(self, task: Task, work: Callable[[Task], Any]) -> None:
        try:
            task.result = work(task)
            task.status = "done"
        except LlmoptError as exc:
            task.status, task.error = "failed", Problem(error=exc.problem, fix=exc.fix)
        except Exception as exc:  # noqa: BLE001 -- a thread has no caller to raise to: the task says what happened
            log.exception("task %s failed", task.id)
            task.status, task.error = "failed", Problem(error=f"{type(exc).__name__}: {exc}", fix="see the studio's log")
        task.ended_at = time.time()
        task.version += 1
        task.accepted.set()

    def get(self, task_id: str, kind: str | None = None) -> Task:
        task = self._tasks.get(task_id)
        if task is None or (kind is not None and task.kind != kind):
            raise NotFound(f"no {kind or 'task'} '{task_id}' in this studio", "it may have run in an earlier studio session")
        return task

    def list(self, kind: str | None = None) -> list[Task]:
        return sorted((t for t in self._tasks.values() if kind is None or t.kind == kind), key=lambda t: -t.started_at)
