"""Engine servers forked from a process that has imported vLLM's server once.

Every start of `engine/serve.py` used to begin with its imports: vLLM, torch, Inductor,
transformers, about 5,000 modules, 13-16 s of one core on a Zen 3 EPYC, more than a third of a
precompiled start of SmolLM2-135M (25.8 s there). A process that starts several engines (a job
measuring the source and then its artifact, a sweep serving without and with speculation,
`evaluate --compare`, `recommend`, the studio, the test suite) paid them each time. Here it pays
them once: its zygote, a child started on its first engine start, imports what the server
imports and then forks a server for each start, which runs `engine/serve.py` as `python -m` would.

What a forked server cannot change is what its modules read from the environment when they were
imported (the preloaded libraries, OpenMP's settings, `VLLM_USE_LAYERNAME`, Hugging Face's
folders). A zygote therefore imports under the start's own environment, and serves only starts
whose environment agrees with it on every variable such a module could read at import
(`import_key`); the rest of a start's environment (`PER_START`: the KV cache size, the compile
cache's folders, the kernel switches `engine/serve.py` reads when it runs, the socket folder, the
API key) is set in the forked server before it runs. A start that agrees with no zygote gets one
of its own, up to `MAX_ZYGOTES` a process; past that, and wherever a zygote fails, the server is
spawned as before. With `LLMOPT_SPAWNED_SERVER` set every server is spawned (to measure the
difference).

A forked server is the zygote's child, in the caller's process group, as a spawned one was:
`own_session` gives it a session of its own, and `dies_with_caller` a SIGTERM when its zygote
ends, which it does as soon as its caller does (its requests come on a pipe from the caller, which
the kernel closes when the caller dies, however it dies). The zygote reaps its children; their
exit status is not kept (callers read a server's end in its log).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from llmopt import paths
from llmopt.engine import (avx2_int8_linear, guard, kernels, platform, prefill_attention, small_batch_linear,
                           weight_only_int8_linear)

OFF_ENV = "LLMOPT_SPAWNED_SERVER"  # set: every server is spawned and imports for itself (benchmarks)
SERVER_MODULE = "llmopt.engine.serve"
# what a server imports before it serves, beyond `SERVER_MODULE` itself: vLLM's server entry point,
# and what its engine core (forked from the server) imports to build the model
PRELOADED = ("vllm.entrypoints.launchers.api_server.entry", "vllm.v1.engine.core", "vllm.v1.worker.cpu_worker",
             "vllm.v1.worker.cpu_model_runner")
MAX_ZYGOTES = 3  # each holds ~600 MB of imported modules, shared with the servers it forks
# the variables a module could read when imported: a zygote imports under the start's values
IMPORT_PREFIXES = ("VLLM_", "TORCH", "LD_", "OMP_", "KMP_", "MKL_", "GOMP_", "PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS_",
                   "TOKENIZERS_", "CUDA", "NUMBA_", "TRITON_", "LLMOPT_")
# per-start variables that nothing reads before the server runs: vLLM's through `vllm.envs` when
# asked (no module reads these at import), Inductor's cache folder when it compiles, and llmopt's
# switches, which `engine/serve.py` reads as it starts
PER_START = frozenset({
    "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CACHE_ROOT", "VLLM_RPC_BASE_PATH", guard.API_KEY_ENV,
    "VLLM_ENABLE_V1_MULTIPROCESSING", "TORCHINDUCTOR_CACHE_DIR", platform.PACKED_LINEAR_ENV, small_batch_linear.ENV,
    avx2_int8_linear.ENV, weight_only_int8_linear.ENV, prefill_attention.ENV, kernels.LIBRARY_ENV,
    platform.INDUCTOR_KERNELS_ENV, platform.MODEL_INFOS_ENV, platform.SPAWNED_CORE_ENV, platform.VLLM_ATTENTION_CALLS_ENV,
    guard.NO_CHAT_ENV, paths.HOME_ENV,
})
_PR_SET_PDEATHSIG = 1
READY = "imported\n"  # what a zygote says once it has imported


def import_key(module: str, env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What a zygote for a start of `python -m module` must have imported: the module, under the
    start's values of the variables a module could read at import."""
    return (("", module), *sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_PREFIXES) and k not in PER_START))


@dataclass
class Zygote:
    process: subprocess.Popen
    key: tuple[tuple[str, str], ...]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fork(self, argv: list[str], env: dict[str, str], log_path: Path, own_session: bool, dies_with_caller: bool) -> int:
        """The pid of a server forked to run `argv` (`python -m SERVER_MODULE ...`)."""
        request = {"args": argv[3:], "env": env, "log": str(log_path), "cwd": os.getcwd(), "session": own_session,
                   "dies_with_caller": dies_with_caller}
        with self.lock:
            assert self.process.stdin is not None and self.process.stdout is not None
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            answer = self.process.stdout.readline()
        if not answer:
            raise OSError(f"the zygote {self.process.pid} ended (exit {self.process.poll()})")
        return int(json.loads(answer)["pid"])


_ZYGOTES: list[Zygote] = []
_FAILED: set[tuple[tuple[str, str], ...]] = set()  # keys whose zygote could not import: not tried again
_LOCK = threading.Lock()


def forks(argv: list[str]) -> bool:
    """Whether a start of `argv` can come from a zygote: llmopt's own server, run by this Python."""
    return argv[:3] == [sys.executable, "-m", SERVER_MODULE] and os.environ.get(OFF_ENV) != "1"


def start(argv: list[str], env: dict[str, str], log_path: Path, own_session: bool, dies_with_caller: bool) -> int | None:
    """A process forked from this process's zygote to run `argv` (`python -m MODULE ...`) as the
    start's environment asks: its pid, or None where none can (the caller then spawns it)."""
    module = argv[2]
    key = import_key(module, env)
    with _LOCK:
        for zygote in list(_ZYGOTES):
            if zygote.process.poll() is not None:
                _ZYGOTES.remove(zygote)
        zygote = next((z for z in _ZYGOTES if z.key == key), None)
        if zygote is None:
            if len(_ZYGOTES) >= MAX_ZYGOTES or key in _FAILED:
                return None
            zygote = _imported(module, env, key)
            if zygote is None:
                _FAILED.add(key)
                return None
            _ZYGOTES.append(zygote)
    try:
        return zygote.fork(argv, env, log_path, own_session, dies_with_caller)
    except (OSError, ValueError, KeyError):  # a zygote that died: spawned instead
        with _LOCK:
            if zygote in _ZYGOTES:
                _ZYGOTES.remove(zygote)
        zygote.process.kill()
        return None


def _imported(module: str, env: dict[str, str], key: tuple[tuple[str, str], ...]) -> Zygote | None:
    """A zygote for `module`, in this process's group and session, once it has imported (None if
    it could not); its own output goes nowhere (a run's goes to its log). The wait for its imports
    comes before any request: interrupted there (a ctrl-c), nothing has been forked, and the zygote
    is killed; a request is then answered in milliseconds, as a spawn is."""
    preloaded = PRELOADED if module == SERVER_MODULE else ()
    process = subprocess.Popen([sys.executable, "-m", __name__, str(os.getpid()), module, *preloaded], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
    ready = False
    try:
        assert process.stdout is not None
        ready = process.stdout.readline() == READY
    finally:
        if not ready:
            process.kill()
            process.wait()
    return Zygote(process, key) if ready else None


def _run_forked(module: str, request: dict, zygote_pid: int, cores: set[int]) -> None:
    """In the forked child: become the run the request describes, and end as it ends."""
    # Intel OpenMP, loaded with torch in the zygote, pins a forked child's main thread to the first
    # of its cores, and every thread and process the server starts would inherit that one core (a
    # forked server's engine core ran on core 0 of two): the run gets the zygote's cores back
    os.sched_setaffinity(0, cores)
    if request["session"]:
        os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its engine core is its own child to wait for
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request["dies_with_caller"]:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != zygote_pid:  # the zygote, and so its caller, ended before the signal was armed
            os._exit(128 + signal.SIGTERM)
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    if sys.path and sys.path[0] == os.getcwd():  # `python -m` puts its folder first
        sys.path[0] = request["cwd"]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [sys.modules[module].__file__ or module, *request["args"]]
    _titled(" ".join([sys.executable, "-m", module, *request["args"]]))
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    # the exit a spawned run makes, less the interpreter's teardown, where modules a spawned server
    # never imports report their leaks and bury the server's last words
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _titled(title: str) -> None:
    """`ps` shows a forked run as the command a spawned one was, and vLLM can name its processes
    (its engine core `VLLM::EngineCore`): setproctitle writes over the zygote's command line, which
    it learned to find in the zygote (`_main`), before the forked run's environment moved."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def _main(caller: int, modules: list[str], requests: IO[str], answers: IO[str]) -> None:
    """Import `modules` (the one to run first), then fork a run of it per request until the caller
    (the pid that started this) closes the pipe."""
    import importlib

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ctrl-c at the caller's terminal is the caller's to handle
    imported = threading.Event()

    def orphaned() -> None:
        """A caller that dies while this imports asks for nothing more: this ends then, not after
        (or at once, if the caller died before this began)."""
        while os.getppid() == caller:
            if imported.wait(0.5):
                return
        os._exit(1)

    watcher = threading.Thread(target=orphaned, daemon=True)
    watcher.start()
    gc.disable()  # as `engine/serve.py` does while importing: objects made to last, scanned for nothing
    for name in modules:
        importlib.import_module(name)
    imported.set()
    watcher.join()  # no thread but this one is forked from
    try:
        import setproctitle

        setproctitle.getproctitle()  # finds the command line while the environment still lies after it
    except ImportError:
        pass
    gc.enable()
    gc.freeze()  # what was imported stays out of collections, and so its pages stay shared with the forked servers
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the servers as they end
    me, cores = os.getpid(), os.sched_getaffinity(0)
    answers.write(READY)
    answers.flush()
    for line in requests:
        request = json.loads(line)
        pid = os.fork()  # nothing is left in `answers`' buffer for the child to repeat: each write was flushed
        if pid == 0:
            _run_forked(modules[0], request, me, cores)
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()


if __name__ == "__main__":
    try:
        _main(int(sys.argv[1]), sys.argv[2:], sys.stdin, sys.stdout)
    except (KeyboardInterrupt, BrokenPipeError):
        sys.exit(1)
