"""Faults: every bad input a user can give gets one line and leaves nothing behind; processes
llmopt does not own are never signalled; a manifest cannot run code; endpoints can require a key;
interrupts, kills at every stage and races leave records that tell the truth; quantizing twice
gives the same bytes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from psutil import _pslinux

import llmopt
from llmopt import artifact, client, names, paths, procs, records, sources
from llmopt.engine import platform
from llmopt.errors import LlmoptError
from llmopt.jobs import store
from llmopt.techniques import quantization
from llmopt.techniques.quantization import schemes

from conftest import QUICK_SMOOTHQUANT, SMALL_ENGINE, assert_one_line_error, run_cli, run_cli_forked

DEFAULT = "smollm2-135m-instruct"


def _snapshot(home: Path) -> dict:
    """What a refused command must not change: files in the home (logs, the database and caches of
    what the machine and engine are aside) and records."""
    files = sorted(str(p.relative_to(home)) for p in home.rglob("*")
                   if not {"logs", "compile-cache", "engine-facts"} & set(p.relative_to(home).parts)
                   and not p.name.startswith("llmopt.db") and p.name != "hash-cache")
    return {"files": files, "jobs": [j.name for j in llmopt.list_jobs()], "endpoints": [e.name for e in llmopt.list_endpoints()],
            "models": [m.id for m in llmopt.list_models()]}


def _bad_inputs(tmp: Path, smol: sources.Model) -> list[tuple[list[str], str]]:
    latin1 = tmp / "latin1.yaml"
    latin1.write_bytes("name: caf\xe9\n".encode("latin-1"))
    huge_len = tmp / "huge.yaml"
    huge_len.write_text("compilation:\n  max_model_len: 100000000000000000000000000\n")
    missing_calibration = tmp / "calibrate.yaml"
    missing_calibration.write_text(f"quantization:\n  method: smoothquant\n  calibration:\n    dataset: {tmp / 'nope.jsonl'}\n")
    infinity = tmp / "infinity.jsonl"
    infinity.write_text('{"prompt": "x", "max_tokens": Infinity}\n' + "[" * 5000 + "]" * 5000 + "\n")
    store_path = str(Path(smol.path).parent / "..")
    return [
        (["deploy", DEFAULT, "--name", "../../../../tmp/x"], "invalid endpoint name"),
        (["deploy", DEFAULT, "--name=-leading-dash"], "invalid endpoint name"),
        (["deploy", DEFAULT, "--name", "new\nline"], "invalid endpoint name"),
        (["models", "import", DEFAULT, "--name", ".."], "invalid model name"),
        (["models", "import", DEFAULT, "--name", "a/b"], "invalid model name"),
        (["optimize", "--name", "a/b/c"], "invalid job name"),
        (["optimize", "--name", "UPPER"], "invalid job name"),
        (["optimize", "--tensor-parallel", "0"], "tensor_parallel_size"),
        (["optimize", "--recipe", str(latin1)], "not UTF-8"),
        (["optimize", "--recipe", str(huge_len)], "max_model_len"),
        (["optimize", "--recipe", str(missing_calibration)], "calibration"),
        (["optimize", "--quantize", "int3"], "quantization"),
        (["optimize", "--speculative", "eagle9"], "unknown --speculative"),
        (["optimize", "--model", "/no/such/model"], "does not exist"),
        (["deploy", DEFAULT, "--port", "-1"], "is not a TCP port"),
        (["deploy", DEFAULT, "--port", "99999"], "is not a TCP port"),
        (["deploy", DEFAULT, "--host", "bad host"], "is not an address"),
        (["deploy", DEFAULT, "--host", "0.0.0.0"], "without an API key"),
        (["deploy", DEFAULT, "--max-model-len", "0"], "max_model_len"),
        (["deploy", DEFAULT, "--kv-cache-gib", "-1"], "kv_cache_gib"),
        (["deploy", DEFAULT, "--timeout", "-1"], "timeout"),
        (["deploy", str(tmp)], "not a model folder"),
        (["evaluate", "--model", DEFAULT, "--timeout", "-1"], "timeout_s"),
        (["evaluate", "--model", DEFAULT, "--ttft-target", "-5"], "ttft_ms"),
        (["evaluate", "--model", DEFAULT, "--concurrency", "0"], "concurrency"),
        (["evaluate", "--model", DEFAULT, "--requests", "0"], "requests"),
        (["demo", "--recipe", "baseline", "--concurrency", "0"], "concurrency"),  # before its job, not after
        (["demo", "--recipe", "baseline", "--concurrency", "2,1"], "bad evaluation setting: concurrency levels must be increasing"),
        (["demo", "--concurrency", "1,x"], "bad --concurrency"),
        (["demo", "--recipe", "baseline", "--dataset", str(tmp / "missing.jsonl")], "unknown dataset"),
        (["evaluate", "--model", DEFAULT, "--dataset", str(tmp / "missing.jsonl")], "unknown dataset"),
        (["evaluate", "--model", DEFAULT, "--dataset", str(infinity)], "no valid line"),
        (["evaluate", "--model", DEFAULT, "--dataset", "synthetic:0,5"], "out of range"),
        (["evaluate", "--model", DEFAULT, "--discount", "1.5"], "outside"),
        (["evaluate", "--compare", store_path], "not a model folder"),
        (["evaluate", "--compare", DEFAULT, "--compare", store_path], "not a model folder"),  # before the first deploys
        (["endpoints", "list", "--status", "bogus"], "unknown status"),
        (["jobs", "list", "--status", "bogus"], "unknown status"),
        (["jobs", "stop", "nope"], "no job named"),
        (["endpoints", "stop", "nope"], "no endpoint named"),
        (["models", "remove", "nope"], "no imported model"),
        (["cache", "prune", "--older-than-days", "-1"], "negative"),
        (["export-command", str(tmp / "nowhere")], "not an llmopt artifact"),
    ]


def test_every_bad_input_is_one_line_and_leaves_nothing(smol: sources.Model, home: Path, tmp_path: Path) -> None:
    rows = _bad_inputs(tmp_path, smol)
    before = _snapshot(home)
    results = run_cli_forked([args for args, _ in rows])  # each a process of its own: nothing shared but the home
    for (args, needle), result in zip(rows, results):
        assert_one_line_error(result, needle)
    assert _snapshot(home) == before


def test_one_name_rule_for_everything() -> None:
    for good in ("a", "smollm2-135m-instruct", "job_1.v2", "x" * 63):
        assert names.check(good, "job") == good
    for bad in ("", ".", "..", "a/b", "-a", ".hidden", "a..b", "A", "a b", "a\nb", "x" * 64, "é"):
        with pytest.raises(LlmoptError, match="invalid job name"):
            names.check(bad, "job")
    for text in ("My Model (v2)..gguf", "../../etc", "-x-", "ÉTÉ", "a" * 100):
        assert names.check(names.slug(text), "model")


def test_a_recycled_pid_is_never_signalled(home: Path) -> None:
    """A stale job record whose pid now belongs to someone else's process group: left alone."""
    stranger = subprocess.Popen(["setsid", "sleep", "60"])  # a process group of its own, not llmopt's
    try:
        time.sleep(0.5)
        group = psutil.Process(stranger.pid)
        assert os.getpgid(group.pid) == group.pid
        now = time.time()
        store.JOBS.insert(store.JobRecord(name="stale-job", source="x", recipe={}, status=store.INPROGRESS, log_path="/dev/null",
                                          output_dir=None, pid=group.pid, pid_create_time=group.create_time() - 3600,
                                          created_at=now - 3600))
        assert procs.kill_group(group.pid, group.create_time() - 3600) == 0
        record = store.get("stale-job")  # reconciles the record; must not kill the stranger
        assert record.status == store.FAILED and "died without finishing" in record.failure_reason
        assert group.is_running() and group.status() != psutil.STATUS_ZOMBIE
    finally:
        stranger.kill()
        stranger.wait()


def test_a_clock_step_leaves_live_workers_alive(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wall clock stepping (time sync, a paused virtual machine resumed) moves the boot time it
    implies: a job whose worker runs stays IN_PROGRESS, and its build folder stays."""
    sleeper = subprocess.Popen(["setsid", "sleep", "60"])
    try:
        time.sleep(0.2)
        store.JOBS.insert(store.JobRecord(name="clock-stepped", source="x", recipe={}, status=store.INPROGRESS, log_path="/dev/null",
                                          output_dir=str(paths.artifacts_dir() / "clock-stepped"), pid=sleeper.pid,
                                          pid_create_time=procs.create_time(sleeper.pid), created_at=time.time()))
        record = store.get("clock-stepped")
        record.workdir.mkdir(parents=True)
        stepped = _pslinux.boot_time() + 30
        monkeypatch.setattr(_pslinux, "boot_time", lambda: stepped)
        assert store.get("clock-stepped").status == store.INPROGRESS and record.workdir.is_dir()
        assert procs.kill_group(sleeper.pid, record.pid_create_time) == 1  # still recognised as the one recorded
        sleeper.wait(timeout=10)
        assert store.get("clock-stepped").status == store.FAILED and not record.workdir.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.engine
def test_a_crafted_manifest_cannot_run_code(baseline: llmopt.Job, tmp_path: Path) -> None:
    copy = tmp_path / "crafted"
    shutil.copytree(baseline.artifact, copy)
    for p in [copy, *copy.rglob("*")]:
        p.chmod(0o700)
    manifest = json.loads((copy / artifact.MANIFEST).read_text())
    for key, value in [("env", {"LD_PRELOAD": "/tmp/evil.so", "PYTHONPATH": "/tmp"}), ("args", {"trust-remote-code": True})]:
        crafted = {**manifest, "engine": {**manifest["engine"], key: value}}
        (copy / artifact.MANIFEST).write_text(json.dumps(crafted))
        line = assert_one_line_error(run_cli("deploy", str(copy)), "not a valid manifest", f"engine.{key}: unknown key")
        assert "evil" not in line
    settings = {**manifest["engine"]["settings"], "preload": "/tmp/evil.so"}
    (copy / artifact.MANIFEST).write_text(json.dumps({**manifest, "engine": {**manifest["engine"], "settings": settings}}))
    assert_one_line_error(run_cli("deploy", str(copy)), "engine.settings.preload")
    newer = {**manifest, "schema_version": artifact.SCHEMA_VERSION + 1}
    (copy / artifact.MANIFEST).write_text(json.dumps(newer))
    assert_one_line_error(run_cli("deploy", str(copy)), f"schema version {artifact.SCHEMA_VERSION + 1}", "upgrade llmopt")
    # a weights file changed after the build is caught before anything is served
    (copy / artifact.MANIFEST).write_text(json.dumps(manifest))
    with (copy / "config.json").open("a") as f:
        f.write(" ")
    assert_one_line_error(run_cli("deploy", str(copy)), "was modified after it was built")


@pytest.mark.engine
def test_an_api_key_guards_every_route(smol: sources.Model) -> None:
    key = "test-key-123"
    with llmopt.deploy(smol.id, name="keyed", engine=SMALL_ENGINE, api_key=key) as endpoint:
        body = {"model": endpoint.served_name, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
        for method, route, payload in [("POST", "/v1/chat/completions", body), ("POST", "/invocations", body),
                                       ("GET", "/metrics", None), ("GET", "/v1/models", None), ("GET", "/ping", None),
                                       ("POST", "/tokenize", {"model": endpoint.served_name, "prompt": "hi"})]:
            refused = httpx.request(method, endpoint.url + route, json=payload, timeout=60)
            wrong = httpx.request(method, endpoint.url + route, json=payload, timeout=60, headers={"Authorization": "Bearer no"})
            allowed = httpx.request(method, endpoint.url + route, json=payload, timeout=60, headers=endpoint.headers)
            assert (refused.status_code, wrong.status_code, allowed.status_code) == (401, 401, 200), route
        # llmopt's own tools pass the key: a load test against the endpoint by name
        results = llmopt.evaluate(endpoint="keyed", concurrency=[1], requests=4, min_duration_s=0, quality=False)
        assert results.targets[0].levels[0].invocation_errors == 0
        assert key not in Path(endpoint.log_path).read_text(), "the key never reaches a log"
        assert key not in json.dumps(llmopt.get_endpoint("keyed").to_dict())
        assert client.chat(endpoint.url, endpoint.served_name, "Hi", max_tokens=4, headers=endpoint.headers).completion_tokens


def test_state_is_readable_by_its_owner_alone(home: Path, smol: sources.Model) -> None:
    assert (home.stat().st_mode & 0o077) == 0
    assert (paths.db_path().stat().st_mode & 0o077) == 0


@pytest.mark.engine
def test_artifacts_are_readable_by_their_owner_alone(baseline: llmopt.Job) -> None:
    modes = [p.stat().st_mode & 0o777 for p in baseline.artifact.rglob("*") if p.is_file()]
    assert modes and all(m == 0o400 for m in modes)


def test_a_state_file_is_replaced_whole_by_many_writers_at_once(tmp_path: Path) -> None:
    """Eight threads replace one file 50 times each: every read sees one writer's whole text, and
    no temporary file is left, nor by a write that fails; a private file is its owner's alone."""
    target = tmp_path / "state.json"
    texts = [json.dumps({"writer": n, "pad": "x" * 100_000}) for n in range(8)]
    seen: list[str] = []

    def write(text: str) -> None:
        for _ in range(50):
            paths.write_atomic(target, text)
            seen.append(target.read_text())

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, texts))
    assert set(seen) <= set(texts) and len(seen) == 400
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
    assert target.stat().st_mode & 0o777 == 0o666 & ~paths._UMASK  # as a plain write would make it
    paths.write_atomic(target, "secret", private=True)
    assert target.read_text() == "secret" and target.stat().st_mode & 0o777 == 0o600
    (tmp_path / "folder").mkdir()
    with pytest.raises(IsADirectoryError):
        paths.write_atomic(tmp_path / "folder", "a folder is not replaced")  # its temporary file went beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "state.json"]


def test_a_workers_peak_memory_is_its_own() -> None:
    """A parent that touched 1 GiB starts a small child: the child's ru_maxrss says 1 GiB (Linux
    carries the parent's peak across fork and exec), its recorded peak says what it used."""
    child = ("import resource; from llmopt import procs; "
             "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, procs.peak_rss_bytes())")
    parent = f"import subprocess, sys; a = bytearray(2**30); a[::4096] = b'x' * (2**30 // 4096); subprocess.run([sys.executable, '-c', {child!r}])"
    inherited, own = map(int, subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True,
                                             check=True).stdout.split())
    assert inherited > 2**30 > 4 * own, (inherited, own)


def test_database_creation_from_many_processes_at_once(tmp_path: Path) -> None:
    code = ("import os, sys; os.environ['LLMOPT_HOME'] = sys.argv[1]\n"
            "from llmopt import sources\n"
            "for _ in range(50): sources.list_models()\n")
    env = {**os.environ, "LLMOPT_HOME": str(tmp_path)}
    procs_ = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env, stderr=subprocess.PIPE) for _ in range(6)]
    errors = [p.communicate(timeout=120)[1].decode() for p in procs_]
    assert all(p.returncode == 0 for p in procs_), errors
    with sqlite3.connect(tmp_path / "llmopt.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_two_claims_of_one_endpoint_name_one_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The name is checked and recorded in one transaction: of two deploys, one is refused before it starts anything."""
    from llmopt import endpoints
    from llmopt.engine.config import EngineConfig

    def claim(_: int) -> str:
        record = endpoints.Endpoint(name="twice", model="m", model_path="/m", served_name="m", host="127.0.0.1", port=1,
                                    log_path="/dev/null", engine=EngineConfig(), started_at=time.time(),
                                    deployer_pid=os.getpid(), deployer_create_time=procs.create_time(os.getpid()))
        try:
            endpoints._claim(record)
            return "claimed"
        except LlmoptError as exc:
            return exc.problem

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(claim, range(4)))
    assert outcomes.count("claimed") == 1 and all("already running" in o for o in outcomes if o != "claimed")
    endpoints.ENDPOINTS.delete("twice")


def test_an_interrupted_import_leaves_nothing_and_the_next_one_cleans_up(home: Path, tmp_path: Path) -> None:
    gguf_file = str(__import__("llmopt.catalog", fromlist=["get"]).get(DEFAULT).weight_files()[0])
    cli = subprocess.Popen([sys.executable, "-c", "from llmopt.cli import main; main()", "models", "import", gguf_file,
                            "--name", "interrupted"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list((home / "models").glob(".import-interrupted-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    cli.send_signal(signal.SIGTERM)
    _, stderr = cli.communicate(timeout=60)
    assert cli.returncode == 143, stderr
    assert not list((home / "models").glob(".import-interrupted-*")) and sources.get("interrupted") is None
    # a folder left by an import killed outright (no chance to clean up) goes at the next import
    stale = home / "models" / ".import-ghost-999999-abcd"
    stale.mkdir()
    with pytest.raises(LlmoptError):
        sources.import_model(str(tmp_path / "nothing-here"))
    sources.import_model(str(Path(sources.resolve(DEFAULT).path)), name="after-stale")
    assert not stale.exists()
    sources.remove("after-stale")


@pytest.mark.engine
def test_ctrl_c_while_waiting_exits_130_and_the_job_goes_on(smol: sources.Model) -> None:
    cli = subprocess.Popen([sys.executable, "-c", "from llmopt.cli import main; main()", "optimize", "--name", "waited",
                            "--recipe", "baseline", "--force", "--wait"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while store.load("waited") is None and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)
    cli.send_signal(signal.SIGINT)
    _, stderr = cli.communicate(timeout=60)
    assert cli.returncode == 130 and "interrupted" in stderr, stderr
    job = llmopt.Job("waited").wait(timeout_s=900)
    assert job.status == store.COMPLETED


@pytest.mark.engine
def test_kills_at_every_stage_leave_true_records(smol: sources.Model, baseline: llmopt.Job, tmp_path: Path) -> None:
    # the worker, mid-quantization: FAILED with the reason, nothing complete-looking, and a retry succeeds
    quick = {"quantization": QUICK_SMOOTHQUANT}
    kept = quantization.kept_weights(schemes.SmoothQuant(**QUICK_SMOOTHQUANT), smol, 1, quantization.calibration_dtype(platform.detect()))
    shutil.rmtree(kept, ignore_errors=True)  # quantizing here, whatever this session quantized before (kept weights are linked)
    # built here, not reused, whatever an earlier test built (the suite's SmoothQuant recipe is this one)
    job = llmopt.optimize(smol.id, quick, name="killed-mid-quantize", force=True, wait=False)
    deadline = time.monotonic() + 300
    while job.record.progress.get("quantize", store.StepProgress()).fraction < 0.1 and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(job.record.pid, signal.SIGKILL)
    time.sleep(1)
    record = job.record
    assert record.status == store.FAILED and "died without finishing" in record.failure_reason
    assert not Path(record.output_dir).exists() and not record.workdir.exists()
    assert not kept.exists(), "killed before quantizing was done: no weights kept"
    retry = llmopt.optimize(smol.id, quick, name="retry-after-kill", force=True)
    assert retry.status == store.COMPLETED, retry.record.failure_reason
    # the engine, mid-start: the deploy fails with its log and the record says so
    cli = subprocess.Popen([sys.executable, "-c", "from llmopt.cli import main; main()", "deploy", str(retry.artifact),
                            "--name", "killed-mid-start"], stderr=subprocess.PIPE, text=True)
    pid = _engine_pid("killed-mid-start")
    time.sleep(3)
    os.killpg(pid, signal.SIGKILL)
    _, stderr = cli.communicate(timeout=120)
    assert cli.returncode == 1 and "exited before it was ready" in stderr
    assert llmopt.get_endpoint("killed-mid-start").status == "FAILED"
    # the deploying command, mid-start: its orphaned engine is stopped and the record says why
    cli = subprocess.Popen([sys.executable, "-c", "from llmopt.cli import main; main()", "deploy", str(retry.artifact),
                            "--name", "orphaned"], stderr=subprocess.PIPE)
    _engine_pid("orphaned")
    cli.kill()
    cli.wait()
    orphan = llmopt.get_endpoint("orphaned")
    assert orphan.status == "FAILED" and "deploying process died" in orphan.failure_reason
    assert not procs.is_alive(orphan.pid, orphan.pid_create_time)
    # the engine, mid-load-test: the evaluation ends with what it measured, and says so
    with llmopt.deploy(str(retry.artifact), name="killed-mid-load") as endpoint:
        cli = subprocess.Popen([sys.executable, "-c", "from llmopt.cli import main; main()", "evaluate", "--endpoint",
                                endpoint.name, "--concurrency", "2", "--requests", "200", "--no-quality",
                                "--output", str(tmp_path / "partial")], stderr=subprocess.PIPE, text=True)
        time.sleep(20)
        os.killpg(endpoint.pid, signal.SIGKILL)
        _, stderr = cli.communicate(timeout=300)
    assert cli.returncode == 1 and "partial results were saved" in stderr
    level = llmopt.load_results(tmp_path / "partial").targets[0].levels[0]
    assert level.aborted and 0 < level.invocations < 200
    assert llmopt.get_endpoint("killed-mid-load").status in ("FAILED", "STOPPED")


def _engine_pid(name: str, timeout_s: float = 120) -> int:
    """The pid of a starting endpoint's engine, once its record has one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = next((e for e in llmopt.list_endpoints() if e.name == name and e.pid is not None), None)
        if found is not None:
            return found.pid
        time.sleep(0.2)
    raise AssertionError(f"endpoint {name} never recorded an engine")


def test_quantizing_twice_gives_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibration runs in order with every seed fixed: llm-compressor's default shuffle made two
    runs of one recipe differ (by +0.70% against +1.64% perplexity on SmolLM2). Weights once made
    are kept, and the next artifact asking for the same links them instead of quantizing again."""
    import logging

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmopt.techniques.quantization import quantize_model

    source = tmp_path / "tiny"
    torch.manual_seed(1)
    config = AutoConfig.for_model(model_type="llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=49152)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(source)
    smol_path = Path(sources.resolve(DEFAULT).path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smol_path / name).exists():
            shutil.copyfile(smol_path / name, source / name)
    model = sources.Model(id="tiny", path=str(source), source="test", content_hash="-", architecture="LlamaForCausalLM",
                          size_bytes=1, imported_at=0)
    recipe = schemes.SmoothQuant(calibration=schemes.Calibration(samples=8, sequence_length=64))
    built = []
    for run in range(3):
        monkeypatch.setenv(paths.HOME_ENV, str(tmp_path / f"home{min(run, 1)}"))  # two homes: two fresh quantizations
        dest = tmp_path / f"run{run}"
        dest.mkdir()
        record = quantize_model(recipe, model, dest, 1, logging.getLogger("test"), lambda f: None)
        built.append((dest / "model.safetensors").read_bytes())
        assert record.seed == schemes.SEED and record.reused == (run == 2)
    assert built[0] == built[1] == built[2]
    assert (tmp_path / "run2" / "model.safetensors").stat().st_nlink > 1  # linked, not copied


def test_records_of_an_older_llmopt_gain_new_columns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path))
    with sqlite3.connect(tmp_path / "llmopt.db") as conn:
        conn.execute("CREATE TABLE models (id TEXT PRIMARY KEY, path TEXT, source TEXT, content_hash TEXT, architecture TEXT,"
                     " size_bytes INTEGER)")
        conn.execute("INSERT INTO models VALUES ('old', '/x', 'hf:/x', 'h', 'LlamaForCausalLM', 1)")
    table = records.Table("models", sources.Model, key="id", order="id")
    with table.connect() as conn:
        assert "imported_at" in {row["name"] for row in conn.execute("PRAGMA table_info(models)")}


SOCKETS_SCENARIO = """
import json, os, signal, sys, time
from pathlib import Path
from llmopt.engine import vllm
binds = ("import os, socket, time; s = socket.socket(socket.AF_UNIX); "
         "s.bind(os.path.join(os.environ['VLLM_RPC_BASE_PATH'], 'engine.sock')); time.sleep(120)")
def start(n):
    server = vllm.start_server([sys.executable, '-c', binds], {}, Path(sys.argv[1]) / f'{n}.log', '127.0.0.1', 1)
    deadline = time.monotonic() + 20
    while not (server.sockets / 'engine.sock').exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return server
stopped, killed = start(0), start(1)
seen = {'stopped': str(stopped.sockets), 'killed': str(killed.sockets), 'bound': (stopped.sockets / 'engine.sock').is_socket()}
stopped.stop()
seen['after_stop'] = stopped.sockets.exists()
os.killpg(killed.pid, signal.SIGKILL)
killed.popen.wait()
seen['after_kill'] = killed.sockets.exists()
third = start(2)
seen['after_next_start'] = killed.sockets.exists()
seen['third_kept'] = third.sockets.exists()
third.stop()
print(json.dumps(seen))
"""


def test_a_server_keeps_its_sockets_in_a_folder_that_goes_with_it(tmp_path: Path) -> None:
    """vLLM makes its ZeroMQ sockets in the temporary folder, and a server stopped by a signal left
    them there (about 2,700 over a few days of tests): each server gets a folder of its own, removed
    when it is stopped, or at the next start once its process is gone."""
    out = subprocess.run([sys.executable, "-c", SOCKETS_SCENARIO, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["bound"], "the server's sockets are made in its own folder"
    assert all(Path(seen[k]).parent == Path(tempfile.gettempdir()) and Path(seen[k]).name.startswith("llmopt-sockets-")
               for k in ("stopped", "killed"))
    assert not seen["after_stop"], "stopping a server removes its folder"
    assert seen["after_kill"] and not seen["after_next_start"], "a killed server's folder goes at the next start"
    assert seen["third_kept"], "a running server's folder is kept"


def test_a_server_started_for_one_run_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """A deployer killed outright runs no cleanup; the kernel stops what it started for itself."""
    code = ("import sys, time; from pathlib import Path; from llmopt.engine import vllm; "
            "s = vllm.start_server(['sleep', '120'], {}, Path(sys.argv[1]), '127.0.0.1', 1, dies_with_caller=sys.argv[2] == '1'); "
            "print(s.pid, flush=True); time.sleep(120)")
    started = {}
    for dies in ("1", "0"):
        deployer = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / f"{dies}.log"), dies], stdout=subprocess.PIPE, text=True)
        started[dies] = psutil.Process(int(deployer.stdout.readline()))
        deployer.kill()
        deployer.wait()
    try:
        deadline = time.monotonic() + 10
        while started["1"].is_running() and started["1"].status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not started["1"].is_running() or started["1"].status() == psutil.STATUS_ZOMBIE
        assert started["0"].is_running(), "a deployed endpoint outlives `llmopt deploy`"
    finally:
        started["0"].kill()
