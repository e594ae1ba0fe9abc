"""What an executor is: where a job's (or an evaluation's) worker runs. Every executor runs the same worker command
(the worker owns the job's record from then on); it starts it, stops it, and tells how it ended
when it ended without recording that itself, so reading a record tells a dead worker from a busy one.
"""

from __future__ import annotations

import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from llmopt import records

STOP_GRACE_S = 30.0  # from SIGTERM to SIGKILL: time for the worker to remove its work folder and record STOPPED
# A worker's record, a job's or an evaluation's alike, is in one of these.
STARTING, INPROGRESS, COMPLETED, FAILED, STOPPING, STOPPED = (
    "STARTING", "INPROGRESS", "COMPLETED", "FAILED", "STOPPING", "STOPPED",
)
STATUSES = (STARTING, INPROGRESS, COMPLETED, FAILED, STOPPING, STOPPED)
ACTIVE = (STARTING, INPROGRESS, STOPPING)


class Worker(Protocol):
    """What executors read from a job's record (`jobs.store.JobRecord` has all of it)."""

    name: str
    log_path: str
    created_at: float
    executor: str
    pid: int | None
    pid_create_time: float | None
    ray_address: str | None
    ray_submission_id: str | None


@dataclass(frozen=True)
class Resources:
    """What a job's worker needs reserved where it runs (a scheduler such as Ray's reserves it)."""

    cpus: float
    memory_bytes: int
    gpus: int = 0


@dataclass(frozen=True)
class Ended:
    """How a worker ended without recording an end itself."""

    reason: str
    stopped: bool = False  # stopped from outside llmopt (`ray job stop`, say), rather than failed


class Executor(ABC):
    name: ClassVar[str]

    def check(self) -> None:
        """Refuse now what would fail later, before a job is recorded or a stop is: nothing to check by default."""

    @abstractmethod
    def start(self, name: str, log_path: Path, resources: Resources, kind: Kind = "job") -> dict[str, object]:
        """Start the worker of the job (or evaluation) `name`, its output appended to `log_path`;
        returns the record fields that find it again."""

    @abstractmethod
    def stop(self, worker: Worker) -> None:
        """SIGTERM the worker and what it started (it records STOPPED), SIGKILL what is left after
        STOP_GRACE_S; returns once they have ended."""

    @abstractmethod
    def ended(self, worker: Worker) -> Ended | None:
        """How the worker ended (whatever it left running is gone by then), or None while it runs or may still start."""


WORKERS = {"job": "llmopt.jobs.worker", "evaluation": "llmopt.evaluation.worker"}  # what a worker runs, by kind
Kind = Literal["job", "evaluation"]


def worker_command(name: str, kind: Kind = "job") -> list[str]:
    """The worker's command line for a recorded job or evaluation, the same under every executor."""
    return [sys.executable, "-m", WORKERS[kind], name]


def settle(table: records.Table, name: str, ended: Ended) -> Any:
    """Record how a worker ended without recording it: FAILED with the executor's reason, or
    STOPPED (a stop llmopt asked for needs no reason; one from outside keeps the executor's).
    Read and written in one transaction, so an end the worker recorded meanwhile stands (then
    None). The record as it now is."""
    with table.transaction() as conn:
        latest = table.read(conn, name)
        if latest is None or latest.status not in ACTIVE:
            return None
        stopping = latest.status == STOPPING
        fields = {"status": STOPPED if stopping or ended.stopped else FAILED,
                  "failure_reason": None if stopping else ended.reason, "ended_at": time.time()}
        table.write(conn, name, **fields)
    return latest.model_copy(update=fields)
