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
from typing import Iterator

from llmopt import sources
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


def run(name: str) -> int:
    record = store.get(name)
    log = logging.getLogger(f"llmopt.job.{name}")
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request to the measuring engine says nothing
    signal.signal(signal.SIGTERM, _on_sigterm)
    workdir, output = record.workdir, Path(record.output_dir or "")
    assert workdir is not None
    try:
        store.update(name, status=store.INPROGRESS, started_at=time.time())
        source = sources.get(record.source)
        if source is None:
            raise LlmoptError(f"source model '{record.source}' is no longer in the store", "import it again")
        recipe = parse(record.recipe)
        workdir.mkdir(parents=True, exist_ok=False)

        @contextmanager
        def finalizing() -> Iterator[None]:
            """The rename into place and the COMPLETED record happen with stop signals held off."""
            with _signals_held():
                yield
                store.update(name, status=store.COMPLETED, artifact=str(output), ended_at=time.time())

        pipeline.build(
            name, record.artifact_key or "", source, recipe, workdir, output, log,
            report=lambda step, status, fraction, seconds: store.set_step(name, step, status, fraction, seconds),
            finalize_guard=finalizing,
        )
        return 0
    except Stopped:
        shutil.rmtree(workdir, ignore_errors=True)
        store.update(name, status=store.STOPPED, ended_at=time.time())
        log.info("stopped")
        return 0
    except BaseException as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        reason = exc.one_line() if isinstance(exc, LlmoptError) else f"{type(exc).__name__}: {exc}"
        log.exception("job failed: %s", reason)
        store.update(name, status=store.FAILED, failure_reason=" ".join(reason.split()), ended_at=time.time())
        return 1


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]))
