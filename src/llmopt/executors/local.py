"""The local executor, the default: the worker as a background process on this machine, in a session
of its own (the measuring engine it starts shares its process group, so one signal reaches both)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from llmopt import procs
from llmopt.executors.base import STOP_GRACE_S, Ended, Executor, Kind, Resources, Worker, worker_command


class LocalExecutor(Executor):
    name = "local"

    def start(self, name: str, log_path: Path, resources: Resources, kind: Kind = "job") -> dict[str, object]:
        """The process gets this machine as it is: nothing is reserved, so `resources` go unused."""
        with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            popen = subprocess.Popen(
                worker_command(name, kind), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                # the job reports progress per step; llm-compressor's and transformers' bars would only fill its log
                env={**os.environ, "TQDM_DISABLE": "1"}, start_new_session=True,
            )
        return {"pid": popen.pid, "pid_create_time": procs.create_time(popen.pid)}

    def stop(self, worker: Worker) -> None:
        if worker.pid is not None:
            procs.stop_group(worker.pid, worker.pid_create_time, grace_s=STOP_GRACE_S)

    def ended(self, worker: Worker) -> Ended | None:
        found = lost_end(worker)
        if found is not None and worker.pid is not None:
            procs.kill_group(worker.pid, worker.pid_create_time)  # an engine the dead worker started shares its group
        return found


def lost_end(worker: Worker) -> Ended | None:
    """How a recorded local process ended without recording it, or None while it runs or may still
    start; nothing is signalled (a foreground evaluation's pid is its caller's)."""
    lost = procs.lost(worker.pid, worker.pid_create_time, worker.created_at)
    if lost is None:
        return None
    if worker.pid is None:
        return Ended("the worker was never started (the process creating it died)")
    return Ended(f"worker process {worker.pid} died without finishing; see {worker.log_path}")
