"""Job records. Reading a record reconciles it with reality: a job whose worker died is FAILED
(or STOPPED, if a stop was asked for), never left running forever. Its executor says whether the
worker still runs (a local process's pid, or Ray's status of the Ray job)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from llmopt import executors, locations, paths, records
from llmopt.errors import LlmoptError
from llmopt.executors.base import (  # noqa: F401 (the statuses, read as store.FAILED and so on)
    ACTIVE, COMPLETED, FAILED, INPROGRESS, STARTING, STATUSES, STOPPED, STOPPING,
)


class StepProgress(BaseModel):
    status: str = "pending"  # pending | running | done
    fraction: float = 0.0
    seconds: float | None = None
    reused_from: str | None = None  # the job whose artifact this one reuses


class JobRecord(BaseModel):
    name: str
    source: str
    source_hash: str | None = None
    recipe: dict[str, Any]  # as the user gave it (parsed again by the worker)
    artifact_key: str | None = None
    status: str = STARTING
    failure_reason: str | None = None
    log_path: str
    output_dir: str | None
    artifact: str | None = None
    artifact_hash: str | None = None  # the finished artifact's content hash (its manifest's): what `built_here` trusts
    executor: str = "local"  # where the worker runs: one of executors.NAMES
    pid: int | None = None  # the local executor's worker
    pid_create_time: float | None = None
    ray_address: str | None = None  # the Ray executor's: the dashboard the job went to, and its id there
    ray_submission_id: str | None = None
    # what the worker may hold at its peak (`pipeline.peak_memory_bytes`): the estimate where the job was
    # submitted (what Ray reserves for it), replaced by the building machine's where that is higher
    memory_bytes: int | None = None
    progress: dict[str, StepProgress] = Field(default_factory=dict)
    force: bool = False
    created_at: float
    started_at: float | None = None
    ended_at: float | None = None

    @property
    def built_dir(self) -> Path | None:
        """The local folder the finished artifact is renamed into: the output folder, or for an
        output URI the local build it is published from."""
        if not self.output_dir:
            return None
        if locations.is_uri(self.output_dir):
            return paths.artifacts_dir(create=False) / f".publish-{self.name}"
        return Path(self.output_dir)

    @property
    def workdir(self) -> Path | None:
        """Where the artifact is built before it is renamed into place; hidden, never complete."""
        out = self.built_dir
        return None if out is None else out.parent / f".build-{out.name}"

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


JOBS = records.Table("jobs", JobRecord, key="name", order="created_at")


def _gives_up_its_name(record: JobRecord | None) -> bool:
    """A failed job whose worker never started (no process, no Ray job)."""
    return record is not None and record.status == FAILED and record.pid is None and record.ray_submission_id is None


def taken(name: str) -> bool:
    record = JOBS.get(name)
    return record is not None and not _gives_up_its_name(record)


def claim(record: JobRecord) -> None:
    """Record a new job under its name; the record of a job whose worker never started gives the name up."""
    with JOBS.transaction() as conn:
        if _gives_up_its_name(JOBS.read(conn, record.name)):
            JOBS.delete(record.name, conn)
        JOBS.insert(record, conn)


def update(name: str, **fields: object) -> None:
    JOBS.update(name, **fields)


def set_step(name: str, step: str, status: str, fraction: float, seconds: float | None = None) -> None:
    """Progress of one step, kept in the record so any process can show it."""
    with JOBS.transaction() as conn:
        record = JOBS.read(conn, name)
        if record is None:
            return
        entry = record.progress.setdefault(step, StepProgress())
        entry.status, entry.fraction = status, round(fraction, 4)
        if seconds is not None:
            entry.seconds = round(seconds, 2)
        JOBS.write(conn, name, progress=record.progress)


def get(name: str) -> JobRecord:
    record = load(name)
    if record is None:
        raise LlmoptError(f"no job named '{name}'", "see `llmopt jobs list`")
    return record


def load(name: str) -> JobRecord | None:
    record = JOBS.get(name)
    return _reconcile(record) if record else None


def list_jobs(status: str | None = None, name_contains: str | None = None) -> list[JobRecord]:
    if status is not None and status.upper() not in STATUSES:
        raise LlmoptError(f"unknown status '{status}'", f"use one of {', '.join(STATUSES)}")
    found = [_reconcile(r) for r in JOBS.select()]
    return [r for r in found
            if (status is None or r.status == status.upper()) and (not name_contains or name_contains in r.name)]


def find_completed(key: str) -> JobRecord | None:
    """The newest completed job that built an artifact with this key, whose artifact is still there."""
    for record in reversed(JOBS.select("artifact_key = ? AND status = ? AND artifact = output_dir", (key, COMPLETED))):
        if record.artifact and locations.exists(record.artifact):
            return record
    return None


def built_here(content_hash: str) -> bool:
    """Whether a completed job of this home built an artifact of exactly this content (wherever its
    copy is now): the compiled code it ships is then this user's own."""
    return bool(content_hash) and bool(JOBS.select("artifact_hash = ? AND status = ?", (content_hash, COMPLETED), limit=1))


def _reconcile(record: JobRecord) -> JobRecord:
    if record.status not in ACTIVE:
        return record
    ended = executors.of(record).ended(record)
    if ended is None:
        return record
    settled = executors.settle(JOBS, record.name, ended)
    if settled is None:  # the worker recorded its end after all, while it was being asked about
        return JOBS.get(record.name) or record
    if record.workdir is not None:
        shutil.rmtree(record.workdir, ignore_errors=True)
    return settled
