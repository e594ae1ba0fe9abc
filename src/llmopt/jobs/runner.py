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

from llmopt import compatibility, hashing, paths, procs, sources
from llmopt.engine import platform
from llmopt.errors import LlmoptError
from llmopt.jobs import pipeline, store
from llmopt.recipe import DraftModel, Recipe
from llmopt.techniques import plan

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

    def deploy(self, **kwargs):
        from llmopt.sdk import deploy

        if self.artifact is None:
            raise LlmoptError(f"job '{self.name}' is {self.status}, it has no artifact", "deploy a COMPLETED job")
        return deploy(str(self.artifact), **kwargs)

    def __repr__(self) -> str:
        return f"Job({self.name!r}, status={self.status})"


def create(model: str, recipe: Recipe, name: str | None = None, output: str | Path | None = None, force: bool = False) -> Job:
    """Record a job, check it, and start its worker (or reuse a matching artifact).

    Every failure after the record exists is written to it (FAILED, with the reason) and raised.
    """
    name = name or f"{Path(model).name}-{recipe.name or 'custom'}-{secrets.token_hex(3)}"
    output_dir = Path(output).expanduser().resolve() if output else paths.artifacts_dir() / name
    log_path = paths.logs_dir() / f"job-{name}.log"
    record = store.JobRecord(
        name=name, source=model, source_hash=None, recipe=json.dumps(recipe.to_dict()), artifact_key=None,
        status=store.STARTING, failure_reason=None, log_path=str(log_path), output_dir=str(output_dir),
        artifact=None, pid=None, pid_create_time=None,
        progress=json.dumps({s.name: {"status": "pending", "fraction": 0.0} for s in plan(recipe)}),
        force=int(force), created_at=time.time(), started_at=None, ended_at=None,
    )
    store.insert(record)
    try:
        source = sources.resolve(model)
        store.update(name, source=source.id, source_hash=source.content_hash)
        hardware = platform.detect()
        verdict = compatibility.check(recipe, source, hardware)
        verdict.raise_if_refused()
        _check_output(output_dir)
        key = pipeline.artifact_key(source, recipe, hardware, _key_extras(recipe, source))
        store.update(name, artifact_key=key)
        previous = None if force else store.find_completed(key)
        if previous is not None:
            now = time.time()
            store.update(name, status=store.COMPLETED, artifact=previous.artifact, started_at=now, ended_at=now,
                         progress=json.dumps({"reused": {"status": "done", "fraction": 1.0, "from": previous.name}}))
            return Job(name, verdict.warnings, reused_from=previous.name)
        _spawn(name, log_path)
        return Job(name, verdict.warnings)
    except BaseException as exc:
        reason = exc.one_line() if isinstance(exc, LlmoptError) else f"{type(exc).__name__}: {exc}"
        store.update(name, status=store.FAILED, failure_reason=reason, ended_at=time.time())
        raise


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
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "llmopt.jobs.worker", name],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            # the job reports progress per step; llm-compressor's and transformers' bars would only fill its log
            env={**os.environ, "TQDM_DISABLE": "1"}, start_new_session=True,
        )
    store.update(name, pid=popen.pid, pid_create_time=procs.create_time(popen.pid))


def _check_output(output_dir: Path) -> None:
    if output_dir.exists():
        raise LlmoptError(f"output folder '{output_dir}' already exists", "pass a new --output, or remove the folder")
    parent = output_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".llmopt-write-test-"):
            pass
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise LlmoptError(f"output folder '{parent}' is not writable ({exc.strerror})", "pass an --output in a folder you can write") from exc
        raise LlmoptError(f"cannot write to '{parent}' ({exc.strerror})", "pass another --output") from exc


def _key_extras(recipe: Recipe, source: sources.Model) -> dict:
    """Inputs beyond the source and recipe that change the artifact: the draft model's content and
    quantization (the catalogue may recommend one), the calibration text (the built-in set changes
    between versions; a user's file may change) and the user's workload a speculation sweep measures on."""
    from llmopt.techniques import calibration

    extras: dict = {}
    calibration_spec = getattr(recipe.quantization, "calibration", None)
    if calibration_spec is not None:
        extras["calibration"] = calibration.fingerprint(calibration_spec)
    if isinstance(recipe.speculative, DraftModel):
        from llmopt.techniques import speculative

        draft = speculative.resolve_draft(recipe.speculative, source)
        extras["draft"] = draft.model.content_hash
        if draft.quantization is not None:
            extras["draft_quantization"] = draft.quantization.model_dump(mode="json")
            draft_calibration = getattr(draft.quantization, "calibration", None)
            if draft_calibration is not None:
                extras["draft_calibration"] = calibration.fingerprint(draft_calibration)
    sweep_file = Path(recipe.speculative.sweep.dataset) if recipe.speculative else None
    if sweep_file is not None and sweep_file.is_file():  # where speculation pays depends on the user's workload
        extras["sweep"] = hashing.file_sha256(sweep_file)
    return extras
