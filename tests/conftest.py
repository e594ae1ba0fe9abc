"""Shared fixtures: one llmopt home, one imported default model and one vLLM engine per session,
and the artifacts several test modules use, each built once per session.

Tests that start an engine or a job are marked `engine`; those that import vLLM or build llmopt's
kernels in a process of their own, `vllm` (which counts as `engine` for `-m`). `pytest -m "not
engine"` is the fast tier, without either. A test not marked `engine`, or marked `vllm`, that
tries to start one fails at once, so the tiers stay honest.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

# A suite started in the background by a non-interactive shell (`pytest &`) inherits SIGINT ignored,
# and so would every command it starts, since Python keeps an inherited SIG_IGN: the CLI would never
# see the ctrl-c its test sends. The commands get what a terminal gives them instead.
signal.signal(signal.SIGINT, signal.default_int_handler)

# Every test session gets a fresh llmopt home, set before llmopt is imported anywhere.
os.environ["LLMOPT_HOME"] = tempfile.mkdtemp(prefix="llmopt-test-home-")

import llmopt  # noqa: E402
from llmopt import ChunkedPrefill, Compilation, DraftModel, Recipe, catalog, recipe, sources  # noqa: E402
from llmopt.engine import platform, vllm, zygote  # noqa: E402
from llmopt.engine.config import EngineConfig  # noqa: E402
from llmopt.jobs import store  # noqa: E402
from llmopt.executors import local as local_executor  # noqa: E402
from llmopt.executors import ray as ray_executor  # noqa: E402

# llmopt's default shapes, so the session endpoint and the baseline artifact share compiled code;
# a smaller KV cache, which the compile cache's key leaves out
SMALL_ENGINE = EngineConfig(kv_cache_gib=1)
VNNI = platform.detect().has_vnni
# SmoothQuant pays here: VNNI sums its int8 products, or llmopt's AVX2 W8A8 kernel does without it
INT8_FAST = VNNI or platform.avx2_int8_applies(platform.detect())
# SmoothQuant that quantizes in seconds (round-to-nearest weights, 8 samples), the lm_head too. It
# landed at +2.6% (GPTQ weights: +1.0%); the suite allows 5% where the built-in budget is 3%. On an
# AVX2 Zen 3 EPYC, served through llmopt's AVX2 W8A8 kernel (the default there), +1.94%; through
# torch's weight-only int8 kernel (bf16 activations, not quantized) +0.82-1.01%; through vLLM's
# oneDNN int8 there, whose 16-bit sums saturate without VNNI, it was +5.2%.
QUICK_SMOOTHQUANT = {"method": "smoothquant", "weights": "rtn", "calibration": {"samples": 8, "sequence_length": 128},
                     "ignore": [], "max_perplexity_increase": 0.05}
# The suite's SmoothQuant jobs are the quick recipe on every processor: the `smoothquant` fixture,
# the retried job after a kill, the job refused for its budget (which is in neither key) and
# test_quantization's SmoothQuant scheme share one artifact's weights and one compiled entry. The
# built-in recipe differs only in how GPTQ picks the int8 values (same checkpoint format, same
# kernels; test_faults quantizes with GPTQ on a tiny model), and building it cost the suite its
# quantizing (142 s alone on an Intel Xeon with AMX, 100 s in float32 on a Zen 3 EPYC) and one
# more cold compile, which kept CI over its hour on AMX (62 min). (The demo's test takes the
# n-gram recipe where SmoothQuant does not pay, as the demo does.)
SUITE_SMOOTHQUANT = {"name": "smoothquant", "quantization": QUICK_SMOOTHQUANT}


_RUNNING: dict[str, pytest.Item | None] = {"item": None}
# which collected tests are engine tests, written by xdist's workers for the controller's schedule
ENGINE_TESTS = os.environ.setdefault("LLMOPT_TEST_ENGINE_TESTS", f"{os.environ['LLMOPT_HOME']}.engine-tests")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A passing session's home goes once its session fixtures are torn down: it holds every model,
    artifact and compiled entry the session built (about 4.4 GB for the whole suite), and homes left
    behind had filled this machine's disk. A failing session's stays, for its logs. The home's
    zygotes end either way (they would after ten idle minutes)."""
    zygote.stop_shared()
    if exitstatus == 0:
        shutil.rmtree(os.environ["LLMOPT_HOME"], ignore_errors=True)
    if "PYTEST_XDIST_WORKER" not in os.environ:
        Path(ENGINE_TESTS).unlink(missing_ok=True)


def _starts_engines(item: pytest.Item) -> bool:
    return item.get_closest_marker("engine") is not None and item.get_closest_marker("vllm") is None


@pytest.hookimpl(tryfirst=True)  # before `-m` selects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test marked `vllm` (it imports vLLM, or builds llmopt's kernels, in a process of its own:
    11-50 s each on two cores) leaves the fast tier with the engine tests: it is marked `engine` too. It
    starts no engine, so the schedule below deals it out with the other tests. Under xdist each
    worker collects; it writes down which tests start engines for that schedule, which sees node
    ids only (xdist's own groups rename node ids, which pytest 9.2 no longer lets a plugin do)."""
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.engine)
    if "PYTEST_XDIST_WORKER" in os.environ:
        engine = [item.nodeid for item in items if _starts_engines(item)]
        mine = Path(f"{ENGINE_TESTS}.{os.getpid()}")
        mine.write_text("\n".join(engine))
        mine.replace(ENGINE_TESTS)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The suite runs on two xdist workers (`-n 2`): every engine test on the first, in order,
    sharing that session's engines, artifacts and compiled code, and the other tests on the second
    beside them. An engine test leaves a core idle for much of its time (a cold compile kept the
    machine 50-70% busy; imports run on one core). Tests are handed out by index: schemathesis
    gives each API operation the same node id. A crashed worker is not replaced
    (`--max-worker-restart 0`): its engine tests would be dealt out to both workers, each with a
    home and engines of its own, side by side on two cores."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScheduling

    class EngineTierScheduling(LoadScheduling):
        def schedule(self) -> None:
            if self.collection is not None or len(self.nodes) < 2:
                return super().schedule()
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            collection = next(iter(self.node2collection.values()))
            named = set(Path(ENGINE_TESTS).read_text().splitlines()) if Path(ENGINE_TESTS).is_file() else set()
            engine = [i for i, nodeid in enumerate(collection) if nodeid in named]
            if not engine:
                return super().schedule()
            self.collection, self.maxschedchunk = collection, self.maxschedchunk or len(collection)
            self.pending[:] = [i for i in range(len(collection)) if collection[i] not in named]
            self.engine_node, *others = self.nodes
            self.node2pending[self.engine_node].extend(engine)
            self.engine_node.send_runtest_some(engine)
            for node in others:
                self._send_tests(node, max(2, len(self.pending) // len(others) // 4))
            if not self.pending:
                for node in others:
                    node.shutdown()

        def check_schedule(self, node: Any, duration: float = 0) -> None:
            """The engine worker takes other tests only once its own are done: queued behind them
            they would wait while the other worker ran out of work."""
            if node is getattr(self, "engine_node", None) and self.node2pending[node] and self.pending:
                return
            super().check_schedule(node, duration)

    return EngineTierScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _RUNNING["item"] = item  # session fixtures a test sets up count as the test's


def _engine_tier_only(start):
    """Outside the engine tier, starting an engine or a job worker (in a test or a fixture it uses) is a test bug."""
    def guarded(*args: object, **kwargs: object):
        item = _RUNNING["item"]
        if item is not None and not _starts_engines(item):
            raise AssertionError(f"{item.nodeid} starts an engine or a job: mark it @pytest.mark.engine (not vllm)")
        return start(*args, **kwargs)

    return guarded


vllm.start_server = _engine_tier_only(vllm.start_server)
local_executor.LocalExecutor.start = _engine_tier_only(local_executor.LocalExecutor.start)  # type: ignore[method-assign]
# a real Ray cluster is reached only to run jobs on it (fast tests give the executor a fake client)
ray_executor._client = _engine_tier_only(ray_executor._client)


@pytest.fixture(scope="session")
def home() -> Path:
    return Path(os.environ["LLMOPT_HOME"])


@pytest.fixture(scope="session")
def smol(home: Path) -> sources.Model:
    """The packaged default model, imported from its GGUF once per session."""
    return sources.resolve(catalog.DEFAULT_MODEL)


@pytest.fixture(scope="session")
def endpoint(smol: sources.Model):
    """One real vLLM engine serving the default model for the whole session."""
    with llmopt.deploy(smol.id, name="session", engine=SMALL_ENGINE) as ep:
        yield ep


# Compiled for its own shapes, and scheduled with a chunked-prefill budget: each of the two changes
# the compile cache's key, so one job gives test_compilation and test_jobs' chunked-prefill test the
# artifact each needs for the price of one cold compile (about 130 s on a Zen 3 EPYC)
COMPILED = Recipe(compilation=Compilation(max_num_seqs=8, max_model_len=2048),
                  chunked_prefill=ChunkedPrefill(max_num_batched_tokens=256))
# the target drafting for itself never pays, so the recipe speculates at every batch size
SELF_DRAFT = Recipe(speculative=DraftModel(catalog.DEFAULT_MODEL, num_speculative_tokens=3, disable_above_batch="never"))


@pytest.fixture(scope="session")
def session_jobs(request: pytest.FixtureRequest, smol: sources.Model) -> dict[str, llmopt.Job]:
    """The jobs whose work is mostly cold compiles, started together when the first is needed: a cold
    compile keeps about one core busy, so the baseline's, the compiled job's and the self-drafting
    job's side by side took less time than one after the other, and the source is measured once
    (techniques/measure.py). Not quantizing jobs: SmoothQuant's quantizing took 1,045 s beside two
    compiles on an Intel Xeon with AMX, against 142 s alone. Only the jobs some collected test
    needs start."""
    needed = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    recipes = {"baseline": ("baseline", "baseline-job"), "compiled": (COMPILED, "compiled-job"), "draft_job": (SELF_DRAFT, "draft-job")}
    return {key: llmopt.optimize(smol.id, chosen, name=name, wait=False) for key, (chosen, name) in recipes.items()
            if key == "baseline" or key in needed}


def _finished(jobs: dict[str, llmopt.Job], key: str) -> llmopt.Job:
    job = jobs[key].wait()
    assert job.status == "COMPLETED", job.record.failure_reason
    return job


@pytest.fixture(scope="session")
def baseline(session_jobs: dict[str, llmopt.Job]) -> llmopt.Job:
    """The baseline recipe's artifact, built (and measured) once per session."""
    return _finished(session_jobs, "baseline")


@pytest.fixture(scope="session")
def compiled(session_jobs: dict[str, llmopt.Job]) -> llmopt.Job:
    """An artifact compiled for its shapes, with a chunked-prefill budget, built once per session."""
    return _finished(session_jobs, "compiled")


@pytest.fixture(scope="session")
def draft_job(session_jobs: dict[str, llmopt.Job]) -> llmopt.Job:
    """The target drafting for itself, as it was started (its warnings are those of its creation)."""
    return session_jobs["draft_job"]


@pytest.fixture(scope="session")
def smoothquant(smol: sources.Model, baseline: llmopt.Job) -> llmopt.Job:
    """The suite's SmoothQuant artifact (the demo's technique where int8 pays), once per session."""
    job = llmopt.optimize(smol.id, recipe.parse(SUITE_SMOOTHQUANT), name="smoothquant-job")
    assert job.status == "COMPLETED", job.record.failure_reason
    return job


FORCED_AGREEMENT_MIN = 0.95  # of `other`'s tokens, the share the base model ranks first within a tie


def assert_parted_only_at_ties(endpoint: Any, base: list[list[int]], other: list[list[int]]) -> None:
    """Greedy answers `other` are `base`'s (the answers of the model `endpoint` serves) but where
    that model itself saw a bf16 tie between the two tokens (checked with its logprobs), and that
    model, fed `other`'s answers, ranks nearly all their tokens first within a tie (teacher
    forcing): another batch shape or another fusion of the same weights breaks ties either way, and
    one flip early in an answer changes every token after it, so free-running agreement says
    little (half of four answers identical, asked here before, read one of four on Zen 4 with every
    parting a tie)."""
    from transformers import AutoTokenizer

    from llmopt.evaluation import quality

    agreement = quality.agreement(base, other)
    parted = quality.divergences(endpoint.url, endpoint.served_name, AutoTokenizer.from_pretrained(endpoint.model_path),
                                 base, other)
    assert all(d["tie"] for d in parted), (agreement, parted)
    forced = quality.forced_agreement(endpoint.url, endpoint.served_name, other)
    assert forced is not None and forced >= FORCED_AGREEMENT_MIN, (forced, agreement, parted)


def run_cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run the real `llmopt` command in this session's home."""
    return subprocess.run(
        [sys.executable, "-c", "from llmopt.cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "250"},
    )


FORKED_CLI = """
import json, os, signal, sys, tempfile, threading
from llmopt.cli import main
from llmopt.engine.zygote import exit_as_a_process


def joined():
    try:
        main()
    finally:  # as a process's exit joins its threads
        threading._shutdown()


done = []
for args in json.loads(sys.argv[1]):
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            try:
                signal.alarm(int(sys.argv[2]))  # the child's whole life, its exit too
                os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
                sys.argv = ["llmopt", *args]
                exit_as_a_process(joined)
            finally:  # never back into this loop, whatever failed
                os._exit(1)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        out.seek(0), err.seek(0)
        done.append([status, out.read().decode(), err.read().decode()])
print(json.dumps(done))
"""


def run_cli_forked(rows: list[list[str]], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Many `llmopt` commands, each in a process of its own forked from one that imported the CLI
    once (as `llmopt` runs them, from `main`), in this session's home: a table of refusals pays one
    import instead of 1.3-1.7 s for each of its rows."""
    done = subprocess.run([sys.executable, "-c", FORKED_CLI, json.dumps(rows), str(int(timeout))], capture_output=True,
                          text=True, timeout=timeout * len(rows), env={**os.environ, "COLUMNS": "250"})
    assert done.returncode == 0, done.stderr[-3000:]
    found = [subprocess.CompletedProcess(["llmopt", *args], code, out, err)
             for args, (code, out, err) in zip(rows, json.loads(done.stdout.splitlines()[-1]))]
    for result in found:  # killed by its alarm, or by anything else: `run_cli` would have raised too
        assert result.returncode >= 0, f"{result.args} ended by signal {-result.returncode}: {result.stderr[-2000:]}"
    return found


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    """A refused command exits non-zero with one `error:` line naming the problem and the fix."""
    assert result.returncode != 0, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert " -- " in line, f"no fix given: {line}"
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def wait_for_step(name: str, step: str, timeout_s: float = 600) -> store.JobRecord:
    """A job's record once `step` runs, or once the job has ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = store.get(name)
        if (record.progress.get(step) and record.progress[step].status == "running") or record.status not in store.ACTIVE:
            return record
        time.sleep(0.2)
    raise AssertionError(f"{name} never reached step {step}: {store.get(name).progress}")


# -- the studio in a real browser ---------------------------------------------------------------

CHROMIUM = Path("/usr/bin/chromium")  # Debian's: Playwright's own browser download fails here
STUDIO_TOKEN = "test-token-0123456789"


@contextmanager
def studio_server() -> Iterator[str]:
    """The studio served by uvicorn on a free loopback port, in this process (its token: STUDIO_TOKEN)."""
    import uvicorn

    from llmopt.studio.app import create_app

    port = vllm.free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(STUDIO_TOKEN), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(100):
        if server.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def browser_page(errors: list[str]) -> Iterator[Any]:
    """A page in headless Chromium; script errors and failed requests the page logs land in `errors`."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM.exists():
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--no-first-run"])
        try:
            page = chromium.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: errors.append(f"{page.url}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"{page.url}: {e}"))
            yield page
        finally:
            chromium.close()


def _ray(*args: str, **kwargs: Any) -> subprocess.CompletedProcess:
    """The `ray` command of the Python running the tests."""
    return subprocess.run([sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()",
                           *args], capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    """A Ray head on 127.0.0.1 for the module using it (2 CPUs, the dashboard on a free port), stopped
    after it, so no Ray process runs beside other modules' measurements; its address."""
    pytest.importorskip("ray.job_submission", reason="needs Ray in the Python running the tests: pip install 'llmopt[ray]'")
    port = vllm.free_port()
    temp = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths must fit in 107 bytes
    started = _ray("start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(vllm.free_port()), "--num-cpus", "2",
                   "--include-dashboard=true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(port),
                   "--temp-dir", temp, "--disable-usage-stats", timeout=300)
    assert started.returncode == 0, started.stdout + started.stderr
    address = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(address + "/api/version", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "Ray's dashboard never answered"
            time.sleep(1)
        yield address
    finally:
        _ray("stop", timeout=300)
