"""vLLM's phases of a step (`PHASES`), each timed around vLLM's own method: wall time and the
calling thread's CPU time, whose difference is time the thread waited (for a core, the GIL, or
OpenMP's other thread). Timed in this process (`Timer`), or in a served engine core, whose server
imports this folder's `sitecustomize` when the folder is on its PYTHONPATH and `ENV` names the file
to write (`served_step.py`).

Kept apart from the benchmarks' other imports: in a server it runs as every Python process starts,
before vLLM is imported, and must import nothing heavy.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ENV = "LLMOPT_PHASE_TIMES"  # the JSON-lines file a served engine core appends its phases to
FLUSH = ".flush"  # a file of this suffix beside it asks the engine core for the phases timed so far
# vLLM 0.32's methods a step passes through once each, by module and qualified name: the engine
# core's step holds the rest but the offline engine's own step (output processing) and the
# served front end's work; the model runner's `execute_model` holds the forward and the `lm_head`.
PHASES = (("vllm.v1.engine.llm_engine", "LLMEngine.step"), ("vllm.v1.engine.core", "EngineCore.step"),
          ("vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
          ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model"),
          ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._update_states"),
          ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._prepare_inputs"),
          ("vllm.v1.worker.block_table", "BlockTable.compute_slot_mapping"),
          ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._build_attention_metadata"),
          ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward"),
          ("vllm.model_executor.layers.logits_processor", "LogitsProcessor.forward"),
          ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens"), ("vllm.v1.sample.sampler", "Sampler.forward"),
          ("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output"),
          ("vllm.v1.engine.output_processor", "OutputProcessor.process_outputs"))


class Timer:
    """Wraps each of `PHASES` whose module is imported (a timer costs about a microsecond a call)."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {name: [] for _, name in PHASES}
        self.cpu: dict[str, list[float]] = {name: [] for _, name in PHASES}
        self._installed: set[str] = set()

    def install(self, import_modules: bool = False) -> None:
        """Wrap what is imported now (with `import_modules`, everything), again until every phase is.
        Install before the engine is made: vLLM's engine core binds its step method then."""
        for module, name in PHASES:
            if import_modules:
                importlib.import_module(module)
            if name in self._installed or module not in sys.modules:
                continue
            class_name, attribute = name.split(".")
            owner = getattr(sys.modules[module], class_name, None)
            if owner is None:  # its module is still being imported (in another thread)
                continue
            method = getattr(owner, attribute)

            def timed(*args, _method=method, _wall=self.wall[name], _cpu=self.cpu[name], **kwargs):
                started, cpu = time.perf_counter(), time.thread_time()
                try:
                    return _method(*args, **kwargs)
                finally:
                    _wall.append(time.perf_counter() - started)
                    _cpu.append(time.thread_time() - cpu)

            setattr(owner, attribute, timed)
            self._installed.add(name)

    def installed(self, name: str) -> bool:
        return name in self._installed

    def take(self) -> dict[str, dict[str, float]]:
        """Median milliseconds a call, wall and CPU, and the calls, by phase called; then forgets them."""
        found = {name: {"wall_ms": round(statistics.median(self.wall[name]) * 1e3, 3),
                        "cpu_ms": round(statistics.median(self.cpu[name]) * 1e3, 3), "calls": len(self.wall[name])}
                 for name in self.wall if self.wall[name]}
        for times in (*self.wall.values(), *self.cpu.values()):
            times.clear()
        return found


def _engine_core() -> bool:
    """Whether this process is vLLM's engine core, by the title vLLM gives it."""
    return Path("/proc/self/cmdline").read_bytes().startswith(b"VLLM::EngineCore")


def serve_in_background(out: Path) -> None:
    """In a server: time the phases in each process forked from this one (vLLM's engine core, as
    llmopt starts it), and have the engine core append them to `out`, with its pid, whenever the
    benchmark creates `out` + FLUSH. Installed at the fork, before the engine core makes its engine."""
    timer = Timer()
    flush = out.with_name(out.name + FLUSH)

    def watch() -> None:
        while True:
            time.sleep(0.1)
            timer.install()
            if flush.exists() and timer.installed("EngineCore.step") and _engine_core():
                with out.open("a") as f:
                    f.write(json.dumps({"pid": os.getpid(), "phases": timer.take()}) + "\n")
                flush.unlink(missing_ok=True)

    def forked() -> None:
        timer.install()
        threading.Thread(target=watch, daemon=True).start()

    os.register_at_fork(after_in_child=forked)
