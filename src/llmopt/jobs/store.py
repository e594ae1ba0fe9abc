"""Job records in SQLite. Reading a record reconciles it with reality: a job whose worker died is
FAILED (or STOPPED, if a stop was asked for), never left running forever."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from llmopt import db, procs
from llmopt.errors import LlmoptError

STARTING, INPROGRESS, COMPLETED, FAILED, STOPPING, STOPPED = (
    "STARTING", "INPROGRESS", "COMPLETED", "FAILED", "STOPPING", "STOPPED",
)
STATUSES = (STARTING, INPROGRESS, COMPLETED, FAILED, STOPPING, STOPPED)
ACTIVE = (STARTING, INPROGRESS, STOPPING)
SPAWN_GRACE_S = 120.0  # a STARTING record with no worker after this long was abandoned


@dataclass
class JobRecord:
    name: str
    source: str
    source_hash: str | None
    recipe: str
    artifact_key: str | None
    status: str
    failure_reason: str | None
    log_path: str
    output_dir: str | None
    artifact: str | None
    pid: int | None
    pid_create_time: float | None
    progress: str
    force: int
    created_at: float
    started_at: float | None
    ended_at: float | None

    @property
    def workdir(self) -> Path | None:
        """Where the artifact is built before it is renamed into place; hidden, never complete."""
        if not self.output_dir:
            return None
        out = Path(self.output_dir)
        return out.parent / f".build-{out.name}"

    @property
    def steps(self) -> dict[str, dict]:
        return json.loads(self.progress)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["recipe"] = json.loads(self.recipe)
        data["progress"] = self.steps
        return data


def insert(record: JobRecord) -> None:
    data = asdict(record)
    with db.connect() as conn:
        try:
            conn.execute(f"INSERT INTO jobs ({', '.join(data)}) VALUES ({', '.join(':' + k for k in data)})", data)
        except Exception as exc:
            if "UNIQUE" in str(exc):
                raise LlmoptError(f"a job named '{record.name}' already exists", "pass another --name") from exc
            raise


def update(name: str, **fields: object) -> None:
    with db.connect() as conn:
        conn.execute(
            f"UPDATE jobs SET {', '.join(f'{k} = :{k}' for k in fields)} WHERE name = :name", {**fields, "name": name}
        )


def set_step(name: str, step: str, status: str, fraction: float, seconds: float | None = None) -> None:
    """Progress of one step, kept in the record so any process can show it."""
    with db.connect() as conn:
        conn.execute("BEGIN IMMEDIATE")
        row = conn.execute("SELECT progress FROM jobs WHERE name = ?", (name,)).fetchone()
        progress = json.loads(row["progress"]) if row else {}
        entry = progress.setdefault(step, {})
        entry.update(status=status, fraction=round(fraction, 4))
        if seconds is not None:
            entry["seconds"] = round(seconds, 2)
        conn.execute("UPDATE jobs SET progress = ? WHERE name = ?", (json.dumps(progress), name))
        conn.execute("COMMIT")


def get(name: str) -> JobRecord:
    record = load(name)
    if record is None:
        raise LlmoptError(f"no job named '{name}'", "see `llmopt jobs list`")
    return record


def load(name: str) -> JobRecord | None:
    with db.connect() as conn:
        row = conn.execute("SELECT * FROM jobs WHERE name = ?", (name,)).fetchone()
    return _reconcile(JobRecord(**dict(row))) if row else None


def list_jobs(status: str | None = None, name_contains: str | None = None) -> list[JobRecord]:
    if status is not None and status.upper() not in STATUSES:
        raise LlmoptError(f"unknown status '{status}'", f"use one of {', '.join(STATUSES)}")
    with db.connect() as conn:
        rows = conn.execute("SELECT * FROM jobs ORDER BY created_at").fetchall()
    records = [_reconcile(JobRecord(**dict(r))) for r in rows]
    return [
        r for r in records
        if (status is None or r.status == status.upper()) and (not name_contains or name_contains in r.name)
    ]


def find_completed(key: str) -> JobRecord | None:
    with db.connect() as conn:
        rows = conn.execute(
            "SELECT name FROM jobs WHERE artifact_key = ? AND status = ? AND artifact = output_dir ORDER BY ended_at DESC",
            (key, COMPLETED),
        ).fetchall()
    from llmopt import artifact

    for row in rows:
        record = load(row["name"])
        if record and record.artifact and artifact.is_artifact(Path(record.artifact)):
            return record
    return None


def _reconcile(record: JobRecord) -> JobRecord:
    if record.status not in ACTIVE:
        return record
    if record.pid is None:
        if time.time() - record.created_at < SPAWN_GRACE_S:
            return record
        reason = "the job's worker was never started (the creating process died)"
    elif procs.is_alive(record.pid, record.pid_create_time):
        return record
    else:
        reason = f"worker process {record.pid} died without finishing; see {record.log_path}"
    status = STOPPED if record.status == STOPPING else FAILED
    if record.pid is not None:
        procs.kill_group(record.pid)  # an engine the dead worker started shares its group
    if record.workdir is not None:
        shutil.rmtree(record.workdir, ignore_errors=True)
    update(record.name, status=status, failure_reason=None if status == STOPPED else reason, ended_at=time.time())
    record.status, record.failure_reason, record.ended_at = status, (None if status == STOPPED else reason), time.time()
    return record
