"""Servers forked from a zygote that imported once (`engine/zygote.py`), driven with a stand-in
server module: each run gets the start's argv, environment, folder and log, its session or the
caller's group, and ends with its caller only when asked to. The engine tier forks real vLLM
servers this way (test_endpoints)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from llmopt import paths
from llmopt.engine import zygote

TESTS = Path(__file__).parent
MODULE = "zygote_child"


@pytest.fixture(autouse=True)
def own_zygotes(monkeypatch) -> None:
    """The zygotes a test starts are its own, and end with it (a process keeps at most `MAX_ZYGOTES`),
    the home's too: the test has a home of its own (short: its path names a socket)."""
    mine: list[zygote.Zygote] = []
    monkeypatch.setattr(zygote, "_ZYGOTES", mine)
    monkeypatch.setattr(zygote, "_FAILED", set())
    home = tempfile.mkdtemp(prefix="zy-")
    monkeypatch.setenv(paths.HOME_ENV, home)
    yield
    zygote.stop_shared()
    shutil.rmtree(home, ignore_errors=True)
    for z in mine:
        z.process.kill()
        z.process.wait()


def _env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(TESTS), **extra}


def _said(log: Path, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines() if log.exists() else []
        if lines:
            return json.loads(lines[0])
        time.sleep(0.05)
    raise AssertionError(f"nothing in {log}")


def _ended(pid: int, timeout_s: float = 20) -> bool:
    """Whether `pid` ends within the time: gone, or a zombie (an orphan's waits on whoever reaps it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _home_zygote(pid: int) -> psutil.Process:
    """The home's zygote that forked `pid`, checked to be one: in a session of its own, on a socket in the home."""
    parent = psutil.Process(pid).parent()
    assert parent.cmdline()[1:3] == ["-m", zygote.__name__] and parent.cmdline()[4].startswith(str(paths.home()))
    assert os.getsid(parent.pid) == parent.pid != os.getsid(0)
    return parent


def test_a_forked_run_gets_the_starts_argv_environment_folder_and_log(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "a.log"
    argv = [sys.executable, "-m", MODULE, "--port", "1234"]
    pid = zygote.start(argv, _env(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="2"), log, own_session=True,
                       dies_with_caller=False)
    assert pid is not None
    runs = [pid]
    try:
        said = _said(log)
        assert said["argv"] == ["--port", "1234"] and said["pid"] == pid and said["main"] == MODULE
        assert said["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1" and "PYTEST_CURRENT_TEST" not in said["env"]
        assert said["cwd"] == said["path0"] == str(tmp_path)
        assert said["sid"] == said["pgid"] == pid  # a session of its own
        home_zygote = _home_zygote(pid)
        assert not [fd for fd in said["fds"] if fd.startswith(("socket:", "pipe:"))], said["fds"]  # none of the zygote's
        assert "VLLM_CPU_KVCACHE_SPACE" not in home_zygote.environ()  # a run's own: not the zygote's, which /proc shows
        # in the caller's group: from this process's own zygote, its child, whatever the home's has imported
        grouped = zygote.start(argv, _env(VLLM_CPU_KVCACHE_SPACE="4", OMP_NUM_THREADS="2"), tmp_path / "b.log",
                               own_session=False, dies_with_caller=False)
        # a per-start variable differs: the home's zygote forks it; an import-time one differs: another one
        again = zygote.start(argv, _env(VLLM_CPU_KVCACHE_SPACE="8", OMP_NUM_THREADS="2"), tmp_path / "c.log",
                             own_session=True, dies_with_caller=False)
        other = zygote.start(argv, _env(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1"), tmp_path / "d.log",
                             own_session=True, dies_with_caller=False)
        assert grouped is not None and again is not None and other is not None
        runs += [grouped, again, other]
        said_grouped, said_again = _said(tmp_path / "b.log"), _said(tmp_path / "c.log")
        assert psutil.Process(said_grouped["ppid"]).parent().pid == os.getpid()
        assert said_grouped["env"]["VLLM_CPU_KVCACHE_SPACE"] == "4"
        assert said_grouped["pgid"] == os.getpgid(0) and said_grouped["sid"] == os.getsid(0)  # the caller's group
        assert said_again["ppid"] == home_zygote.pid and said_again["env"]["VLLM_CPU_KVCACHE_SPACE"] == "8"
        assert _home_zygote(other).pid not in (home_zygote.pid, said_grouped["ppid"])
        for run in runs:
            os.kill(run, signal.SIGTERM)
            assert _ended(run)
        assert (tmp_path / "b.log").read_text().splitlines()[-1] == "terminated"
    finally:
        for run in runs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(run, signal.SIGKILL)


ANOTHER = """
import os, sys, time
from pathlib import Path
from llmopt.engine import zygote
os.umask(int(sys.argv[3], 8))
os.nice(int(sys.argv[4]))
started = time.monotonic()
pid = zygote.start([sys.executable, "-m", "zygote_child"], {"PATH": "", "PYTHONPATH": sys.argv[1],
                   "ZYGOTE_TEST_IMPORT_S": "3"}, Path(sys.argv[2]), own_session=True, dies_with_caller=False)
print(pid, time.monotonic() - started)
"""


def test_the_homes_zygote_forks_for_every_process_of_the_home_and_ends_when_asked(tmp_path: Path) -> None:
    """A one-off command (`llmopt deploy`) has one start: the home's zygote, started by the first,
    takes the imports off the later ones, from other processes; stopped, it leaves their runs alone."""
    runs = []
    try:
        # the second by another name of the same interpreter, as a console script runs it; the third
        # at another niceness, which a run inherits from its zygote and cannot always take back
        other_name = str(Path(sys.executable).with_name("python3"))
        for name, python, umask, nice in (("first", sys.executable, "022", "0"), ("second", other_name, "027", "0"),
                                          ("third", sys.executable, "022", "3")):
            done = subprocess.run([python, "-c", ANOTHER, str(TESTS), str(tmp_path / f"{name}.log"), umask, nice],
                                  capture_output=True, text=True, timeout=60, check=True)
            pid, seconds = done.stdout.split()
            runs.append((int(pid), float(seconds)))
        (first, first_s), (second, second_s), (third, third_s) = runs
        assert first_s > 3 > second_s + 1 and third_s > 3, runs  # the stand-in's imports take 3 s
        owner = _home_zygote(first)
        assert _home_zygote(second).pid == owner.pid != _home_zygote(third).pid
        # what a spawned run would have inherited from its caller, not from whoever started the zygote
        assert _said(tmp_path / "second.log")["umask"] == 0o027 and _said(tmp_path / "first.log")["umask"] == 0o022
        assert _said(tmp_path / "third.log")["nice"] == 3 and _said(tmp_path / "second.log")["nice"] == 0
        zygote.stop_shared()
        assert _ended(owner.pid) and not list((paths.home() / zygote.RUN_DIR).glob("*.sock"))
        assert all(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid, _ in runs)
    finally:
        for pid, _ in runs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_the_homes_zygote_ends_when_idle_or_its_socket_is_gone_and_shrugs_off_bad_requests(tmp_path: Path,
                                                                                           monkeypatch) -> None:
    argv = [sys.executable, "-m", MODULE]
    pid = zygote.start(argv, _env(), tmp_path / "a.log", own_session=True, dies_with_caller=False)
    assert pid is not None
    owner = _home_zygote(pid)
    (sock,) = (paths.home() / zygote.RUN_DIR).glob("*.sock")
    for junk in (b"[1]\n", b"not json\n", b'{"args": 1}\n', b'{"args": [], "env": {}}\n'):
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(str(sock))
            conn.sendall(junk)
            assert conn.makefile().readline() == ""  # no answer, and nothing forked
    assert [c.pid for c in owner.children()] == [pid]
    # a run that fails as it sets up (its log cannot be opened) ends there, not in the zygote's code
    failed = zygote.start(argv, _env(), tmp_path / "no" / "such.log", own_session=True, dies_with_caller=False)
    assert failed is not None and _ended(failed, timeout_s=5)
    again = zygote.start(argv, _env(), tmp_path / "b.log", own_session=True, dies_with_caller=False)
    assert again is not None and _home_zygote(again).pid == owner.pid
    sock.unlink()
    assert _ended(owner.pid, timeout_s=10), "the home's zygote outlived its socket"
    monkeypatch.setattr(zygote, "IDLE_S", 1.0)
    idle = zygote.start(argv, _env(), tmp_path / "c.log", own_session=True, dies_with_caller=False)
    assert idle is not None
    owner = _home_zygote(idle)
    assert _ended(owner.pid, timeout_s=10), "the home's zygote outlived its idle time"
    assert not sock.exists()
    for run in (pid, again, idle):
        assert psutil.Process(run).status() != psutil.STATUS_ZOMBIE
        os.kill(run, signal.SIGKILL)


def test_two_processes_starting_at_once_share_one_homes_zygote(tmp_path: Path) -> None:
    callers = [subprocess.Popen([sys.executable, "-c", ANOTHER, str(TESTS), str(tmp_path / f"{n}.log"), "022", "0"],
                                stdout=subprocess.PIPE, text=True) for n in range(2)]
    runs = [int(caller.communicate(timeout=60)[0].split()[0]) for caller in callers]
    try:
        assert len({_home_zygote(run).pid for run in runs}) == 1
        assert len(list((paths.home() / zygote.RUN_DIR).glob("*.sock"))) == 1
    finally:
        for run in runs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(run, signal.SIGKILL)


def test_a_start_that_must_die_with_its_caller_is_spawned_where_pidfds_are_missing(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    monkeypatch.setattr(zygote, "_PIDFDS", False)
    argv = [sys.executable, "-m", MODULE]
    assert zygote.start(argv, _env(), tmp_path / "a.log", own_session=True, dies_with_caller=True) is None
    assert not list((paths.home() / zygote.RUN_DIR).glob("*.sock")) and not zygote._ZYGOTES


CALLER = """
import sys, time
from pathlib import Path
from llmopt.engine import zygote
argv = [sys.executable, "-m", "zygote_child"]
env = {"PATH": "", "PYTHONPATH": sys.argv[1]}
for name, dies in (("dies", True), ("stays", False)):
    print(zygote.start(argv, env, Path(sys.argv[2]) / f"{name}.log", own_session=sys.argv[3] == "session",
                       dies_with_caller=dies), flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("where", ["session", "group"])  # forked by the home's zygote, or by the caller's own
def test_a_run_that_dies_with_its_caller_does_even_when_the_caller_is_killed(tmp_path: Path, where: str) -> None:
    caller = subprocess.Popen([sys.executable, "-c", CALLER, str(TESTS), str(tmp_path), where], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert caller.stdout is not None
        dies, stays = (int(caller.stdout.readline()) for _ in range(2))
        _said(tmp_path / "dies.log"), _said(tmp_path / "stays.log")
        caller.kill()
        caller.wait()
        assert _ended(dies), "a run that dies with its caller outlived it"
        assert (tmp_path / "dies.log").read_text().splitlines()[-1] == "terminated"
        assert psutil.pid_exists(stays) and psutil.Process(stays).status() != psutil.STATUS_ZOMBIE
    finally:
        caller.kill()
        for name in ("dies", "stays"):
            pid = _said(tmp_path / f"{name}.log")["pid"]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


INTERRUPTED = """
import sys
from pathlib import Path
from llmopt.engine import zygote
try:
    zygote.start([sys.executable, "-m", "zygote_child"], {"PATH": "", "PYTHONPATH": sys.argv[1],
                 "ZYGOTE_TEST_IMPORT_S": sys.argv[3]}, Path(sys.argv[2]), own_session=True, dies_with_caller=False)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_a_start_interrupted_while_its_zygote_imports_forks_nothing(tmp_path: Path) -> None:
    """The wait for the imports comes before the request: a ctrl-c there leaves no run behind."""
    log = tmp_path / "slow.log"
    caller = subprocess.Popen([sys.executable, "-c", INTERRUPTED, str(TESTS), str(log), "3"], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not psutil.Process(caller.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    (imports,) = psutil.Process(caller.pid).children()
    time.sleep(0.5)
    caller.send_signal(signal.SIGINT)
    out, _ = caller.communicate(timeout=30)
    assert out.strip() == "interrupted"
    assert _ended(imports.pid), "the zygote outlived the interrupted start"
    time.sleep(3)  # past its import, had it gone on
    assert not log.exists(), "a run was forked for an interrupted start"


def test_a_zygote_whose_caller_dies_while_it_imports_ends_then(tmp_path: Path) -> None:
    caller = subprocess.Popen([sys.executable, "-c", INTERRUPTED, str(TESTS), str(tmp_path / "slow.log"), "60"])
    deadline = time.monotonic() + 20
    while not psutil.Process(caller.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    (imports,) = psutil.Process(caller.pid).children()
    caller.kill()
    caller.wait()
    try:
        assert _ended(imports.pid, timeout_s=30), "the zygote imported on for no one (its import takes 60 s)"
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            imports.kill()


def test_a_zygote_that_cannot_import_leaves_the_start_to_a_spawn_and_is_not_tried_again(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "no_such_module_for_llmopt"]
    assert zygote.start(argv, _env(), tmp_path / "a.log", own_session=True, dies_with_caller=False) is None
    assert zygote.import_key(argv[2], _env()) in zygote._FAILED and not zygote._ZYGOTES
    started = time.monotonic()
    assert zygote.start(argv, _env(), tmp_path / "b.log", own_session=True, dies_with_caller=False) is None
    assert time.monotonic() - started < 0.1, "a second zygote was started"


def test_only_llmopts_server_is_forked_and_the_switch_turns_it_off(monkeypatch) -> None:
    server = [sys.executable, "-m", zygote.SERVER_MODULE, "--model", "m"]
    assert zygote.forks(server)
    assert not zygote.forks(["python3", "-m", zygote.SERVER_MODULE]) and not zygote.forks([sys.executable, "-m", "vllm"])
    monkeypatch.setenv(zygote.OFF_ENV, "1")
    assert not zygote.forks(server)


def test_the_import_key_keeps_what_modules_read_at_import_and_leaves_per_start_settings_out() -> None:
    key = dict(zygote.import_key("m", {"LD_PRELOAD": "/x.so", "VLLM_USE_LAYERNAME": "0", "VLLM_CPU_KVCACHE_SPACE": "4",
                                       "TORCHINDUCTOR_CACHE_DIR": "/c", "PYTEST_CURRENT_TEST": "t", "LLMOPT_HOME": "/h"}))
    assert key == {"": "m", "LD_PRELOAD": "/x.so", "VLLM_USE_LAYERNAME": "0"}
