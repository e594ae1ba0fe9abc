"""Endpoints: running vLLM servers that llmopt started, recorded in SQLite, listed and stopped.

Records tell the truth: whenever one is read, a recorded process that is gone is marked FAILED.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from pydantic import BaseModel, Field

from llmopt import model_check, names, paths, procs, records
from llmopt.engine import compile_cache, platform, vllm
from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError

STARTING, READY, FAILED, STOPPED = "STARTING", "READY", "FAILED", "STOPPED"
STATUSES = (STARTING, READY, FAILED, STOPPED)
LIVE = (STARTING, READY)
DEFAULT_READY_TIMEOUT_S = 900.0


class Endpoint(BaseModel):
    """A deployed model. Use it as a context manager to stop it when the block ends."""

    name: str
    model: str
    model_path: str
    served_name: str
    host: str
    port: int
    pid: int | None = None
    pid_create_time: float | None = None
    status: str = STARTING
    failure_reason: str | None = None
    log_path: str
    engine: EngineConfig
    environment: dict[str, str] = Field(default_factory=dict)  # as the server was started, on this machine
    trust_remote_code: bool = False
    chat_template: str | None = None
    started_at: float
    ready_at: float | None = None
    stopped_at: float | None = None
    start: compile_cache.Start | None = None  # served from the compile cache, or compiled
    deployer_pid: int | None = None  # the process waiting for readiness: a start it does not see through is orphaned
    deployer_create_time: float | None = None
    temporary: bool = False  # deployed for one run (an evaluation): it goes when the process that deployed it does (a signal when that process ends, and the record's reconciling)
    verified: dict[str, Any] = Field(default_factory=dict)  # what each technique proved after the start
    api_key: str | None = Field(None, repr=False)  # kept in the owner-only database, never shown

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """What a client sends to be let in."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def seconds_to_ready(self) -> float | None:
        return None if self.ready_at is None else self.ready_at - self.started_at

    def stop(self) -> None:
        stop(self.name)
        self.status = STOPPED

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def to_dict(self) -> dict:
        return {**self.model_dump(mode="json", exclude={"api_key"}), "url": self.url, "authenticated": bool(self.api_key)}


ENDPOINTS = records.Table("endpoints", Endpoint, key="name", order="started_at")
Verifier = Callable[[Endpoint], dict[str, Any]]


def check_request(name: str, host: str, port: int | None, api_key: str | None, insecure: bool, timeout_s: float) -> None:
    """The name, the address (a host other than loopback needs an API key, or `insecure`) and the
    timeout: checked before anything slower, so bad input is refused at once."""
    names.check(name, "endpoint")
    vllm.check_address(host, port)
    if not vllm.is_loopback(host) and not api_key and not insecure:
        raise LlmoptError(f"binding {host} without an API key would serve the model to anyone who can reach it",
                          "pass --api-key (or set LLMOPT_API_KEY), or --insecure if the network is yours alone")
    if not 0 < timeout_s <= 86400:
        raise LlmoptError(f"timeout {timeout_s:g} s is not a wait", "pass --timeout in seconds, e.g. 900")


def launch(
    model_path: str,
    model_label: str,
    served_name: str,
    engine: EngineConfig,
    name: str,
    verify: Verifier,
    port: int | None = None,
    host: str = vllm.DEFAULT_HOST,
    timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    api_key: str | None = None,
    insecure: bool = False,
    trust_remote_code: bool = False,
    chat_template: str | None = None,
    temporary: bool = False,
    chat: bool = True,
    compiled_code_trusted: bool = False,
) -> Endpoint:
    """Claim the name, start a server, wait until it answers and `verify` has proven what its settings
    promise; on any failure the server is stopped and the record says why.

    Bad input is refused before anything is recorded or started: `check_request` first, then what
    takes longer to know (the port free, vLLM's attention on this device taking the model's head size)."""
    check_request(name, host, port, api_key, insecure, timeout_s)
    if port is None:
        port = vllm.free_port(host)
    else:
        vllm.check_port_free(host, port)
    hw = platform.detect()
    model_check.attends_here(Path(model_path), hw)
    log_path = paths.logs_dir() / f"endpoint-{name}.log"
    has_chat = chat or chat_template is not None
    env = {**vllm.environment(engine, hw), **vllm.chat_env(has_chat)}
    endpoint = Endpoint(name=name, model=model_label, model_path=model_path, served_name=served_name, host=host, port=port,
                        log_path=str(log_path), engine=engine, environment=env, trust_remote_code=trust_remote_code,
                        chat_template=chat_template, started_at=time.time(), api_key=api_key,
                        deployer_pid=os.getpid(), deployer_create_time=procs.create_time(os.getpid()), temporary=temporary)
    _claim(endpoint)
    server: vllm.ServerProcess | None = None
    try:
        log_path.unlink(missing_ok=True)
        with compile_cache.Watch(compile_cache.entry_for(model_path, engine, hw, compiled_code_trusted)) as cache:
            endpoint.environment = env = {**env, **cache.entry.env}
            path, linked = cache.served(model_path, engine)
            argv = vllm.server_argv(path, linked, served_name, host, port, trust_remote_code, chat_template,
                                    guarded=api_key is not None or not has_chat, module=vllm.LOCAL_SERVER_MODULE)
            server = vllm.start_server(argv, env, log_path, host, port, secret_env=vllm.secret_env(api_key),
                                       dies_with_caller=temporary)
            try:
                ENDPOINTS.update(name, pid=server.pid, pid_create_time=server.create_time, environment=env)
                endpoint.pid, endpoint.pid_create_time = server.pid, server.create_time
                server.wait_ready(timeout_s, endpoint.headers)
            except BaseException:
                server.stop()  # before the entry's lock goes: a compile it cut short stays marked, and no start runs beside it
                raise
            ready = round(time.time() - endpoint.started_at, 2)
            endpoint.start = cache.ready(ready, endpoint.started_at, log_path)
        endpoint.verified = verify(endpoint)
    except BaseException as exc:
        reason = exc.problem.splitlines()[0] if isinstance(exc, LlmoptError) else f"interrupted ({type(exc).__name__})"
        if server is not None:
            server.stop()
        ENDPOINTS.update(name, status=FAILED, failure_reason=reason, stopped_at=time.time())
        raise
    endpoint.status, endpoint.ready_at = READY, time.time()
    ENDPOINTS.update(name, status=READY, ready_at=endpoint.ready_at, start=endpoint.start, verified=endpoint.verified)
    return endpoint


def compile_cache_keys_in_use() -> frozenset[str]:
    """Compile-cache entries that live endpoints started from (pruning must keep them)."""
    return frozenset(e.start.key for e in list_endpoints() if e.status in LIVE and e.start is not None)


def get(name: str) -> Endpoint:
    endpoint = _load(name)
    if endpoint is None:
        raise LlmoptError(f"no endpoint named '{name}'", "see `llmopt endpoints list`")
    return endpoint


def list_endpoints(status: str | None = None) -> list[Endpoint]:
    if status is not None and status.upper() not in STATUSES:
        raise LlmoptError(f"unknown status '{status}'", f"use one of {', '.join(STATUSES)}")
    found = [_reconcile(e) for e in ENDPOINTS.select()]
    return [e for e in found if status is None or e.status == status.upper()]


def stop(name: str) -> Endpoint:
    endpoint = get(name)
    if endpoint.pid is not None:
        procs.stop_group(endpoint.pid, endpoint.pid_create_time)
        vllm.sweep_socket_folders()
    if endpoint.status in LIVE:
        ENDPOINTS.update(name, status=STOPPED, stopped_at=time.time())
    return get(name)


def follow(path: Path, alive: Callable[[], bool]) -> Iterator[str]:
    """Yield a log's lines as they are written, until `alive()` turns false and the file is drained."""
    with path.open(errors="replace") as f:
        while True:
            line = f.readline()
            if line:
                yield line
            elif alive():
                time.sleep(0.5)
            else:
                yield from f
                return


def _load(name: str) -> Endpoint | None:
    endpoint = ENDPOINTS.get(name)
    return _reconcile(endpoint) if endpoint else None


def _dead(endpoint: Endpoint) -> str | None:
    """Why a live record's server is not (or will never be) serving; None while it is, or may yet."""
    if endpoint.status not in LIVE:
        return None
    deployer_gone = ((endpoint.status == STARTING or endpoint.temporary) and endpoint.deployer_pid is not None
                     and not procs.is_alive(endpoint.deployer_pid, endpoint.deployer_create_time))
    if endpoint.pid is None:
        return "the engine was never started (the deploying process died)" if (
            deployer_gone or time.time() - endpoint.started_at >= procs.SPAWN_GRACE_S) else None
    if not procs.is_alive(endpoint.pid, endpoint.pid_create_time):
        return f"engine process {endpoint.pid} exited unexpectedly; see {endpoint.log_path}"
    if not deployer_gone:
        return None
    if endpoint.status == STARTING:
        return "the deploying process died before the engine was ready; the engine was stopped"
    return "the run it was deployed for ended without stopping it (its process died); the engine was stopped"


def _reconcile(endpoint: Endpoint) -> Endpoint:
    """A live record whose server is gone, or was left starting by a deployer that died, is FAILED,
    and what is left of its processes is stopped."""
    reason = _dead(endpoint)
    if reason is None:
        return endpoint
    if endpoint.pid is not None:
        procs.stop_group(endpoint.pid, endpoint.pid_create_time)  # an orphaned start
        procs.kill_group(endpoint.pid, endpoint.pid_create_time)  # what a dead server left (its engine core)
    ENDPOINTS.update(endpoint.name, status=FAILED, failure_reason=reason, stopped_at=time.time())
    return endpoint.model_copy(update={"status": FAILED, "failure_reason": reason})


def _claim(endpoint: Endpoint) -> None:
    """Names are unique among live endpoints; a dead endpoint's record gives its name up. Checked
    and recorded in one transaction, so two deploys of one name cannot both start a server."""
    _load(endpoint.name)  # a dead record's leftover processes are stopped before it gives its name up
    with ENDPOINTS.transaction() as conn:
        existing = ENDPOINTS.read(conn, endpoint.name)
        if existing is not None:
            if existing.status in LIVE:
                raise LlmoptError(f"an endpoint named '{endpoint.name}' is already running", "pass another --name or stop it first")
            ENDPOINTS.delete(endpoint.name, conn)
        ENDPOINTS.insert(endpoint, conn)
