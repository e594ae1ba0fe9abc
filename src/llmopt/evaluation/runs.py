"""Evaluation runs as records: every evaluation (from the CLI, the SDK or the studio) has one, with
its status, progress and results folder, listable like jobs. A background run is a worker process
of its own (`python -m llmopt.evaluation.worker NAME`), started by an executor, here or as a Ray
job; a foreground one is the caller's process."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from llmopt import executors, paths, procs, records
from llmopt.engine import platform
from llmopt.errors import LlmoptError
from llmopt.executors.base import ACTIVE, COMPLETED, FAILED, INPROGRESS, STARTING, STATUSES, STOPPED, STOPPING
from llmopt.evaluation import benchmark
from llmopt.evaluation.levels import Events, Plan
from llmopt.evaluation.pricing import HardwareProfile
from llmopt.evaluation.results import EvaluationResults

PROGRESS_EVERY_S = 1.0  # progress reaches the record at most this often: a live page reads it, never faster


class Progress(BaseModel):
    stage: str = "queued"  # queued | deploying <target> | <target> @ concurrency N | quality <target> | done
    done: int = 0  # requests finished in the current level
    total: int | None = None


class EvaluationRecord(BaseModel):
    name: str
    status: str = STARTING
    arguments: dict[str, Any]  # as `llmopt.evaluate` takes them
    output_dir: str
    log_path: str
    executor: str = "local"  # where a background run's worker runs: one of executors.NAMES
    pid: int | None = None
    pid_create_time: float | None = None
    ray_address: str | None = None
    ray_submission_id: str | None = None
    progress: Progress = Field(default_factory=Progress)
    failure_reason: str | None = None
    created_at: float
    started_at: float | None = None
    ended_at: float | None = None

    @property
    def results_file(self) -> Path:
        return Path(self.output_dir) / "results.json"

    def to_dict(self) -> dict:
        data = self.model_dump(mode="json")
        data["arguments"].pop("api_key", None)  # kept in the owner-only database, never shown
        return data


EVALUATIONS = records.Table("evaluations", EvaluationRecord, key="name", order="created_at")


def output_dir(name: str) -> Path:
    return paths.home() / "evaluations" / name


def create(name: str, arguments: dict[str, Any], executor: str = "local") -> EvaluationRecord:
    record = EvaluationRecord(name=name, arguments=arguments, output_dir=str(output_dir(name)), executor=executor,
                              log_path=str(paths.logs_dir() / f"evaluation-{name}.log"), created_at=time.time())
    EVALUATIONS.insert(record)
    return record


def spawn(name: str, runs_on: executors.Executor) -> None:
    """Start the background worker for a recorded evaluation with an executor: a process here, or
    a Ray job that reserves every core (it deploys and loads one target at a time)."""
    record = get(name)
    resources = executors.Resources(cpus=float(platform.detect().cores), memory_bytes=0)
    try:
        EVALUATIONS.update(name, **runs_on.start(name, Path(record.log_path), resources, kind="evaluation"))
    except BaseException as exc:
        EVALUATIONS.update(name, status=FAILED, failure_reason=f"the worker did not start: {type(exc).__name__}: {exc}",
                           ended_at=time.time())
        raise


def wait(name: str, poll_s: float = 1.0) -> EvaluationRecord:
    """A background run's record once it has ended."""
    while (record := get(name)).status in ACTIVE:
        time.sleep(poll_s)
    return record


def execute(name: str, events: Events | None = None) -> EvaluationResults:
    """Run a recorded evaluation in this process, keeping its record's status and progress true."""
    record = get(name)
    arguments = record.arguments
    EVALUATIONS.update(name, status=INPROGRESS, started_at=time.time(), pid=os.getpid(), pid_create_time=procs.create_time(os.getpid()))
    reporter = Reporter(name, events)
    try:
        results = benchmark.run([(spec, kind) for spec, kind in arguments["targets"]], Plan.model_validate(arguments["plan"]),
                                HardwareProfile.model_validate(arguments["price"]), arguments["quality"], arguments["tokenizer"],
                                Path(record.output_dir), reporter, arguments.get("api_key"))
    except BaseException as exc:
        stopped = isinstance(exc, (KeyboardInterrupt, SystemExit)) or get(name).status == STOPPING
        reason = None if stopped else (exc.one_line() if isinstance(exc, LlmoptError) else f"{type(exc).__name__}: {exc}")
        EVALUATIONS.update(name, status=STOPPED if stopped else FAILED, failure_reason=reason, ended_at=time.time())
        raise
    aborted = next((t.aborted for t in results.targets if t.aborted), None)
    EVALUATIONS.update(name, status=FAILED if aborted else COMPLETED, failure_reason=aborted, ended_at=time.time(),
                       progress=Progress(stage="done"))
    return results


class Reporter:
    """Events of a running evaluation, written to its record at most once a second."""

    def __init__(self, name: str, events: Events | None = None) -> None:
        self.name, self.progress, self.written, self.events = name, Progress(), 0.0, events

    def __call__(self, kind: str, **data: Any) -> None:
        if self.events is not None:
            self.events(kind, **data)
        if kind == "deploying":
            self.progress = Progress(stage=f"deploying {data['target']}")
        elif kind == "level":
            self.progress = Progress(stage=f"{data['target']} @ concurrency {data['concurrency']}", total=data.get("total"))
        elif kind == "request":
            self.progress.done += 1
        elif kind == "quality":
            self.progress = Progress(stage=f"quality {data['target']}")
        now = time.monotonic()
        if now - self.written >= PROGRESS_EVERY_S or kind != "request":
            EVALUATIONS.update(self.name, progress=self.progress)
            self.written = now


def get(name: str) -> EvaluationRecord:
    record = EVALUATIONS.get(name)
    if record is None:
        raise LlmoptError(f"no evaluation named '{name}'", "see `llmopt evaluations list`")
    return _reconcile(record)


def list_runs(status: str | None = None, limit: int | None = None) -> list[EvaluationRecord]:
    if status is not None and status.upper() not in STATUSES:
        raise LlmoptError(f"unknown status '{status}'", f"use one of {', '.join(STATUSES)}")
    found = [_reconcile(r) for r in EVALUATIONS.select(limit=limit)]
    return [r for r in found if status is None or r.status == status.upper()]


def stop(name: str) -> EvaluationRecord:
    record = get(name)
    if record.status not in ACTIVE:
        raise LlmoptError(f"evaluation '{name}' is {record.status}, not running", "nothing to stop")
    EVALUATIONS.update(name, status=STOPPING)
    if record.executor != "local":
        executors.of(record).stop(record)
    elif record.pid is not None and record.pid != os.getpid():
        procs.stop_group(record.pid, record.pid_create_time) if _own_session(record.pid) else os.kill(record.pid, signal.SIGTERM)
    return get(name)


def _own_session(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def _reconcile(record: EvaluationRecord) -> EvaluationRecord:
    """An active record whose process ended without recording it: FAILED with the reason, or
    STOPPED (a stop asked for, or one from outside, which keeps the executor's reason). A Ray run
    is asked of Ray; a local one is only checked, never signalled: a foreground run's pid is its
    caller's (a notebook, a shell pipeline), whose process group is not llmopt's to clean up."""
    if record.status not in ACTIVE:
        return record
    ended = executors.local.lost_end(record) if record.executor == "local" else executors.of(record).ended(record)
    if ended is None:
        return record
    return executors.settle(EVALUATIONS, record.name, ended) or EVALUATIONS.get(record.name) or record

