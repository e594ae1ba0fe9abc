"""The background process that runs one optimization job: `python -m llmopt.jobs.worker NAME`.

It owns the job's status from INPROGRESS on. SIGTERM (from `llmopt jobs stop`) ends the build,
removes the unfinished work folder and records STOPPED.
"""

from __future__ import annotations

import logging
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from llmopt import artifact, locations, sources
from llmopt.engine import platform
from llmopt.errors import LlmoptError
from llmopt.jobs import pipeline, store
from llmopt.recipe import parse


class Stopped(Exception):
    """Raised inside the build when a stop signal arrives."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Stopped()


@contextmanager
def _signals_held() -> Iterator[None]:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def _as_built_here(name: str, record: store.JobRecord, source: sources.Model, recipe: Any,
                   log: logging.Logger) -> str:
    """The artifact key of what this machine builds, recorded, with its memory estimate, where they
    differ from the submitting machine's. A job is keyed where it is submitted, but part of
    a key is what the building machine chooses (the dtype quantizing runs in: float32 on x86 without
    AVX-512) or reads (a calibration or workload file): a Ray node of another processor kind, or a
    file changed since, builds another artifact. The record then takes this key, so that a later job
    reuses the artifact only where it would have built the same one. Quantizing in float32 also holds
    up to about twice the memory: where this machine's build needs more than the submitting machine
    estimated (and Ray reserved), the log says so and the record takes this machine's estimate."""
    hardware = platform.detect()
    here = pipeline.artifact_key(source, recipe, hardware)
    changed: dict[str, Any] = {}
    if record.artifact_key is not None and here != record.artifact_key:
        log.warning("this machine (%s) builds another artifact than the one the job was keyed for where it was "
                    "submitted (its processor, engine or the files it reads differ): recorded under this machine's key",
                    hardware.cpu_label)
        changed["artifact_key"] = here
    needed = pipeline.peak_memory_bytes(source, recipe, hardware)
    if record.memory_bytes is not None and needed > record.memory_bytes:
        log.warning("this machine (%s) may hold %.2f GiB at its peak building the job, more than the %.2f GiB "
                    "estimated where it was submitted (what Ray reserved for it): submit such jobs from a machine of "
                    "the nodes' processor kind so that the reservation is theirs", hardware.cpu_label, needed / 2**30,
                    record.memory_bytes / 2**30)
        changed["memory_bytes"] = needed
    if changed:
        store.update(name, **changed)
    return here


def run(name: str) -> int:
    record = store.get(name)
    log = logging.getLogger(f"llmopt.job.{name}")
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request to the measuring engine says nothing
    signal.signal(signal.SIGTERM, _on_sigterm)
    workdir, output = record.workdir, record.built_dir
    assert workdir is not None and output is not None and record.output_dir is not None
    uri = record.output_dir if locations.is_uri(record.output_dir) else None
    try:
        store.update(name, status=store.INPROGRESS, started_at=time.time())
        source = sources.get(record.source)
        if source is None:
            raise LlmoptError(f"source model '{record.source}' is no longer in the store", "import it again")
        recipe = parse(record.recipe)
        key = _as_built_here(name, record, source, recipe, log)
        workdir.mkdir(parents=True, exist_ok=False)

        @contextmanager
        def finalizing() -> Iterator[None]:
            """The rename into place and the COMPLETED record happen with stop signals held off."""
            with _signals_held():
                yield
                if uri is None:
                    store.update(name, status=store.COMPLETED, artifact=str(output),
                                 artifact_hash=artifact.load(output).content_hash, ended_at=time.time())

        def report(step: str, status: str, fraction: float, seconds: float | None) -> None:
            store.set_step(name, step, status, fraction, seconds)

        manifest = pipeline.build(name, key, source, recipe, workdir, output, log, report=report,
                                  finalize_guard=finalizing)
        if uri is not None:
            _publish(output, uri, log, report)
            store.update(name, status=store.COMPLETED, artifact=uri, artifact_hash=manifest.content_hash, ended_at=time.time())
        return 0
    except Stopped:
        _remove_unpublished(output, uri)
        shutil.rmtree(workdir, ignore_errors=True)
        store.update(name, status=store.STOPPED, ended_at=time.time())
        log.info("stopped")
        return 0
    except BaseException as exc:
        _remove_unpublished(output, uri)
        shutil.rmtree(workdir, ignore_errors=True)
        reason = exc.one_line() if isinstance(exc, LlmoptError) else f"{type(exc).__name__}: {exc}"
        log.exception("job failed: %s", reason)
        store.update(name, status=store.FAILED, failure_reason=" ".join(reason.split()), ended_at=time.time())
        return 1


def _publish(built: Path, uri: str, log: logging.Logger, report: pipeline.StepReporter) -> None:
    """Copy the finished artifact to its URI, checked there; the local build becomes this machine's
    copy of it."""
    log.info("step publish: start (to %s)", uri)
    started = time.monotonic()
    report(pipeline.PUBLISH, "running", 0.0, None)
    locations.keep_copy(built, locations.publish(built, uri).content_hash)
    seconds = time.monotonic() - started
    report(pipeline.PUBLISH, "done", 1.0, seconds)
    log.info("step publish: done in %.1f s", seconds)


def _remove_unpublished(built: Path, uri: str | None) -> None:
    """A job publishing to a URI leaves no local build behind when it fails or stops (the copy
    at the URI is removed by `locations.publish`)."""
    if uri is not None:
        shutil.rmtree(built, ignore_errors=True)  # frozen, but its folders are the owner's to write


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]))
