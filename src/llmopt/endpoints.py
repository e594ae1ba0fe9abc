"""Endpoints: running vLLM servers that llmopt started, recorded in SQLite, listed and stopped.

Records tell the truth: whenever one is read, a recorded process that is gone is marked FAILED.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from llmopt import db, paths, procs
from llmopt.engine import compile_cache
from llmopt.engine import metrics as engine_metrics
from llmopt.engine import vllm
from llmopt.errors import LlmoptError
from llmopt.serving import ServingSpec

STARTING, READY, FAILED, STOPPED = "STARTING", "READY", "FAILED", "STOPPED"
LIVE = (STARTING, READY)
DEFAULT_READY_TIMEOUT_S = 900.0


@dataclass
class Endpoint:
    """A deployed model. Use it as a context manager to stop it when the block ends."""

    name: str
    model: str
    model_path: str
    host: str
    port: int
    pid: int | None
    pid_create_time: float | None
    status: str
    failure_reason: str | None
    log_path: str
    engine_args: str
    engine_env: str
    started_at: float
    ready_at: float | None
    stopped_at: float | None
    verification: str | None = None  # JSON: what was proven after start (e.g. speculation running)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def served_name(self) -> str:
        return str(json.loads(self.engine_args).get("served-model-name", self.model))

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
        data = asdict(self)
        data["engine_args"] = json.loads(self.engine_args)
        data["engine_env"] = json.loads(self.engine_env)
        data["verification"] = json.loads(self.verification) if self.verification else None
        data["url"] = self.url
        return data


def deploy(
    spec: ServingSpec,
    name: str | None = None,
    port: int | None = None,
    host: str = vllm.DEFAULT_HOST,
    timeout_s: float = DEFAULT_READY_TIMEOUT_S,
) -> Endpoint:
    """Start a server for `spec`, wait until it answers, and record it; on failure record why."""
    name = name or f"{spec.served_name}-{secrets.token_hex(3)}"
    _claim_name(name)
    if port is None:
        port = vllm.free_port(host)
    else:
        vllm.check_port_free(host, port)
    log_path = paths.logs_dir() / f"endpoint-{name}.log"
    log_path.unlink(missing_ok=True)
    args = spec.args()
    with compile_cache.Watch(compile_cache.entry_for(spec.model_path, args)) as cache:
        env = {**spec.env, **cache.entry.env}
        server = vllm.start_server(spec.model_path, args, env, log_path, host, port)
        endpoint = Endpoint(
            name=name,
            model=spec.model_label,
            model_path=spec.model_path,
            host=host,
            port=port,
            pid=server.pid,
            pid_create_time=server.create_time,
            status=STARTING,
            failure_reason=None,
            log_path=str(log_path),
            engine_args=json.dumps(args),
            engine_env=json.dumps(env),
            started_at=time.time(),
            ready_at=None,
            stopped_at=None,
        )
        _insert(endpoint)
        try:
            server.wait_ready(timeout_s)
            started = cache.ready(round(time.time() - endpoint.started_at, 2))
            verification = _verify(endpoint)
        except BaseException as exc:
            reason = exc.problem.splitlines()[0] if isinstance(exc, LlmoptError) else f"interrupted ({type(exc).__name__})"
            server.stop()
            _update(name, status=FAILED, failure_reason=reason, stopped_at=time.time())
            raise
    endpoint.status, endpoint.ready_at = READY, time.time()
    verification["compile_cache"] = started
    endpoint.verification = json.dumps(verification)
    _update(name, status=READY, ready_at=endpoint.ready_at, verification=endpoint.verification)
    return endpoint


def compile_cache_keys_in_use() -> frozenset[str]:
    """Compile-cache entries that live endpoints started from (pruning must keep them)."""
    dirs = (json.loads(e.engine_env).get("TORCHINDUCTOR_CACHE_DIR") for e in list_endpoints() if e.status in LIVE)
    return frozenset(Path(d).parent.name for d in dirs if d)


def _verify(endpoint: Endpoint) -> dict:
    """Prove what the configuration promises; today that is speculative decoding actually running."""
    if "speculative-config" not in json.loads(endpoint.engine_args):
        return {}
    return {"speculative": engine_metrics.verify_speculation(endpoint.url, endpoint.served_name)}


def get(name: str) -> Endpoint:
    endpoint = _load(name)
    if endpoint is None:
        raise LlmoptError(f"no endpoint named '{name}'", "see `llmopt endpoints list`")
    return endpoint


def list_endpoints(status: str | None = None) -> list[Endpoint]:
    with db.connect() as conn:
        names = [r["name"] for r in conn.execute("SELECT name FROM endpoints ORDER BY started_at")]
    found = [e for e in (_load(n) for n in names) if e is not None]
    return [e for e in found if status is None or e.status == status.upper()]


def stop(name: str) -> Endpoint:
    endpoint = get(name)
    if endpoint.pid is not None:
        procs.stop_group(endpoint.pid, endpoint.pid_create_time)
    if endpoint.status in LIVE:
        _update(name, status=STOPPED, stopped_at=time.time())
    return get(name)


def logs(name: str) -> Path:
    return Path(get(name).log_path)


def follow(path: Path, alive) -> Iterator[str]:
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
    with db.connect() as conn:
        row = conn.execute("SELECT * FROM endpoints WHERE name = ?", (name,)).fetchone()
    if row is None:
        return None
    endpoint = Endpoint(**dict(row))
    if endpoint.status in LIVE and not procs.is_alive(endpoint.pid, endpoint.pid_create_time):
        reason = f"engine process {endpoint.pid} exited unexpectedly; see {endpoint.log_path}"
        _update(name, status=FAILED, failure_reason=reason, stopped_at=time.time())
        endpoint.status, endpoint.failure_reason = FAILED, reason
    return endpoint


def _claim_name(name: str) -> None:
    """Names are unique among live endpoints; a dead endpoint's record gives its name up."""
    existing = _load(name)
    if existing is None:
        return
    if existing.status in LIVE:
        raise LlmoptError(f"an endpoint named '{name}' is already running", "pass another --name or stop it first")
    with db.connect() as conn:
        conn.execute("DELETE FROM endpoints WHERE name = ?", (name,))


def _insert(endpoint: Endpoint) -> None:
    data = asdict(endpoint)
    columns = ", ".join(data)
    with db.connect() as conn:
        conn.execute(f"INSERT INTO endpoints ({columns}) VALUES ({', '.join(':' + c for c in data)})", data)


def _update(name: str, **fields: object) -> None:
    assignments = ", ".join(f"{k} = :{k}" for k in fields)
    with db.connect() as conn:
        conn.execute(f"UPDATE endpoints SET {assignments} WHERE name = :name", {**fields, "name": name})
