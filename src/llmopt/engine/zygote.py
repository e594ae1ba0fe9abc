"""Engine servers forked from a process that has imported vLLM's server once.

Every start of `engine/serve.py` used to begin with its imports: vLLM, torch, Inductor,
transformers, about 5,000 modules, 13-16 s of one core on a Zen 3 EPYC, more than a third of a
precompiled start of SmolLM2-135M (25.8 s there). A process that starts several engines (a job
measuring the source and then its artifact, a sweep serving without and with speculation,
`evaluate --compare`, `recommend`, the studio, the test suite) paid them each time. Here they are
paid once: a zygote, a process started by the first start, imports what the server imports and
then forks a server for each start, which runs `engine/serve.py` as `python -m` would.

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

Two kinds of zygote serve the two kinds of start:
- A start in the caller's process group (a job's engine, stopped with its worker's group) comes
  from the process's own zygote, its child, which takes requests on a pipe and ends as soon as the
  caller does (the kernel closes the pipe however the caller dies).
- A start in a session of its own (a deploy) comes from the home's zygote, shared by every process
  of the home: a one-off command such as `llmopt deploy` has a single start, and would otherwise
  pay the imports every time. It listens on a Unix socket in the home's `run` folder, named for
  what it imported and what its runs inherit from it (the import key, the interpreter, the
  caller's cores, control group and niceness, and the size and time of llmopt's files and of its
  engine's packages, so an edited or upgraded install gets a zygote of its own), talks with its
  own user alone, and ends after `IDLE_S` without a start, when its socket is removed (with the
  home), or when asked (`stop_shared`). The first start pays the imports as before; the starts
  after it, from any process, do not.
`dies_with_caller` sends a forked server SIGTERM when its caller ends, however it ends: the server
watches the caller's pidfd, whichever zygote is its parent. A zygote reaps its children; their exit
status is not kept (callers read a server's end in its log).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import gc
import hashlib
import importlib.util
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Iterator, NoReturn

from llmopt import paths, procs
from llmopt.engine import (avx2_bf16_linear, avx2_int8_linear, guard, kernels, platform, prefill_attention,
                           small_batch_linear, weight_only_int8_linear)

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
    avx2_int8_linear.ENV, avx2_bf16_linear.ENV, weight_only_int8_linear.ENV, prefill_attention.ENV, kernels.LIBRARY_ENV,
    platform.INDUCTOR_KERNELS_ENV, platform.MODEL_INFOS_ENV, platform.SPAWNED_CORE_ENV, platform.VLLM_ATTENTION_CALLS_ENV,
    guard.NO_CHAT_ENV, paths.HOME_ENV,
})
READY = "imported\n"  # what a zygote says once it has imported
RUN_DIR = "run"  # in the home: the sockets of its shared zygotes
IDLE_S = 600.0  # a home's zygote without a start for this long ends (it holds ~600 MB)
_TICK_S = 1.0  # how often an idle home's zygote looks whether its socket is still there
_SOCKET_PATH_MAX = 107  # a Unix socket's path holds 108 bytes, the last a NUL
LOCK_WAIT_S = 300.0  # a start waits this long for another's start of the home's zygote, then spawns


def exit_as_a_process(run: Callable[[], object]) -> NoReturn:
    """In a forked child: `run`, then exit with the status and last words a process running it would
    have (a `SystemExit`'s code, its message; a traceback and 1), without the interpreter's teardown,
    where modules a spawned run never imports report their leaks and bury its last words."""
    code = 0
    try:
        run()
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def import_key(module: str, env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What a zygote for a start of `python -m module` must have imported: the module, under the
    start's values of the variables a module could read at import."""
    return (("", module), *sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_PREFIXES) and k not in PER_START))


@dataclass
class Zygote:
    """A process's own zygote, its child, asked on a pipe."""

    process: subprocess.Popen
    key: tuple[tuple[str, str], ...]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fork(self, request: dict) -> int:
        """The pid of a server forked for `request`."""
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
_STARTED: list[subprocess.Popen] = []  # the home's zygotes this process started
_LOCK = threading.Lock()


def forks(argv: list[str]) -> bool:
    """Whether a start of `argv` can come from a zygote: llmopt's own server, run by this Python."""
    return argv[:3] == [sys.executable, "-m", SERVER_MODULE] and os.environ.get(OFF_ENV) != "1"


def start(argv: list[str], env: dict[str, str], log_path: Path, own_session: bool, dies_with_caller: bool) -> int | None:
    """A process forked from a zygote to run `argv` (`python -m MODULE ...`) as the start's
    environment asks: the home's zygote for a start in a session of its own, this process's for one
    in its group. Its pid, or None where none can fork it (the caller then spawns it, as it would
    where this machine cannot watch a caller's end through a pidfd)."""
    module = argv[2]
    key = import_key(module, env)
    if key in _FAILED or (dies_with_caller and not _PIDFDS):
        return None
    try:
        caller = [os.getpid(), procs.create_time(os.getpid())] if dies_with_caller else None
        request = {"args": argv[3:], "env": env, "log": str(log_path), "cwd": os.getcwd(), "session": own_session,
                   "caller": caller, "umask": _umask(), "nice": os.getpriority(os.PRIO_PROCESS, 0)}
        shared = _socket_path(key) if own_session else None
        if shared is not None:
            return _shared_fork(shared, module, env, key, request)
    except (OSError, ValueError, KeyError, IndexError):  # whatever went wrong, a spawn still starts it
        return None
    with _LOCK:
        for zygote in list(_ZYGOTES):
            if zygote.process.poll() is not None:
                _ZYGOTES.remove(zygote)
        zygote = next((z for z in _ZYGOTES if z.key == key), None)
        if zygote is None:
            if len(_ZYGOTES) >= MAX_ZYGOTES or key in _FAILED:
                return None
            process = _launched(module, env)
            if process is None:
                _FAILED.add(key)
                return None
            zygote = Zygote(process, key)
            _ZYGOTES.append(zygote)
    try:
        return zygote.fork(request)
    except (OSError, ValueError, KeyError):  # a zygote that died: spawned instead
        with _LOCK:
            if zygote in _ZYGOTES:
                _ZYGOTES.remove(zygote)
        zygote.process.kill()
        return None


def _pidfds() -> bool:
    """Whether this kernel lets a process watch another's end through a pidfd (Linux 5.3, and a
    seccomp profile that allows it)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (OSError, AttributeError):
        return False
    return True


_PIDFDS = _pidfds()


def _umask() -> int:
    """This process's umask, read without setting it (another thread may be making a file)."""
    umask = procs.status_field("Umask")
    if umask is None:  # a kernel before 4.7: the start is spawned, which inherits it
        raise OSError("/proc/self/status has no Umask")
    return int(umask, 8)


def stop_shared() -> None:
    """End the home's zygotes now rather than after `IDLE_S`; the servers they forked go on."""
    for path in (paths.home() / RUN_DIR).glob("zygote-*.sock"):
        with _locked(path, timeout_s=30) as held:
            if held:
                _ask(path, {"stop": True})
                path.unlink(missing_ok=True)


def _socket_path(key: tuple[tuple[str, str], ...]) -> Path | None:
    """Where the home's zygote for `key` listens, as this process would have it import and its
    runs would inherit; None where the home's path is too long for a socket, or its `run` folder is
    open to other users (this process's own zygote serves then)."""
    files = sorted(Path(__file__).parents[1].rglob("*.py"))
    for name in ("vllm", "torch", "transformers"):  # what an upgrade changes, found without importing it
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin is not None:
            files.append(Path(spec.origin))
    installed = []
    for f in files:
        with contextlib.suppress(OSError):  # one gone since the listing (an editor's lock file)
            st = f.stat()
            installed.append((str(f), st.st_size, st.st_mtime_ns))
    # the interpreter by what it is (a console script runs `python3.11` where a user types `python`),
    # and what a run inherits from its zygote rather than its caller: control group and niceness
    interpreter = [os.path.realpath(sys.executable), sys.prefix]
    inherited = [Path("/proc/self/cgroup").read_text(), os.getpriority(os.PRIO_PROCESS, 0)]
    what = json.dumps([key, interpreter, sorted(os.sched_getaffinity(0)), inherited, installed])
    run = paths.home().resolve() / RUN_DIR
    run.mkdir(mode=0o700, exist_ok=True)
    st = run.lstat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    path = run / f"zygote-{hashlib.sha256(what.encode()).hexdigest()[:16]}.sock"
    return path if len(os.fsencode(path)) <= _SOCKET_PATH_MAX else None


@contextlib.contextmanager
def _locked(path: Path, timeout_s: float) -> Iterator[bool]:
    """The lock beside the socket at `path`, held for the block if it came within `timeout_s`
    (False if not: a process stopped while it held it, its zygote importing, hangs no other)."""
    with open(path.with_suffix(".lock"), "a") as lock:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.1)
        yield True


def _shared_fork(path: Path, module: str, env: dict[str, str], key: tuple[tuple[str, str], ...], request: dict) -> int | None:
    """A server forked by the home's zygote at `path`, started first if none listens there. Under a
    lock: of processes starting at once, one starts it and the others wait for its imports."""
    with _locked(path, timeout_s=LOCK_WAIT_S) as held:
        if not held:
            return None
        pid = _ask(path, request)
        if pid is None:
            path.unlink(missing_ok=True)  # a zygote that ended without removing it, killed
            process = _launched(module, env, path)
            if process is None:
                _FAILED.add(key)
                return None
            for pipe in (process.stdin, process.stdout):
                assert pipe is not None
                pipe.close()
            with _LOCK:  # kept to be reaped when it ends: it is this process's child while this lives
                _STARTED[:] = [p for p in _STARTED if p.poll() is None] + [process]
            pid = _ask(path, request)
    return pid


def _ask(path: Path, request: dict) -> int | None:
    """What the home's zygote at `path` answers `request`: a forked server's pid, or None where no
    zygote of this user answers (none listens, or one ending)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30)
            conn.connect(str(path))
            if _peer_uid(conn) != os.getuid():  # the request carries the start's environment, its secrets too
                return None
            conn.sendall((json.dumps(request) + "\n").encode())
            answer = conn.makefile().readline()
        return int(json.loads(answer)["pid"]) if answer else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _peer_uid(conn: socket.socket) -> int:
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def _launched(module: str, env: dict[str, str], path: Path | None = None) -> subprocess.Popen | None:
    """A zygote for `module`, once it has imported (None if it could not): this process's own, in
    its group and session, or with `path` the home's, in a session of its own, listening there. Its
    own output goes nowhere (a run's goes to its log). The wait for its imports comes before any
    request: interrupted there (a ctrl-c), nothing has been forked, and the zygote is killed; a
    request is then answered in milliseconds, as a spawn is. It imports without the start's
    per-start settings, which no import reads: they are each run's (an API key among them), and a
    zygote's environment is what `/proc` shows of every run it forks."""
    preloaded = PRELOADED if module == SERVER_MODULE else ()
    process = subprocess.Popen(
        [sys.executable, "-m", __name__, str(os.getpid()), str(path or ""), str(IDLE_S), module, *preloaded],
        env={k: v for k, v in env.items() if k not in PER_START}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
        start_new_session=path is not None)
    ready = False
    try:
        assert process.stdout is not None
        ready = process.stdout.readline() == READY
    finally:
        if not ready:
            process.kill()
            process.wait()
    return process if ready else None


@dataclass(frozen=True)
class _Forker:
    """What a zygote's forked runs start from: its module, cores and launch folder."""

    module: str
    cores: set[int]
    folder: str  # where it was started, which `python -m` put first on its path

    def fork(self, request: dict, inherited: tuple[int, ...] = ()) -> int:
        """Fork a run for `request`; the child closes the zygote's own `inherited` descriptors."""
        pid = os.fork()  # nothing is left in a buffer for the child to repeat: each write was flushed
        if pid == 0:
            try:
                for fd in inherited:
                    os.close(fd)
                self._run(request)
            finally:  # never back into the zygote's own code, whatever failed
                os._exit(1)
        return pid

    def _run(self, request: dict) -> None:
        """In the forked child: become the run the request describes, and end as it ends."""
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        try:  # from here on a failure is told in the run's log
            self._set_up(request)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        if sys.path and sys.path[0] == self.folder:  # `python -m` puts its folder first
            sys.path[0] = request["cwd"]
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [sys.modules[self.module].__file__ or self.module, *request["args"]]
        _titled(" ".join([sys.executable, "-m", self.module, *request["args"]]))
        exit_as_a_process(lambda: runpy.run_module(self.module, run_name="__main__", alter_sys=True))

    def _set_up(self, request: dict) -> None:
        """What a spawned run would have had from its caller and its start, which the zygote had
        from whoever started it."""
        # Intel OpenMP, loaded with torch in the zygote, pins a forked child's main thread to the first
        # of its cores, and every thread and process the server starts would inherit that one core (a
        # forked server's engine core ran on core 0 of two): the run gets the zygote's cores back
        os.sched_setaffinity(0, self.cores)
        if request["session"]:
            os.setsid()
        os.umask(request["umask"])
        with contextlib.suppress(PermissionError):  # a lower niceness than the zygote's needs privilege
            os.setpriority(os.PRIO_PROCESS, 0, request["nice"])
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its engine core is its own child to wait for
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if request["caller"] is not None:
            _dies_with(*request["caller"])


def _dies_with(pid: int, created: float) -> None:
    """SIGTERM to this run when the process `pid` ends, however it ends, whoever this run's parent
    is: a thread waits on its pidfd. A caller already gone (or its pid taken by another) ends it now."""
    try:
        caller = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(128 + signal.SIGTERM)
    if not procs.is_alive(pid, created):
        os._exit(128 + signal.SIGTERM)

    def watch() -> None:
        select.select([caller], [], [])  # readable once the process has ended
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="dies-with-caller", daemon=True).start()


def _titled(title: str) -> None:
    """`ps` shows a forked run as the command a spawned one was, and vLLM can name its processes
    (its engine core `VLLM::EngineCore`): setproctitle writes over the zygote's command line, which
    it learned to find in the zygote (`_main`), before the forked run's environment moved."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def _main(caller: int, path: str, idle_s: float, modules: list[str], requests: IO[str], answers: IO[str]) -> None:
    """Import `modules` (the one to run first), then fork a run of it per request: on the pipe until
    the caller (the pid that started this) closes it, or with a socket `path` on that socket."""
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
    forker = _Forker(modules[0], os.sched_getaffinity(0), os.getcwd())
    listener = _listening(Path(path)) if path else None
    answers.write(READY)
    answers.flush()
    if listener is None:
        for line in requests:
            answers.write(json.dumps({"pid": forker.fork(json.loads(line))}) + "\n")
            answers.flush()
        return
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # the caller has read what it waited for, and may be gone
        os.dup2(null, fd)
    os.close(null)
    os.chdir("/")  # no folder of a caller's kept busy
    _serve(listener, Path(path), idle_s, forker)


def _listening(path: Path) -> socket.socket:
    """The home's zygote's socket, its owner's alone (its folder is too), bound before the zygote
    says it has imported, so the caller waiting for that finds it."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen()
    return listener


def _serve(listener: socket.socket, path: Path, idle_s: float, forker: _Forker) -> None:
    """Fork a run per request on `listener` from this user, until `idle_s` pass without one, the
    socket at `path` is gone or replaced, or a request asks this to stop."""
    own = os.stat(path).st_ino
    listener.settimeout(_TICK_S)
    last = time.monotonic()
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if time.monotonic() - last > idle_s or not _listens_at(path, own):
                break
            continue
        with conn:
            conn.settimeout(10)
            try:
                request = json.loads(conn.makefile().readline()) if _peer_uid(conn) == os.getuid() else None
            except (OSError, ValueError):
                continue
            if isinstance(request, dict) and request.get("stop"):
                break
            if _well_formed(request):
                try:
                    pid = forker.fork(request, (listener.fileno(), conn.fileno()))
                    conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
                except OSError:  # no fork (memory), or a caller gone: it spawns, or asks no more
                    pass
        last = time.monotonic()
    if _listens_at(path, own):
        path.unlink()


def _well_formed(request: object) -> bool:
    """Whether `request` is a start as `start` writes one; anything else is ignored, not forked."""
    fields = {"args": list, "env": dict, "log": str, "cwd": str, "session": bool, "umask": int, "nice": int}
    if not (isinstance(request, dict) and all(isinstance(request.get(k), t) for k, t in fields.items())):
        return False
    caller = request.get("caller", "")
    return (all(isinstance(a, str) for a in request["args"])
            and all(isinstance(k, str) and isinstance(v, str) for k, v in request["env"].items())
            and (caller is None or (isinstance(caller, list) and len(caller) == 2
                                    and all(isinstance(c, (int, float)) for c in caller))))


def _listens_at(path: Path, inode: int) -> bool:
    """Whether the socket at `path` is still the one this zygote bound (not removed, not replaced)."""
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False


if __name__ == "__main__":
    try:
        _main(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4:], sys.stdin, sys.stdout)
    except (KeyboardInterrupt, BrokenPipeError):
        sys.exit(1)
