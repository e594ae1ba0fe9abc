"""An engine started on what a job is building (or on its source), as the job's steps need it:
in the worker's process group, so a stopped job takes it down, and on its compile-cache entry."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from llmopt import paths
from llmopt.engine import compile_cache, vllm
from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError
from llmopt.techniques.base import BuildContext, Running

SERVED_NAME = "artifact-under-test"
READY_TIMEOUT_S = 900.0


@dataclass
class Served:
    server: vllm.ServerProcess
    log_path: Path
    ready_seconds: float
    start: compile_cache.Start
    cache_entry: compile_cache.Entry

    @property
    def running(self) -> Running:
        return Running(self.server.url, SERVED_NAME, self.log_path, {})


@contextmanager
def served(ctx: BuildContext, model_path: str, engine: EngineConfig, purpose: str) -> Iterator[Served]:
    """A vLLM server for `model_path` in the worker's process group (a stopped job takes it down),
    started against its compile-cache entry; its log is `<purpose><build label>.log`."""
    config = vllm.for_checkpoint(vllm.located(engine, ctx.workdir), model_path, ctx.hardware)
    log_path = paths.logs_dir() / f"{purpose}{ctx.workdir.name.removeprefix('.build')}.log"
    ctx.log.info("serving %s; engine log: %s", model_path, log_path)
    host = vllm.DEFAULT_HOST
    with compile_cache.Watch(compile_cache.entry_for(model_path, config, ctx.hardware)) as cache:
        started, started_at = time.monotonic(), time.time()
        port = vllm.free_port(host)
        env = {**vllm.environment(config, ctx.hardware), **cache.entry.env}
        path, linked = cache.served(model_path, config)
        server = vllm.start_server(vllm.server_argv(path, linked, SERVED_NAME, host, port, module=vllm.LOCAL_SERVER_MODULE), env, log_path, host, port,
                                   own_session=False, dies_with_caller=True)
        try:
            server.wait_ready(READY_TIMEOUT_S)
            ready = round(time.monotonic() - started, 2)
            start = cache.ready(ready, started_at, log_path)
            yield Served(server, log_path, ready, start, cache.entry)
        except Exception as exc:
            failure = None if isinstance(exc, LlmoptError) else vllm.engine_failure(log_path)
            if failure:  # a request's HTTP 500 says nothing of why: the engine's own error does
                raise LlmoptError(f"the engine died while serving ({purpose}): {failure}",
                                  f"its log is {log_path}; report it with that log") from exc
            raise
        finally:
            server.stop()
