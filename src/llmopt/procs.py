"""Background processes that outlive the command that started them: liveness and clean stops.

A record stores a pid with the process's start time, so a recycled pid is never mistaken for
the engine or worker it once was.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import sys
import time
from pathlib import Path

import psutil

SPAWN_GRACE_S = 120.0  # a record whose process was never started, after this long, was abandoned


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_SAME_START_S = 0.5 / _TICKS_PER_S  # start times are whole ticks: equal, or apart by one at least


def create_time(pid: int) -> float:
    """When the process started, in seconds after boot. Not psutil's `create_time`, which adds the
    boot time the wall clock implies *now*: a clock step (time sync, a virtual machine paused and
    resumed) moves that for every process at once, and a CI run saw its live workers and engines
    all taken for dead (their build folders deleted under them). The kernel's start tick never moves."""
    return _stat(pid)[1]


def _stat(pid: int) -> tuple[str, float]:
    """The process's state letter ("Z" for a zombie) and start time, from one read of its stat file."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError) as gone:
        raise psutil.NoSuchProcess(pid) from gone
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return fields[0], int(fields[19]) / _TICKS_PER_S


def is_alive(pid: int | None, created: float | None) -> bool:
    """True if the process is running and is the same one that was recorded."""
    if pid is None:
        return False
    try:
        state, started = _stat(pid)
    except psutil.NoSuchProcess:
        return False
    if state == "Z":
        _reap(pid)
        return False
    return created is None or abs(started - created) < _SAME_START_S


def lost(pid: int | None, created: float | None, recorded_at: float) -> str | None:
    """Why a recorded background process is not running ("never started": none was recorded within
    the grace period, so its creator died; "exited"), or None while it runs or may still start."""
    if pid is None:
        return "never started" if time.time() - recorded_at >= SPAWN_GRACE_S else None
    return None if is_alive(pid, created) else "exited"


def stop_group(pid: int, created: float | None, grace_s: float = 20.0) -> None:
    """SIGTERM the process group led by pid, then SIGKILL whatever is left after the grace period.

    Children (vLLM's engine core, a worker's engine) share the group because every background
    process is started in a session of its own. A process that joins the group after the SIGTERM
    (an engine core its server was forking) gets one of its own, and the wait lasts until the group
    is empty, not only the family seen first.
    """
    if not is_alive(pid, created):
        return
    family = _family(pid)
    signalled = {proc.pid for proc in _group(pid, created)}
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        members = _group(pid, created)
        for proc in members:
            if proc.pid not in signalled:
                _signal_proc(proc, signal.SIGTERM)
                signalled.add(proc.pid)
        if not any(_running(p) for p in (*family, *members)):
            return
        time.sleep(0.2)
    _signal_group(pid, signal.SIGKILL)
    kill_group(pid, created)  # members left after their leader died, which killpg finds no group for
    for proc in family:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)
    _reap(pid)


def stop_tree(pid: int, created: float | None, grace_s: float = 20.0) -> None:
    """Like stop_group, for a process that shares our group: signal it and its children only."""
    if not is_alive(pid, created):
        return
    family = _family(pid)
    for proc in family:
        _signal_proc(proc, signal.SIGTERM)
    gone, alive = psutil.wait_procs(family, timeout=grace_s)
    for proc in alive:
        _signal_proc(proc, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=10)
    _reap(pid)


def _group(pgid: int, created: float | None) -> list[psutil.Process]:
    """The live members of a process group that started after its leader (recorded with its start
    time) did: never a process that merely got a recycled pid."""
    if created is None:
        return []
    members = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid and create_time(proc.pid) > created - _SAME_START_S:
                members.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return members


def kill_group(pgid: int, created: float | None) -> int:
    """SIGKILL what is left of a process group whose leader (recorded with its start time) may be
    gone: only processes in that group that started after the leader did, never a process that
    merely got a recycled pid. Returns how many were killed."""
    if created is None:
        return 0
    if psutil.pid_exists(pgid) and not is_alive(pgid, created):
        return 0  # the pid now belongs to another process, and so may the group
    killed = 0
    for proc in _group(pgid, created):
        try:
            proc.kill()
            killed += 1
        except (psutil.NoSuchProcess, PermissionError):
            continue
    return killed


def _signal_proc(proc: psutil.Process, sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def _family(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _running(proc: psutil.Process) -> bool:
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            _reap(proc.pid)
            return False
        return True
    except psutil.NoSuchProcess:
        return False


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(os.getpgid(pid), sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap(pid: int) -> None:
    """Collect the exit status of our own dead child, so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def dying_with_caller(argv: list[str]) -> list[str]:
    """`argv` made to end when the process starting it dies, even killed outright (SIGKILL, the
    OOM killer: nothing of llmopt's runs then): util-linux's `setpriv --pdeathsig TERM` asks the
    kernel to send it SIGTERM then, and the setting survives its exec. Where `setpriv` is missing
    `argv` is as it was (records still reconcile it). An exec wrapper, not a `preexec_fn`: Python
    code between fork and exec can deadlock in a process with threads, as the studio is.

    Linux ties the signal to the *thread* that forks: start such a child from a thread that lives
    as long as the child should (the studio runs a recommendation's deploys, loads and stops in
    one thread). A caller that dies before the signal is armed is caught by a shell that checks,
    once armed, that its parent is still the caller, and only then execs `argv`."""
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    if setpriv is None:
        return argv
    armed = f'[ "$PPID" = {os.getpid()} ] || exit 143; exec "$@"'
    return [setpriv, "--pdeathsig", "TERM", "--", "/bin/sh", "-c", armed, "sh", *argv]


def peak_rss_bytes() -> int:
    """This process's own peak resident memory. Not `ru_maxrss`: Linux carries a parent's peak into
    a child across fork and exec, so a worker started by a 3.3 GB process reported 3.3 GB whatever
    it used itself (a quantization's peak, over its estimate, in CI). VmHWM is this image's alone."""
    hwm = status_field("VmHWM")  # "123456 kB"
    try:
        if hwm is not None:
            return int(hwm.split()[0]) * 1024
    except (ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def status_field(name: str) -> str | None:
    """A field of this process's `/proc/self/status` ("VmHWM", "Umask"), None where it has none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{name}:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
