"""Create, start, follow and stop optimization jobs. The SDK's `optimize()` lands here."""

from __future__ import annotations

import errno
import secrets
import tempfile
import time
from pathlib import Path

from typing import Any

from llmopt import executors, locations, model_check, names, paths, serving, sources, techniques
from llmopt.endpoints import Endpoint
from llmopt.engine import platform
from llmopt.errors import LlmoptError
from llmopt.jobs import pipeline, store


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
    def artifact(self) -> Path | str | None:
        """The artifact's folder, or its URI when the job published it to one."""
        record = self.record
        if record.status != store.COMPLETED or not record.artifact:
            return None
        return record.artifact if locations.is_uri(record.artifact) else Path(record.artifact)

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


def create(model: str, recipe: Any, name: str | None = None, output: str | Path | None = None, force: bool = False,
           executor: str = "local", ray_address: str | None = None) -> Job:
    """Check a job, then record it and start its worker with `executor` (or reuse a matching artifact).

    Everything checkable before the worker starts is checked first (the executor too: Ray installed
    and answering): a refused job leaves no record and no folder. Once recorded, a job keeps its
    record whatever happens, with the reason if it fails.
    """
    name = names.check(name, "job") if name else f"{names.slug(Path(model).name)[:40]}-{recipe.name or 'custom'}-{secrets.token_hex(3)}"
    if store.taken(name):
        raise LlmoptError(f"a job named '{name}' already exists", "pass another --name")
    if output is not None and locations.is_uri(output):
        output_dir: str | Path = str(output).rstrip("/")
        locations.check_new(str(output_dir))
    else:
        output_dir = Path(output).expanduser().resolve() if output else paths.artifacts_dir(create=False) / name
        _check_output(output_dir)
    runs_on = executors.choose(executor, ray_address)
    techniques.check_inputs(recipe)
    source = sources.resolve(model)
    hardware = platform.detect()
    model_check.attends_here(Path(source.path), hardware)
    verdict = techniques.check(recipe, source, hardware)
    verdict.raise_if_refused()
    key = pipeline.artifact_key(source, recipe, hardware)
    log_path = paths.logs_dir() / f"job-{name}.log"
    record = store.JobRecord(
        name=name, source=source.id, source_hash=source.content_hash, recipe=recipe.to_dict(), artifact_key=key,
        log_path=str(log_path), output_dir=str(output_dir),
        progress={s: store.StepProgress() for s in _steps(recipe, output_dir)}, force=force, created_at=time.time(),
        executor=runs_on.name,
    )
    previous = None if force else store.find_completed(key)
    if previous is not None:
        now = time.time()
        store.claim(record.model_copy(update={
            "status": store.COMPLETED, "artifact": previous.artifact, "artifact_hash": previous.artifact_hash,
            "started_at": now, "ended_at": now,
            "progress": {"reused": store.StepProgress(status="done", fraction=1.0, reused_from=previous.name)}}))
        return Job(name, verdict.warnings, reused_from=previous.name)
    resources = _resources(source, recipe, hardware)
    store.claim(record.model_copy(update={"memory_bytes": resources.memory_bytes}))
    try:
        store.update(name, **runs_on.start(name, log_path, resources))
    except BaseException as exc:
        store.update(name, status=store.FAILED, failure_reason=f"the worker did not start: {type(exc).__name__}: {exc}",
                     ended_at=time.time())
        raise
    return Job(name, verdict.warnings)


def stop(name: str) -> store.JobRecord:
    """Stop a job's worker through its executor (it removes its work folder and records STOPPED)."""
    record = store.get(name)
    if record.status not in store.ACTIVE:
        raise LlmoptError(f"job '{name}' is {record.status}, not running", "nothing to stop")
    runs_on = executors.of(record)
    runs_on.check()  # a Ray job needs Ray answering: refused before the record says STOPPING
    store.update(name, status=store.STOPPING)
    runs_on.stop(record)
    deadline = time.monotonic() + 5
    while store.get(name).status in store.ACTIVE and time.monotonic() < deadline:
        time.sleep(0.2)
    return store.get(name)


def _resources(source: sources.Model, recipe: Any, hardware: platform.Hardware) -> executors.Resources:
    """What the worker needs where it runs. On CPU, every core (quantizing and the measuring engine
    use them all); on GPUs, one per tensor-parallel shard, and a core for each shard's worker plus
    two (the engine core and the API server), as exports assume. Memory: `pipeline.peak_memory_bytes`."""
    gpus = techniques.engine(recipe).tensor_parallel_size if hardware.device == "cuda" else 0
    return executors.Resources(cpus=float(gpus + 2 if gpus else hardware.cores),
                               memory_bytes=pipeline.peak_memory_bytes(source, recipe, hardware), gpus=gpus)


def _steps(recipe: Any, output_dir: str | Path) -> list[str]:
    return [s.name for s in pipeline.plan(recipe)] + ([pipeline.PUBLISH] if locations.is_uri(output_dir) else [])


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
