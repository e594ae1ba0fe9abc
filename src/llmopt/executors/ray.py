"""The Ray executor: the worker as a Ray job, submitted through Ray's job API (the dashboard's
address) to a cluster whose nodes share this machine's filesystem: the llmopt home (records, logs,
models, artifacts) and the Python that runs llmopt. Ray reserves the job's CPUs, GPUs and memory
and runs the worker where they are free; the worker reads and writes the job's record as it does
locally. Ray is an optional dependency, imported only here, and only when a Ray job is asked for.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shlex
import time
from pathlib import Path
from typing import Any

import httpx

from llmopt import paths, procs
from llmopt.errors import LlmoptError
from llmopt.executors.base import STOP_GRACE_S, Ended, Executor, Kind, Resources, Worker, worker_command

DEFAULT_ADDRESS = "http://127.0.0.1:8265"  # the dashboard `ray start --head` serves
CONNECT_TIMEOUT_S = 5.0
ACTIVE = ("PENDING", "RUNNING")  # Ray's job statuses before an end (then STOPPED, SUCCEEDED or FAILED)
INSTALL = "pip install 'llmopt[ray]'"


def dashboard_address(given: str | None) -> str:
    """The Ray dashboard's http(s) address (where the job API is), checked for form."""
    text = (given or DEFAULT_ADDRESS).strip()
    if "://" not in text:
        text = "http://" + text
    try:
        url = httpx.URL(text)
    except httpx.InvalidURL:
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host:
        raise LlmoptError(f"'{given}' is not the address of a Ray dashboard",
                          f"pass one such as {DEFAULT_ADDRESS} (Ray's job API; not a ray:// or GCS address)")
    return text.rstrip("/")


@functools.lru_cache(maxsize=None)
def _client(address: str) -> Any:
    """A job-submission client for the cluster at `address`, made once per process."""
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError as exc:
        raise LlmoptError(f"--executor ray needs Ray, which is not installed here ({exc})", INSTALL) from None
    try:  # Ray's client (requests, no timeout) would wait minutes on a host that drops packets
        httpx.get(address + "/api/version", timeout=CONNECT_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise LlmoptError(f"Ray at {address} does not answer ({type(exc).__name__})",
                          "start Ray (`ray start --head`), or pass its dashboard's address with --ray-address") from None
    try:
        return JobSubmissionClient(address)
    except (OSError, RuntimeError) as exc:
        raise LlmoptError(f"Ray at {address} refused its job API: {' '.join(str(exc).split())}",
                          "pass the dashboard's address of a Ray 2.8 or newer cluster with --ray-address") from None


def submission_id(job: str, kind: Kind = "job") -> str:
    """`llmopt-JOB-HOME`: found from the job's name, and distinct for llmopt homes that share a
    cluster (Ray refuses a submission id twice, and each home names its jobs alone)."""
    label = job if kind == "job" else f"{kind}-{job}"
    return f"llmopt-{label}-{hashlib.sha256(str(paths.home()).encode()).hexdigest()[:8]}"


def entrypoint(job: str, log_path: Path, kind: Kind = "job") -> str:
    """The local executor's worker command, word for word, its output appended to the job's own log
    (so `llmopt jobs logs` reads it wherever the worker ran). A worker killed outright (SIGKILL, the
    OOM killer) would leave its measuring engine running: Ray 2.60 does not clean up after an
    entrypoint that dies, so the shell Ray starts (the leader of the job's process group) kills the
    group then, as reading a dead local job's record does."""
    worker = f"{shlex.join(worker_command(job, kind))} < /dev/null >> {shlex.quote(str(log_path))} 2>&1"
    return f"{worker}; code=$?; if [ $code -gt 128 ]; then kill -KILL 0; fi; exit $code"


def environment() -> dict[str, str]:
    """What the worker needs beyond the Ray node's environment: this llmopt home, the same llmopt
    (PYTHONPATH, when llmopt comes from one), no progress bars in the log, and the stop grace period
    (Ray's job supervisor reads it: its default, 3 s, is too short to clean up and record STOPPED)."""
    env = {paths.HOME_ENV: str(paths.home()), "TQDM_DISABLE": "1", "RAY_JOB_STOP_WAIT_TIME_S": str(int(STOP_GRACE_S))}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def _not_found(exc: Exception) -> bool:
    return "status code 404" in str(exc)  # how Ray's client reports a job it does not know


def _one_line(text: str | None, limit: int = 300) -> str:
    return " ".join((text or "").split())[:limit]


class RayExecutor(Executor):
    name = "ray"

    def __init__(self, address: str) -> None:
        self.address = address

    def check(self) -> None:
        """Ray is installed here and the cluster answers."""
        _client(self.address)

    def start(self, name: str, log_path: Path, resources: Resources, kind: Kind = "job") -> dict[str, object]:
        os.close(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))  # the owner's alone, as locally
        sid = submission_id(name, kind)
        try:
            _client(self.address).submit_job(
                entrypoint=entrypoint(name, log_path, kind), submission_id=sid, runtime_env={"env_vars": environment()},
                entrypoint_num_cpus=resources.cpus, entrypoint_num_gpus=resources.gpus or None,
                entrypoint_memory=resources.memory_bytes, metadata={f"llmopt_{kind}": name},
            )
        except (OSError, RuntimeError) as exc:
            raise LlmoptError(f"Ray at {self.address} did not take job '{sid}': {_one_line(str(exc))}",
                              "see `ray job list`, or pass another --name") from None
        return {"ray_address": self.address, "ray_submission_id": sid}

    def stop(self, worker: Worker) -> None:
        """Ray's stop: SIGTERM to the worker and its children, SIGKILL after RAY_JOB_STOP_WAIT_TIME_S."""
        sid = worker.ray_submission_id
        if sid is None:
            return  # never submitted: nothing runs
        client = _client(self.address)
        try:
            client.stop_job(sid)
            deadline = time.monotonic() + STOP_GRACE_S + 10
            while str(client.get_job_status(sid)) in ACTIVE and time.monotonic() < deadline:
                time.sleep(0.5)
        except (OSError, RuntimeError) as exc:
            if not _not_found(exc):
                raise LlmoptError(f"Ray at {self.address} did not stop job '{sid}': {_one_line(str(exc))}",
                                  f"stop it with `ray job stop {sid}`") from None

    def ended(self, worker: Worker) -> Ended | None:
        """From Ray's job status; None also when Ray cannot be asked (not installed here, or the
        cluster does not answer): whether the worker runs cannot be told then."""
        sid = worker.ray_submission_id
        if sid is None:
            if time.time() - worker.created_at < procs.SPAWN_GRACE_S:
                return None
            return Ended("the job was never submitted to Ray (the creating process died)")
        try:
            info = _client(self.address).get_job_info(sid)
        except LlmoptError:
            return None
        except (OSError, RuntimeError) as exc:
            if _not_found(exc):
                return Ended(f"Ray at {self.address} has no job '{sid}' (was the cluster restarted?); see {worker.log_path}")
            return None
        status = str(info.status)
        if status in ACTIVE:
            return None
        if status == "STOPPED":
            return Ended(f"Ray job '{sid}' was stopped before its worker recorded an end; see {worker.log_path}", stopped=True)
        # Ray's message on a failure goes on with the log's tail: the worker's log is the job's own
        detail = _one_line((info.message or "no message from Ray").split(", last available logs")[0])
        return Ended(f"Ray job '{sid}' ended {status} before its worker recorded an end ({detail}); see {worker.log_path}")
