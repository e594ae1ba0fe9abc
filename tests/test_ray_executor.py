"""The Ray executor: a job's worker submitted as a Ray job, its record and log where a local job
keeps them. The fast tier drives the executor with a fake job-submission client (what it submits,
what it records, how Ray's statuses reconcile a record, stops) and the refusals through the CLI;
the engine tier runs real jobs on a real local Ray head."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import psutil
import pytest

import llmopt
from llmopt import Recipe, SmoothQuant, artifact, client, executors, locations, paths, sources
from llmopt.engine import platform, vllm
from llmopt.errors import LlmoptError
from llmopt.evaluation import runs
from llmopt.executors import ray as ray_executor
from llmopt.jobs import pipeline, store, worker

from conftest import assert_one_line_error, run_cli, wait_for_step

ADDRESS = "http://127.0.0.1:9"  # where the fake answers; a real Ray, asked from a CLI subprocess, does not


class FakeRay:
    """Ray's JobSubmissionClient as the executor uses it: submissions kept, statuses set by the test."""

    def __init__(self) -> None:
        self.addresses: list[str] = []  # the clusters the executor asked for
        self.submitted: list[dict[str, Any]] = []
        self.statuses: dict[str, str] = {}
        self.messages: dict[str, str] = {}
        self.stopped: list[str] = []
        self.on_info = lambda sid: None  # what happens while Ray is being asked (the worker may finish meanwhile)
        self.on_stop = lambda sid: None  # what the worker does on the SIGTERM Ray sends it

    def submit_job(self, **kwargs: Any) -> str:
        sid = kwargs["submission_id"]
        if sid in self.statuses:
            raise RuntimeError(f"Request failed with status code 400: Job with submission_id {sid} already exists.")
        self.submitted.append(kwargs)
        self.statuses[sid] = "PENDING"
        return sid

    def _known(self, sid: str) -> None:
        if sid not in self.statuses:
            raise RuntimeError(f"Request failed with status code 404: Job {sid} does not exist.")

    def get_job_info(self, sid: str) -> SimpleNamespace:
        self._known(sid)
        self.on_info(sid)
        return SimpleNamespace(status=self.statuses[sid], message=self.messages.get(sid))

    def get_job_status(self, sid: str) -> str:
        self._known(sid)
        return self.statuses[sid]

    def stop_job(self, sid: str) -> bool:
        self._known(sid)
        self.stopped.append(sid)
        running = self.statuses[sid] in ("PENDING", "RUNNING")
        self.on_stop(sid)
        self.statuses[sid] = "STOPPED"
        return running


@pytest.fixture(autouse=True)
def no_running_ray_records_left() -> Iterator[None]:
    """Records of Ray jobs a fake ran must not outlive the test: reading one would ask a real Ray."""
    yield
    for record in store.JOBS.select("executor = ?", ("ray",)):
        if record.status in store.ACTIVE:
            store.JOBS.delete(record.name)
    for evaluation in runs.EVALUATIONS.select("executor = ?", ("ray",)):
        if evaluation.status in runs.ACTIVE:
            runs.EVALUATIONS.delete(evaluation.name)


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> FakeRay:
    fake = FakeRay()

    def client(address: str) -> FakeRay:
        fake.addresses.append(address)
        return fake

    monkeypatch.setattr(ray_executor, "_client", client)
    return fake


def _ray_record(name: str, status: str, tmp_path: Path, **fields: Any) -> store.JobRecord:
    """A Ray job's record as the runner leaves it once submitted, with a work folder in progress."""
    output = tmp_path / f"out-{name}"
    record = store.JobRecord(name=name, source="x", recipe={}, status=status, log_path=str(tmp_path / f"{name}.log"),
                             output_dir=str(output), executor="ray", ray_address=ADDRESS,
                             ray_submission_id=ray_executor.submission_id(name), created_at=time.time(), **fields)
    store.JOBS.insert(record)
    record.workdir.mkdir(parents=True)
    return record


# -- what is submitted and recorded -------------------------------------------------------------


def test_a_ray_job_submits_the_local_worker_command_with_its_log_env_and_resources(smol: sources.Model, fake_ray: FakeRay,
                                                                                   home: Path) -> None:
    job = llmopt.optimize(smol.id, Recipe(), name="ray-submitted", force=True, wait=False, executor="ray",
                          ray_address="127.0.0.1:9/")
    record = job.record
    sid = ray_executor.submission_id("ray-submitted")
    assert (record.executor, record.ray_address, record.ray_submission_id) == ("ray", ADDRESS, sid)
    assert record.pid is None and record.status == store.STARTING  # Ray says PENDING: nothing to reconcile
    [submitted] = fake_ray.submitted
    assert submitted["submission_id"] == sid and sid.startswith("llmopt-ray-submitted-")
    # the local executor's command word for word, its output appended to the job's own log
    worker, cleanup = submitted["entrypoint"].split(";", 1)
    assert shlex.split(worker) == [sys.executable, "-m", "llmopt.jobs.worker", "ray-submitted", "<", "/dev/null", ">>",
                                   record.log_path, "2>&1"]
    assert "kill -KILL 0" in cleanup  # what a worker killed outright leaves in its process group
    assert Path(record.log_path).exists() and Path(record.log_path).stat().st_mode & 0o777 == 0o600
    env = submitted["runtime_env"]["env_vars"]
    assert env["LLMOPT_HOME"] == str(home) and env["TQDM_DISABLE"] == "1"
    assert env["RAY_JOB_STOP_WAIT_TIME_S"] == str(int(executors.STOP_GRACE_S))
    assert env.get("PYTHONPATH") == (os.environ.get("PYTHONPATH") or None)
    # every core, no GPU, and memory for the measuring server: the weights, the KV cache and its overhead
    hardware = platform.detect()
    assert submitted["entrypoint_num_cpus"] == hardware.cores and submitted["entrypoint_num_gpus"] is None
    assert submitted["entrypoint_memory"] == smol.size_bytes + 2 * 2**30 + pipeline.SERVER_OVERHEAD_BYTES
    assert submitted["metadata"] == {"llmopt_job": "ray-submitted"}
    # the record is the local one's otherwise, and the CLI shows it
    described = json.loads(run_cli("jobs", "describe", "ray-submitted").stdout)
    assert described["executor"] == "ray" and described["ray_submission_id"] == sid


def test_a_node_of_another_processor_kind_records_the_key_and_memory_of_what_it_builds(
        smol: sources.Model, fake_ray: FakeRay, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A SmoothQuant job submitted from a Zen 4 and run by a Ray node without AVX-512 (a Zen 3),
    which quantizes in float32: the record, and the key the build is given, are the node's, so the
    artifact is reused only for a job that would have built the same one. Both machines are
    pinned, so the test reads the same on any machine the suite runs on. Quantizing in float32
    holds more memory than the reservation made for the Zen 4: on a model whose quantizing peak is
    above its serving one (not SmolLM2-135M, whose 2 GiB KV cache outweighs it), the log says so
    and the record takes the node's estimate."""
    here = platform.detect()
    zen4 = here.model_copy(update={"device": "cpu", "gpu": None, "gpu_count": 0, "cpu_model": "AMD EPYC",
                                   "cpu_signature": "AuthenticAMD family 25 model 17",
                                   "cpu_flags": ("avx", "avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16")})
    zen3 = zen4.model_copy(update={"cpu_signature": "AuthenticAMD family 25 model 1", "cpu_flags": ("avx", "avx2")})
    assert (platform.default_dtype(zen4), platform.default_dtype(zen3)) == ("bfloat16", "float32")
    monkeypatch.setattr(platform, "detect", lambda: zen4)  # the submitting machine
    estimate = pipeline.peak_memory_bytes
    quantizing = {"bfloat16": 6 * 2**30, "float32": 12 * 2**30}  # a model whose quantizing peak counts
    monkeypatch.setattr(pipeline, "peak_memory_bytes",
                        lambda source, recipe, hw: max(estimate(source, recipe, hw), quantizing[platform.default_dtype(hw)]))
    recipe = Recipe(quantization=SmoothQuant())
    job = llmopt.optimize(smol.id, recipe, name="ray-other-node", force=True, wait=False, executor="ray",
                          ray_address=ADDRESS)
    submitted = job.record.artifact_key
    assert submitted == pipeline.artifact_key(smol, recipe, zen4)
    assert job.record.memory_bytes == 6 * 2**30 == fake_ray.submitted[-1]["entrypoint_memory"]
    built: list[str] = []
    monkeypatch.setattr(platform, "detect", lambda: zen3)  # the node the worker runs on
    monkeypatch.setattr(pipeline, "build", lambda name, key, *args, **kwargs: built.append(key))  # its key, not a build
    monkeypatch.setattr(worker.signal, "signal", lambda *args: None)  # the worker's SIGTERM handler stays out of pytest
    httpx_level = logging.getLogger("httpx").level
    try:
        assert worker.run("ray-other-node") == 0
    finally:
        logging.getLogger("httpx").setLevel(httpx_level)
        shutil.rmtree(job.record.workdir, ignore_errors=True)  # the work folder the faked build left
    assert built == [job.record.artifact_key] == [pipeline.artifact_key(smol, recipe, zen3)] != [submitted]
    assert job.record.memory_bytes == 12 * 2**30
    assert "this machine (AMD EPYC" in caplog.text
    assert "may hold 12.00 GiB at its peak building the job, more than the 6.00 GiB estimated" in caplog.text


def test_a_quantizing_job_reserves_what_quantizing_needs(smol: sources.Model) -> None:
    from llmopt.techniques.quantization import calibration_dtype, estimate_peak_bytes

    recipe = Recipe(quantization=SmoothQuant())
    config = json.loads((Path(smol.path) / "config.json").read_text())
    hardware = platform.detect()
    quantizing = estimate_peak_bytes(recipe.quantization, config, smol.size_bytes, calibration_dtype(hardware))
    assert pipeline.peak_memory_bytes(smol, recipe, hardware) == max(quantizing, pipeline.peak_memory_bytes(smol, Recipe(), hardware))
    assert quantizing > 3 * smol.size_bytes


def test_submission_ids_differ_between_homes_and_addresses_are_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    here = ray_executor.submission_id("job")
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path))
    assert ray_executor.submission_id("job") != here
    assert ray_executor.dashboard_address(None) == "http://127.0.0.1:8265"
    assert ray_executor.dashboard_address("https://ray.example:443/") == "https://ray.example:443"
    for bad in ("ray://127.0.0.1:10001", "http://", "ftp://x:1"):
        with pytest.raises(LlmoptError, match="not the address of a Ray dashboard"):
            ray_executor.dashboard_address(bad)


def test_the_entrypoint_is_a_shell_line_that_passes_the_workers_exit_code_on(tmp_path: Path) -> None:
    """What Ray runs, run by sh: a worker for a job that does not exist fails at once (it builds
    nothing), its traceback in the log whatever the log's name, its exit code passed on."""
    log = tmp_path / "a b" / "it's.log"
    log.parent.mkdir()
    ran = subprocess.run(["sh", "-c", ray_executor.entrypoint("no-such-job", log)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 1 and ran.stdout == ran.stderr == ""
    assert "no job named 'no-such-job'" in log.read_text()


# -- reconciling a record from Ray's statuses -------------------------------------------------------


@pytest.mark.parametrize("ray_status, before, after, reason", [
    ("PENDING", store.STARTING, store.STARTING, None),
    ("RUNNING", store.INPROGRESS, store.INPROGRESS, None),
    ("FAILED", store.INPROGRESS, store.FAILED, "ended FAILED before its worker recorded an end (Job entrypoint command failed with exit code -9)"),
    ("SUCCEEDED", store.INPROGRESS, store.FAILED, "ended SUCCEEDED before its worker recorded an end"),
    ("STOPPED", store.INPROGRESS, store.STOPPED, "was stopped before its worker recorded an end"),
    ("STOPPED", store.STARTING, store.STOPPED, "was stopped before its worker recorded an end"),
    ("STOPPED", store.STOPPING, store.STOPPED, None),  # a stop llmopt asked for
    ("FAILED", store.STOPPING, store.STOPPED, None),
    ("unknown", store.INPROGRESS, store.FAILED, "has no job"),
])
def test_a_ray_job_record_follows_rays_status(fake_ray: FakeRay, tmp_path: Path, ray_status: str, before: str, after: str,
                                               reason: str | None) -> None:
    name = f"ray-{ray_status.lower()}-{before.lower()}"
    record = _ray_record(name, before, tmp_path)
    if ray_status != "unknown":
        fake_ray.statuses[record.ray_submission_id] = ray_status
        fake_ray.messages[record.ray_submission_id] = ("Job entrypoint command failed with exit code -9, last available logs "
                                                       "(truncated to 20,000 chars):\nRunning entrypoint for job ...")
    found = store.get(name)
    assert found.status == after and store.JOBS.get(name).status == after
    if reason is None:
        assert found.failure_reason is None
    else:
        assert reason in found.failure_reason and record.ray_submission_id in found.failure_reason
        assert "last available logs" not in found.failure_reason and record.log_path in found.failure_reason
    assert record.workdir.exists() == (after in store.ACTIVE), "an ended job's unfinished work folder goes"
    assert (found.ended_at is not None) == (after not in store.ACTIVE)


def test_a_record_is_left_alone_while_ray_cannot_be_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def unreachable(address: str) -> Any:
        raise LlmoptError(f"Ray at {address} does not answer (ConnectError)", "start Ray")

    monkeypatch.setattr(ray_executor, "_client", unreachable)
    record = _ray_record("ray-unreachable", store.INPROGRESS, tmp_path)
    assert store.get("ray-unreachable").status == store.INPROGRESS and record.workdir.exists()
    with pytest.raises(LlmoptError, match="does not answer"):  # a stop is refused before the record says STOPPING
        llmopt.stop_job("ray-unreachable")
    assert store.get("ray-unreachable").status == store.INPROGRESS


def test_an_end_the_worker_records_while_ray_is_asked_is_kept(fake_ray: FakeRay, tmp_path: Path) -> None:
    record = _ray_record("ray-finishing", store.INPROGRESS, tmp_path)
    fake_ray.statuses[record.ray_submission_id] = "SUCCEEDED"
    fake_ray.on_info = lambda sid: store.update("ray-finishing", status=store.COMPLETED, artifact="/done")
    found = store.get("ray-finishing")
    assert (found.status, found.artifact, found.failure_reason) == (store.COMPLETED, "/done", None)


def test_a_never_submitted_ray_job_fails_after_the_grace_period_and_gives_up_its_name(fake_ray: FakeRay, tmp_path: Path) -> None:
    from llmopt import procs

    record = store.JobRecord(name="ray-never", source="x", recipe={}, status=store.STARTING, log_path="/dev/null",
                             output_dir=None, executor="ray", ray_address=ADDRESS, created_at=time.time())
    store.JOBS.insert(record)
    assert store.get("ray-never").status == store.STARTING  # it may still be on its way
    store.update("ray-never", created_at=time.time() - procs.SPAWN_GRACE_S - 1)
    found = store.get("ray-never")
    assert found.status == store.FAILED and "never submitted to Ray" in found.failure_reason
    assert not store.taken("ray-never")


# -- stopping -------------------------------------------------------------------------------------


def test_stopping_a_ray_job_asks_ray_and_the_worker_records_stopped(fake_ray: FakeRay, tmp_path: Path) -> None:
    record = _ray_record("ray-stop", store.INPROGRESS, tmp_path)
    fake_ray.statuses[record.ray_submission_id] = "RUNNING"
    fake_ray.on_stop = lambda sid: store.update("ray-stop", status=store.STOPPED, ended_at=time.time())  # the worker's SIGTERM handler
    stopped = llmopt.stop_job("ray-stop")
    assert fake_ray.stopped == [record.ray_submission_id] and fake_ray.addresses[-1] == ADDRESS
    assert stopped.status == store.STOPPED and stopped.failure_reason is None


def test_a_ray_job_killed_before_it_records_its_stop_ends_stopped(fake_ray: FakeRay, tmp_path: Path) -> None:
    record = _ray_record("ray-stop-killed", store.INPROGRESS, tmp_path)
    fake_ray.statuses[record.ray_submission_id] = "RUNNING"  # the worker records nothing: Ray's SIGKILL came first
    stopped = llmopt.stop_job("ray-stop-killed")
    assert stopped.status == store.STOPPED and stopped.failure_reason is None and not record.workdir.exists()


def test_an_evaluation_runs_its_worker_as_a_ray_job_and_its_record_follows_ray(fake_ray: FakeRay) -> None:
    record = llmopt.evaluate(model="smollm2-135m-instruct", concurrency=[1], requests=4, quality=False, name="ray-eval",
                             background=True, executor="ray", ray_address="127.0.0.1:9/")
    sid = ray_executor.submission_id("ray-eval", "evaluation")
    assert (record.executor, record.ray_address, record.ray_submission_id, record.pid) == ("ray", ADDRESS, sid, None)
    assert sid != ray_executor.submission_id("ray-eval")  # a job of the same name does not collide with it
    [submitted] = fake_ray.submitted
    worker, cleanup = submitted["entrypoint"].split(";", 1)
    assert shlex.split(worker) == [sys.executable, "-m", "llmopt.evaluation.worker", "ray-eval", "<", "/dev/null", ">>",
                                   record.log_path, "2>&1"] and "kill -KILL 0" in cleanup
    assert submitted["metadata"] == {"llmopt_evaluation": "ray-eval"}
    assert submitted["entrypoint_num_cpus"] == platform.detect().cores
    fake_ray.statuses[sid] = "RUNNING"
    fake_ray.on_stop = lambda sid: runs.EVALUATIONS.update("ray-eval", status=runs.STOPPED, ended_at=time.time())
    assert llmopt.stop_evaluation("ray-eval").status == runs.STOPPED and fake_ray.stopped == [sid]
    # a worker that died before recording its end: Ray's FAILED becomes the record's, naming the Ray job
    llmopt.evaluate(model="smollm2-135m-instruct", concurrency=[1], requests=4, quality=False, name="ray-eval-dies",
                    background=True, executor="ray", ray_address="127.0.0.1:9/")
    dying = ray_executor.submission_id("ray-eval-dies", "evaluation")
    fake_ray.statuses[dying], fake_ray.messages[dying] = "FAILED", "Job entrypoint command failed with exit code 1"
    died = llmopt.get_evaluation("ray-eval-dies")
    assert died.status == runs.FAILED and dying in (died.failure_reason or "") and "exit code 1" in (died.failure_reason or "")


def test_evaluation_records_end_as_job_records_do(fake_ray: FakeRay, tmp_path: Path) -> None:
    """Through the same executors: a dead local worker is FAILED with the reason; a Ray job stopped
    from outside llmopt is STOPPED and keeps Ray's account of it."""
    now = time.time()
    runs.EVALUATIONS.insert(runs.EvaluationRecord(name="local-eval-dead", arguments={}, output_dir=str(tmp_path),
                                                  status=runs.INPROGRESS, log_path=str(tmp_path / "l.log"), pid=2**22 + 9,
                                                  pid_create_time=1.0, created_at=now))
    dead = llmopt.get_evaluation("local-eval-dead")
    assert dead.status == runs.FAILED and "died without finishing" in (dead.failure_reason or "") and fake_ray.addresses == []
    sid = ray_executor.submission_id("ray-eval-outside", "evaluation")
    runs.EVALUATIONS.insert(runs.EvaluationRecord(name="ray-eval-outside", arguments={}, output_dir=str(tmp_path),
                                                  status=runs.INPROGRESS, log_path=str(tmp_path / "r.log"), executor="ray",
                                                  ray_address=ADDRESS, ray_submission_id=sid, created_at=now))
    fake_ray.statuses[sid] = "STOPPED"  # `ray job stop`, say: llmopt never asked
    outside = llmopt.get_evaluation("ray-eval-outside")
    assert outside.status == runs.STOPPED and sid in (outside.failure_reason or "") and "stopped" in (outside.failure_reason or "")


def test_a_local_job_never_asks_ray(fake_ray: FakeRay, tmp_path: Path) -> None:
    store.JOBS.insert(store.JobRecord(name="local-dead", source="x", recipe={}, status=store.INPROGRESS, log_path="/dev/null",
                                      output_dir=None, pid=2**22 + 7, pid_create_time=1.0, created_at=time.time()))
    found = store.get("local-dead")
    assert found.status == store.FAILED and "died without finishing" in found.failure_reason
    assert fake_ray.addresses == []


# -- refusals: one line, before anything is recorded ---------------------------------------------------


def _stub_ray(root: Path, importable: bool) -> Path:
    """A `ray` package that shadows any installed one: importing it fails, or its client is never reached."""
    package = root / "ray"
    package.mkdir(parents=True)
    if importable:
        (package / "__init__.py").write_text("")
        (package / "job_submission.py").write_text("class JobSubmissionClient:\n    def __init__(self, address):\n"
                                                    "        raise AssertionError('the address was checked first')\n")
    else:
        (package / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    return root


def _refused_on_the_cli(monkeypatch: pytest.MonkeyPatch, name: str, stub: Path | None, *args: str) -> subprocess.CompletedProcess:
    with monkeypatch.context() as patched:
        if stub is not None:
            patched.setenv("PYTHONPATH", os.pathsep.join([str(stub), *filter(None, [os.environ.get("PYTHONPATH")])]))
        result = run_cli("optimize", "--name", name, *args)
    assert store.load(name) is None, "a refused job leaves no record"
    assert not (paths.artifacts_dir(create=False) / name).exists()
    assert not (paths.logs_dir() / f"job-{name}.log").exists()
    return result


def test_ray_executor_refusals_are_one_line_and_leave_nothing(smol: sources.Model, monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    no_ray = _stub_ray(tmp_path / "no-ray", importable=False)
    line = assert_one_line_error(_refused_on_the_cli(monkeypatch, "no-ray", no_ray, "--executor", "ray"),
                                 "--executor ray needs Ray, which is not installed here")
    assert line.endswith("-- pip install 'llmopt[ray]'"), line
    stub = _stub_ray(tmp_path / "stub-ray", importable=True)
    port = vllm.free_port()
    assert_one_line_error(_refused_on_the_cli(monkeypatch, "ray-gone", stub, "--executor", "ray", "--ray-address",
                                              f"http://127.0.0.1:{port}"),
                          f"Ray at http://127.0.0.1:{port} does not answer", "--ray-address")
    assert_one_line_error(_refused_on_the_cli(monkeypatch, "ray-bad", stub, "--executor", "ray", "--ray-address",
                                              "ray://127.0.0.1:10001"), "not the address of a Ray dashboard")
    assert_one_line_error(_refused_on_the_cli(monkeypatch, "slurm", None, "--executor", "slurm"),
                          "unknown executor 'slurm'", "local, ray")
    assert_one_line_error(_refused_on_the_cli(monkeypatch, "local-ray", None, "--ray-address", ADDRESS),
                          "--ray-address is for the Ray executor")


def test_records_of_an_older_llmopt_open_as_local_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Columns added since (the executor, Ray's address and id) read as their defaults in older rows."""
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path))
    old = ["name", "source", "source_hash", "recipe", "artifact_key", "status", "failure_reason", "log_path", "output_dir",
           "artifact", "pid", "pid_create_time", "progress", "force", "created_at", "started_at", "ended_at"]
    with sqlite3.connect(tmp_path / "llmopt.db") as conn:
        conn.execute(f"CREATE TABLE jobs ({', '.join(c + (' TEXT PRIMARY KEY' if c == 'name' else '') for c in old)})")
        conn.execute("INSERT INTO jobs (name, source, recipe, status, log_path, progress, force, created_at, ended_at) "
                     "VALUES ('old-job', 'm', '{}', 'COMPLETED', '/dev/null', '{}', 0, 1.0, 2.0)")
    record = store.get("old-job")
    assert (record.executor, record.ray_address, record.ray_submission_id) == ("local", None, None)
    assert [r.name for r in store.list_jobs()] == ["old-job"]


# -- the engine tier: real jobs on a real local Ray head ---------------------------------------------------


def _ray_client(address: str) -> Any:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)


def _ray_status(address: str, sid: str, settled: bool = True, timeout_s: float = 120) -> str:
    """Ray's status of a job, once it is no longer PENDING or RUNNING if `settled`."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = str(_ray_client(address).get_job_status(sid))
        if not settled or status not in ("PENDING", "RUNNING") or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def _worker(name: str) -> psutil.Process:
    for proc in psutil.process_iter(["cmdline"]):
        if (proc.info["cmdline"] or [])[1:] == ["-m", "llmopt.jobs.worker", name]:
            return proc
    raise AssertionError(f"no worker process for {name}")


@pytest.mark.engine
def test_a_ray_job_builds_what_a_local_job_builds(ray_head: str, baseline: llmopt.Job, smol: sources.Model,
                                                  tmp_path: Path) -> None:
    """Built through Ray into a URI every node could read (a `file://` one here), then deployed from
    that URI: fetched into a local copy, checked, and served."""
    uri = f"file://{tmp_path}/shared/ray-baseline"
    job = llmopt.optimize(smol.id, "baseline", name="ray-baseline", output=uri, force=True, wait=False, executor="ray",
                          ray_address=ray_head)
    assert job.wait(timeout_s=1800).status == store.COMPLETED, job.record.failure_reason
    record, local = job.record, baseline.record
    assert (record.executor, record.ray_address, record.pid) == ("ray", ray_head, None)
    assert record.artifact_key == local.artifact_key and list(record.progress) == [*local.progress, "publish"]
    assert all(step.status == "done" for step in record.progress.values())
    assert job.artifact == record.artifact == uri and not record.built_dir.exists()
    manifest = artifact.verify(locations.fetch(uri))
    assert manifest.key == local.artifact_key and [s.name for s in manifest.steps] == ["weights", "measure"]
    assert manifest.content_hash == artifact.load(baseline.artifact).content_hash  # the same weights, bit for bit
    assert record.artifact_hash == manifest.content_hash  # its compiled code is this home's own, at the URI and in copies
    with llmopt.deploy(uri, name="from-uri") as endpoint:
        assert endpoint.served_name == "ray-baseline" and Path(endpoint.model_path).parent == locations.copies_dir()
        answer = client.chat(endpoint.url, endpoint.served_name, "Answer in one sentence: what is the capital city of France?",
                             max_tokens=24, headers=endpoint.headers)
        assert "Paris" in answer.text, answer.text
    assert _ray_status(ray_head, record.ray_submission_id) == "SUCCEEDED"  # the worker has exited: its log is whole
    logs = run_cli("jobs", "logs", "ray-baseline").stdout
    assert "step weights: start" in logs and "perplexity" in logs and logs == Path(record.log_path).read_text()
    described = json.loads(run_cli("jobs", "describe", "ray-baseline").stdout)
    assert described["status"] == "COMPLETED" and described["ray_submission_id"] == record.ray_submission_id


@pytest.mark.engine
def test_an_evaluation_through_ray_measures_and_records_as_a_local_one(ray_head: str, baseline: llmopt.Job) -> None:
    results = llmopt.evaluate(model=str(baseline.artifact), concurrency=[1], requests=4, min_duration_s=0, quality=False,
                              name="ray-evaluation", executor="ray", ray_address=ray_head)
    record = llmopt.get_evaluation("ray-evaluation")
    assert (record.status, record.executor) == (runs.COMPLETED, "ray") and record.pid != os.getpid()  # the Ray worker's
    assert _ray_status(ray_head, record.ray_submission_id) == "SUCCEEDED"
    (level,) = results.targets[0].levels
    assert level.invocations >= 4 and level.invocation_errors == 0 and level.output_tokens_per_s > 0
    assert results == llmopt.evaluation_results("ray-evaluation")
    described = json.loads(run_cli("evaluations", "describe", "ray-evaluation").stdout)
    assert described["executor"] == "ray" and described["status"] == runs.COMPLETED


@pytest.mark.engine
def test_stopping_a_ray_job_ends_stopped_through_ray(ray_head: str, smol: sources.Model) -> None:
    job = llmopt.optimize(smol.id, "baseline", name="ray-to-stop", force=True, wait=False, executor="ray", ray_address=ray_head)
    wait_for_step("ray-to-stop", "measure")
    time.sleep(5)  # the measuring engine is starting, a child of the worker
    worker = _worker("ray-to-stop")
    family = [worker, *worker.children(recursive=True)]
    stopped = run_cli("jobs", "stop", "ray-to-stop")
    assert stopped.returncode == 0 and "STOPPED" in stopped.stdout, stopped.stdout + stopped.stderr
    record = job.record
    assert record.status == store.STOPPED and record.artifact is None
    assert record.failure_reason is None, "the worker itself recorded the stop: it got SIGTERM, not SIGKILL"
    assert not Path(record.output_dir).exists() and not record.workdir.exists()
    assert any(line.endswith("INFO stopped") for line in Path(record.log_path).read_text().splitlines())
    assert _ray_status(ray_head, record.ray_submission_id) == "STOPPED"
    psutil.wait_procs(family, timeout=30)
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "the job's engine outlived the stop"


@pytest.mark.engine
def test_a_ray_job_killed_from_outside_ends_its_record_failed(ray_head: str, smol: sources.Model) -> None:
    # the worker killed outright: Ray says FAILED, and so does the record, naming the Ray job
    job = llmopt.optimize(smol.id, "baseline", name="ray-killed-outside", force=True, wait=False, executor="ray",
                          ray_address=ray_head)
    wait_for_step("ray-killed-outside", "measure")
    time.sleep(5)
    worker = _worker("ray-killed-outside")
    family = [worker, *worker.children(recursive=True)]
    worker.kill()
    sid = job.record.ray_submission_id
    assert _ray_status(ray_head, sid) == "FAILED"
    record = job.record
    assert record.status == store.FAILED and sid in record.failure_reason and "exit code -9" in record.failure_reason
    assert not record.workdir.exists() and Path(record.log_path).exists()
    psutil.wait_procs(family, timeout=30)  # Ray kills what the dead worker left in its process group
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "the dead worker's engine was left running"
