"""Create, start, follow and stop optimization jobs. The SDK's `optimize()` lands here."""

from __future__ import annotations

import errno
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from typing import Any

from llmopt import model_check, names, paths, procs, serving, sources, techniques
from llmopt.endpoints import Endpoint
from llmopt.engine import platform
from llmopt.errors import LlmoptError
from llmopt.jobs import pipeline, store

STOP_GRACE_S = 30.0


class Job:
    """A handle on a job record; every property reads the record afresh."""

    def __init__(self, name: str, warnings: list[str] | None = None, reused_from: str | None = None) -> None:
        self.name = name
        self.warnings = warnings or []
        self.reused_from = reused_from

    @property
    def record(self) -> store.JobRecord:
        return store.get(self.name)

    @property
    def status(self) -> str:
        return self.record.status

    @property
    def artifact(self) -> Path | None:
        record = self.record
        return Path(record.artifact) if record.status == store.COMPLETED and record.artifact else None

    def wait(self, timeout_s: float | None = None, poll_s: float = 0.5) -> "Job":
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.status in store.ACTIVE:
            if deadline is not None and time.monotonic() > deadline:
                raise LlmoptError(f"job '{self.name}' still {self.status} after {timeout_s:.0f} s", "wait longer or stop it")
            time.sleep(poll_s)
        return self

    def stop(self) -> "Job":
        stop(self.name)
        return self

    def deploy(self, **kwargs: Any) -> Endpoint:
        """Serve the job's artifact (keyword arguments as `llmopt.deploy`'s)."""
        if self.artifact is None:
            raise LlmoptError(f"job '{self.name}' is {self.status}, it has no artifact", "deploy a COMPLETED job")
        return serving.deploy(serving.for_target(str(self.artifact)), **kwargs)

    def __repr__(self) -> str:
        return f"Job({self.name!r}, status={self.status})"


def create(model: str, recipe: Any, name: str | None = None, output: str | Path | None = None, force: bool = False) -> Job:
    """Check a job, then record it and start its worker (or reuse a matching artifact).

    Everything checkable before the worker starts is checked first: a refused job leaves no record
    and no folder. Once recorded, a job keeps its record whatever happens, with the reason if it fails.
    """
    name = names.check(name, "job") if name else f"{names.slug(Path(model).name)[:40]}-{recipe.name or 'custom'}-{secrets.token_hex(3)}"
    if store.taken(name):
        raise LlmoptError(f"a job named '{name}' already exists", "pass another --name")
    output_dir = Path(output).expanduser().resolve() if output else paths.artifacts_dir(create=False) / name
    _check_output(output_dir)
    source = sources.resolve(model)
    hardware = platform.detect()
    model_check.attends_here(json.loads((Path(source.path) / "config.json").read_text()), hardware)
    verdict = techniques.check(recipe, source, hardware)
    verdict.raise_if_refused()
    key = pipeline.artifact_key(source, recipe, hardware)
    log_path = paths.logs_dir() / f"job-{name}.log"
    record = store.JobRecord(
        name=name, source=source.id, source_hash=source.content_hash, recipe=recipe.to_dict(), artifact_key=key,
        log_path=str(log_path), output_dir=str(output_dir),
        progress={s.name: store.StepProgress() for s in pipeline.plan(recipe)}, force=force, created_at=time.time(),
    )
    previous = None if force else store.find_completed(key)
    if previous is not None:
        now = time.time()
        store.claim(record.model_copy(update={
            "status": store.COMPLETED, "artifact": previous.artifact, "started_at": now, "ended_at": now,
            "progress": {"reused": store.StepProgress(status="done", fraction=1.0, reused_from=previous.name)}}))
        return Job(name, verdict.warnings, reused_from=previous.name)
    store.claim(record)
    try:
        _spawn(name, log_path)
    except BaseException as exc:
        store.update(name, status=store.FAILED, failure_reason=f"the worker did not start: {type(exc).__name__}: {exc}",
                     ended_at=time.time())
        raise
    return Job(name, verdict.warnings)


def stop(name: str) -> store.JobRecord:
    record = store.get(name)
    if record.status not in store.ACTIVE:
        raise LlmoptError(f"job '{name}' is {record.status}, not running", "nothing to stop")
    store.update(name, status=store.STOPPING)
    if record.pid is not None:
        procs.stop_group(record.pid, record.pid_create_time, grace_s=STOP_GRACE_S)
    deadline = time.monotonic() + 5
    while store.get(name).status in store.ACTIVE and time.monotonic() < deadline:
        time.sleep(0.2)
    return store.get(name)


def _spawn(name: str, log_path: Path) -> None:
    with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "llmopt.jobs.worker", name],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            # the job reports progress per step; llm-compressor's and transformers' bars would only fill its log
            env={**os.environ, "TQDM_DISABLE": "1"}, start_new_session=True,
        )
    store.update(name, pid=popen.pid, pid_create_time=procs.create_time(popen.pid))


def _check_output(output_dir: Path) -> None:
    """The artifact folder must be new, and the nearest folder above it that exists writable (the
    worker creates the rest; a refused job creates nothing)."""
    if output_dir.exists():
        raise LlmoptError(f"output folder '{output_dir}' already exists", "pass a new --output, or remove the folder")
    parent = next(p for p in output_dir.parents if p.exists())
    if not parent.is_dir():
        raise LlmoptError(f"'{parent}' is a file, so '{output_dir}' cannot be made", "pass an --output in a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".llmopt-write-test-"):
            pass
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise LlmoptError(f"output folder '{parent}' is not writable ({exc.strerror})", "pass an --output in a folder you can write") from exc
        raise LlmoptError(f"cannot write to '{parent}' ({exc.strerror})", "pass another --output") from exc
